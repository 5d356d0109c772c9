// kvrunner-bench: prefill and decode throughput of the runner's decoder backend on a model directory or on
// random weights of a given geometry, with the time split per phase. Prints one JSON object per run on
// stdout (scripts/bench-real-model drives it next to Hugging Face); progress and errors go to stderr.
//
//   kvrunner-bench --model DIR --ids FILE [--decode N] [--repeat R] [--threads N]
//   kvrunner-bench --synthetic smollm2-135m --tokens 1024 [--decode N] ...
//   kvrunner-bench --sgemm-ceiling [--threads N]

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/model.hpp"

namespace {

using namespace kvscope;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr const char* kUsage =
    "usage: kvrunner-bench (--model DIR --ids FILE | --synthetic smollm2-135m --tokens N) [options]\n"
    "       kvrunner-bench --sgemm-ceiling [--threads N]\n"
    "Times the runner's decoder (CPU, or the cuBLAS backend with --device cuda): one prefill over the\n"
    "prompt, then greedy decode steps (EOS ignored),\n"
    "and prints one JSON object per repetition on stdout.\n"
    "  --sgemm-ceiling      instead: the machine's sgemm rate through the OpenBLAS the runner links\n"
    "                       (2048^3, --threads BLAS threads, best of 3 after a warm-up), one JSON object\n"
    "                       {sgemm_n, sgemm_flops_per_s, threads, blas_core}\n"
    "  --model DIR          a model directory Model::load reads (config.json, model.safetensors, tokenizer)\n"
    "  --ids FILE           the prompt's token ids, whitespace-separated\n"
    "  --synthetic NAME     random weights of a known geometry instead of a model (smollm2-135m)\n"
    "  --tokens N           prompt length: the first N ids of --ids, or N random ids with --synthetic\n"
    "  --decode N           decode steps after the prefill (default 32)\n"
    "  --repeat R           repetitions (default 1)\n"
    "  --device cpu|cuda    the backend (default cpu); cuda needs a CUDA build and a GPU, and reports no\n"
    "                       phases_s (its kernels run asynchronously)\n"
    "  --threads N          OpenMP threads (default: all cores)\n"
    "  --warmup             an untimed prefill of the whole prompt and 2 decode steps first (the work\n"
    "                       buffers and the allocator reach their steady state, as in a second request)\n"
    "  --no-phases          no per-phase timing (no observer)\n"
    "  --help               this text\n"
    "JSON fields: tokens, prefill_s, prefill_tok_s, prefill_flop (multiply-add = 2: the projections of "
    "every\n"
    "token, causal attention over the lower triangle, the last token's logits), decode_steps, decode_s,\n"
    "decode_tok_s, device, threads, blas_core,\n"
    "next_token (the greedy token after the prefill),\n"
    "phases_s (prefill only: qkv = norm + q/k/v projections + RoPE; attention = KV append + attention +\n"
    "o_proj; mlp = norm + gate/up/down; lm_head = final norm + logits of the last token).\n";

int bad(const std::string& msg) {
  std::cerr << "kvrunner-bench: " << msg << "\n";
  return 2;
}

// Geometry of SmolLM2-135M-Instruct (config.json of the imported model).
runner::ModelConfig smollm2_config() {
  runner::ModelConfig c;
  c.hidden_size = 576;
  c.intermediate_size = 1536;
  c.num_layers = 30;
  c.num_q_heads = 9;
  c.num_kv_heads = 3;
  c.head_dim = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 100000.0;
  c.max_position_embeddings = 8192;
  c.vocab_size = 49152;
  c.kind = runner::ModelKind::kLlama;
  c.tie_word_embeddings = true;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.eos_token_ids = {2};
  c.image_start_token_id = c.image_end_token_id = c.sep_token_id = -1;
  c.model_name = "synthetic-smollm2-135m";
  return c;
}

std::vector<float> random_vector(std::mt19937& rng, std::size_t n, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

runner::ModelWeights random_weights(const runner::ModelConfig& c) {
  std::mt19937 rng(1234);
  const std::size_t d = c.hidden_size, q = static_cast<std::size_t>(c.num_q_heads) * c.head_dim,
                    kv = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim, in = c.intermediate_size;
  const float sd = 1.0f / std::sqrt(static_cast<float>(d)), si = 1.0f / std::sqrt(static_cast<float>(in));
  runner::ModelWeights w;
  w.embed_tokens = random_vector(rng, c.vocab_size * d, 1.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    runner::LayerWeights lw;
    lw.input_norm.assign(d, 1.0f);
    lw.post_norm.assign(d, 1.0f);
    lw.wq = random_vector(rng, q * d, sd);
    lw.wk = random_vector(rng, kv * d, sd);
    lw.wv = random_vector(rng, kv * d, sd);
    lw.wo = random_vector(rng, d * q, sd);
    lw.w_gate = random_vector(rng, in * d, sd);
    lw.w_up = random_vector(rng, in * d, sd);
    lw.w_down = random_vector(rng, d * in, si);
    w.layers.push_back(std::move(lw));
  }
  w.final_norm.assign(d, 1.0f);
  // Tied embeddings, as the real model: lm_head stays empty and output() is embed_tokens.
  return w;
}

// Ids as their decimal text: enough for a benchmark without a tokenizer.
class NumberTokenizer final : public runner::Tokenizer {
 public:
  explicit NumberTokenizer(int n) {
    for (int i = 0; i < n; ++i) text_.push_back(std::to_string(i));
  }
  int size() const override { return static_cast<int>(text_.size()); }
  const std::string& text(int id) const override { return text_.at(static_cast<std::size_t>(id)); }
  std::vector<std::int32_t> encode(const std::string&) const override { return {}; }
  std::string decode(const std::vector<std::int32_t>&) const override { return {}; }
  bool is_special(int) const override { return false; }

 private:
  std::vector<std::string> text_;
};

// Sums the wall time of the prefill's phases from the backend's ranges: "layer NNN/attention" is split at
// on_prefill_layer (after norm, q/k/v and RoPE) into qkv and attention; "layer NNN/mlp" is mlp.
class PhaseTimer final : public runner::RunObserver {
 public:
  void range_push(const char* name) override { stack_.push_back({name, Clock::now()}); }
  void range_pop() override {
    const Open o = stack_.back();
    stack_.pop_back();
    const double s = seconds_since(o.start);
    if (o.name.ends_with("/attention")) {
      phases_["attention"] += std::chrono::duration<double>(Clock::now() - split_).count();
      phases_["qkv"] += std::chrono::duration<double>(split_ - o.start).count();
    } else if (o.name.ends_with("/mlp")) {
      phases_["mlp"] += s;
    }
  }
  void on_prefill_layer(int, const runner::TensorRef&, const runner::TensorRef&,
                        const runner::TensorRef&) override {
    split_ = Clock::now();
  }
  std::map<std::string, double>& phases() { return phases_; }

 private:
  struct Open {
    std::string name;
    Clock::time_point start;
  };
  std::vector<Open> stack_;
  Clock::time_point split_;
  std::map<std::string, double> phases_;
};

// FLOP of a prefill of t tokens (multiply-add = 2): q/k/v/o and MLP projections of every token, QK^T and
// PV of causal attention (query i sees i + 1 slots), the last token's logits.
double prefill_flop(const runner::ModelConfig& c, int t) {
  const double d = c.hidden_size, dh = c.head_dim, hq = c.num_q_heads, hkv = c.num_kv_heads;
  const double per_token = 2.0 * d * (2 * hq * dh + 2 * hkv * dh + 3.0 * c.intermediate_size);
  const double pairs = 0.5 * t * (t + 1.0);
  return c.num_layers * (per_token * t + 2.0 * 2.0 * dh * hq * pairs) + 2.0 * d * c.vocab_size;
}

int argmax(const std::vector<float>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

}  // namespace

int main(int argc, char** argv) {
  kernels::use_fast_blas_runtime(argv);
  kernels::keep_freed_memory();
  std::string model_dir, ids_file, synthetic, device_name = "cpu";
  int tokens = -1, decode = 32, repeat = 1, threads = 0;
  bool phases = true, warmup = false, ceiling = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* what) -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(what) + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--help" || a == "-h") {
        std::cout << kUsage;
        return 0;
      } else if (a == "--model") {
        model_dir = value("--model");
      } else if (a == "--ids") {
        ids_file = value("--ids");
      } else if (a == "--synthetic") {
        synthetic = value("--synthetic");
      } else if (a == "--tokens") {
        tokens = std::stoi(value("--tokens"));
      } else if (a == "--decode") {
        decode = std::stoi(value("--decode"));
      } else if (a == "--repeat") {
        repeat = std::stoi(value("--repeat"));
      } else if (a == "--device") {
        device_name = value("--device");
      } else if (a == "--threads") {
        threads = std::stoi(value("--threads"));
      } else if (a == "--warmup") {
        warmup = true;
      } else if (a == "--no-phases") {
        phases = false;
      } else if (a == "--sgemm-ceiling") {
        ceiling = true;
      } else {
        return bad("unknown argument " + a + " (see --help)");
      }
    } catch (const std::exception& e) {
      return bad(a + ": " + e.what());
    }
  }
  if (decode < 0 || repeat < 1 || threads < 0)
    return bad("--decode, --repeat and --threads must be >= 0 / 1");
  if (device_name != "cpu" && device_name != "cuda")
    return bad("unknown --device " + device_name + " (cpu, cuda)");
  const runner::Device device = device_name == "cuda" ? runner::Device::kCuda : runner::Device::kCpu;
  if (device == runner::Device::kCuda) phases = false;
  kernels::set_cpu_threads(threads);
  if (ceiling) {
    if (!model_dir.empty() || !synthetic.empty()) return bad("--sgemm-ceiling takes no model");
    constexpr int kN = 2048;
    const double flops = kernels::measure_sgemm_flops_per_s(kernels::cpu_threads(), kN, 3);
    std::printf("{\"sgemm_n\": %d, \"sgemm_flops_per_s\": %.6g, \"threads\": %d, \"blas_core\": \"%s\"}\n",
                kN, flops, kernels::cpu_threads(), kernels::blas_core_name());
    return 0;
  }
  if (model_dir.empty() == synthetic.empty()) return bad("give exactly one of --model and --synthetic");
  if (!model_dir.empty() && ids_file.empty()) return bad("--model needs --ids");
  if (!synthetic.empty() && synthetic != "smollm2-135m") return bad("unknown --synthetic " + synthetic);
  if (!synthetic.empty() && tokens <= 0) return bad("--synthetic needs --tokens N > 0");
  try {
    std::vector<std::int32_t> ids;
    std::unique_ptr<runner::Model> model;
    if (!model_dir.empty()) {
      std::ifstream in(ids_file);
      if (!in) return bad(ids_file + ": cannot open");
      long long id;
      while (in >> id) ids.push_back(static_cast<std::int32_t>(id));
      if (!in.eof()) return bad(ids_file + ": not a list of integer token ids");
      if (tokens > 0) {
        if (tokens > static_cast<int>(ids.size())) {
          return bad(ids_file + ": " + std::to_string(ids.size()) + " ids, fewer than --tokens " +
                     std::to_string(tokens));
        }
        ids.resize(static_cast<std::size_t>(tokens));
      }
      model = std::make_unique<runner::Model>(runner::Model::load(model_dir, device));
    } else {
      runner::ModelConfig c = smollm2_config();
      std::cerr << "kvrunner-bench: random weights of " << c.model_name << "\n";
      model = std::make_unique<runner::Model>(c, random_weights(c),
                                              std::make_shared<NumberTokenizer>(c.vocab_size), device);
      std::mt19937 rng(7);
      std::uniform_int_distribution<int> u(0, c.vocab_size - 1);
      for (int i = 0; i < tokens; ++i) ids.push_back(u(rng));
    }
    const runner::ModelConfig& c = model->config();
    const int t = static_cast<int>(ids.size());
    if (t < 1) return bad(ids_file + ": no token ids");
    for (std::int32_t id : ids) {
      if (id < 0 || id >= c.vocab_size)
        return bad(ids_file + ": token id " + std::to_string(id) + " out of range");
    }
    if (t + decode > c.max_position_embeddings)
      return bad("prompt + decode steps exceed the model's context");
    runner::Prompt prompt;
    for (int i = 0; i < t; ++i) {
      runner::TokenInfo ti;
      ti.token_id = ids[static_cast<std::size_t>(i)];
      ti.position = ti.index = i;
      prompt.tokens.push_back(ti);
    }
    const std::vector<float> x = model->embed(prompt);
    if (warmup) {
      runner::KvCache cache(c.num_layers, c.num_kv_heads, c.head_dim);
      std::vector<float> logits;
      runner::ForwardRequest req;
      req.x = x.data();
      req.tokens = prompt.tokens.data();
      req.num_tokens = t;
      model->backend().forward(req, cache, nullptr, logits);
      for (int s = 0; s < 2; ++s) {
        runner::TokenInfo tok = prompt.tokens[static_cast<std::size_t>(s)];
        tok.position = tok.index = req.num_tokens + s;
        runner::ForwardRequest dr;
        dr.x = x.data();
        dr.tokens = &tok;
        dr.num_tokens = 1;
        dr.decode_step = s;
        model->backend().forward(dr, cache, nullptr, logits);
      }
    }
    for (int r = 0; r < repeat; ++r) {
      std::cerr << "kvrunner-bench: run " << r + 1 << "/" << repeat << ": prefill " << t << " tokens, "
                << decode << " decode steps, " << kernels::cpu_threads() << " threads\n";
      runner::KvCache cache(c.num_layers, c.num_kv_heads, c.head_dim);
      std::vector<float> logits;
      PhaseTimer timer;
      runner::ForwardRequest req;
      req.x = x.data();
      req.tokens = prompt.tokens.data();
      req.num_tokens = t;
      auto t0 = Clock::now();
      model->backend().forward(req, cache, phases ? &timer : nullptr, logits);
      const double prefill_s = seconds_since(t0);
      const int first = argmax(logits);
      const auto t1 = Clock::now();
      for (int s = 0; s < decode; ++s) {
        runner::TokenInfo tok;
        tok.token_id = argmax(logits);
        tok.position = tok.index = t + s;
        runner::ForwardRequest dr;
        dr.x = model->weights().embed_tokens.data() + static_cast<std::size_t>(tok.token_id) * c.hidden_size;
        dr.tokens = &tok;
        dr.num_tokens = 1;
        dr.decode_step = s;
        model->backend().forward(dr, cache, nullptr, logits);
      }
      const double decode_s = seconds_since(t1);
      std::printf(
          "{\"tokens\": %d, \"prefill_s\": %.6f, \"prefill_tok_s\": %.3f, \"decode_steps\": %d, "
          "\"decode_s\": %.6f, \"decode_tok_s\": %.3f, \"device\": \"%s\", \"threads\": %d, "
          "\"blas_core\": \"%s\", \"next_token\": %d, \"prefill_flop\": %.6g",
          t, prefill_s, t / prefill_s, decode, decode_s, decode > 0 ? decode / decode_s : 0.0,
          device_name.c_str(), kernels::cpu_threads(), kernels::blas_core_name(), first, prefill_flop(c, t));
      if (phases) {
        auto& p = timer.phases();
        double layers = 0;
        for (const auto& [k, v] : p) layers += v;
        p["lm_head"] = prefill_s - layers;
        std::printf(", \"phases_s\": {");
        bool comma = false;
        for (const auto& [k, v] : p) {
          std::printf("%s\"%s\": %.6f", comma ? ", " : "", k.c_str(), v);
          comma = true;
        }
        std::printf("}");
      }
      std::printf("}\n");
      std::fflush(stdout);
    }
  } catch (const runner::RunnerError& e) {
    return bad(e.what());
  }
  return 0;
}
