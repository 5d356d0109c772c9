// Straightforward float64 references for the attention statistics and a small
// helper that builds attention problems (seeded inputs in fp32/fp16/bf16).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kvscope/kernels/attention_stats.hpp"

namespace kvscope::testing {

using kernels::AttentionProblem;
using kernels::DType;

// Owns the host buffers of one attention problem. qf/kf hold the values as the
// kernel sees them (after rounding to the element type).
struct AttentionCase {
  int hq = 1, hkv = 1, tq = 1, tk = 1, d = 1;
  DType dtype = DType::kF32;
  bool causal = true;
  std::vector<float> qf, kf;               // [hq, tq, d], [hkv, tk, d] as floats
  std::vector<std::uint16_t> q16, k16;     // element bits for fp16/bf16
  std::vector<std::int32_t> q_pos, k_pos;  // empty: default positions
  std::vector<std::uint8_t> k_mod, q_mod;  // [tk], [tq]

  std::string params() const {
    return "hq=" + std::to_string(hq) + " hkv=" + std::to_string(hkv) + " tq=" + std::to_string(tq) +
           " tk=" + std::to_string(tk) + " d=" + std::to_string(d) + " dtype=" + kernels::dtype_name(dtype) +
           " causal=" + std::to_string(causal) + " qpos=" + std::to_string(!q_pos.empty()) +
           " kpos=" + std::to_string(!k_pos.empty());
  }

  AttentionProblem problem() const {
    AttentionProblem a;
    a.q = dtype == DType::kF32 ? static_cast<const void*>(qf.data()) : q16.data();
    a.k = dtype == DType::kF32 ? static_cast<const void*>(kf.data()) : k16.data();
    a.q_pos = q_pos.empty() ? nullptr : q_pos.data();
    a.k_pos = k_pos.empty() ? nullptr : k_pos.data();
    a.num_q_heads = hq;
    a.num_kv_heads = hkv;
    a.q_len = tq;
    a.k_len = tk;
    a.head_dim = d;
    a.dtype = dtype;
    a.causal = causal;
    return a;
  }
};

inline void round_to_dtype(std::vector<float>& f, std::vector<std::uint16_t>& bits, DType t) {
  if (t == DType::kF32) return;
  bits.resize(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) {
    bits[i] = t == DType::kF16 ? kernels::float_to_half(f[i]) : kernels::float_to_bf16(f[i]);
    f[i] = t == DType::kF16 ? kernels::half_to_float(bits[i]) : kernels::bf16_to_float(bits[i]);
  }
}

inline AttentionCase make_case(int hq, int hkv, int tq, int tk, int d, DType t, std::uint64_t seed,
                               bool causal = true, float stddev = 1.0f) {
  AttentionCase c;
  c.hq = hq, c.hkv = hkv, c.tq = tq, c.tk = tk, c.d = d, c.dtype = t, c.causal = causal;
  c.qf = random_normal(static_cast<std::size_t>(hq) * tq * d, seed, stddev);
  c.kf = random_normal(static_cast<std::size_t>(hkv) * tk * d, seed + 1, stddev);
  round_to_dtype(c.qf, c.q16, t);
  round_to_dtype(c.kf, c.k16, t);
  std::mt19937_64 rng(seed + 2);
  c.k_mod.resize(tk);
  c.q_mod.resize(tq);
  for (auto& m : c.k_mod) m = static_cast<std::uint8_t>(rng() % 4);
  for (auto& m : c.q_mod) m = static_cast<std::uint8_t>(rng() % 4);
  return c;
}

// p[j][i][t] in float64 with the kernels' mask rule; rows without a visible
// key are all zero.
inline std::vector<double> reference_probs(const AttentionCase& c) {
  const int G = c.hq / c.hkv;
  std::vector<double> p(static_cast<std::size_t>(c.hq) * c.tq * c.tk, 0.0);
  std::vector<double> s(c.tk);
  for (int j = 0; j < c.hq; ++j) {
    const int h = j / G;
    for (int i = 0; i < c.tq; ++i) {
      const long long qpos = c.q_pos.empty() ? c.tk - c.tq + i : c.q_pos[i];
      double m = -INFINITY;
      for (int t = 0; t < c.tk; ++t) {
        const long long kpos = c.k_pos.empty() ? t : c.k_pos[t];
        if (c.causal && kpos > qpos) {
          s[t] = -INFINITY;
          continue;
        }
        double dot = 0.0;
        for (int e = 0; e < c.d; ++e) {
          dot += static_cast<double>(c.qf[(static_cast<std::size_t>(j) * c.tq + i) * c.d + e]) *
                 c.kf[(static_cast<std::size_t>(h) * c.tk + t) * c.d + e];
        }
        s[t] = dot / std::sqrt(static_cast<double>(c.d));
        m = std::max(m, s[t]);
      }
      if (m == -INFINITY) continue;
      double sum = 0.0;
      for (int t = 0; t < c.tk; ++t) sum += std::exp(s[t] - m);
      double* row = p.data() + (static_cast<std::size_t>(j) * c.tq + i) * c.tk;
      for (int t = 0; t < c.tk; ++t) row[t] = std::exp(s[t] - m) / sum;
    }
  }
  return p;
}

// sum over rows [b, e) of p: [hq, tk]
inline std::vector<double> reference_colsum(const AttentionCase& c, const std::vector<double>& p, int b,
                                            int e) {
  std::vector<double> out(static_cast<std::size_t>(c.hq) * c.tk, 0.0);
  for (int j = 0; j < c.hq; ++j)
    for (int i = b; i < e; ++i)
      for (int t = 0; t < c.tk; ++t)
        out[static_cast<std::size_t>(j) * c.tk + t] += p[(static_cast<std::size_t>(j) * c.tq + i) * c.tk + t];
  return out;
}

}  // namespace kvscope::testing
