// kvsim: the simulator's command line. Subcommands: info.
#include <boost/program_options.hpp>

#include <iostream>
#include <string>

#include "kvscope/cli/options.hpp"
#include "kvscope/cli/progress.hpp"
#include "kvscope/sim/info.hpp"
#include "plan_command.hpp"
#include "sweep_command.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/sim/stages.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace po = boost::program_options;
using namespace kvscope;

namespace {

using kvscope::cli::kExitError;
using kvscope::cli::kExitOk;

void print_usage(std::ostream& os) {
  os << "kvsim - replay kvscope traces through KV-cache compression policies\n\n"
        "Usage: kvsim <command> [options]\n\n"
        "Commands:\n"
        "  info       summarise a trace: geometry, tokens per modality and segment, KV bytes per layer/modality\n"
        "  run        replay a trace through one policy: memory and quality per layer, head and modality\n"
        "  sweep      replay a trace through many policies x budgets: table, Pareto front, collapse flags\n"
        "  plan       capacity planner: KV bytes per token/request, concurrent requests and context that fit\n"
        "  stages     list the policy stages (head merge, scorer, allocator, executor, quantizer) with their\n"
        "             parameters; --markdown prints the tables of docs/policies.md\n\n"
        "Run 'kvsim <command> --help' for the options of a command.\n"
        "Input traces are parsed first in an isolated child process (10 s per object, 1 GiB), so a\n"
        "corrupt file gives one line and exit 2; --trusted-files (info, run, sweep, plan) or\n"
        "KVSCOPE_TRUSTED_FILES=1 skips that pre-check (docs/robustness.md).\n";
}

int cmd_info(const std::vector<std::string>& args) {
  po::options_description opts(
      "kvsim info FILE\n\n"
      "Prints the model geometry, whether the trace is synthetic, tokens per modality and per\n"
      "segment (images with their patch grid), and the exact full KV-cache bytes per layer and per\n"
      "modality. Reads only metadata and /tokens (fast on large traces). Exit 2 on a bad file.\n\nOptions");
  opts.add_options()("help,h", "show this help")("file", po::value<std::string>(), "trace file")(
      "trusted-files", trace::kTrustedFilesHelp);
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  if (const auto exit = cli::parse_options("kvsim info", args, opts, vm, "", &pos)) return *exit;
  if (!vm.count("file")) return cli::missing("kvsim info", "FILE");
  if (vm.count("trusted-files")) trace::set_trusted_files(true);
  try {
    trace::check_trace_file(vm["file"].as<std::string>());
    trace::TraceReader reader(vm["file"].as<std::string>());
    std::cout << sim::format_summary(sim::summarize(reader));
  } catch (const trace::TraceError& e) {
    std::cerr << "kvsim info: " << e.what() << "\n";
    return kExitError;
  }
  return kExitOk;
}

int cmd_stages(const std::vector<std::string>& args) {
  po::options_description opts(
      "kvsim stages [--markdown]\n\n"
      "Lists every policy stage method by kind with its parameters (type, default, range, meaning),\n"
      "whether it works in decode-time mode (~decode), and the pipeline's own parameters: the keys a\n"
      "[policy NAME] section of --policy-file may set. All of it comes from the stages' declarations.\n\nOptions");
  opts.add_options()("help,h", "show this help")("markdown", "print the parameter tables of docs/policies.md");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(args).options(opts).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "kvsim stages: " << e.what() << " (see kvsim stages --help)\n";
    return kExitError;
  }
  if (vm.count("help")) {
    std::cout << opts;
    return kExitOk;
  }
  std::cout << (vm.count("markdown") ? sim::stage_tables_markdown() : sim::stage_listing_text());
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  kvscope::cli::use_fast_blas_core(argv);
  kvscope::cli::release_large_blocks_promptly();
  if (argc < 2) {
    print_usage(std::cerr);
    return kExitError;
  }
  const std::string cmd = argv[1];
  const std::vector<std::string> rest(argv + 2, argv + argc);
  try {
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      print_usage(std::cout);
      return kExitOk;
    }
    if (cmd == "info") return cmd_info(rest);
    if (cmd == "plan") return kvscope::tools::run_plan_command(rest);
    if (cmd == "stages") return cmd_stages(rest);
    if (cmd == "run" || cmd == "sweep") {
      return sim::run_sweep_command(cmd, rest, sim::command_line_string(argc, argv));
    }
    std::cerr << "kvsim: unknown command '" << cmd << "' (valid: info, run, sweep, plan, stages; see kvsim --help)\n";
    return kExitError;
  } catch (const std::exception& e) {
    std::cerr << "kvsim " << cmd << ": " << e.what() << "\n";
    return kExitError;
  }
}
