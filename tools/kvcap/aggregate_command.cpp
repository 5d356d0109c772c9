#include "aggregate_command.hpp"

#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <stdexcept>

#include "kvscope/aggregate/aggregate.hpp"
#include "kvscope/cli/options.hpp"
#include "kvscope/cli/progress.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace po = boost::program_options;

namespace kvscope::cli {

int aggregate_command(const std::vector<std::string>& args) {
  const std::string name = "kvcap aggregate";
  po::options_description opts(
      "kvcap aggregate TRACE [options]\n\n"
      "Computes, once, the statistics of the causal prefill attention that kvsim's policies read and\n"
      "stores them in the trace (/aggregates, trace format 1.2; docs/trace-format.md section 3a): per\n"
      "layer and query head the H2O accumulated attention of every key, the SnapKV observation-window\n"
      "sums of the last --window queries, the last query's attention row (TOVA), the cross-modal\n"
      "attention received and given, and per kv head the key redundancy to the neighbours. The\n"
      "attention is computed blockwise (blocks of 64 query rows against the keys they see), never as\n"
      "a T x T matrix: memory is one layer of the trace plus its [heads, T] statistics.\n"
      "kvsim then uses them where a policy's definition is the same (window, redundancy radii,\n"
      "T without --question-in-context) and recomputes the rest; its output says which.\n"
      "Writing is safe: layers are staged in TRACE.aggregates.partial and copied into the trace only\n"
      "when all are done, /aggregates@complete = 1 set last; a run that is killed leaves no\n"
      "aggregates that look complete (docs/trace-format.md). Running it again replaces them.\n\nOptions");
  opts.add_options()("help,h", "show this help")("trace", po::value<std::string>(), "trace file (.h5)")(
      "window", po::value<int>()->default_value(aggregate::kDefaultWindow),
      "observation window W of the stored window sums (SnapKV's snap_window; capped at T)")(
      "threads", po::value<int>()->default_value(0),
      "CPU threads for the kernels (0 = all cores; at most 4 x the hardware threads, 1024)")(
      "quiet,q", "no progress bar")("trusted-files", trace::kTrustedFilesHelp);
  po::positional_options_description pos;
  pos.add("trace", 1);
  po::variables_map vm;
  const std::string examples =
      "\nExample:\n  kvcap aggregate t.h5\n  kvsim sweep --trace t.h5 -o r.h5   # says 'attention "
      "statistics: "
      "stored ...'\n";
  if (const auto exit = parse_options(name, args, opts, vm, examples, &pos)) return *exit;
  if (!vm.count("trace")) return missing(name, "TRACE");
  const std::string path = vm["trace"].as<std::string>();
  const int window = vm["window"].as<int>();
  if (window < 1) return fail(name, "--window must be at least 1, got " + std::to_string(window));
  const int threads = vm["threads"].as<int>();
  if (const std::string bad = check_threads(threads); !bad.empty()) return fail(name, bad);
  if (vm.count("trusted-files")) trace::set_trusted_files(true);
  try {
    trace::check_trace_file(path);  // untrusted: parsed first in an isolated child
    kernels::set_cpu_threads(threads);
    ProgressBar bar(name, 1, !vm.count("quiet"));
    const aggregate::AggregateRun run =
        aggregate::aggregate_trace(path, window, "kvcap aggregate", [&](int done, int total) {
          if (done == 1) bar = ProgressBar(name, static_cast<std::size_t>(total), !vm.count("quiet"));
          bar.update(static_cast<std::size_t>(done));
        });
    bar.finish();
    char line[256];
    std::snprintf(
        line, sizeof line,
        "%d layers, T = %zu, window %d: %.1f s of attention passes, %.1f GFLOP of logits (%.1f GFLOP/s)",
        run.layers, run.tokens, run.window, run.seconds, run.logit_flop / 1e9,
        run.seconds > 0 ? run.logit_flop / 1e9 / run.seconds : 0.0);
    std::cout << "aggregated " << path << ": " << line << "\n";
  } catch (const trace::TraceError& e) {
    return fail(name, e.what());
  } catch (const std::exception& e) {
    return fail(name, path + ": " + e.what());
  }
  return kExitOk;
}

}  // namespace kvscope::cli
