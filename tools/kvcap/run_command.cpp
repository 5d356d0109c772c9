// kvcap run: loads a model directory, builds the prompt (tiny VLM: PNG images or procedural scenes and a
// question; text LLaMA: a text or a chat prompt), generates greedily and records prefill Q/K/V, decode steps
// and ranges into a trace via the capture C API.
#include "run_command.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "kvscope/cli/options.hpp"
#include "kvscope/cli/progress.hpp"
#include "kvscope/closedloop/evaluate.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/model.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/trace/dataset.hpp"
#include "kvscope/trace/schema.hpp"
#include "kvscope_capture.h"

namespace kvscope::cli {
namespace {

namespace po = boost::program_options;
using runner::RunnerError;

constexpr const char* kExamples =
    "\nExamples:\n"
    "  kvcap run --model traces/models/tiny-shapes --scene 7 --question \"how many shapes ?\" "
    "-o t.h5\n"
    "  kvcap run --model traces/models/tiny-shapes --scene 3,8 \\\n"
    "      --question \"which image has more shapes ?\" --max-new 8 -o two.h5\n"
    "  kvcap run --model DIR --image a.png --question \"what color is the circle ?\" -o a.h5\n"
    "  kvcap run --model ~/.cache/kvscope/models/smollm2-135m-instruct --chat \\\n"
    "      --prompt \"What is the capital of France?\" -o paris.h5\n"
    "  kvcap run --model ~/.cache/kvscope/models/smollm2-135m-instruct \\\n"
    "      --prompt-file notes.txt --max-new 32 --dtype float16 -o notes.h5\n"
    "  kvcap run --model ~/.cache/kvscope/models/smollm2-135m-instruct --task passkey \\\n"
    "      --length 512 --sample 3 --max-new 8 --dtype float16 -o passkey-3.h5\n";

int fail(const std::string& msg) { return cli::fail("kvcap run", msg); }

// A failed capture call: the C API's one-line message.
class CaptureFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void check(int status, const char* what) {
  if (status != KVSCOPE_OK) {
    throw CaptureFailure(std::string(what) + ": " + kvscope_capture_last_error());
  }
}

kvscope_tensor to_c(const runner::TensorRef& r) {
  kvscope_tensor t{};
  t.data = r.data;
  t.dtype = KVSCOPE_F32;
  t.memory = r.device ? KVSCOPE_DEVICE : KVSCOPE_HOST;
  for (int i = 0; i < 3; ++i) {
    t.shape[i] = r.shape[i];
    t.stride[i] = r.stride[i];
  }
  return t;
}

// Token i of a [heads, n, D] tensor as a [heads, 1, D] view (same strides).
runner::TensorRef token_slice(const runner::TensorRef& r, std::int64_t i) {
  runner::TensorRef out = r;
  const std::int64_t stride = r.stride[1] ? r.stride[1] : r.shape[2];
  out.data = r.data + i * stride;
  out.shape[1] = 1;
  if (!r.stride[0] && !r.stride[1] && !r.stride[2]) {  // contiguous [heads, n, D]
    out.stride[0] = r.shape[1] * r.shape[2];
    out.stride[1] = r.shape[2];
    out.stride[2] = 1;
  }
  return out;
}

// Forwards the runner's reports to an open capture. Range pops come from destructors, so their failures are
// kept and rethrown by the next call (or by finish()).
class CaptureObserver final : public runner::RunObserver {
 public:
  CaptureObserver(kvscope_capture* c, const runner::Tokenizer& tokenizer) : c_(c), tokenizer_(tokenizer) {}
  void on_prefill_layer(int layer, const runner::TensorRef& q, const runner::TensorRef& k,
                        const runner::TensorRef& v) override {
    rethrow();
    const kvscope_tensor tq = to_c(q), tk = to_c(k), tv = to_c(v);
    check(kvscope_capture_prefill_layer(c_, layer, &tq, &tk, &tv), "recording a prefill layer");
  }
  // A forward of n tokens after the prefill is n decode steps: token i's q/k/v are step step + i.
  void on_decode_layer(int layer, int step, const runner::TensorRef& q, const runner::TensorRef& k,
                       const runner::TensorRef& v) override {
    rethrow();
    for (std::int64_t i = 0; i < q.shape[1]; ++i) {
      const kvscope_tensor tq = to_c(token_slice(q, i)), tk = to_c(token_slice(k, i)),
                           tv = to_c(token_slice(v, i));
      check(kvscope_capture_decode_layer(c_, layer, step + static_cast<int>(i), &tq, &tk, &tv),
            "recording a decode step");
    }
  }
  void on_decode_token(int step, std::int32_t token_id, std::int32_t position) override {
    rethrow();
    check(kvscope_capture_decode_token(c_, step, token_id, position, tokenizer_.text(token_id).c_str()),
          "recording a decode token");
  }
  void range_push(const char* name) override {
    rethrow();
    check(kvscope_capture_range_push(c_, name), "range push");
  }
  void range_pop() override {
    const int status = kvscope_capture_range_pop(c_);
    if (status != KVSCOPE_OK && error_.empty())
      error_ = std::string("range pop: ") + kvscope_capture_last_error();
  }
  void rethrow() const {
    if (!error_.empty()) throw CaptureFailure(error_);
  }

 private:
  kvscope_capture* c_;
  const runner::Tokenizer& tokenizer_;
  std::string error_;
};

std::vector<std::uint64_t> parse_seeds(const std::string& text) {
  std::vector<std::uint64_t> seeds;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::size_t used = 0;
    unsigned long long v = 0;
    bool ok = !item.empty() && item.find_first_not_of("0123456789") == std::string::npos;
    if (ok) {
      try {
        v = std::stoull(item, &used, 10);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok || used != item.size()) {
      throw std::invalid_argument("--scene '" + text + "': '" + item +
                                  "' is not an unsigned 64-bit seed (use SEED or SEED1,SEED2)");
    }
    seeds.push_back(v);
  }
  if (seeds.empty() || seeds.size() > 2) {
    throw std::invalid_argument("--scene '" + text + "': give one or two seeds (SEED or SEED1,SEED2)");
  }
  return seeds;
}

po::options_description make_options() {
  po::options_description opts(
      "kvcap run --model DIR (--image PNG [--image PNG2] | --scene SEED[,SEED2]) --question TEXT -o FILE\n"
      "kvcap run --model DIR (--prompt TEXT | --prompt-file F) [--chat] [--max-new N] -o FILE\n"
      "kvcap run --model DIR --task NAME [--length N] [--seed S] [--sample I] -o FILE\n"
      "kvcap run --model DIR --heldout I -o FILE\n"
      "kvcap run --model DIR [--task NAME [--length N] [--seed S]] --samples N [--first F] -o DIR/\n\n"
      "Runs a model directory and captures the run into a trace. Two kinds of model:\n"
      "  - a kvscope tiny VLM (config.json KvscopeTinyVlm, model.safetensors, vocab.json): one or two\n"
      "    images (--image or --scene) and a --question in its vocabulary;\n"
      "  - a text-only HF LLaMA (config.json LlamaForCausalLM, model.safetensors, tokenizer.json, e.g.\n"
      "    SmolLM2-135M-Instruct imported by scripts/setup): a --prompt or --prompt-file, tokenized as is\n"
      "    (no automatic BOS) or, with --chat, as the user message rendered through the model's chat\n"
      "    template (chat_template.jinja or tokenizer_config.json; its default system prompt) with the\n"
      "    assistant turn opened; or --task: sample I of a long-context task (docs/tasks.md), exactly the\n"
      "    prompt kvcap eval --task runs (chat template, answer prefix pre-filled), with its answer "
      "checked.\n"
      "    The prefill is the context (system prompt, intro, haystack); the rest of the prompt (question,\n"
      "    end of the user turn, answer prefix) is fed after it in one forward (--question-chunk) and\n"
      "    recorded as decode steps, then the answer is generated; every token's role (context, question,\n"
      "    answer, template) is written (docs/trace-format.md). --whole-prompt prefills it all instead.\n"
      "Generates the answer greedily (prefill, then each generated token fed back until an EOS token,\n"
      "--max-new tokens or the end of the context) and records per layer the prefill Q, K (after RoPE) and "
      "V,\n"
      "per decode step the fed token's Q/K/V, token labels (special, vision with patch grid and image\n"
      "index, text), each token's text, and steady-clock ranges per layer, attention and MLP.\n"
      "--samples N writes a dataset (docs/datasets.md): samples 0..N-1 (the tiny VLM's heldout.json, or the\n"
      "--task prompts) captured into DIR/s00000.h5 ..., then DIR/manifest.csv with each sample's family,\n"
      "context length, images, question, reference answer, generated answer and capture command.\n"
      "Prints the answer (decoded text) and the prefill/decode times on stdout. The trace is marked "
      "complete\n"
      "only when the run succeeded; on any error the partial file is removed and the exit status is 2.\n\n"
      "Options");
  opts.add_options()("help,h", "show this help")(
      "model", po::value<std::string>(),
      "model directory (e.g. traces/models/tiny-shapes, ~/.cache/kvscope/models/smollm2-135m-instruct)")(
      "image", po::value<std::vector<std::string>>(),
      "tiny VLM: PNG image of the model's size (64x64 RGB); repeat for two")(
      "scene", po::value<std::string>(),
      "tiny VLM: procedural scene seed(s) instead of images: SEED or SEED1,SEED2")(
      "question", po::value<std::string>(),
      "tiny VLM: the question, in the model's vocabulary (e.g. \"how many shapes ?\")")(
      "heldout", po::value<int>(),
      "tiny VLM: held-out sample I of the model's heldout.json (its scenes and question)")(
      "samples", po::value<int>(),
      "capture samples 0..N-1 (tiny VLM: heldout.json; text model: --task prompts) into the dataset "
      "directory -o DIR (docs/datasets.md)")(
      "first", po::value<int>()->default_value(0),
      "with --samples: index of the first sample (samples F .. F+N-1; ids s%05d of the index)")(
      "quiet,q", "no progress bar (with --samples; one capture shows none)")(
      "prompt", po::value<std::string>(), "text model: the prompt text")(
      "prompt-file", po::value<std::string>(), "text model: read the prompt text from this file (UTF-8)")(
      "chat", po::bool_switch(), "text model: render the prompt as a user message through the chat template")(
      "task", po::value<std::string>(),
      ("text model: a long-context task prompt (" + closedloop::task_names_list() + ")").c_str())(
      "length", po::value<int>()->default_value(1024),
      "with --task: tokens of the user message (512 .. 4096)")(
      "seed", po::value<unsigned long long>()->default_value(0), "with --task: the task generator's seed")(
      "sample", po::value<int>()->default_value(0), "with --task: the sample index (0 .. 99999)")(
      "haystack", po::value<std::vector<std::string>>(),
      "with --task: prose files or directories (repeatable; default /usr/share/common-licenses)")(
      "whole-prompt", po::bool_switch(),
      "with --task: prefill the whole prompt (question included) instead of prefilling the context and "
      "feeding the rest as decode steps")(
      "question-chunk", po::value<int>()->default_value(0),
      "with --task: feed the tokens after the context in forwards of N tokens (0 = one forward; 1 = one "
      "token at a time)")(
      "max-new", po::value<int>(),
      "at most this many generated tokens (1..1024; default 16 for the tiny VLM, 64 for a text model)")(
      "device", po::value<std::string>()->default_value("cpu"),
      "cpu or cuda (cuda needs a GPU build and a GPU)")(
      "threads", po::value<int>()->default_value(0),
      "CPU threads (0 = all cores; at most 4 x the hardware threads, 1024)")(
      "dtype", po::value<std::string>()->default_value("float32"),
      "tensor dtype in the trace: float32, float16, bfloat16")(
      "output,o", po::value<std::string>(), "output trace file (.h5); with --samples the dataset directory");
  return opts;
}

// The prompt text of --prompt or --prompt-file (exactly one). Throws std::invalid_argument.
std::string read_prompt(const po::variables_map& vm) {
  const bool has_text = vm.count("prompt") != 0, has_file = vm.count("prompt-file") != 0;
  if (has_text == has_file) {
    throw std::invalid_argument(has_text ? "give either --prompt or --prompt-file, not both"
                                         : "give --prompt TEXT or --prompt-file F (see kvcap run --help)");
  }
  std::string text;
  if (has_text) {
    text = vm["prompt"].as<std::string>();
  } else {
    const std::string path = vm["prompt-file"].as<std::string>();
    std::error_code ec;
    if (!std::filesystem::exists(path, ec))
      throw std::invalid_argument(path + ": cannot open the prompt file (no such file)");
    if (!std::filesystem::is_regular_file(path, ec))
      throw std::invalid_argument(path + ": cannot open the prompt file (not a regular file)");
    // A context of even 128K tokens is a few MB of text: a larger file is a mistake, not a prompt.
    constexpr std::uintmax_t kMaxPromptBytes = 16u << 20;
    if (std::filesystem::file_size(path, ec) > kMaxPromptBytes)
      throw std::invalid_argument(path + ": the prompt file is larger than 16 MiB");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::invalid_argument(path + ": cannot open the prompt file");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  if (text.find_first_not_of(" \t\r\n") == std::string::npos)
    throw std::invalid_argument(has_text ? "--prompt is empty"
                                         : vm["prompt-file"].as<std::string>() + ": the prompt is empty");
  return text;
}
// A prompt ready to capture: the prefill, the roles of the whole prompt (--task; empty otherwise) and the
// tokens fed after the prefill as decode steps.
struct Prepared {
  runner::Prompt prompt;
  std::vector<std::uint8_t> roles;
  std::vector<std::int32_t> after_prefill;
  int images = 0;
};

// --task sample `s`: without `whole_prompt` the prefill is the prompt up to the question and the rest
// (question, end of the user turn, answer prefix) is fed after it. Throws std::invalid_argument.
Prepared task_prompt(runner::Model& model, const runner::ChatTemplate& chat_template,
                     const closedloop::TaskSample& s, bool whole_prompt) {
  Prepared p;
  const std::vector<std::int32_t> ids =
      model.tokenizer().encode(closedloop::task_prompt_text(chat_template, s));
  p.roles = closedloop::task_token_roles(model.tokenizer(), ids, chat_template, s);
  std::size_t split = ids.size();
  if (!whole_prompt) {
    split = static_cast<std::size_t>(
        std::find(p.roles.begin(), p.roles.end(), static_cast<std::uint8_t>(trace::Role::kQuestion)) -
        p.roles.begin());
    if (split == 0 || split == ids.size())
      throw std::invalid_argument("task prompt without a context or a question");
  }
  p.prompt = model.build_prompt_from_ids(
      std::vector<std::int32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(split)));
  p.after_prefill.assign(ids.begin() + static_cast<std::ptrdiff_t>(split), ids.end());
  return p;
}

Prepared vlm_prompt(runner::Model& model, const std::vector<runner::Image>& images,
                    const std::string& question) {
  Prepared p;
  p.prompt = model.build_prompt(images, question);
  p.images = static_cast<int>(images.size());
  return p;
}

// Captures one run of `p` into the trace `out`. On any error the partial file is removed and the error
// (one line) is thrown as std::runtime_error.
runner::Generation capture_trace(runner::Model& model, const Prepared& p, const std::string& out,
                                 kvscope_dtype dtype, int max_new, int question_chunk) {
  const runner::Prompt& prompt = p.prompt;
  const runner::ModelConfig& mc = model.config();
  kvscope_capture_config cfg{};
  cfg.struct_size = sizeof(cfg);
  cfg.num_layers = mc.num_layers;
  cfg.num_q_heads = mc.num_q_heads;
  cfg.num_kv_heads = mc.num_kv_heads;
  cfg.head_dim = mc.head_dim;
  cfg.rope_theta = mc.rope_base();
  cfg.model_name = mc.model_name.c_str();
  const std::string device_label = model.backend().device_name();
  cfg.device = device_label.c_str();
  cfg.dtype = dtype;
  cfg.max_decode_steps = max_new + static_cast<int>(p.after_prefill.size());
  cfg.profile = 1;
  kvscope_capture* cap = nullptr;
  std::error_code ec;
  if (kvscope_capture_open(out.c_str(), &cfg, prompt.size(), &cap) != KVSCOPE_OK) {
    const std::string msg = kvscope_capture_last_error();
    if (std::filesystem::exists(out, ec)) std::filesystem::remove(out, ec);
    throw std::runtime_error(out + ": cannot create the trace (" + msg + ")");
  }
  runner::Generation gen;
  try {
    const std::size_t t = static_cast<std::size_t>(prompt.size());
    std::vector<std::uint8_t> modality(t);
    std::vector<std::int32_t> position(t), token_id(t), segment(t), grid_row(t), grid_col(t);
    std::vector<const char*> text(t);
    for (std::size_t i = 0; i < t; ++i) {
      const runner::TokenInfo& tok = prompt.tokens[i];
      modality[i] = tok.modality;
      position[i] = tok.position;
      token_id[i] = tok.token_id;
      segment[i] = tok.segment;
      grid_row[i] = tok.grid_row;
      grid_col[i] = tok.grid_col;
      text[i] = prompt.text[i].c_str();
    }
    check(kvscope_capture_set_tokens(cap, modality.data(), position.data(), token_id.data(), segment.data(),
                                     grid_row.data(), grid_col.data(), text.data()),
          "setting tokens");
    CaptureObserver observer(cap, model.tokenizer());
    runner::GenerateOptions gopt;
    gopt.max_new = max_new;
    gopt.observer = &observer;
    gopt.after_prefill = p.after_prefill;
    gopt.after_prefill_chunk = p.roles.empty() ? 0 : question_chunk;
    gen = model.generate(prompt, gopt);
    observer.rethrow();
    if (!p.roles.empty()) {
      // Roles: the prefill's from the prompt; decode steps: the fed prompt tokens', then answer.
      check(kvscope_capture_set_token_roles(cap, p.roles.data()), "setting token roles");
      std::vector<std::uint8_t> decode_roles(p.roles.begin() + prompt.size(), p.roles.end());
      decode_roles.resize(static_cast<std::size_t>(gen.decode_steps),
                          static_cast<std::uint8_t>(trace::Role::kAnswer));
      check(kvscope_capture_set_decode_roles(cap, decode_roles.data(),
                                             static_cast<std::int64_t>(decode_roles.size())),
            "setting decode roles");
    }
  } catch (const std::exception& e) {
    kvscope_capture_abort(cap);
    std::filesystem::remove(out, ec);
    throw std::runtime_error(e.what());
  }
  if (kvscope_capture_close(cap) != KVSCOPE_OK) {
    const std::string msg = kvscope_capture_last_error();
    std::filesystem::remove(out, ec);
    throw std::runtime_error(out + ": closing the trace failed (" + msg + ")");
  }
  return gen;
}

// The kvcap run command that captures one trace, shell-quoted (the manifest's capture_command).
std::string capture_command(std::vector<std::string> args) {
  args.insert(args.begin(), {"kvcap", "run"});
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return sim::command_line_string(static_cast<int>(argv.size()), argv.data());
}

std::string seed_text(const std::vector<std::uint64_t>& seeds, char sep) {
  std::string out;
  for (std::uint64_t s : seeds) out.append(out.empty() ? "" : std::string(1, sep)).append(std::to_string(s));
  return out;
}

}  // namespace

int run_command(const std::vector<std::string>& args) {
  kernels::keep_freed_memory();  // the decoder's buffers, request after request
  const po::options_description opts = make_options();
  po::variables_map vm;
  if (const auto exit = parse_options("kvcap run", args, opts, vm, kExamples)) return *exit;
  for (const char* required : {"model", "output"}) {
    if (!vm.count(required)) return missing("kvcap run", std::string("--") + required);
  }
  const std::string model_dir = vm["model"].as<std::string>();
  // The model's kind decides which prompt options apply; config.json is read first (cheap) so that a
  // mismatch is reported before the weights load.
  bool text_model = false;
  try {
    if (!std::filesystem::is_directory(model_dir))
      throw RunnerError(runner::ErrorKind::kModel, model_dir + ": not a model directory");
    text_model = !runner::load_config(model_dir).has_vision();
  } catch (const RunnerError& e) {
    return fail(e.what());
  }
  const bool has_image = vm.count("image") != 0, has_scene = vm.count("scene") != 0;
  const bool has_heldout = vm.count("heldout") != 0;
  const bool chat = vm["chat"].as<bool>();
  const bool dataset = vm.count("samples") != 0;
  const bool task = vm.count("task") != 0;
  if (text_model) {
    for (const char* vlm_only : {"scene", "image", "question", "heldout"}) {
      if (vm.count(vlm_only)) {
        return fail(std::string("--") + vlm_only + " is for the tiny VLM; " + model_dir +
                    " is a text model (use --prompt or --prompt-file)");
      }
    }
    if (dataset && !task) return fail("--samples on a text model needs --task (the samples are its prompts)");
  } else {
    for (const char* text_only : {"prompt", "prompt-file", "chat", "task", "length", "seed", "sample",
                                  "haystack", "whole-prompt", "question-chunk"}) {
      if (vm.count(text_only) && !vm[text_only].defaulted()) {
        return fail(std::string("--") + text_only + " is for text models; " + model_dir +
                    " is the tiny VLM (use --image or --scene and --question)");
      }
    }
    if (dataset) {
      for (const char* single : {"image", "scene", "question", "heldout"}) {
        if (vm.count(single))
          return fail(std::string("--") + single +
                      " captures one trace; --samples takes heldout.json's samples");
      }
    } else if (has_heldout) {
      if (has_image || has_scene || vm.count("question"))
        return fail("--heldout takes the sample's scenes and question: drop --image, --scene and --question");
    } else {
      if (!vm.count("question")) return fail("missing --question (see kvcap run --help)");
      if (has_image == has_scene) {
        return fail(has_image ? "give either --image or --scene, not both"
                              : "give --image PNG or --scene SEED (see kvcap run --help)");
      }
    }
  }
  int num_samples = 0;
  const int first = vm["first"].as<int>();
  if (!dataset && !vm["first"].defaulted()) return fail("--first needs --samples");
  if (first < 0 || first > 99999) return fail("--first must be in 0..99999, got " + std::to_string(first));
  if (dataset) {
    num_samples = vm["samples"].as<int>();
    if (num_samples < 1 || num_samples > 100000)
      return fail("--samples must be in 1..100000, got " + std::to_string(num_samples));
    if (vm.count("sample") && !vm["sample"].defaulted())
      return fail("--sample captures one trace; --samples N captures samples 0..N-1");
  }
  const int max_new = vm.count("max-new") ? vm["max-new"].as<int>() : (text_model ? 64 : 16);
  if (max_new < 1 || max_new > 1024)
    return fail("--max-new must be in 1..1024, got " + std::to_string(max_new));
  const std::string device_name = vm["device"].as<std::string>();
  if (device_name != "cpu" && device_name != "cuda")
    return fail("--device '" + device_name + "' is not cpu or cuda");
  const int threads = vm["threads"].as<int>();
  if (const std::string bad = cli::check_threads(threads); !bad.empty()) return fail(bad);
  const std::string dtype_name = vm["dtype"].as<std::string>();
  kvscope_dtype dtype = KVSCOPE_F32;
  if (dtype_name == "float16" || dtype_name == "fp16") {
    dtype = KVSCOPE_F16;
  } else if (dtype_name == "bfloat16" || dtype_name == "bf16") {
    dtype = KVSCOPE_BF16;
  } else if (dtype_name != "float32" && dtype_name != "fp32") {
    return fail("--dtype '" + dtype_name + "' is not one of float32, float16, bfloat16");
  }
  const std::string out = vm["output"].as<std::string>();
  if (dataset) {
    std::error_code ec;
    if (std::filesystem::exists(out, ec) && !std::filesystem::is_directory(out, ec))
      return fail(out + ": exists and is not a directory (--samples writes a dataset directory)");
    if (std::filesystem::exists(std::filesystem::path(out) / trace::kManifestName, ec))
      return fail(out + ": already a dataset (has " + trace::kManifestName +
                  "); remove it or choose another -o");
  }
  std::string question, prompt_text;
  if (!task) {
    for (const char* task_only : {"length", "seed", "sample", "haystack", "whole-prompt", "question-chunk"}) {
      if (vm.count(task_only) && !vm[task_only].defaulted())
        return fail(std::string("--") + task_only + " needs --task");
    }
  }
  closedloop::Haystack haystack;
  std::vector<closedloop::HeldoutSample> heldout;
  try {
    if (task) {
      if (vm.count("prompt") || vm.count("prompt-file") || chat)
        return fail("--task builds the prompt itself: drop --prompt, --prompt-file and --chat");
      closedloop::check_task_name(vm["task"].as<std::string>());
      const int length = vm["length"].as<int>(), sample = vm["sample"].as<int>();
      if (length < closedloop::kMinTaskLength || length > closedloop::kMaxTaskLength) {
        return fail("--length " + std::to_string(length) + " out of range (" +
                    std::to_string(closedloop::kMinTaskLength) + " .. " +
                    std::to_string(closedloop::kMaxTaskLength) + " tokens)");
      }
      if (sample < 0 || sample > 99999)
        return fail("--sample must be in 0..99999, got " + std::to_string(sample));
      const int chunk = vm["question-chunk"].as<int>();
      if (chunk < 0 || chunk > 1000000)
        return fail("--question-chunk must be in 0..1000000, got " + std::to_string(chunk));
      haystack =
          closedloop::load_haystack(vm.count("haystack") ? vm["haystack"].as<std::vector<std::string>>()
                                                         : closedloop::default_haystack_paths());
    } else if (text_model) {
      prompt_text = read_prompt(vm);
    } else if (dataset || has_heldout) {
      heldout = closedloop::load_heldout(model_dir);
      const int want = dataset ? first + num_samples : vm["heldout"].as<int>() + 1;
      if (has_heldout && vm["heldout"].as<int>() < 0) return fail("--heldout must be >= 0");
      if (want > static_cast<int>(heldout.size())) {
        return fail((dataset ? "--first " + std::to_string(first) + " --samples " + std::to_string(num_samples)
                             : "--heldout " + std::to_string(vm["heldout"].as<int>())) +
                    " but " + model_dir + "/heldout.json has only " + std::to_string(heldout.size()) +
                    " samples");
      }
    } else {
      question = vm["question"].as<std::string>();
      if (question.find_first_not_of(" \t\r\n") == std::string::npos) return fail("--question is empty");
    }
  } catch (const std::invalid_argument& e) {
    return fail(e.what());
  } catch (const closedloop::TaskError& e) {
    return fail(e.what());
  } catch (const closedloop::EvalError& e) {
    return fail(e.what());
  }
  kernels::set_cpu_threads(threads);

  // Everything that can be checked is checked before the output file is created.
  std::optional<runner::Model> model;
  std::optional<runner::ChatTemplate> chat_template;
  std::vector<closedloop::TaskSample> task_samples;
  Prepared single;
  try {
    model.emplace(
        runner::Model::load(model_dir, device_name == "cuda" ? runner::Device::kCuda : runner::Device::kCpu));
    if (task) {
      // Samples 0..I are drawn (sample i depends only on task, length, seed and i) and I is run.
      chat_template.emplace(runner::ChatTemplate::load(model_dir));
      task_samples = closedloop::make_task_samples(vm["task"].as<std::string>(), vm["length"].as<int>(),
                                                   dataset ? first + num_samples : vm["sample"].as<int>() + 1,
                                                   vm["seed"].as<unsigned long long>(), haystack,
                                                   closedloop::token_counter(model->tokenizer()));
      if (!dataset)
        single = task_prompt(*model, *chat_template, task_samples.back(), vm["whole-prompt"].as<bool>());
    } else if (text_model) {
      single.prompt = chat ? model->build_chat_prompt(prompt_text) : model->build_text_prompt(prompt_text);
    } else if (has_heldout) {
      const closedloop::HeldoutSample& h = heldout[static_cast<std::size_t>(vm["heldout"].as<int>())];
      std::vector<runner::Image> images;
      for (std::uint64_t seed : h.image_seeds) images.push_back(runner::render_scene(seed).image);
      single = vlm_prompt(*model, images, h.question);
    } else if (!dataset) {
      const auto& vc = model->config().vision;
      std::vector<runner::Image> images;
      if (has_scene) {
        for (std::uint64_t seed : parse_seeds(vm["scene"].as<std::string>()))
          images.push_back(runner::render_scene(seed).image);
      } else {
        const auto paths = vm["image"].as<std::vector<std::string>>();
        if (paths.size() > 2) return fail("at most two --image");
        for (const auto& p : paths) images.push_back(runner::load_image(p, vc.image_size, vc.image_size));
      }
      single = vlm_prompt(*model, images, question);
    }
  } catch (const RunnerError& e) {
    return fail(e.what());
  } catch (const std::invalid_argument& e) {
    return fail(e.what());
  } catch (const closedloop::TaskError& e) {
    return fail(e.what());
  }
  const runner::ModelConfig& mc = model->config();
  const int chunk = task ? vm["question-chunk"].as<int>() : 0;
  const std::string device_label = model->backend().device_name();

  if (dataset) {
    // A dataset (docs/datasets.md): one trace per sample, then manifest.csv, written last (to a temporary
    // name, renamed): a directory without it is not a dataset.
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    if (ec) return fail(out + ": cannot create the dataset directory (" + ec.message() + ")");
    std::vector<std::vector<std::string>> rows;
    cli::ProgressBar bar("kvcap run", static_cast<std::size_t>(num_samples), !vm.count("quiet"));
    int correct = 0;
    for (int i = first; i < first + num_samples; ++i) {
      char name[32];
      std::snprintf(name, sizeof name, "s%05d", i);
      const std::string file = std::string(name) + ".h5";
      const std::string path = (std::filesystem::path(out) / file).string();
      std::vector<std::string> cmd = {"--model", model_dir};
      std::string family, questions, reference, seeds, task_name, length, seed, sample_index;
      Prepared p;
      try {
        if (task) {
          const closedloop::TaskSample& s = task_samples[static_cast<std::size_t>(i)];
          p = task_prompt(*model, *chat_template, s, vm["whole-prompt"].as<bool>());
          family = task_name = s.task;
          questions = s.question;
          reference = s.answer;
          length = std::to_string(s.length);
          seed = std::to_string(s.seed);
          sample_index = std::to_string(s.index);
          cmd.insert(cmd.end(),
                     {"--task", s.task, "--length", length, "--seed", seed, "--sample", sample_index});
          if (vm.count("haystack"))
            for (const auto& h : vm["haystack"].as<std::vector<std::string>>())
              cmd.insert(cmd.end(), {"--haystack", h});
          if (vm["whole-prompt"].as<bool>()) cmd.push_back("--whole-prompt");
          if (chunk) cmd.insert(cmd.end(), {"--question-chunk", std::to_string(chunk)});
        } else {
          const closedloop::HeldoutSample& h = heldout[static_cast<std::size_t>(i)];
          std::vector<runner::Image> images;
          for (std::uint64_t sd : h.image_seeds) images.push_back(runner::render_scene(sd).image);
          p = vlm_prompt(*model, images, h.question);
          family = closedloop::kFamilies[static_cast<std::size_t>(h.family)];
          questions = h.question;
          reference = h.answer;
          seeds = seed_text(h.image_seeds, ';');
          sample_index = std::to_string(h.index);
          cmd.insert(cmd.end(), {"--heldout", std::to_string(i)});
        }
        cmd.insert(cmd.end(), {"--max-new", std::to_string(max_new), "--dtype", dtype_name, "-o", path});
        const runner::Generation gen = capture_trace(*model, p, path, dtype, max_new, chunk);
        const bool ok = closedloop::answer_matches(gen.text, reference);
        correct += ok ? 1 : 0;
        rows.push_back({name, file, family, std::to_string(p.prompt.size()), std::to_string(gen.decode_steps),
                        std::to_string(p.images), seeds, questions, reference, gen.text, ok ? "1" : "0",
                        task_name, length, seed, sample_index, mc.model_name, capture_command(cmd)});
      } catch (const std::exception& e) {
        return fail("sample " + std::string(name) + ": " + e.what() + " (" + out +
                    " is left without a manifest: not a dataset)");
      }
      bar.update(static_cast<std::size_t>(i - first + 1));
    }
    bar.finish();
    try {
      trace::write_manifest(out, trace::manifest_columns(), rows);
    } catch (const trace::TraceError& e) {
      return fail(e.what());
    }
    std::printf("wrote dataset %s: %d samples (%s), %d/%d answers match the reference; device %s, %s\n",
                out.c_str(), num_samples, (std::filesystem::path(out) / trace::kManifestName).c_str(),
                correct, num_samples, device_label.c_str(), dtype_name.c_str());
    return kExitOk;
  }

  runner::Generation gen;
  try {
    gen = capture_trace(*model, single, out, dtype, max_new, chunk);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  const runner::Prompt& prompt = single.prompt;
  const closedloop::TaskSample* task_sample = task ? &task_samples.back() : nullptr;
  const double prefill_tps = gen.prefill_ms > 0 ? prompt.size() / gen.prefill_ms * 1e3 : 0;
  const double decode_tps = gen.decode_ms > 0 ? gen.decode_steps / gen.decode_ms * 1e3 : 0;
  std::printf("answer: %s\n", gen.text.c_str());
  if (task_sample) {
    std::printf("task: %s sample %d (length %d, seed %llu, depth %.2f): expected \"%s\", %s\n",
                task_sample->task.c_str(), task_sample->index, task_sample->length,
                static_cast<unsigned long long>(task_sample->seed), task_sample->depth,
                task_sample->answer.c_str(),
                closedloop::answer_matches(gen.text, task_sample->answer) ? "correct" : "wrong");
  }
  if (has_heldout) {
    const closedloop::HeldoutSample& h = heldout[static_cast<std::size_t>(vm["heldout"].as<int>())];
    std::printf("heldout: sample %d (%s, scenes %s): expected \"%s\", %s\n", h.index,
                closedloop::kFamilies[static_cast<std::size_t>(h.family)],
                seed_text(h.image_seeds, ',').c_str(), h.answer.c_str(),
                closedloop::answer_matches(gen.text, h.answer) ? "correct" : "wrong");
  }
  std::printf(
      "prefill: %d tokens in %.2f ms (%.0f tokens/s); decode: %d steps in %.2f ms (%.0f tokens/s); "
      "device %s\n",
      prompt.size(), gen.prefill_ms, prefill_tps, gen.decode_steps, gen.decode_ms, decode_tps,
      device_label.c_str());
  std::printf("wrote %s: %d context tokens, %d decode steps, %d layers, %d/%d heads, %s\n", out.c_str(),
              prompt.size(), gen.decode_steps, mc.num_layers, mc.num_q_heads, mc.num_kv_heads,
              dtype_name.c_str());
  if (task) {
    int counts[trace::kNumRoles] = {};
    for (std::uint8_t r : single.roles) ++counts[r];
    std::printf(
        "roles: %d context, %d question, %d template, %d answer prefix tokens; %d of them fed after the "
        "prefill as decode steps, then %d generated\n",
        counts[0], counts[1], counts[3], counts[2], gen.after_prefill_steps,
        gen.decode_steps - gen.after_prefill_steps);
  }
  return kExitOk;
}

}  // namespace kvscope::cli
