// Reuse across budgets: one eviction policy at several budgets on one layer (budget_batch.hpp).
//
// For an eviction without quantization the compressed attention of a decode query row is the full
// attention restricted to the surviving tokens and renormalised (evaluation.hpp, exact_context), so a
// budget's metrics need, per row, only sums over its kept set K_b: Z_b = sum p(t), sum p(t) log p(t), the
// mass per modality and O_b = sum p(t) v_t (plus the decode tokens, kept by every budget). When
// K_1 c K_2 c ... (sorted by size), the increments D_b = K_b \ K_{b-1} partition the largest set and
// every sum of budget b is the sum of budget b - 1 plus that of D_b: one GEMM [R, |D_b|] x [|D_b|, D] per
// increment, the union's size in all, instead of one over each whole K_b.
#include "budget_batch.hpp"
#include "stages/stage.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "evaluation.hpp"
#include "kvscope/kernels/blas_runtime.hpp"

namespace kvscope::sim {

namespace {

constexpr int kM = kModalities;

// One kv head, one budget, on its own: the kept tokens compacted with the decode tokens, evaluated by the
// batched CPU evaluation (which reuses the full attention for such a cache).
void evaluate_alone(LayerData& L, const TraceContext& ctx, int h, const std::vector<std::int32_t>& kept,
                    bool proportional, EvalScratch& scratch, Quality& q) {
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim, G = ctx.geometry.group_size();
  const int K = static_cast<int>(kept.size());
  const std::size_t stride = static_cast<std::size_t>(T + S) * D;
  const float* kh = L.k_all().data() + static_cast<std::size_t>(h) * stride;
  const float* vh = L.v_all().data() + static_cast<std::size_t>(h) * stride;
  std::vector<float>& sk = scratch.sk;
  std::vector<float>& sv = scratch.sv;
  std::vector<std::int32_t>& sn = scratch.sn;
  std::vector<std::int32_t>& t2s = scratch.t2s;
  std::vector<std::uint8_t>& smod = scratch.smod;
  sk.resize(static_cast<std::size_t>(K + S) * D);
  sv.resize(sk.size());
  sn.assign(static_cast<std::size_t>(K + S), 1);
  t2s.assign(static_cast<std::size_t>(T + S), -1);
  smod.assign(static_cast<std::size_t>(K + S), 0);
  for (int s = 0; s < K + S; ++s) {
    const int t = s < K ? kept[static_cast<std::size_t>(s)] : T + (s - K);
    std::copy_n(kh + static_cast<std::size_t>(t) * D, D, &sk[static_cast<std::size_t>(s) * D]);
    std::copy_n(vh + static_cast<std::size_t>(t) * D, D, &sv[static_cast<std::size_t>(s) * D]);
    if (s < K) smod[static_cast<std::size_t>(s)] = ctx.modality[static_cast<std::size_t>(t)];
    t2s[static_cast<std::size_t>(t)] = s;
  }
  PrefillProblem p;
  p.layer = &L;
  p.kv_head = h;
  p.group = G;
  p.steps = S;
  p.context_tokens = T;
  p.head_dim = D;
  p.q = &L.q_steps()[static_cast<std::size_t>(h) * G * D];
  p.q_step_stride = static_cast<std::size_t>(ctx.geometry.num_q_heads) * D;
  p.modality = ctx.modality_all.data();
  p.cache = PrefillCache{sk.data(), sv.data(), K, sn.data(), smod.data(), t2s.data(), true};
  p.proportional_attention = proportional;
  RowMetrics& r = scratch.rows;
  evaluate_prefill_rows_cpu(p, scratch, r);
  for (int s = 0; s < S; ++s) {
    const std::size_t o = static_cast<std::size_t>(s) * static_cast<std::size_t>(G), om = o * kM;
    add_step_rows(L, ctx, h, s, &r.output_error[o], &r.recall[o], &r.kl[o], &r.entropy_change[o],
                  &r.recall_modality[om], &r.mass_full[om], &r.mass_compressed[om], q);
  }
  add_topk_recall(L, ctx, h, kept, q);
}

// All budgets of kv head h from one pass over the increments. `order` sorts the budgets by kept count,
// sets[b] are the kept tokens (ascending) of budget b. Returns false (writing nothing) when the sets are
// not nested or a row's survivors hold under 1e-20 of its attention (float underflow of p, as in
// evaluate_prefill_rows_reuse).
bool evaluate_nested(LayerData& L, const TraceContext& ctx, int h, const std::vector<std::size_t>& order,
                     const std::vector<const std::vector<std::int32_t>*>& sets, std::vector<Quality*>& out) {
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim, G = ctx.geometry.group_size(), R = S * G;
  const std::size_t B = order.size();
  std::vector<std::vector<std::int32_t>> inc;
  if (!nested_increments(sets, order, T, &inc)) return false;

  const std::size_t n_rows = static_cast<std::size_t>(R);
  const std::size_t stride = static_cast<std::size_t>(T + S) * D;
  const float* vh = L.v_all().data() + static_cast<std::size_t>(h) * stride;
  kernels::pin_blas_to_one_thread();
  // Per row: the full probabilities and their p log p.
  std::vector<const float*> pr(n_rows), pl(n_rows);
  for (int r = 0; r < R; ++r) {
    const int st = r / G, j = r % G;
    const std::size_t len = static_cast<std::size_t>(T + st + 1);
    pr[static_cast<std::size_t>(r)] = L.full_step(h, st).probs + static_cast<std::size_t>(j) * len;
    pl[static_cast<std::size_t>(r)] = L.full_step_plogp(h, st) + static_cast<std::size_t>(j) * len;
  }
  // The decode tokens (every budget keeps them): causal sums and outputs.
  std::vector<double> z(n_rows, 0.0), e(n_rows, 0.0), cm(n_rows * kM, 0.0);
  std::vector<float> o(n_rows * D, 0.0f), ed(n_rows * static_cast<std::size_t>(S), 0.0f);
  for (int r = 0; r < R; ++r) {
    const int st = r / G;
    for (int jj = 0; jj <= st; ++jj) {
      const float x = pr[static_cast<std::size_t>(r)][T + jj];
      ed[static_cast<std::size_t>(r) * S + static_cast<std::size_t>(jj)] = x;
      z[static_cast<std::size_t>(r)] += x;
      e[static_cast<std::size_t>(r)] += pl[static_cast<std::size_t>(r)][T + jj];
      cm[static_cast<std::size_t>(r) * kM] += x;  // decode tokens are text
    }
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, D, S, 1.0f, ed.data(), S,
              vh + static_cast<std::size_t>(T) * D, D, 0.0f, o.data(), D);
  std::vector<float> eb, vb;
  for (std::size_t b = 0; b < B; ++b) {
    const std::vector<std::int32_t>& d = inc[b];
    const int n = static_cast<int>(d.size());
    if (n > 0) {
      eb.resize(n_rows * static_cast<std::size_t>(n));
      vb.resize(static_cast<std::size_t>(n) * D);
      for (int i = 0; i < n; ++i)
        std::copy_n(vh + static_cast<std::size_t>(d[static_cast<std::size_t>(i)]) * D, D,
                    &vb[static_cast<std::size_t>(i) * D]);
      for (int r = 0; r < R; ++r) {
        const float* p = pr[static_cast<std::size_t>(r)];
        const float* q = pl[static_cast<std::size_t>(r)];
        float* er = &eb[static_cast<std::size_t>(r) * n];
        double zs = 0.0, es = 0.0;
        double* c = &cm[static_cast<std::size_t>(r) * kM];
        for (int i = 0; i < n; ++i) {
          const std::int32_t t = d[static_cast<std::size_t>(i)];
          er[i] = p[t];
          zs += p[t];
          es += q[t];
          c[ctx.modality[static_cast<std::size_t>(t)]] += p[t];
        }
        z[static_cast<std::size_t>(r)] += zs;
        e[static_cast<std::size_t>(r)] += es;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, D, n, 1.0f, eb.data(), n, vb.data(), D, 1.0f,
                  o.data(), D);
    }
    for (int r = 0; r < R; ++r)
      if (!(z[static_cast<std::size_t>(r)] >= 1e-20)) return false;
    Quality q{};
    // The G rows of a step, added together (add_step_rows) once the step's last row is done.
    std::vector<float> rows(static_cast<std::size_t>(G) * 4), rows_m(static_cast<std::size_t>(G) * 3 * kM);
    for (int r = 0; r < R; ++r) {
      const int st = r / G, j = r % G;
      const kernels::FullAttention full = L.full_step(h, st);
      const double* mass = L.full_step_mass(h, st) + static_cast<std::size_t>(j) * kM;
      const double* c = &cm[static_cast<std::size_t>(r) * kM];
      const double total = (mass[0] + mass[1]) + (mass[2] + mass[3]);
      const double zs = z[static_cast<std::size_t>(r)], inv = 1.0 / zs;
      const float* of = full.output + static_cast<std::size_t>(j) * D;
      const float* oc = &o[static_cast<std::size_t>(r) * D];
      double diff2 = 0.0, norm2 = 0.0;
      for (int dd = 0; dd < D; ++dd) {
        const double x = oc[dd] * inv, y = of[dd];
        diff2 += (x - y) * (x - y);
        norm2 += y * y;
      }
      const double survived = (c[0] + c[1]) + (c[2] + c[3]);
      const double kl = survived > 0.0 ? (zs / survived) * (std::log(zs) - std::log(survived)) : 0.0;
      const double h_comp = std::log(zs) - e[static_cast<std::size_t>(r)] * inv;
      const double norm = std::sqrt(norm2), diff = std::sqrt(diff2);
      const std::size_t gj = static_cast<std::size_t>(j), GG = static_cast<std::size_t>(G);
      float* recm = &rows_m[gj * kM];
      float* mfull = &rows_m[(GG + gj) * kM];
      float* mcomp = &rows_m[(2 * GG + gj) * kM];
      for (int m = 0; m < kM; ++m) {
        recm[m] = static_cast<float>(mass[m] > 0.0 ? c[m] / mass[m] : 1.0);
        mfull[m] = static_cast<float>(mass[m] / total);
        mcomp[m] = static_cast<float>(c[m] * inv);
      }
      rows[gj] = static_cast<float>(norm > 0.0 ? diff / norm : diff);
      rows[GG + gj] = static_cast<float>(survived / total);
      rows[2 * GG + gj] = static_cast<float>(kl);
      rows[3 * GG + gj] = static_cast<float>(h_comp - static_cast<double>(full.entropy[j]));
      if (j == G - 1) {
        add_step_rows(L, ctx, h, st, &rows[0], &rows[GG], &rows[2 * GG], &rows[3 * GG], &rows_m[0],
                      &rows_m[GG * kM], &rows_m[2 * GG * kM], q);
      }
    }
    add_topk_recall(L, ctx, h, *sets[order[b]], q);
    *out[order[b]] = q;
  }
  return true;
}

}  // namespace

bool nested_increments(const std::vector<const std::vector<std::int32_t>*>& sets,
                       const std::vector<std::size_t>& order, int num_tokens,
                       std::vector<std::vector<std::int32_t>>* increments) {
  const std::size_t B = order.size();
  const int none = static_cast<int>(B);
  // first[t]: the rank (in `order`) of the smallest set holding t; nested iff every set holds exactly the
  // tokens first held at its rank or below (it holds them all by construction; compare the counts).
  std::vector<int> first(static_cast<std::size_t>(num_tokens), none);
  for (std::size_t b = 0; b < B; ++b)
    for (std::int32_t t : *sets[order[b]]) {
      int& f = first[static_cast<std::size_t>(t)];
      f = std::min(f, static_cast<int>(b));
    }
  std::vector<std::size_t> upto(B, 0);  // tokens first held at rank <= b
  for (int f : first)
    if (f < none) ++upto[static_cast<std::size_t>(f)];
  for (std::size_t b = 1; b < B; ++b) upto[b] += upto[b - 1];
  for (std::size_t b = 0; b < B; ++b)
    if (upto[b] != sets[order[b]]->size()) return false;
  increments->assign(B, {});
  for (int t = 0; t < num_tokens; ++t) {
    const int f = first[static_cast<std::size_t>(t)];
    if (f < none) (*increments)[static_cast<std::size_t>(f)].push_back(t);
  }
  return true;
}

bool budget_batch_eligible(const PolicySpec& p) {
  return p.mode == PolicyMode::kPrefill && p.compress_tokens && !p.adaptive &&
         !stages::executor_of(p).merges() && !p.key_quant && !p.value_quant && p.stages.head_merge == "none";
}

std::vector<LayerResult> run_budgets_on_layer(const PolicySpec& p, const std::vector<double>& keeps,
                                              LayerData& L, TraceContext& ctx,
                                              const std::vector<std::vector<std::string>*>& warnings,
                                              BudgetBatchStats* stats) {
  const std::size_t B = keeps.size();
  const int H = ctx.geometry.num_kv_heads;
  std::vector<LayerResult> res(B);
  // Kept tokens [B][H] (ascending); the rest of the token maps is dropped at once (memory).
  std::vector<std::vector<std::vector<std::int32_t>>> kept(B);
  for (std::size_t b = 0; b < B; ++b) {
    res[b] = run_policy_on_layer(p, keeps[b], L, ctx, *warnings[b], /*record_tokens=*/true, nullptr,
                                 /*evaluate=*/false);
    kept[b].resize(static_cast<std::size_t>(H));
    for (int h = 0; h < H; ++h)
      kept[b][static_cast<std::size_t>(h)] =
          std::move(res[b].token_maps[static_cast<std::size_t>(h)].slot_token);
    res[b].token_maps = {};
  }
  L.prepare_steps();
  L.answer_topk();  // before the parallel evaluation reads it
  PooledScratch pooled;  // reused across points (evaluation.hpp)
  EvalScratch& scratch = *pooled;
  for (int h = 0; h < H; ++h) {
    std::vector<const std::vector<std::int32_t>*> sets(B);
    std::vector<Quality*> out(B);
    for (std::size_t b = 0; b < B; ++b) {
      sets[b] = &kept[b][static_cast<std::size_t>(h)];
      out[b] = &res[b].heads[static_cast<std::size_t>(h)].quality;
    }
    std::vector<std::size_t> order(B);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return sets[a]->size() < sets[b]->size(); });
    if (evaluate_nested(L, ctx, h, order, sets, out)) {
      if (stats) ++stats->nested_heads;
      // A budget that keeps every token is evaluated as `full` and the token-free policies are, so that
      // equal caches keep equal numbers (a tie on the Pareto front stays a tie).
      for (std::size_t b = 0; b < B; ++b) {
        if (static_cast<int>(sets[b]->size()) != ctx.T) continue;
        *out[b] = Quality{};
        evaluate_alone(L, ctx, h, *sets[b], p.proportional_attention, scratch, *out[b]);
      }
      continue;
    }
    if (stats) ++stats->fallback_heads;
    for (std::size_t b = 0; b < B; ++b) {
      *out[b] = Quality{};
      evaluate_alone(L, ctx, h, *sets[b], p.proportional_attention, scratch, *out[b]);
    }
  }
  return res;
}

}  // namespace kvscope::sim
