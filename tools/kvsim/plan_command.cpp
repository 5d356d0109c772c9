#include "plan_command.hpp"

#include <boost/program_options.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "kvscope/cli/options.hpp"
#include "kvscope/sim/planner.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/synth/synth.hpp"
#include "kvscope/trace/error.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace po = boost::program_options;

namespace kvscope::tools {

namespace {

using cli::kExitError;
using cli::kExitOk;
constexpr std::int64_t kDefaultText = 64;
constexpr std::int64_t kDefaultMaxNew = 256;

po::options_description plan_options() {
  po::options_description all(
      "kvsim plan (--model PRESET | --trace FILE | --layers L --kv-heads H --head-dim D --params P)\n"
      "           --gpu-mem SIZE [options]\n\n"
      "Capacity planner: KV bytes per token (2 x layers x kv_heads x head_dim x element bytes) and per\n"
      "request, the maximum number of concurrent requests and the longest context that fit in the GPU\n"
      "memory left after the weights and a workspace reserve, without and with compression (bytes\n"
      "ratios kept / full per modality). Sizes: 24GiB (2^30), 80GB (10^9), 512MiB, or bytes.\n"
      "Formulas and parameter counts: docs/planner.md. Exit 2 on bad input");
  po::options_description model("Model");
  model.add_options()("model", po::value<std::string>(), "preset: llava-1.5-7b, qwen2-vl-7b")(
      "trace", po::value<std::string>(),
      "take geometry and the request's tokens per modality (images, text) from a trace; "
      "--images/--image-tokens/--text/--audio override them")("layers", po::value<int>(),
                                                              "generic model: transformer layers")(
      "kv-heads", po::value<int>(), "generic model: KV heads per layer")("head-dim", po::value<int>(),
                                                                         "generic model: head dimension")(
      "q-heads", po::value<int>(), "generic model: query heads (informational, multiple of --kv-heads)")(
      "params", po::value<double>(),
      "total parameters on the GPU, e.g. 7.06e9 (required for generic models and traces of unknown "
      "models; overrides a preset's count)");
  po::options_description memory("Memory");
  memory.add_options()("gpu-mem", po::value<std::string>(), "GPU memory, e.g. 24GiB, 80GB (required)")(
      "weights-dtype", po::value<std::string>()->default_value("fp16"),
      "fp16 | bf16 (2 B/param), int8 (1 B), int4 (0.5 B + one fp16 scale per 128)")(
      "reserve", po::value<double>()->default_value(0.10, "0.10"),
      "fraction of GPU memory kept for activations and workspace, in [0, 1)")(
      "kv-dtype", po::value<std::string>()->default_value("fp16"),
      "KV element type: fp16 | bf16 | fp32 | int8 | int4");
  po::options_description request("Request shape");
  request.add_options()("images", po::value<long long>(),
                        "images per request (default 1 for presets, 0 for generic)")(
      "image-tokens", po::value<long long>(),
      "tokens per image (default: the preset's, e.g. 576 for llava-1.5-7b)")(
      "text", po::value<long long>(), "prompt text tokens per request (default 64)")(
      "audio", po::value<long long>(), "prompt audio tokens per request (default 0)")(
      "max-new", po::value<long long>()->default_value(kDefaultMaxNew), "generated tokens per request");
  po::options_description compression("Compression (bytes kept / bytes full, in (0, 1])");
  compression.add_options()("kv-ratio", po::value<double>(), "ratio for every prompt modality")(
      "vision-ratio", po::value<double>(), "ratio for vision tokens (overrides --kv-ratio)")(
      "text-ratio", po::value<double>(), "ratio for text and special tokens (overrides --kv-ratio)")(
      "policy", po::value<std::string>(),
      "a kvsim policy with budget (e.g. h2o+int8@0.3): its per-modality byte ratios are measured by "
      "replaying it on --trace (required with --policy)")(
      "output-ratio", po::value<double>(), "ratio for generated tokens (default 1: a prefill-time policy)");
  po::options_description output("Output");
  output.add_options()("csv", po::value<std::string>(),
                       "write one row per setting (full, compressed) to FILE")(
      "json", po::value<std::string>(), "write the plan as JSON to FILE")(
      "trusted-files", trace::kTrustedFilesHelp)("help,h", "show this help");
  all.add(model).add(memory).add(request).add(compression).add(output);
  return all;
}

std::int64_t count_option(const po::variables_map& vm, const char* name, std::int64_t fallback) {
  if (!vm.count(name)) return fallback;
  const long long v = vm[name].as<long long>();
  if (v < 0) throw sim::PlanError(name, std::string("--") + name + " must be >= 0, got " + std::to_string(v));
  return v;
}

// Model and the request's default shape from --model, --trace or the generic options.
void fill_model(const po::variables_map& vm, sim::PlanInput& in, std::vector<std::string>& notes) {
  const bool preset = vm.count("model") > 0, from_trace = vm.count("trace") > 0;
  const bool generic =
      vm.count("layers") || vm.count("kv-heads") || vm.count("head-dim") || vm.count("q-heads");
  if (preset + from_trace + generic > 1) {
    throw sim::PlanError("model",
                         "give one of --model, --trace or the generic --layers/--kv-heads/--head-dim");
  }
  in.request.text_tokens = kDefaultText;
  if (preset) {
    in.model = sim::find_model_preset(vm["model"].as<std::string>());
    const synth::SynthPreset* p = synth::find_preset(in.model.name);
    in.request.images = p ? p->images : 1;
    in.request.image_tokens = p ? p->image_tokens : 0;
  } else if (from_trace) {
    sim::TraceRequest t = sim::request_from_trace(vm["trace"].as<std::string>());
    in.model = t.model;
    in.request = t.request;
    notes = t.notes;
  } else if (generic) {
    for (const char* need : {"layers", "kv-heads", "head-dim", "params"}) {
      if (!vm.count(need)) throw sim::PlanError(need, std::string("generic model: missing --") + need);
    }
    in.model =
        sim::generic_model(vm["layers"].as<int>(), vm["kv-heads"].as<int>(), vm["head-dim"].as<int>(),
                           vm["params"].as<double>(), vm.count("q-heads") ? vm["q-heads"].as<int>() : 0);
  } else {
    throw sim::PlanError("model",
                         "missing the model: --model PRESET, --trace FILE or --layers/--kv-heads/--head-dim");
  }
  if (vm.count("params")) {
    in.model.params = vm["params"].as<double>();
    if (!generic) in.model.source += "; params from --params";
  }
}

// Configured compression; the simulator's --policy would fill the same KeepRatios from measured bytes.
std::optional<sim::KeepRatios> ratios_from_options(const po::variables_map& vm) {
  if (!vm.count("kv-ratio") && !vm.count("vision-ratio") && !vm.count("text-ratio") &&
      !vm.count("output-ratio")) {
    return std::nullopt;
  }
  sim::KeepRatios k = sim::KeepRatios::uniform(vm.count("kv-ratio") ? vm["kv-ratio"].as<double>() : 1.0);
  if (vm.count("vision-ratio"))
    k.prompt[static_cast<std::size_t>(kernels::Modality::kVision)] = vm["vision-ratio"].as<double>();
  if (vm.count("text-ratio")) {
    k.prompt[static_cast<std::size_t>(kernels::Modality::kText)] = vm["text-ratio"].as<double>();
    k.prompt[static_cast<std::size_t>(kernels::Modality::kSpecial)] = vm["text-ratio"].as<double>();
  }
  if (vm.count("output-ratio")) k.output = vm["output-ratio"].as<double>();
  // Name the option in the error: the library only knows the modality.
  for (const char* name : {"kv-ratio", "vision-ratio", "text-ratio", "output-ratio"}) {
    if (!vm.count(name)) continue;
    const double r = vm[name].as<double>();
    if (!(r > 0.0 && r <= 1.0)) {
      std::ostringstream got;
      got << r;
      throw sim::PlanError(
          name, std::string("--") + name + " must be in (0, 1] (bytes kept / bytes full), got " + got.str());
    }
  }
  return k;
}

// Per-modality bytes kept / full of a policy, measured by replaying it on a trace.
sim::KeepRatios measured_ratios(const std::string& text, const std::string& trace_path, std::vector<std::string>& notes) {
  sim::PolicyRegistry reg;
  sim::SweepPoint point;
  try {
    auto [name, budget] = sim::split_policy_budget(text);
    point.policy = reg.get(name);
    point.budget = budget;
    if (budget.kind == sim::Budget::Kind::kNone) point.budget.text = "-";
  } catch (const sim::PolicyError& e) {
    throw sim::PlanError("policy", e.what());
  }
  trace::TraceReader reader(trace_path);
  sim::require_replayable(reader, "kvsim plan --policy");
  const sim::SweepOutput out = sim::run_sweep(reader, {point}, sim::SweepOptions{});
  const sim::HeadResult& t = out.points.at(0).total;
  sim::KeepRatios k;
  for (int m = 0; m < sim::kModalities; ++m) {
    const auto i = static_cast<std::size_t>(m);
    if (t.bytes_full_modality[i] > 0)
      k.prompt[i] = static_cast<double>(t.bytes_kept_modality[i]) / static_cast<double>(t.bytes_full_modality[i]);
  }
  std::ostringstream o;
  o.precision(3);
  o << "policy " << text << " measured on " << trace_path << ": bytes ratio text " << k.prompt[0] << ", vision "
    << k.prompt[1] << " (error " << t.quality.output_error << "); generated tokens kept in full";
  notes.push_back(o.str());
  return k;
}

sim::PlanInput input_from_options(const po::variables_map& vm, std::vector<std::string>& notes) {
  sim::PlanInput in;
  fill_model(vm, in, notes);
  if (!vm.count("gpu-mem")) throw sim::PlanError("gpu-mem", "missing --gpu-mem SIZE (e.g. 24GiB, 80GB)");
  in.gpu_mem_bytes = sim::parse_byte_size(vm["gpu-mem"].as<std::string>(), "gpu-mem");
  in.weights = sim::parse_weights_dtype(vm["weights-dtype"].as<std::string>());
  in.kv_dtype = sim::parse_kv_dtype(vm["kv-dtype"].as<std::string>());
  in.reserve_fraction = vm["reserve"].as<double>();
  if (!(in.reserve_fraction >= 0.0 && in.reserve_fraction < 1.0)) {
    std::ostringstream got;
    got << in.reserve_fraction;
    throw sim::PlanError("reserve", "--reserve must be in [0, 1), got " + got.str());
  }
  in.request.images = count_option(vm, "images", in.request.images);
  in.request.image_tokens = count_option(vm, "image-tokens", in.request.image_tokens);
  in.request.text_tokens = count_option(vm, "text", in.request.text_tokens);
  in.request.audio_tokens = count_option(vm, "audio", in.request.audio_tokens);
  in.request.output_tokens = count_option(vm, "max-new", kDefaultMaxNew);
  in.compression = ratios_from_options(vm);
  if (vm.count("policy")) {
    if (in.compression) throw sim::PlanError("policy", "--policy and --kv-ratio/--vision-ratio/--text-ratio exclude each other");
    if (!vm.count("trace")) {
      throw sim::PlanError("policy", "--policy needs --trace FILE: the policy's per-modality compression is measured by "
                                     "replaying it on that trace");
    }
    in.compression = measured_ratios(vm["policy"].as<std::string>(), vm["trace"].as<std::string>(), notes);
  }
  return in;
}

bool write_file(const std::string& path, const std::string& text, const char* option) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (f) f << text;
  if (f) f.close();
  if (!f) {
    std::cerr << "kvsim plan: cannot write --" << option << " " << path << ": " << std::strerror(errno)
              << "\n";
    return false;
  }
  return true;
}

}  // namespace

int run_plan_command(const std::vector<std::string>& args) {
  const po::options_description opts = plan_options();
  po::variables_map vm;
  if (const auto exit = cli::parse_options("kvsim plan", args, opts, vm)) return *exit;
  sim::PlanResult result;
  try {
    std::vector<std::string> notes;  // what the trace implied (shape source, uneven images)
    if (vm.count("trusted-files")) trace::set_trusted_files(true);
    // Untrusted input: parsed first in an isolated child.
    if (vm.count("trace")) trace::check_trace_file(vm["trace"].as<std::string>());
    const sim::PlanInput input = input_from_options(vm, notes);
    result = sim::plan(input);
    result.notes.insert(result.notes.begin(), notes.begin(), notes.end());
  } catch (const sim::PlanError& e) {
    std::cerr << "kvsim plan: " << e.what() << "\n";
    return kExitError;
  } catch (const trace::TraceError& e) {
    std::cerr << "kvsim plan: --trace: " << e.what() << "\n";
    return kExitError;
  }
  std::cout << sim::format_plan(result);
  if (vm.count("csv")) {
    if (!write_file(vm["csv"].as<std::string>(), sim::plan_csv(result), "csv")) return kExitError;
  }
  if (vm.count("json")) {
    if (!write_file(vm["json"].as<std::string>(), sim::plan_json(result), "json")) return kExitError;
  }
  return kExitOk;
}

}  // namespace kvscope::tools
