// kvcap: the capture-side command line. Subcommands: synth, validate, aggregate, export-chrome, run, eval,
// tasks, import-gguf.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <string>

#include "aggregate_command.hpp"
#include "eval_command.hpp"
#include "export_chrome_command.hpp"
#include "import_gguf_command.hpp"
#include "kvscope/cli/options.hpp"
#include "kvscope/cli/progress.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/synth/synth.hpp"
#include "kvscope/trace/untrusted.hpp"
#include "kvscope/trace/validate.hpp"
#include "run_command.hpp"

namespace po = boost::program_options;
using namespace kvscope;

namespace {

using cli::kExitError;
using cli::kExitOk;

void print_usage(std::ostream& os) {
  os << "kvcap - capture and check kvscope traces (trace format v1)\n\n"
        "Usage: kvcap <command> [options]\n\n"
        "Commands:\n"
        "  synth      write a deterministic synthetic trace with the geometry of a known model\n"
        "  validate   check that a file is a valid, complete kvscope trace (exit 0 valid, 2 not)\n"
        "  aggregate  compute the prefill attention statistics of a trace once and store them in it\n"
        "  export-chrome  write a trace's /profile ranges and kernels as Chrome/Perfetto trace JSON\n"
        "  run        run a model (tiny VLM: images + a question; HF LLaMA: a text or chat prompt) and\n"
        "             capture a trace\n"
        "  eval       closed-loop evaluation: accuracy, KL and bytes of policies on held-out samples or\n"
        "             long-context tasks (--task, text models)\n"
        "  tasks      write long-context task prompts ("
     << closedloop::task_names_list()
     << ") as JSON lines\n"
        "  import-gguf  convert a LLaMA-family GGUF file into a Hugging Face model folder\n\n"
        "Run 'kvcap <command> --help' for the options of a command.\n"
        "Trace format: docs/trace-format.md. Synthetic structure: docs/synthetic-traces.md.\n"
        "Input traces are parsed first in an isolated child process (10 s per object, 1 GiB), so a\n"
        "corrupt file gives one line and exit 2; --trusted-files (validate, export-chrome) or\n"
        "KVSCOPE_TRUSTED_FILES=1 skips that pre-check (docs/robustness.md).\n";
}

int fail(const std::string& cmd, const std::string& msg) { return cli::fail("kvcap " + cmd, msg); }

trace::DType parse_dtype(const std::string& s) {
  if (s == "float16" || s == "fp16") return trace::DType::kF16;
  if (s == "bfloat16" || s == "bf16") return trace::DType::kBF16;
  if (s == "float32" || s == "fp32") return trace::DType::kF32;
  throw std::invalid_argument("--dtype '" + s + "' is not one of float16, bfloat16, float32");
}

int cmd_synth(const std::vector<std::string>& args) {
  std::string presets;
  for (const auto& p : synth::synth_presets()) presets += "                          " + p.name + ": " + p.description + "\n";
  po::options_description opts(
      "kvcap synth --preset NAME [options] -o FILE\n\n"
      "Writes a synthetic trace (root attribute synthetic = 1), deterministic for a seed, with\n"
      "attention sinks, recency, spatially smooth vision keys, alignment text queries, heads\n"
      "specialised on vision or text, and shallow layers more redundant than deep ones.\n"
      "Token layout: <s>, system text, each image (+ one separator token), audio clip (+ separator),\n"
      "question text. Decode steps are the evaluation queries.\n\nOptions");
  opts.add_options()("help,h", "show this help")("preset", po::value<std::string>()->required(),
                                                 ("model geometry preset:\n" + presets).c_str())(
      "images", po::value<int>(), "number of images (default: preset's, 1)")(
      "image-tokens", po::value<int>(),
      "tokens per image, laid out as a near-square patch grid (default: preset's)")(
      "text", po::value<int>(), "text tokens (default: preset's)")(
      "audio", po::value<int>()->default_value(0), "audio tokens in one clip (0 = none)")(
      "decode", po::value<int>(), "decode steps recorded as evaluation queries (default: preset's)")(
      "layers", po::value<int>(), "layers (default: preset's; the depth schedule spans the layers written)")(
      "seed", po::value<unsigned long long>()->default_value(0),
      "random seed (same seed, same file contents)")(
      "dtype", po::value<std::string>()->default_value("float16"),
      "tensor dtype: float16, bfloat16, float32")("deflate", po::value<int>()->default_value(0),
                                                  "gzip level 0..9 for tensors (0 = uncompressed, fastest)")(
      "output,o", po::value<std::string>()->required(), "output trace file (.h5)")("quiet,q",
                                                                                   "no progress bar");
  po::variables_map vm;
  const std::string examples =
      "\nExample:\n  kvcap synth --preset llava-1.5-7b --images 1 --text 64 --decode 16 -o t.h5\n";
  if (const auto exit = cli::parse_options("kvcap synth", args, opts, vm, examples)) return *exit;
  try {
    synth::SynthOptions o;
    o.preset = vm["preset"].as<std::string>();
    for (const char* name : {"images", "image-tokens", "text", "decode", "audio", "layers"}) {
      if (vm.count(name) && vm[name].as<int>() < 0) {
        throw std::invalid_argument(std::string("--") + name + " must not be negative");
      }
    }
    if (vm.count("images")) o.images = vm["images"].as<int>();
    if (vm.count("image-tokens")) o.image_tokens = vm["image-tokens"].as<int>();
    if (vm.count("text")) o.text = vm["text"].as<int>();
    if (vm.count("decode")) o.decode = vm["decode"].as<int>();
    if (vm.count("layers")) o.layers = vm["layers"].as<int>();
    o.audio = vm["audio"].as<int>();
    o.seed = vm["seed"].as<unsigned long long>();
    o.dtype = parse_dtype(vm["dtype"].as<std::string>());
    o.deflate = vm["deflate"].as<int>();
    const std::string out = vm["output"].as<std::string>();
    synth::SynthGenerator probe(o);  // validates options before touching the output file
    const int layers = probe.header().geometry.num_layers;
    cli::ProgressBar bar("kvcap synth", static_cast<std::size_t>(layers), !vm.count("quiet"));
    const std::string tmp = out + ".partial";
    synth::write_synthetic_trace(o, tmp, [&](int done, int) { bar.update(static_cast<std::size_t>(done)); });
    bar.finish();
    if (std::rename(tmp.c_str(), out.c_str()) != 0) return fail("synth", out + ": cannot move finished trace into place");
    std::cout << "wrote " << out << ": " << probe.header().geometry.model_name << " (synthetic), "
              << probe.num_tokens() << " context tokens, " << probe.num_decode_steps() << " decode steps, "
              << layers << " layers, " << kernels::dtype_name(o.dtype) << "\n";
  } catch (const trace::TraceError& e) {
    return fail("synth", e.what());
  } catch (const std::invalid_argument& e) {
    return fail("synth", e.what());
  }
  return kExitOk;
}

int cmd_validate(const std::vector<std::string>& args) {
  po::options_description opts(
      "kvcap validate FILE\n\n"
      "Checks a trace against trace format v1: root attributes and version, /tokens, every layer's\n"
      "q/k/v shapes and dtypes, /decode, /profile, and every tensor element for NaN/Inf (read one\n"
      "head at a time). Prints one line. Exit 0 if valid and complete, 2 otherwise (an incomplete\n"
      "trace, whose writer never finished, is reported with what it contains). The whole check runs\n"
      "in an isolated child process: a file that crashes or hangs the HDF5 library, or needs more\n"
      "than 1 GiB, is reported as corrupt (docs/robustness.md).\n\nOptions");
  opts.add_options()("help,h", "show this help")("file", po::value<std::string>(), "trace file")(
      "quiet,q", "no progress bar")("trusted-files", trace::kTrustedFilesHelp);
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  if (const auto exit = cli::parse_options("kvcap validate", args, opts, vm, "", &pos)) return *exit;
  if (!vm.count("file")) return cli::missing("kvcap validate", "FILE");
  if (vm.count("trusted-files")) trace::set_trusted_files(true);
  const std::string file = vm["file"].as<std::string>();
  cli::ProgressBar bar("kvcap validate", 1, !vm.count("quiet"));
  bool started = false;
  const auto report = trace::validate_trace_isolated(file, [&](std::size_t done, std::size_t total) {
    if (!started) {
      bar = cli::ProgressBar("kvcap validate", total, !vm.count("quiet"));
      started = true;
    }
    bar.update(done);
  });
  if (started) bar.finish();
  if (report.ok) {
    std::cout << report.message << "\n";
    return kExitOk;
  }
  std::cerr << "kvcap validate: " << report.message << "\n";
  return kExitError;
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything runs: OpenBLAS's fast kernels where it does not recognise the CPU, idle OpenMP
  // threads that sleep (a model run is thousands of short parallel regions).
  cli::use_fast_blas_core(argv);
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
    if (cmd == "synth") return cmd_synth(rest);
    if (cmd == "validate") return cmd_validate(rest);
    if (cmd == "aggregate") return cli::aggregate_command(rest);
    if (cmd == "export-chrome") return cli::export_chrome_command(rest);
    if (cmd == "run") return cli::run_command(rest);
    if (cmd == "eval") return cli::eval_command(rest);
    if (cmd == "tasks") return cli::tasks_command(rest);
    if (cmd == "import-gguf") return cli::import_gguf_command(rest);
    std::cerr << "kvcap: unknown command '" << cmd
              << "' (valid: synth, validate, aggregate, export-chrome, run, eval, tasks, import-gguf; see "
                 "kvcap --help)\n";
    return kExitError;
  } catch (const std::exception& e) {
    std::cerr << "kvcap " << cmd << ": " << e.what() << "\n";
    return kExitError;
  }
}
