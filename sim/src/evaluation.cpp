#include "evaluation.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

namespace kvscope::sim {

namespace {

// Adds the G rows of step s, each weighted 1 / (G * S), in row order (both paths, so that the
// double sums see the same terms in the same order); and to each query set holding step s, weighted
// 1 / (G * steps of the set) (docs/metrics.md "Query sets").
// The proxies of an answer step's rows (docs/metrics.md "Proxies"): the worst row's error and the
// concentration-weighted error sums (`entropy`: the full attention's entropy of each row, over `tokens`
// keys), weighted 1 / (G * answer steps).
void add_rows(const float* err, const float* rec, const float* kl, const float* dent, const float* recm,
              const float* mfull, const float* mcomp, const float* entropy, int G, int S, int s,
              const TraceContext& ctx, Quality& q) {
  if (ctx.in_query_set(kAnswerQueries, s)) {
    Proxies& x = q.proxies;
    const double ws = 1.0 / (static_cast<double>(G) * ctx.query_set_steps(kAnswerQueries));
    const double log_n = std::log(static_cast<double>(ctx.T + s + 1));
    for (std::size_t r = 0; r < static_cast<std::size_t>(G); ++r) {
      x.error_worst_query = std::max(x.error_worst_query, static_cast<double>(err[r]));
      const double c = log_n > 0 ? std::clamp(1.0 - entropy[r] / log_n, 0.0, 1.0) : 1.0;
      x.error_retrieval += c * err[r] * ws;  // finish_proxies divides by the weight
      x.concentration += c * ws;
    }
  }
  for (int set = 0; set < kQuerySets; ++set) {
    if (!ctx.in_query_set(set, s)) continue;
    QuerySetQuality& qs = q.query_sets[static_cast<std::size_t>(set)];
    const double ws = 1.0 / (static_cast<double>(G) * ctx.query_set_steps(set));
    for (std::size_t r = 0; r < static_cast<std::size_t>(G); ++r) {
      qs.output_error += err[r] * ws;
      qs.attention_recall += rec[r] * ws;
      qs.kl += kl[r] * ws;
      qs.entropy_delta += dent[r] * ws;
    }
  }
  const double w = 1.0 / (static_cast<double>(G) * S);
  for (std::size_t r = 0; r < static_cast<std::size_t>(G); ++r) {
    q.output_error += err[r] * w;
    q.attention_recall += rec[r] * w;
    q.kl += kl[r] * w;
    q.entropy_delta += dent[r] * w;
    for (std::size_t m = 0; m < static_cast<std::size_t>(kModalities); ++m) {
      q.recall_modality[m] += recm[r * 4 + m] * w;
      q.share_before[m] += mfull[r * 4 + m] * w;
      q.share_after[m] += mcomp[r * 4 + m] * w;
    }
  }
}

// Share of `top` (tokens) that survive in a cache (token_to_slot >= 0); 1 when empty.
double survival(const std::vector<std::int32_t>& top, const std::int32_t* token_to_slot) {
  if (top.empty()) return 1.0;
  int alive = 0;
  for (const std::int32_t t : top) alive += token_to_slot[t] >= 0 ? 1 : 0;
  return static_cast<double>(alive) / static_cast<double>(top.size());
}

// Adds `weight` x the survival of kv head h's answer top-k and specific top-k tokens to the proxies.
void add_topk_survival(LayerData& L, int h, const std::int32_t* token_to_slot, double weight, Quality& q) {
  const LayerData::AnswerTopK& top = L.answer_topk();
  q.proxies.topk_recall += weight * survival(top.tokens[static_cast<std::size_t>(h)], token_to_slot);
  q.proxies.specific_recall += weight * survival(top.specific[static_cast<std::size_t>(h)], token_to_slot);
  q.proxies.topk_mass = top.mass[static_cast<std::size_t>(h)];
}

struct ScratchPool {
  std::mutex mutex;
  int scopes = 0;
  std::vector<std::unique_ptr<EvalScratch>> idle;
};
ScratchPool& scratch_pool() {
  static ScratchPool pool;
  return pool;
}

}  // namespace

PooledScratch::PooledScratch() {
  ScratchPool& pool = scratch_pool();
  {
    const std::lock_guard<std::mutex> lock(pool.mutex);
    if (!pool.idle.empty()) {
      s_ = std::move(pool.idle.back());
      pool.idle.pop_back();
    }
  }
  if (!s_) s_ = std::make_unique<EvalScratch>();
}

PooledScratch::~PooledScratch() {
  ScratchPool& pool = scratch_pool();
  const std::lock_guard<std::mutex> lock(pool.mutex);
  if (pool.scopes > 0) pool.idle.push_back(std::move(s_));
}

ScratchPoolScope::ScratchPoolScope() {
  ScratchPool& pool = scratch_pool();
  const std::lock_guard<std::mutex> lock(pool.mutex);
  ++pool.scopes;
}

ScratchPoolScope::~ScratchPoolScope() {
  ScratchPool& pool = scratch_pool();
  std::vector<std::unique_ptr<EvalScratch>> drop;  // freed outside the lock
  const std::lock_guard<std::mutex> lock(pool.mutex);
  if (--pool.scopes == 0) drop.swap(pool.idle);
}

void add_step_rows(LayerData& L, const TraceContext& ctx, int h, int s, const float* err, const float* rec,
                   const float* kl, const float* dent, const float* recm, const float* mfull, const float* mcomp,
                   Quality& q) {
  add_rows(err, rec, kl, dent, recm, mfull, mcomp, L.full_step(h, s).entropy, ctx.geometry.group_size(), ctx.S,
           s, ctx, q);
}

void add_topk_recall(LayerData& L, const TraceContext& ctx, int h, const std::vector<std::int32_t>& kept,
                     Quality& q) {
  if (ctx.query_set_steps(kAnswerQueries) <= 0) return;
  auto kept_share = [&](const std::vector<std::int32_t>& top) {
    int alive = 0;
    for (const std::int32_t t : top) alive += std::binary_search(kept.begin(), kept.end(), t) ? 1 : 0;
    return top.empty() ? 1.0 : static_cast<double>(alive) / static_cast<double>(top.size());
  };
  const LayerData::AnswerTopK& top = L.answer_topk();
  q.proxies.topk_recall += kept_share(top.tokens[static_cast<std::size_t>(h)]);
  q.proxies.specific_recall += kept_share(top.specific[static_cast<std::size_t>(h)]);
  q.proxies.topk_mass = top.mass[static_cast<std::size_t>(h)];
}

void add_step_quality(LayerData& L, TraceContext& ctx, int h, int s, const StepCache& c, bool proportional,
                      Quality& q) {
  const auto& g = ctx.geometry;
  const int G = g.group_size(), Hq = g.num_q_heads, D = g.head_dim;
  kernels::EvaluateParams ep;
  ep.num_q_heads = G;
  ep.num_kv_heads = 1;
  ep.num_queries = 1;
  ep.num_tokens = ctx.T + s + 1;
  ep.head_dim = D;
  ep.dtype = kernels::DType::kF32;
  ep.proportional_attention = proportional;
  const std::int32_t offsets[2] = {0, c.slots};
  kernels::CompressedCache cache;
  cache.k = c.k;
  cache.v = c.v;
  cache.slot_offsets = offsets;
  cache.multiplicity_i32 = c.multiplicity;
  cache.slot_modality = c.slot_modality;
  cache.token_to_slot = c.token_to_slot;
  const std::size_t n = static_cast<std::size_t>(G);
  std::vector<float> err(n), rec(n), kl(n), dent(n), recm(n * 4), mfull(n * 4), mcomp(n * 4);
  kernels::EvaluateOutputs eo{err.data(), rec.data(), kl.data(), dent.data(), recm.data(), mfull.data(), mcomp.data()};
  const float* query = &L.q_steps()[(static_cast<std::size_t>(s) * Hq + static_cast<std::size_t>(h) * G) * D];
  const kernels::Status st =
      ctx.backend->evaluate_attention(ep, query, ctx.modality_all.data(), L.full_step(h, s), cache, eo);
  if (!st.ok()) throw std::runtime_error("evaluate (step " + std::to_string(s) + "): " + st.message());
  add_rows(err.data(), rec.data(), kl.data(), dent.data(), recm.data(), mfull.data(), mcomp.data(),
           L.full_step(h, s).entropy, G, ctx.S, s, ctx, q);
  if (ctx.in_query_set(kAnswerQueries, s))
    add_topk_survival(L, h, c.token_to_slot, 1.0 / ctx.query_set_steps(kAnswerQueries), q);
}

void add_prefill_quality(LayerData& L, TraceContext& ctx, int h, const PrefillCache& c, bool proportional,
                         EvalScratch& scratch, Quality& q) {
  const auto& g = ctx.geometry;
  const int G = g.group_size(), S = ctx.S, D = g.head_dim;
  if (!ctx.batched_evaluation || ctx.backend->kind() != BackendKind::kCpu) {
    for (int s = 0; s < S; ++s) {
      const StepCache step{c.k, c.v, c.context_slots + s + 1, c.multiplicity, c.slot_modality,
                           c.token_to_slot};
      add_step_quality(L, ctx, h, s, step, proportional, q);
    }
    return;
  }
  PrefillProblem p;
  p.layer = &L;
  p.kv_head = h;
  p.group = G;
  p.steps = S;
  p.context_tokens = ctx.T;
  p.head_dim = D;
  p.q = &L.q_steps()[static_cast<std::size_t>(h) * G * D];
  p.q_step_stride = static_cast<std::size_t>(g.num_q_heads) * D;
  p.modality = ctx.modality_all.data();
  p.cache = c;
  p.proportional_attention = proportional;
  RowMetrics& r = scratch.rows;
  evaluate_prefill_rows_cpu(p, scratch, r);
  for (int s = 0; s < S; ++s) {
    const std::size_t o = static_cast<std::size_t>(s) * G;
    const std::size_t om = o * kModalities;
    add_rows(&r.output_error[o], &r.recall[o], &r.kl[o], &r.entropy_change[o], &r.recall_modality[om],
             &r.mass_full[om], &r.mass_compressed[om], L.full_step(h, s).entropy, G, S, s, ctx, q);
  }
  // The context slots are the same at every step: the top-k survival is that of any answer step.
  if (ctx.query_set_steps(kAnswerQueries) > 0) add_topk_survival(L, h, c.token_to_slot, 1.0, q);
}

}  // namespace kvscope::sim
