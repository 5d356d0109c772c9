// Float64 reference of compressed-cache evaluation (docs/kernels/evaluate.md) and
// a random compressed-cache builder, shared by test_evaluate.cpp and
// test_evaluate_cuda.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/test_util.hpp"
#include "kvscope/kernels/evaluate.hpp"

namespace kvscope::testing {

// Host-side problem: everything the kernel needs, in float / int arrays.
struct EvalProblem {
  kernels::EvaluateParams params;
  std::vector<float> q, k, v;               // [Hq, Nq, D], [Hkv, T, D], [Hkv, T, D] (float values)
  std::vector<std::uint8_t> modality;       // [T]
  std::vector<float> slot_k, slot_v;        // [S_total, D]
  std::vector<std::int32_t> offsets;        // [Hkv + 1]
  std::vector<float> mult_f32;              // [S_total] (empty: not used)
  std::vector<std::int32_t> mult_i32;       // [S_total] (empty: not used)
  std::vector<std::uint8_t> slot_modality;  // [S_total]
  std::vector<std::int32_t> token_to_slot;  // [Hkv, T]

  kernels::CompressedCache cache() const {
    kernels::CompressedCache c;
    c.k = slot_k.data();
    c.v = slot_v.data();
    c.slot_offsets = offsets.data();
    c.multiplicity_f32 = mult_f32.empty() ? nullptr : mult_f32.data();
    c.multiplicity_i32 = mult_i32.empty() ? nullptr : mult_i32.data();
    c.slot_modality = slot_modality.data();
    c.token_to_slot = token_to_slot.data();
    return c;
  }
};

struct EvalReference {
  std::vector<double> output_error, recall, kl, entropy_change;     // [Hq * Nq]
  std::vector<double> recall_modality, mass_full, mass_compressed;  // [Hq * Nq * 4]
};

inline EvalReference reference_evaluate(const EvalProblem& pr) {
  const auto& p = pr.params;
  const int Hq = p.num_q_heads, Hkv = p.num_kv_heads, Nq = p.num_queries, T = p.num_tokens, D = p.head_dim;
  const int group = Hq / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  EvalReference r;
  const std::size_t rows = static_cast<std::size_t>(Hq) * Nq;
  r.output_error.resize(rows);
  r.recall.resize(rows);
  r.kl.resize(rows);
  r.entropy_change.resize(rows);
  r.recall_modality.resize(rows * 4);
  r.mass_full.resize(rows * 4);
  r.mass_compressed.resize(rows * 4);
  for (int j = 0; j < Hq; ++j) {
    const int h = j / group;
    const int base = pr.offsets[h], S = pr.offsets[h + 1] - base;
    for (int i = 0; i < Nq; ++i) {
      const std::size_t row = static_cast<std::size_t>(j) * Nq + i;
      const float* q = &pr.q[row * D];
      std::vector<double> pf(T), pc(S), o(D, 0.0), oc(D, 0.0), zc(S);
      for (int t = 0; t < T; ++t) {
        double s = 0;
        for (int d = 0; d < D; ++d)
          s += static_cast<double>(q[d]) * pr.k[(static_cast<std::size_t>(h) * T + t) * D + d];
        pf[t] = s * scale;
      }
      const double mf = *std::max_element(pf.begin(), pf.end());
      double zf = 0;
      for (double& x : pf) zf += (x = std::exp(x - mf));
      for (double& x : pf) x /= zf;
      for (int s = 0; s < S; ++s) {
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += static_cast<double>(q[d]) * pr.slot_k[static_cast<std::size_t>(base + s) * D + d];
        double n = 1.0;
        if (!pr.mult_f32.empty()) n = pr.mult_f32[base + s];
        if (!pr.mult_i32.empty()) n = pr.mult_i32[base + s];
        zc[s] = dot * scale + (p.proportional_attention ? std::log(n) : 0.0);
      }
      double zcs = 0;
      if (S > 0) {
        const double mc = *std::max_element(zc.begin(), zc.end());
        for (int s = 0; s < S; ++s) zcs += (pc[s] = std::exp(zc[s] - mc));
        for (double& x : pc) x /= zcs;
      }
      for (int t = 0; t < T; ++t)
        for (int d = 0; d < D; ++d) o[d] += pf[t] * pr.v[(static_cast<std::size_t>(h) * T + t) * D + d];
      for (int s = 0; s < S; ++s)
        for (int d = 0; d < D; ++d) oc[d] += pc[s] * pr.slot_v[static_cast<std::size_t>(base + s) * D + d];
      double diff = 0, norm = 0;
      for (int d = 0; d < D; ++d) {
        diff += (oc[d] - o[d]) * (oc[d] - o[d]);
        norm += o[d] * o[d];
      }
      r.output_error[row] = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
      double mass[4] = {0, 0, 0, 0}, surv[4] = {0, 0, 0, 0}, recall = 0, hf = 0;
      std::vector<double> slot_p(S, 0.0);
      for (int t = 0; t < T; ++t) {
        const int s = pr.token_to_slot[static_cast<std::size_t>(h) * T + t];
        mass[pr.modality[t]] += pf[t];
        if (pf[t] > 0) hf -= pf[t] * std::log(pf[t]);
        if (s >= 0) {
          surv[pr.modality[t]] += pf[t];
          recall += pf[t];
          slot_p[s] += pf[t];
        }
      }
      double kl = 0, hc = 0, cmass[4] = {0, 0, 0, 0};
      for (int s = 0; s < S; ++s) {
        if (pc[s] > 0) hc -= pc[s] * std::log(pc[s]);
        cmass[pr.slot_modality[base + s]] += pc[s];
        if (recall > 0 && slot_p[s] > 0) {
          const double P = slot_p[s] / recall;
          kl += P * std::log(P / pc[s]);
        }
      }
      r.recall[row] = recall;
      r.kl[row] = kl;
      r.entropy_change[row] = hc - hf;
      for (int m = 0; m < 4; ++m) {
        r.recall_modality[row * 4 + m] = mass[m] > 0 ? surv[m] / mass[m] : 1.0;
        r.mass_full[row * 4 + m] = mass[m];
        r.mass_compressed[row * 4 + m] = cmass[m];
      }
    }
  }
  return r;
}

// Random problem: per head, a random subset of tokens survives (ragged counts);
// slot s is the kept token plus quantization-like noise, and every evicted token
// either joins a neighbouring slot (raising its multiplicity) or is dropped.
inline EvalProblem make_eval_problem(int Hq, int Hkv, int Nq, int T, int D, std::uint64_t seed,
                                     bool int_mult = false, float keep_fraction = 0.5f) {
  EvalProblem pr;
  auto& p = pr.params;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.num_queries = Nq;
  p.num_tokens = T;
  p.head_dim = D;
  pr.q = random_normal(static_cast<std::size_t>(Hq) * Nq * D, seed, 1.5f);
  pr.k = random_normal(static_cast<std::size_t>(Hkv) * T * D, seed + 1);
  pr.v = random_normal(static_cast<std::size_t>(Hkv) * T * D, seed + 2);
  std::mt19937_64 rng(seed + 3);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.02f);
  pr.modality.resize(T);
  for (int t = 0; t < T; ++t)
    pr.modality[t] = static_cast<std::uint8_t>(t % 5 == 0 ? 0 : (t % 11 == 3 ? 3 : (t < T / 2 ? 1 : 2)));
  pr.offsets.push_back(0);
  pr.token_to_slot.assign(static_cast<std::size_t>(Hkv) * T, -1);
  for (int h = 0; h < Hkv; ++h) {
    std::vector<int> slot_token;
    for (int t = 0; t < T; ++t)
      if (u01(rng) < keep_fraction || (h == 0 && t == 0)) slot_token.push_back(t);
    std::vector<int> count(slot_token.size(), 1);
    for (std::size_t s = 0; s < slot_token.size(); ++s) {
      pr.token_to_slot[static_cast<std::size_t>(h) * T + slot_token[s]] = static_cast<std::int32_t>(s);
    }
    for (int t = 0; t < T; ++t) {
      std::int32_t& m = pr.token_to_slot[static_cast<std::size_t>(h) * T + t];
      if (m >= 0 || slot_token.empty() || u01(rng) < 0.5f) continue;
      const int s =
          static_cast<int>(std::lower_bound(slot_token.begin(), slot_token.end(), t) - slot_token.begin());
      m = std::min<int>(s, static_cast<int>(slot_token.size()) - 1);
      ++count[m];
    }
    for (std::size_t s = 0; s < slot_token.size(); ++s) {
      const std::size_t src = (static_cast<std::size_t>(h) * T + slot_token[s]) * D;
      for (int d = 0; d < D; ++d) {
        pr.slot_k.push_back(pr.k[src + d] + noise(rng));
        pr.slot_v.push_back(pr.v[src + d] + noise(rng));
      }
      if (int_mult) {
        pr.mult_i32.push_back(count[s]);
      } else {
        pr.mult_f32.push_back(static_cast<float>(count[s]) * (0.75f + 0.5f * u01(rng)));
      }
      pr.slot_modality.push_back(pr.modality[slot_token[s]]);
    }
    pr.offsets.push_back(static_cast<std::int32_t>(pr.slot_modality.size()));
  }
  return pr;
}

}  // namespace kvscope::testing
