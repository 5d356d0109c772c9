// Batched causal evaluation of a prefill-mode cache on the CPU: the S decode steps of one kv
// head in two GEMMs instead of 2 S. In prefill mode the cache of step s is the policy's K
// context slots plus decode tokens 0..s, so every step's slots are a prefix of one array
// [K + S, D]: the logits of all S * G query rows are one sgemm over all K + S slots, row s
// keeps its first K + s + 1 (the rest get probability 0, a causal mask), and the outputs
// are one sgemm of the masked probabilities with the values. The per-row math is that of
// kernels::cpu::evaluate_attention (docs/kernels/evaluate.md), term by term; only the
// GEMMs' summation order differs from the per-step calls (float rounding, see docs/perf.md).
#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "evaluation.hpp"
#include "kvscope/kernels/blas_runtime.hpp"
#include "row_math.hpp"  // kernels/src/cpu: the kernels' vectorisable exp, so both paths share it

namespace kvscope::sim {

namespace {

constexpr int kM = kModalities;

// max of x[0, n), n >= 1, in 16 independent lanes so that it vectorises (max is exact in any order).
float max_of(const float* x, int n) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = x[0];
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = lane[l] > x[i + l] ? lane[l] : x[i + l];
  for (; i < n; ++i) lane[0] = lane[0] > x[i] ? lane[0] : x[i];
  float m = lane[0];
  for (int l = 1; l < kLanes; ++l) m = m > lane[l] ? m : lane[l];
  return m;
}

// Surviving tokens in ascending order (context tokens with a slot, then the decode tokens) and runs of
// equal modality (of the survivors and of the slots), over which the per-modality double sums run in a
// register; every sum adds the same terms in the same order as the kernel's loop over all tokens.
void survivor_runs(const PrefillProblem& p, EvalScratch& s) {
  const int T = p.context_tokens, S = p.steps, N = p.cache.context_slots + S;
  const std::int32_t* map = p.cache.token_to_slot;
  s.surv_token.clear();
  for (int t = 0; t < T + S; ++t)
    if (map[t] >= 0) s.surv_token.push_back(t);
  auto runs = [](const auto& key, int n, std::vector<int>& out) {  // run boundaries of key[0, n)
    out.assign(1, 0);
    for (int i = 1; i < n; ++i)
      if (key(i) != key(i - 1)) out.push_back(i);
    out.push_back(n);
  };
  runs([&](int i) { return p.modality[s.surv_token[static_cast<std::size_t>(i)]]; },
       static_cast<int>(s.surv_token.size()), s.surv_runs);
  runs([&](int i) { return p.cache.slot_modality[i]; }, N, s.slot_runs);
}

// Survived attention mass of row (st, j) per modality: sum of the full probabilities of the surviving
// tokens of the first n_surv survivors, in token order.
void survived_mass(const EvalScratch& s, const std::uint8_t* modality, const float* pr, int n_surv,
                   double* surv) {
  for (std::size_t u = 0; u + 1 < s.surv_runs.size() && s.surv_runs[u] < n_surv; ++u) {
    const int a = s.surv_runs[u], b = std::min(s.surv_runs[u + 1], n_surv);
    const auto mt = modality[s.surv_token[static_cast<std::size_t>(a)]];
    double acc = surv[mt];
    for (int i = a; i < b; ++i) acc += pr[s.surv_token[static_cast<std::size_t>(i)]];
    surv[mt] = acc;
  }
}

// Adds a row's compressed attention e [n] into its per-modality mass cm [4], one run of same-modality
// slots (s.slot_runs) at a time, in slot order (both evaluation paths, so their sums agree).
void add_slot_mass(const EvalScratch& s, const std::uint8_t* slot_modality, const float* er, int n,
                   double* cm) {
  for (std::size_t u = 0; u + 1 < s.slot_runs.size() && s.slot_runs[u] < n; ++u) {
    const int a = s.slot_runs[u], b = std::min(s.slot_runs[u + 1], n);
    double acc = cm[slot_modality[a]];
    for (int k = a; k < b; ++k) acc += er[k];
    cm[slot_modality[a]] = acc;
  }
}

}  // namespace

bool evaluate_prefill_rows_reuse(const PrefillProblem& p, EvalScratch& s, RowMetrics& out) {
  if (!p.cache.exact_context) return false;
  const int G = p.group, S = p.steps, T = p.context_tokens, D = p.head_dim, K = p.cache.context_slots;
  const int N = K + S, R = S * G;
  const std::size_t n_rows = static_cast<std::size_t>(R), n_cols = static_cast<std::size_t>(N);
  survivor_runs(p, s);
  if (static_cast<int>(s.surv_token.size()) != N) return false;  // not one slot per survivor
  kernels::pin_blas_to_one_thread();
  s.e.resize(n_rows * n_cols);
  s.o.resize(n_rows * D);
  s.csum.assign(n_rows, 0.0);
  s.cent.assign(n_rows, 0.0);
  s.cmass.assign(n_rows * kM, 0.0);
  // Row r's compressed probabilities up to their sum zs: the full probabilities of its survivors.
  for (int r = 0; r < R; ++r) {
    const int st = r / G, j = r % G, n = K + st + 1;
    const std::size_t len = static_cast<std::size_t>(T + st + 1);
    const float* pr = p.layer->full_step(p.kv_head, st).probs + static_cast<std::size_t>(j) * len;
    const float* pl = p.layer->full_step_plogp(p.kv_head, st) + static_cast<std::size_t>(j) * len;
    float* er = &s.e[static_cast<std::size_t>(r) * n_cols];
    double zs = 0.0, es = 0.0;
    for (int k = 0; k < n; ++k) {
      const int t = s.surv_token[static_cast<std::size_t>(k)];
      er[k] = pr[t];
      zs += pr[t];
      es += pl[t];
    }
    if (!(zs >= 1e-20)) return false;
    std::fill(er + n, er + N, 0.0f);  // the causal mask: future decode tokens
    s.csum[static_cast<std::size_t>(r)] = zs;
    s.cent[static_cast<std::size_t>(r)] = es;
    add_slot_mass(s, p.cache.slot_modality, er, n, &s.cmass[static_cast<std::size_t>(r) * kM]);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, D, N, 1.0f, s.e.data(), N, p.cache.v, D, 0.0f,
              s.o.data(), D);
  out.resize(n_rows);
  for (int r = 0; r < R; ++r) {
    const int st = r / G, j = r % G;
    const kernels::FullAttention full = p.layer->full_step(p.kv_head, st);
    const float* pr = full.probs + static_cast<std::size_t>(j) * (T + st + 1);
    const double* mass = p.layer->full_step_mass(p.kv_head, st) + static_cast<std::size_t>(j) * kM;
    double surv[kM] = {0.0, 0.0, 0.0, 0.0};
    survived_mass(s, p.modality, pr, K + st + 1, surv);
    const double total = (mass[0] + mass[1]) + (mass[2] + mass[3]);
    const double zsum = s.csum[static_cast<std::size_t>(r)];
    const double inv = 1.0 / zsum;
    const float* o = full.output + static_cast<std::size_t>(j) * D;
    const float* oc = &s.o[static_cast<std::size_t>(r) * D];
    double diff2 = 0.0, norm2 = 0.0;
    for (int d = 0; d < D; ++d) {
      const double ocd = oc[d] * inv, od = o[d];
      diff2 += (ocd - od) * (ocd - od);
      norm2 += od * od;
    }
    const double survived = (surv[0] + surv[1]) + (surv[2] + surv[3]);
    // KL of the survivors' renormalised full attention against the compressed one: p / survived against
    // p / zsum, the same terms summed in two orders, so log(zsum / survived) (0 up to rounding).
    const double kl = survived > 0.0 ? (zsum / survived) * (std::log(zsum) - std::log(survived)) : 0.0;
    const double h_comp = std::log(zsum) - s.cent[static_cast<std::size_t>(r)] * inv;
    const double norm = std::sqrt(norm2), diff = std::sqrt(diff2);
    const std::size_t ri = static_cast<std::size_t>(r);
    out.output_error[ri] = static_cast<float>(norm > 0.0 ? diff / norm : diff);
    out.recall[ri] = static_cast<float>(survived / total);
    out.kl[ri] = static_cast<float>(kl);
    out.entropy_change[ri] = static_cast<float>(h_comp - static_cast<double>(full.entropy[j]));
    for (int m = 0; m < kM; ++m) {
      const std::size_t i = ri * kM + static_cast<std::size_t>(m);
      out.recall_modality[i] = static_cast<float>(mass[m] > 0.0 ? surv[m] / mass[m] : 1.0);
      out.mass_full[i] = static_cast<float>(mass[m] / total);
      out.mass_compressed[i] = static_cast<float>(s.cmass[i] * inv);
    }
  }
  return true;
}

void evaluate_prefill_rows_cpu(const PrefillProblem& p, EvalScratch& s, RowMetrics& out, bool reuse) {
  if (reuse && evaluate_prefill_rows_reuse(p, s, out)) return;
  const int G = p.group, S = p.steps, T = p.context_tokens, D = p.head_dim, K = p.cache.context_slots;
  const int N = K + S;  // slot columns of the batched logits
  const int R = S * G;  // query rows, r = s * G + j
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::size_t n_rows = static_cast<std::size_t>(R), n_cols = static_cast<std::size_t>(N);
  kernels::pin_blas_to_one_thread();
  s.q.resize(n_rows * D);
  for (int st = 0; st < S; ++st)
    std::copy_n(p.q + static_cast<std::size_t>(st) * p.q_step_stride, static_cast<std::size_t>(G) * D,
                &s.q[static_cast<std::size_t>(st) * G * D]);
  s.z.resize(n_rows * n_cols);
  s.e.resize(n_rows * n_cols);
  s.o.resize(n_rows * D);
  s.log_n.assign(n_cols, 0.0f);
  if (p.proportional_attention && p.cache.multiplicity) {
    for (int k = 0; k < N; ++k)
      s.log_n[static_cast<std::size_t>(k)] = std::log(static_cast<float>(p.cache.multiplicity[k]));
  }
  const std::int32_t* map = p.cache.token_to_slot;
  survivor_runs(p, s);
  const int n_context_surv = static_cast<int>(s.surv_token.size()) - S;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, N, D, scale, s.q.data(), D, p.cache.k, D, 0.0f,
              s.z.data(), N);
  out.resize(n_rows);
  std::vector<double>& csum = s.csum;
  std::vector<double>& cent = s.cent;
  csum.assign(n_rows, 0.0);
  cent.assign(n_rows, 0.0);
  s.cmass.assign(n_rows * kM, 0.0);
  s.cmax.assign(n_rows, 0.0f);
  for (int r = 0; r < R; ++r) {
    const int n = K + r / G + 1;  // slots visible to the row's step
    float* zr = &s.z[static_cast<std::size_t>(r) * n_cols];
    float* er = &s.e[static_cast<std::size_t>(r) * n_cols];
    for (int k = 0; k < n; ++k) zr[k] += s.log_n[static_cast<std::size_t>(k)];
    const float m = max_of(zr, n);
    s.cmax[static_cast<std::size_t>(r)] = m;
    // e_k = exp(z_k - m) (a vectorised loop), then Z = sum e and sum e (z - m) in double.
    for (int k = 0; k < n; ++k) er[k] = kernels::cpu::rowmath::exp_vec(zr[k] - m);
    double zs = 0.0, es = 0.0;
#pragma omp simd reduction(+ : zs, es)
    for (int k = 0; k < n; ++k) {
      zs += er[k];
      es += static_cast<double>(er[k]) * (zr[k] - m);
    }
    std::fill(er + n, er + N, 0.0f);  // the causal mask: future decode tokens
    csum[static_cast<std::size_t>(r)] = zs;
    cent[static_cast<std::size_t>(r)] = es;
    add_slot_mass(s, p.cache.slot_modality, er, n, &s.cmass[static_cast<std::size_t>(r) * kM]);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, D, N, 1.0f, s.e.data(), N, p.cache.v, D, 0.0f,
              s.o.data(), D);
  s.slot_mass.resize(n_cols);
  for (int r = 0; r < R; ++r) {
    const int st = r / G, j = r % G;
    const int n = K + st + 1;
    const kernels::FullAttention full = p.layer->full_step(p.kv_head, st);
    const float* pr = full.probs + static_cast<std::size_t>(j) * (T + st + 1);
    const double* mass = p.layer->full_step_mass(p.kv_head, st) + static_cast<std::size_t>(j) * kM;
    double surv[kM] = {0.0, 0.0, 0.0, 0.0};
    float* am = s.slot_mass.data();
    std::fill(am, am + n, 0.0f);
    const int n_surv = n_context_surv + st + 1;
    for (std::size_t u = 0; u + 1 < s.surv_runs.size() && s.surv_runs[u] < n_surv; ++u) {
      const int a = s.surv_runs[u], b = std::min(s.surv_runs[u + 1], n_surv);
      const auto mt = p.modality[s.surv_token[static_cast<std::size_t>(a)]];
      double acc = surv[mt];
      for (int i = a; i < b; ++i) {
        const int t = s.surv_token[static_cast<std::size_t>(i)];
        acc += pr[t];
        am[map[t]] += pr[t];
      }
      surv[mt] = acc;
    }
    const double total = (mass[0] + mass[1]) + (mass[2] + mass[3]);
    const double zsum = csum[static_cast<std::size_t>(r)];
    const float Zc = static_cast<float>(zsum);
    const float* o = full.output + static_cast<std::size_t>(j) * D;
    const float* oc = &s.o[static_cast<std::size_t>(r) * D];
    double diff2 = 0.0, norm2 = 0.0;
    for (int d = 0; d < D; ++d) {
      const float od = o[d];
      const float ocd = oc[d] / Zc;
      diff2 += static_cast<double>(ocd - od) * (ocd - od);
      norm2 += static_cast<double>(od) * od;
    }
    const double survived = (surv[0] + surv[1]) + (surv[2] + surv[3]);
    double kl = 0.0;
    if (survived > 0.0) {
      const double log_surv = std::log(survived), log_zc = std::log(zsum);
      const float* zr = &s.z[static_cast<std::size_t>(r) * n_cols];
      const float cmax = s.cmax[static_cast<std::size_t>(r)];
      for (int k = 0; k < n; ++k) {
        if (!(am[k] > 0.0f)) continue;
        const double log_p = std::log(static_cast<double>(am[k])) - log_surv;
        const double log_pc = static_cast<double>(zr[k] - cmax) - log_zc;
        kl += (static_cast<double>(am[k]) / survived) * (log_p - log_pc);
      }
    }
    const double h_comp = std::log(zsum) - cent[static_cast<std::size_t>(r)] / zsum;
    const double norm = std::sqrt(norm2), diff = std::sqrt(diff2);
    const std::size_t ri = static_cast<std::size_t>(r);
    out.output_error[ri] = static_cast<float>(norm > 0.0 ? diff / norm : diff);
    out.recall[ri] = static_cast<float>(survived / total);
    out.kl[ri] = static_cast<float>(kl);
    out.entropy_change[ri] = static_cast<float>(h_comp - static_cast<double>(full.entropy[j]));
    for (int m = 0; m < kM; ++m) {
      const std::size_t i = ri * kM + static_cast<std::size_t>(m);
      out.recall_modality[i] = static_cast<float>(mass[m] > 0.0 ? surv[m] / mass[m] : 1.0);
      out.mass_full[i] = static_cast<float>(mass[m] / total);
      out.mass_compressed[i] = static_cast<float>(s.cmass[i] / zsum);
    }
  }
}

}  // namespace kvscope::sim
