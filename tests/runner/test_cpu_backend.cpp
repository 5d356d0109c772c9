// The CPU backend's tiling (row blocks x column blocks for the projections, heads x query blocks for
// attention) on a random LLaMA-shaped decoder with prompts longer than one tile: logits against a plain
// float64 forward pass, and bitwise independence of the OpenMP thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvscope/runner/model.hpp"

namespace kvscope::runner {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.hidden_size = 48;
  c.intermediate_size = 800;  // two column blocks of a prefill (768 + 32), 13 of a decode step (64 each)
  c.num_layers = 2;
  c.num_q_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 1024;
  c.vocab_size = 1000;  // two column blocks of all-position logits
  c.eos_token_id = -1;  // generation runs its max_new steps
  return c;
}

std::vector<float> random_vector(std::mt19937& rng, std::size_t n, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

ModelWeights random_weights(const ModelConfig& c) {
  std::mt19937 rng(99);
  const std::size_t d = c.hidden_size, q = static_cast<std::size_t>(c.num_q_heads) * c.head_dim,
                    kv = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim, in = c.intermediate_size;
  ModelWeights w;
  w.embed_tokens = random_vector(rng, c.vocab_size * d, 1.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights lw;
    lw.input_norm = random_vector(rng, d, 1.0f);
    lw.post_norm = random_vector(rng, d, 1.0f);
    for (float& x : lw.input_norm) x += 1.5f;
    for (float& x : lw.post_norm) x += 1.5f;
    lw.wq = random_vector(rng, q * d, 0.4f);
    lw.wk = random_vector(rng, kv * d, 0.4f);
    lw.wv = random_vector(rng, kv * d, 0.3f);
    lw.wo = random_vector(rng, d * q, 0.3f);
    lw.w_gate = random_vector(rng, in * d, 0.3f);
    lw.w_up = random_vector(rng, in * d, 0.3f);
    lw.w_down = random_vector(rng, d * in, 0.2f);
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = random_vector(rng, d, 1.0f);
  w.lm_head = random_vector(rng, c.vocab_size * d, 0.3f);
  return w;
}

class Ids final : public Tokenizer {
 public:
  int size() const override { return 1000; }
  const std::string& text(int) const override { return text_; }
  std::vector<std::int32_t> encode(const std::string&) const override { return {}; }
  std::string decode(const std::vector<std::int32_t>&) const override { return {}; }
  bool is_special(int) const override { return false; }

 private:
  std::string text_ = "x";
};

Prompt random_prompt(int t) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> u(0, 999);
  Prompt p;
  for (int i = 0; i < t; ++i) {
    TokenInfo ti;
    ti.token_id = u(rng);
    ti.position = ti.index = i;
    p.tokens.push_back(ti);
  }
  return p;
}

// The decoder in float64 with plain loops: logits [T, V].
std::vector<double> reference_logits(const ModelConfig& c, const ModelWeights& w, const Prompt& p) {
  const int t = p.size(), d = c.hidden_size, dh = c.head_dim, hq = c.num_q_heads, hkv = c.num_kv_heads,
            in = c.intermediate_size, group = hq / hkv, half = dh / 2;
  auto idx = [](int i, int j, int n) { return static_cast<std::size_t>(i) * n + j; };
  std::vector<double> h(static_cast<std::size_t>(t) * d);
  for (int i = 0; i < t; ++i) {
    for (int j = 0; j < d; ++j) h[idx(i, j, d)] = w.embed_tokens[idx(p.tokens[i].token_id, j, d)];
  }
  auto norm = [&](const std::vector<double>& x, const std::vector<float>& g, int i, std::vector<double>& y) {
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += x[idx(i, j, d)] * x[idx(i, j, d)];
    const double r = 1.0 / std::sqrt(ss / d + c.rms_norm_eps);
    for (int j = 0; j < d; ++j)
      y[static_cast<std::size_t>(j)] = g[static_cast<std::size_t>(j)] * x[idx(i, j, d)] * r;
  };
  auto matvec = [&](const std::vector<float>& m, int rows, int cols, const std::vector<double>& x) {
    std::vector<double> y(static_cast<std::size_t>(rows), 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < cols; ++k)
        y[static_cast<std::size_t>(r)] += m[idx(r, k, cols)] * x[static_cast<std::size_t>(k)];
    }
    return y;
  };
  auto rope = [&](std::vector<double>& x, int heads, int pos) {
    for (int hh = 0; hh < heads; ++hh) {
      for (int k = 0; k < half; ++k) {
        const double f = pos * std::pow(c.rope_theta, -2.0 * k / dh);
        const double a = x[static_cast<std::size_t>(hh * dh + k)],
                     b = x[static_cast<std::size_t>(hh * dh + k + half)];
        x[static_cast<std::size_t>(hh * dh + k)] = a * std::cos(f) - b * std::sin(f);
        x[static_cast<std::size_t>(hh * dh + k + half)] = b * std::cos(f) + a * std::sin(f);
      }
    }
  };
  std::vector<double> a(static_cast<std::size_t>(d));
  for (const LayerWeights& lw : w.layers) {
    std::vector<std::vector<double>> q(static_cast<std::size_t>(t)), k(q.size()), v(q.size());
    for (int i = 0; i < t; ++i) {
      norm(h, lw.input_norm, i, a);
      q[static_cast<std::size_t>(i)] = matvec(lw.wq, hq * dh, d, a);
      k[static_cast<std::size_t>(i)] = matvec(lw.wk, hkv * dh, d, a);
      v[static_cast<std::size_t>(i)] = matvec(lw.wv, hkv * dh, d, a);
      rope(q[static_cast<std::size_t>(i)], hq, p.tokens[i].position);
      rope(k[static_cast<std::size_t>(i)], hkv, p.tokens[i].position);
    }
    for (int i = 0; i < t; ++i) {
      std::vector<double> o(static_cast<std::size_t>(hq * dh), 0.0);
      for (int j = 0; j < hq; ++j) {
        const int g = j / group;
        std::vector<double> s(static_cast<std::size_t>(i + 1));
        double mx = -1e300;
        for (int u = 0; u <= i; ++u) {
          double dot = 0;
          for (int e = 0; e < dh; ++e) {
            dot += q[static_cast<std::size_t>(i)][static_cast<std::size_t>(j * dh + e)] *
                   k[static_cast<std::size_t>(u)][static_cast<std::size_t>(g * dh + e)];
          }
          s[static_cast<std::size_t>(u)] = dot / std::sqrt(static_cast<double>(dh));
          mx = std::max(mx, s[static_cast<std::size_t>(u)]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int u = 0; u <= i; ++u) {
          for (int e = 0; e < dh; ++e) {
            o[static_cast<std::size_t>(j * dh + e)] +=
                s[static_cast<std::size_t>(u)] / sum *
                v[static_cast<std::size_t>(u)][static_cast<std::size_t>(g * dh + e)];
          }
        }
      }
      const std::vector<double> y = matvec(lw.wo, d, hq * dh, o);
      for (int j = 0; j < d; ++j) h[idx(i, j, d)] += y[static_cast<std::size_t>(j)];
    }
    for (int i = 0; i < t; ++i) {
      norm(h, lw.post_norm, i, a);
      std::vector<double> g = matvec(lw.w_gate, in, d, a);
      const std::vector<double> u = matvec(lw.w_up, in, d, a);
      for (int j = 0; j < in; ++j) {
        const double x = g[static_cast<std::size_t>(j)];
        g[static_cast<std::size_t>(j)] = x / (1.0 + std::exp(-x)) * u[static_cast<std::size_t>(j)];
      }
      const std::vector<double> y = matvec(lw.w_down, d, in, g);
      for (int j = 0; j < d; ++j) h[idx(i, j, d)] += y[static_cast<std::size_t>(j)];
    }
  }
  std::vector<double> logits(static_cast<std::size_t>(t) * c.vocab_size);
  for (int i = 0; i < t; ++i) {
    norm(h, w.final_norm, i, a);
    const std::vector<double> y = matvec(w.lm_head, c.vocab_size, d, a);
    std::copy(y.begin(), y.end(), logits.begin() + static_cast<std::ptrdiff_t>(idx(i, 0, c.vocab_size)));
  }
  return logits;
}

// 600 tokens: two row blocks of 512 (the second partial), ten query blocks of 64 (the last partial), three
// key blocks of 256 for the last queries.
TEST(RunnerTiling, LongPromptLogitsMatchFloat64Reference) {
  const ModelConfig c = small_config();
  Model model(c, random_weights(c), std::make_shared<Ids>(), Device::kCpu);
  const Prompt p = random_prompt(600);
  const std::vector<float> got = model.forward_logits(p);
  const std::vector<double> want = reference_logits(c, model.weights(), p);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  EXPECT_GT(scale, 1.0);  // the logits are not all near zero
  EXPECT_LT(worst, 1e-4 * scale) << "max |logit| " << scale;
}

// Tiles have fixed sizes and each runs on one thread: 1, 2 and 3 OpenMP threads give the same bits, for
// a prefill (all logits) and for decode steps over the cache it left.
TEST(RunnerTiling, LogitsAreIndependentOfTheThreadCount) {
  const ModelConfig c = small_config();
  Model model(c, random_weights(c), std::make_shared<Ids>(), Device::kCpu);
  const Prompt p = random_prompt(600);
  const int saved = omp_get_max_threads();
  std::vector<std::vector<float>> prefill, decode;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    prefill.push_back(model.forward_logits(p));
    GenerateOptions opt;
    opt.max_new = 4;
    opt.keep_logits = true;
    const Generation g = model.generate(p, opt);
    std::vector<float> all;
    for (const auto& l : g.logits) all.insert(all.end(), l.begin(), l.end());
    decode.push_back(all);
  }
  omp_set_num_threads(saved);
  for (std::size_t i = 1; i < prefill.size(); ++i) {
    EXPECT_EQ(prefill[i], prefill[0]) << "threads " << i + 1;  // bit-identical
    EXPECT_EQ(decode[i], decode[0]) << "threads " << i + 1;
  }
  EXPECT_EQ(decode[0].size(), 4u * c.vocab_size);
}

}  // namespace
}  // namespace kvscope::runner
