#include "sweep_command.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <iostream>
#include <memory>
#include <sstream>

#include "dataset_sweep.hpp"
#include "kvscope/cli/options.hpp"
#include "kvscope/cli/progress.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/kernels/device.hpp"
#include "kvscope/sim/backend.hpp"
#include "kvscope/sim/dataset.hpp"
#include "kvscope/sim/info.hpp"
#include "kvscope/sim/pareto.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/sim/stages.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace po = boost::program_options;

namespace kvscope::sim {

namespace {

constexpr const char* kDefaultPolicies =
    "full,window,streamingllm,h2o,snapkv,pyramidkv,tova,knorm,random,fastv,vision-stride,hybridkv,look-m,unicache,"
    "adaptive,int8,int4,kivi2,h2o+int8,snapkv+int4";
constexpr const char* kDefaultBudgets = "0.1:0.9:0.1";

// Items of a comma-separated --policies list; an empty item (a,,b or a trailing comma) is an error.
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  if (s.find_first_not_of(" \t,") == std::string::npos) return out;  // reported as an empty list
  std::size_t start = 0;
  while (true) {
    const std::size_t end = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, end - start);
    if (item.find_first_not_of(" \t") == std::string::npos) {
      throw PolicyError("empty item in --policies '" + s + "'");
    }
    out.push_back(item);
    if (end == s.size()) break;
    start = end + 1;
  }
  return out;
}

std::string policy_help(const PolicyRegistry& reg) {
  std::ostringstream o;
  o << "Policies (docs/policies.md has sources and every parameter):\n";
  for (const auto& [name, p] : reg.presets()) o << "  " << name << std::string(name.size() < 24 ? 24 - name.size() : 1, ' ') << p.description << "\n";
  o << "  A+Q                     eviction/merge policy A, then quantizer Q (int8, int8-head, int4, kivi2), e.g. h2o+int8\n"
       "  adaptive-A              policy A with the complexity-driven rate in [0.40, 0.75]\n"
       "  A~decode[:N]            decode-time mode: the cache starts full, every decode step appends its token and\n"
       "                          every N steps (default 1) A evicts down to the budget, now a cap (h2o~decode:4@0.3);\n"
       "                          stages marked [~decode] below work in decode mode\n"
       "Budgets: a fraction of context tokens kept per layer and head (0.3), tokens (512tok) or total\n"
       "bytes over all layers (64MiB, 1.5GB). Quantization-only policies and adaptive ignore budgets.\n"
       "--policy-file FILE: [policy NAME] sections, 'base = PRESET', then 'key = value' for the keys below.\n";
  o << stage_listing_text();
  return o.str();
}

}  // namespace

int run_sweep_command(const std::string& command, const std::vector<std::string>& args, const std::string& argv_line) {
  const bool sweep = command == "sweep";
  PolicyRegistry registry;
  const std::string usage =
      sweep
          ? "kvsim sweep --trace FILE [--policies a,b,...] [--budgets 0.1:0.9:0.1,512tok,64MiB] [-o "
            "results.h5] "
            "[--csv results.csv]\n\n"
            "Replays the trace through every policy at every budget, one layer at a time (one layer's\n"
            "tensors and statistics in memory), and prints memory and quality per point with the Pareto "
            "front of\n"
            "memory vs output error and the collapse flags. Per-layer statistics (attention scores,\n"
            "key norms, redundancy) are computed once and shared by all policies. Beside the policies, in a\n"
            "table of their own and never on the Pareto front, it reports the oracle-topk bound (the tokens "
            "with\n"
            "the most attention from the trace's own evaluation queries) and an allocation search at the "
            "sweep's\n"
            "budgets (docs/policies.md, \"Bound and search rows in sweeps\").\n\n"
            "kvsim sweep --dataset DIR|LIST [--by family,length] [-o results.h5] [--csv aggregates.csv]\n"
            "  [--samples-csv per-sample.csv]   (also: mpirun -np N kvsim sweep --dataset ...)\n\n"
            "Replays every trace of a dataset (docs/datasets.md) and reports each sample and the mean with "
            "a\n"
            "bootstrap confidence interval of every metric per point x layer x modality, over all samples "
            "and\n"
            "per group (--by); the Pareto front and the bound are those of the means. Prints per budget the\n"
            "best policies with their intervals. Under mpirun or srun the (trace x policy group) work units "
            "are\n"
            "spread over the ranks and rank 0 writes the one results file.\n\nOptions"
          : "kvsim run --trace FILE --policy NAME[@BUDGET] [-o results.h5] [--csv results.csv]\n\n"
            "Replays the trace through one policy and prints memory and quality per point (add --layers\n"
            "for the per-layer table).\n\n"
            "Options";
  po::options_description opts(usage);
  opts.add_options()("help,h", "show this help")("trace,t", po::value<std::string>(), "trace file (kvscope-trace v1)");
  if (sweep) {
    opts.add_options()("policies,p", po::value<std::string>()->default_value(kDefaultPolicies),
                       "comma-separated policies")(
        "budgets,b", po::value<std::string>()->default_value(kDefaultBudgets),
        "comma-separated budgets; START:STOP:STEP ranges of fractions allowed")(
        "alloc-search", po::value<std::string>()->default_value("tova"),
        "scorer policy of the allocation search reported beside the policies (rows alloc-search:NAME, not a "
        "policy and not a bound: per layer, allocations of that scorer replayed on the trace; from the scorer's own "
        "allocation at each budget, moves are kept only when they lower the replayed error within its bytes); "
        "'none' to skip")(
        "oracle", po::value<std::string>(), "deprecated name of --alloc-search (prints a warning)")(
        "no-bound", "do not add the oracle-topk bound rows (the tokens with the most attention from the trace's "
        "own evaluation queries, at every budget of the sweep; added by default)");
    add_dataset_options(opts);
  } else {
    opts.add_options()("policy,p", po::value<std::string>(), "policy and budget, e.g. h2o@0.3, h2o+int8@512tok; unicache, adaptive and the "
        "quantizers (int8, int4, kivi2) need no budget");
  }
  opts.add_options()("policy-file", po::value<std::vector<std::string>>()->composing(),
                     "INI file with [policy NAME] sections (base = PRESET, parameters; docs/policies.md)")(
      "output,o", po::value<std::string>(), "write results to this HDF5 file (docs/results-format.md)")(
      "csv", po::value<std::string>(),
      "write results to this CSV file (one row per point x layer x modality)")(
      "threads", po::value<int>()->default_value(0),
      "CPU threads for the kernels (0 = all cores; at most 4 x the hardware threads, 1024)")(
      "backend", po::value<std::string>()->default_value("auto"),
      "kernels to run on: cpu, cuda (exit 2 without a CUDA build or GPU), or auto (the CPU: on an H200 the "
      "CUDA backend, which copies every call's inputs and evaluates one decode step of one head per call, "
      "measured slower than the CPU's batched evaluation, docs/perf.md); the choice is printed in the "
      "summary on stdout")(
      "question-in-context",
      "traces with roles (kvcap run --task): move the decode steps before the first answer step (the "
      "question "
      "and the template tokens around it) into the compressed context, so T grows by their number and the "
      "answer steps are the evaluation queries (default: the question arrives after compression, as decode "
      "steps kept exact in prefill mode; docs/metrics.md \"Query sets\")")(
      "rank-by", po::value<std::string>()->default_value("default"),
      (std::string("rank the table's policy rows by this proxy, best first (default: ") + kDefaultRankProxy +
       ", the best on held-out real-model data, docs/validation.md; none = run order; one of " +
       rank_proxy_names() + "; docs/metrics.md \"Proxies\")")
          .c_str())("layers", "also print the per-layer table of each point")(
      "explain", "print the evidence and suggested fix of every collapse flag (default: Pareto points only)")(
      "blind-recall", po::value<double>()->default_value(0.5, "0.5"),
      "visual blindness: vision recall threshold")("kl-threshold",
                                                   po::value<double>()->default_value(0.1, "0.1"),
                                                   "over-compression: KL threshold in the last layers")(
      "quiet,q", "no progress bar")("trusted-files", trace::kTrustedFilesHelp);
  po::variables_map vm;
  const std::string name = "kvsim " + command;
  if (const auto exit = cli::parse_options(name, args, opts, vm, "\n" + policy_help(registry))) return *exit;
  const bool dataset = sweep && vm.count("dataset") != 0;
  if (!dataset && !vm.count("trace"))
    return cli::missing(name, sweep ? "--trace FILE (or --dataset DIR)" : "--trace FILE");
  if (sweep && !dataset) {
    for (const char* only :
         {"by", "bootstrap", "seed", "confidence", "top", "skip-bad", "policy-groups", "samples-csv"}) {
      if (vm.count(only) && !vm[only].defaulted())
        return cli::fail(name, std::string("--") + only + " needs --dataset");
    }
  }
  if (const std::string r = vm["rank-by"].as<std::string>();
      r != "default" && r != "none" &&
      (", " + rank_proxy_names() + ",").find(", " + r + ",") == std::string::npos) {
    std::cerr << name << ": --rank-by '" << r << "' is not a proxy (valid: " << rank_proxy_names()
              << ", none)\n";
    return 2;
  }
  if (!sweep && !vm.count("policy")) {
    std::cerr << name << ": missing --policy NAME[@BUDGET] (see " << name << " --help)\n";
    return 2;
  }
  // Untrusted input: parsed first in an isolated child, before any thread or device is started.
  if (vm.count("trusted-files")) trace::set_trusted_files(true);
  if (!dataset) {
    try {
      trace::check_trace_file(vm["trace"].as<std::string>());
    } catch (const trace::TraceError& e) {
      std::cerr << name << ": " << e.what() << "\n";
      return 2;
    }
  }
  const int threads = vm["threads"].as<int>();
  if (const std::string bad = cli::check_threads(threads); !bad.empty()) {
    std::cerr << name << ": " << bad << "\n";
    return 2;
  }
  kernels::set_cpu_threads(threads);
  std::unique_ptr<Backend> cuda;
  Backend* backend = nullptr;
  try {
    backend = &select_backend(parse_backend(vm["backend"].as<std::string>()), cuda);
  } catch (const BackendError& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  }
  std::vector<SweepPoint> points;
  try {
    if (vm.count("policy-file")) {
      for (const auto& f : vm["policy-file"].as<std::vector<std::string>>()) registry.load_ini(f);
    }
    if (sweep) {
      std::vector<PolicySpec> pols;
      for (const auto& n : split(vm["policies"].as<std::string>())) pols.push_back(registry.get(n));
      if (pols.empty()) throw PolicyError("--policies is empty");
      points = make_sweep_points(pols, parse_budget_list(vm["budgets"].as<std::string>()));
    } else {
      std::string ignored;
      points.push_back(run_point(registry, vm["policy"].as<std::string>(), &ignored));
      if (!ignored.empty()) {
        std::cerr << name << ": warning: '" << points.back().policy.name << "' ignores the budget '"
                  << ignored << "'\n";
      }
    }
  } catch (const PolicyError& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  }
  try {
    SweepOptions so;
    so.backend = backend;
    so.question_in_context = vm.count("question-in-context") != 0;
    so.thresholds.blind_recall = vm["blind-recall"].as<double>();
    so.thresholds.overcompression_kl = vm["kl-threshold"].as<double>();
    if (sweep) {
      so.bound.enabled = !vm.count("no-bound");
      std::string search = vm["alloc-search"].as<std::string>(), flag = "--alloc-search";
      if (vm.count("oracle")) {
        if (!vm["alloc-search"].defaulted()) throw PolicyError("give --alloc-search or its old name --oracle, not both");
        search = vm["oracle"].as<std::string>();
        flag = "--oracle";
        std::cerr << name << ": warning: --oracle is deprecated, use --alloc-search " << search
                  << " (an allocation search, rows alloc-search:NAME, not a bound; the bound is oracle-topk, "
                     "--no-bound skips it)\n";
      }
      if (search != "none") {
        so.alloc_search.enabled = true;
        so.alloc_search.scorer = registry.get(search);
        const PolicySpec& sc = so.alloc_search.scorer;
        if (!sc.compress_tokens || sc.adaptive || sc.mode == PolicyMode::kDecode ||
            sc.stages.scorer == "oracle-topk") {
          throw PolicyError(flag + " needs a prefill-mode token-scoring policy (e.g. h2o, snapkv, tova), not '" +
                            search + "'");
        }
      }
    }
    if (dataset) return run_dataset_sweep(name, vm, points, so, argv_line, threads);
    trace::TraceReader reader(vm["trace"].as<std::string>());
    require_replayable(reader, name);
    const TraceSummary summary = summarize(reader);
    const std::size_t bar_total = points.size() * static_cast<std::size_t>(reader.geometry().num_layers);
    cli::ProgressBar bar(name, bar_total, !vm.count("quiet"));
    so.progress = [&](std::size_t done, std::size_t total) { bar.update(total ? done * bar_total / total : done); };
    SweepOutput out = run_sweep(reader, points, so);
    bar.finish();
    // The Pareto front is over the policies; bound and search rows are not policies.
    mark_pareto(out.points, [](const PointResult& pt) { return pt.kind == "policy"; });
    for (const auto& w : out.warnings) std::cerr << name << ": warning: " << w << "\n";
    std::cout << "trace " << reader.path() << ": " << summary.header.geometry.model_name
              << (summary.header.synthetic ? " (SYNTHETIC)" : "") << ", " << summary.num_tokens << " tokens ("
              << summary.tokens_per_modality[0] << " text, " << summary.tokens_per_modality[1] << " vision, "
              << summary.tokens_per_modality[2] << " audio, " << summary.tokens_per_modality[3] << " special), "
              << summary.num_decode_steps << " evaluation queries, " << summary.header.geometry.num_layers << " layers\n";
    if (out.has_roles) {
      std::cout << "roles: "
                << (out.steps_in_context > 0
                        ? "question in the compressed context (" + std::to_string(out.steps_in_context) +
                              " decode steps moved into it: " + std::to_string(out.context_tokens) +
                              " context tokens, " + std::to_string(out.decode_steps) + " evaluation queries)"
                        : std::string("question after compression"))
                << "; query sets: " << out.query_set_steps[kAnswerQueries] << " answer, "
                << out.query_set_steps[kQuestionQueries] << " question steps\n";
    }
    // Which backend computed the results (with the reason when auto fell back to the CPU): part of the
    // summary on stdout, so that stderr holds only progress and, on failure, the one-line error.
    std::cout << "backend " << backend->description();
    if (vm["backend"].as<std::string>() == "auto" && backend->kind() == BackendKind::kCpu) {
      if (cuda_backend_built() && kernels::cuda_device_count() > 0) {
        std::cout << " (auto: the CPU; --backend cuda runs on " << kernels::cuda_device_description() << ")";
      } else {
        std::cout << " (auto: "
                  << (cuda_backend_built() ? kernels::cuda_device_description() : "built without CUDA")
                  << ")";
      }
    }
    std::cout << "\nattention statistics: " << out.attention_statistics << "\n\n";
    TableOptions table;
    table.query_sets = out.has_roles;
    table.rank_by = vm["rank-by"].as<std::string>();
    std::cout << format_table(out.points, table);
    for (const auto& pt : out.points) {
      if (!vm.count("explain") && !pt.pareto && out.points.size() > 1) continue;
      for (const auto& f : pt.flags) {
        std::cout << "  " << pt.policy << "@" << pt.budget << ": " << f.mode << " in layers "
                  << format_layer_ranges(f.layers) << ": " << f.evidence << "; fix: " << f.suggested_fix << "\n";
      }
    }
    if (vm.count("layers")) {
      for (const auto& pt : out.points) {
        std::cout << "\n" << pt.policy << "@" << pt.budget << " per layer\n";
        std::printf("  %-6s %10s %10s %10s %10s %10s %10s\n", "layer", "bytes", "error", "recall", "rec_text",
                    "rec_vision", "kl");
        for (const auto& l : pt.layers) {
          const auto& q = l.total.quality;
          std::printf("  %-6d %10.4f %10.4f %10.4f %10.4f %10.4f %10.4f\n", l.layer,
                      l.total.bytes_full.total() ? static_cast<double>(l.total.bytes_kept.total()) / l.total.bytes_full.total() : 1.0,
                      q.output_error, q.attention_recall, q.recall_modality[0], q.recall_modality[1], q.kl);
        }
        std::fflush(stdout);
      }
    }
    const ResultsMeta meta = sweep_results_meta(summary, out, argv_line);
    if (vm.count("output")) {
      write_hdf5(vm["output"].as<std::string>(), out.points, meta);
      std::cout << "\nresults: " << vm["output"].as<std::string>() << "\n";
    }
    if (vm.count("csv")) {
      write_csv(vm["csv"].as<std::string>(), out.points, meta);
      std::cout << (vm.count("output") ? "" : "\n") << "csv: " << vm["csv"].as<std::string>() << "\n";
    }
  } catch (const trace::TraceError& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  } catch (const PolicyError& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  } catch (const ReportError& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  }
  return 0;
}

}  // namespace kvscope::sim
