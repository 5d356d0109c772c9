// Float64 reference of token merging (docs/kernels/merge.md), written
// independently of the kernels for the CPU tests, plus input builders shared by
// test_merge.cpp and test_merge_cuda.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/test_util.hpp"
#include "kvscope/kernels/merge.hpp"

namespace kvscope::testing {

struct MergeReference {
  std::vector<double> k_out, v_out;         // [H, K, D]
  std::vector<std::int32_t> multiplicity;   // [H, K]
  std::vector<std::int32_t> token_to_slot;  // [H, T]
};

// keys / values already converted to float (the values the kernel sees).
inline MergeReference reference_merge(const kernels::MergeParams& p, const std::vector<float>& k,
                                      const std::vector<float>& v, const std::vector<std::int32_t>& kept,
                                      const float* importance) {
  const int H = p.num_heads, T = p.num_tokens, D = p.head_dim, K = p.num_kept;
  MergeReference ref;
  ref.k_out.assign(static_cast<std::size_t>(H) * K * D, 0.0);
  ref.v_out.assign(ref.k_out.size(), 0.0);
  ref.multiplicity.assign(static_cast<std::size_t>(H) * K, 0);
  ref.token_to_slot.assign(static_cast<std::size_t>(H) * T, -1);
  auto row = [&](const std::vector<float>& x, int h, int t) {
    return &x[(static_cast<std::size_t>(h) * T + t) * D];
  };
  auto norm = [&](const float* a) {
    double s = 0;
    for (int d = 0; d < D; ++d) s += static_cast<double>(a[d]) * a[d];
    return std::sqrt(s);
  };
  for (int h = 0; h < H; ++h) {
    const std::int32_t* kh = kept.data() + (p.shared_kept ? 0 : static_cast<std::size_t>(h) * K);
    std::int32_t* map = &ref.token_to_slot[static_cast<std::size_t>(h) * T];
    for (int s = 0; s < K; ++s) map[kh[s]] = s;
    for (int t = 0; t < T; ++t) {
      if (std::find(kh, kh + K, t) != kh + K) continue;
      int best_s = -1;
      double best = -2;
      for (int s = 0; s < K; ++s) {
        if (std::abs(kh[s] - t) > p.window) continue;
        const float* a = row(k, h, t);
        const float* b = row(k, h, kh[s]);
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(a[d]) * b[d];
        const double den = norm(a) * norm(b);
        const double sim = std::clamp(den > 0 ? dot / den : 0.0, -1.0, 1.0);
        if (sim > best) {
          best = sim;
          best_s = s;
        }
      }
      if (best_s >= 0 && best > p.threshold) map[t] = best_s;
    }
    for (int s = 0; s < K; ++s) {
      std::vector<int> mem;
      for (int t = 0; t < T; ++t)
        if (map[t] == s) mem.push_back(t);
      ref.multiplicity[static_cast<std::size_t>(h) * K + s] = static_cast<std::int32_t>(mem.size());
      std::vector<double> w(mem.size(), 1.0);
      double ws = 0;
      for (std::size_t i = 0; i < mem.size(); ++i) {
        if (importance) {
          const float x = importance[static_cast<std::size_t>(h) * T + mem[i]];
          w[i] = x > 0 ? x : 0.0;
        }
        ws += w[i];
      }
      if (!(ws > 0)) {
        std::fill(w.begin(), w.end(), 1.0);
        ws = static_cast<double>(mem.size());
      }
      for (int which = 0; which < 2; ++which) {
        const std::vector<float>& x = which == 0 ? k : v;
        double* out = &(which == 0 ? ref.k_out : ref.v_out)[(static_cast<std::size_t>(h) * K + s) * D];
        double target = 0;
        for (std::size_t i = 0; i < mem.size(); ++i) {
          const float* xi = row(x, h, mem[i]);
          for (int d = 0; d < D; ++d) out[d] += w[i] * xi[d] / ws;
          target += w[i] * norm(xi) / ws;
        }
        double n = 0;
        for (int d = 0; d < D; ++d) n += out[d] * out[d];
        n = std::sqrt(n);
        if (n > 0)
          for (int d = 0; d < D; ++d) out[d] *= target / n;
      }
    }
  }
  return ref;
}

// Random merge problem whose similarities are well separated from the threshold:
// about 60% of the evicted tokens are noisy copies (cos ~ 0.99) of a kept token
// within the window, the rest are independent random keys (cos ~ 0).
struct MergeProblem {
  kernels::MergeParams params;
  std::vector<float> k, v, importance;  // [H, T, D], [H, T, D], [H, T]
  std::vector<std::int32_t> kept;       // [H, K] or [K]
};

inline MergeProblem make_merge_problem(int H, int T, int D, int K, int window, bool shared,
                                       std::uint64_t seed) {
  MergeProblem pr;
  pr.params.num_heads = H;
  pr.params.num_tokens = T;
  pr.params.head_dim = D;
  pr.params.num_kept = K;
  pr.params.shared_kept = shared;
  pr.params.window = window;
  pr.params.threshold = 0.5f;
  std::mt19937_64 rng(seed);
  pr.k = random_normal(static_cast<std::size_t>(H) * T * D, seed + 1);
  pr.v = random_normal(static_cast<std::size_t>(H) * T * D, seed + 2);
  pr.importance = random_uniform(static_cast<std::size_t>(H) * T, seed + 3, 0.0f, 1.0f);
  for (std::size_t i = 0; i < pr.importance.size(); i += 7) pr.importance[i] = 0.0f;
  const int lists = shared ? 1 : H;
  for (int h = 0; h < lists; ++h) {
    std::vector<std::int32_t> all(T);
    for (int t = 0; t < T; ++t) all[t] = t;
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(K);
    std::sort(all.begin(), all.end());
    pr.kept.insert(pr.kept.end(), all.begin(), all.end());
  }
  std::normal_distribution<float> noise(0.0f, 0.05f);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  for (int h = 0; h < H; ++h) {
    const std::int32_t* kh = pr.kept.data() + (shared ? 0 : static_cast<std::size_t>(h) * K);
    for (int t = 0; t < T; ++t) {
      if (std::binary_search(kh, kh + K, t) || u01(rng) > 0.6f) continue;
      // nearest kept token; copy it with noise if it is inside the window
      const int pos = static_cast<int>(std::lower_bound(kh, kh + K, t) - kh);
      int s = pos < K ? pos : K - 1;
      if (pos > 0 && (pos == K || t - kh[pos - 1] < kh[pos] - t)) s = pos - 1;
      if (std::abs(kh[s] - t) > window) continue;
      const float gain = 0.5f + u01(rng);
      for (int d = 0; d < D; ++d) {
        const std::size_t src = (static_cast<std::size_t>(h) * T + kh[s]) * D + d;
        pr.k[(static_cast<std::size_t>(h) * T + t) * D + d] = gain * pr.k[src] + noise(rng);
      }
    }
  }
  return pr;
}

}  // namespace kvscope::testing
