// Evaluation reuse (docs/perf.md "Evaluation reuse"): a compressed cache that only evicts (its context
// slots are the surviving tokens themselves, exact) is evaluated from the full cache's attention instead
// of a second q.k; the metrics must equal the recomputed ones up to float rounding, and the reuse must
// refuse caches where it does not hold (merged slots, not flagged exact). Reuse across budgets: nested
// kept sets of one policy evaluated from one pass (budget_batch.hpp), against point-by-point evaluation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>

#include "../../sim/src/budget_batch.hpp"
#include "../../sim/src/evaluation.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/sweep.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

// T = 1 + 24 + 65 = 90 context tokens (64 vision), 6 decode steps, 4 layers, 2 kv heads (G = 2), D = 32.
const std::string& trace_path() {
  return kvscope::testing::tiny_trace("reuse", 64, 24, 6, 3);
}

// One kv head's prefill-mode cache keeping `keep` (ascending token ids), optionally merging token
// `merged_token` into slot 0 (a token that survives through another token's slot).
struct Cache {
  std::vector<float> k, v;  // [K + S, D]
  std::vector<std::int32_t> n, t2s;
  std::vector<std::uint8_t> smod;
  PrefillCache view;
};

Cache make_cache(LayerData& L, const TraceContext& ctx, int h, const std::vector<int>& keep,
                 int merged_token) {
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim, K = static_cast<int>(keep.size());
  Cache c;
  const std::size_t stride = static_cast<std::size_t>(T + S) * D;
  const float* kh = L.k_all().data() + static_cast<std::size_t>(h) * stride;
  const float* vh = L.v_all().data() + static_cast<std::size_t>(h) * stride;
  c.k.resize(static_cast<std::size_t>(K + S) * D);
  c.v.resize(c.k.size());
  c.n.assign(static_cast<std::size_t>(K + S), 1);
  c.smod.assign(static_cast<std::size_t>(K + S), 0);
  c.t2s.assign(static_cast<std::size_t>(T + S), -1);
  for (int s = 0; s < K; ++s) {
    const int t = keep[static_cast<std::size_t>(s)];
    std::copy_n(kh + static_cast<std::size_t>(t) * D, D, &c.k[static_cast<std::size_t>(s) * D]);
    std::copy_n(vh + static_cast<std::size_t>(t) * D, D, &c.v[static_cast<std::size_t>(s) * D]);
    c.smod[static_cast<std::size_t>(s)] = ctx.modality[static_cast<std::size_t>(t)];
    c.t2s[static_cast<std::size_t>(t)] = s;
  }
  for (int j = 0; j < S; ++j) {
    std::copy_n(kh + static_cast<std::size_t>(T + j) * D, D, &c.k[static_cast<std::size_t>(K + j) * D]);
    std::copy_n(vh + static_cast<std::size_t>(T + j) * D, D, &c.v[static_cast<std::size_t>(K + j) * D]);
    c.t2s[static_cast<std::size_t>(T + j)] = K + j;
  }
  if (merged_token >= 0) {
    c.t2s[static_cast<std::size_t>(merged_token)] = 0;
    c.n[0] = 2;
  }
  c.view = PrefillCache{c.k.data(), c.v.data(), K, c.n.data(), c.smod.data(), c.t2s.data(), merged_token < 0};
  return c;
}

PrefillProblem make_problem(LayerData& L, const TraceContext& ctx, int h, const PrefillCache& c) {
  const auto& g = ctx.geometry;
  PrefillProblem p;
  p.layer = &L;
  p.kv_head = h;
  p.group = g.group_size();
  p.steps = ctx.S;
  p.context_tokens = ctx.T;
  p.head_dim = g.head_dim;
  p.q = &L.q_steps()[static_cast<std::size_t>(h) * p.group * g.head_dim];
  p.q_step_stride = static_cast<std::size_t>(g.num_q_heads) * g.head_dim;
  p.modality = ctx.modality_all.data();
  p.cache = c;
  return p;
}

void expect_rows_near(const RowMetrics& a, const RowMetrics& b) {
  ASSERT_EQ(a.output_error.size(), b.output_error.size());
  for (std::size_t r = 0; r < a.output_error.size(); ++r) {
    EXPECT_NEAR(a.output_error[r], b.output_error[r], 2e-6 * std::max(1.0f, b.output_error[r]))
        << "row " << r;
    EXPECT_FLOAT_EQ(a.recall[r], b.recall[r]) << "row " << r;  // the full side: same terms, same order
    EXPECT_NEAR(a.kl[r], b.kl[r], 1e-6) << "row " << r;
    EXPECT_NEAR(a.entropy_change[r], b.entropy_change[r], 2e-6) << "row " << r;
    for (std::size_t m = 0; m < 4; ++m) {
      EXPECT_FLOAT_EQ(a.recall_modality[r * 4 + m], b.recall_modality[r * 4 + m]);
      EXPECT_FLOAT_EQ(a.mass_full[r * 4 + m], b.mass_full[r * 4 + m]);
      EXPECT_NEAR(a.mass_compressed[r * 4 + m], b.mass_compressed[r * 4 + m], 1e-6);
    }
  }
}

}  // namespace

// Random eviction sets of every size class on every layer and kv head: the reuse applies and matches
// the recomputation (q.k GEMM, exp, log per slot) row by row.
TEST(EvalReuse, EvictionReusesFullAttentionAndMatchesRecomputation) {
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  std::mt19937 rng(11);
  int reused = 0;
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    L.prepare_steps();
    for (int h = 0; h < ctx.geometry.num_kv_heads; ++h) {
      for (double frac : {0.05, 0.3, 0.7, 1.0}) {
        SCOPED_TRACE("layer " + std::to_string(layer) + " head " + std::to_string(h) + " keep " +
                     std::to_string(frac));
        std::vector<int> all(static_cast<std::size_t>(ctx.T));
        for (int t = 0; t < ctx.T; ++t) all[static_cast<std::size_t>(t)] = t;
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int> keep(all.begin(), all.begin() + std::max(1, static_cast<int>(frac * ctx.T)));
        std::sort(keep.begin(), keep.end());
        Cache c = make_cache(L, ctx, h, keep, -1);
        const PrefillProblem p = make_problem(L, ctx, h, c.view);
        EvalScratch s1, s2;
        RowMetrics fast, slow;
        ASSERT_TRUE(evaluate_prefill_rows_reuse(p, s1, fast));
        evaluate_prefill_rows_cpu(p, s2, slow, /*reuse_full_attention=*/false);
        expect_rows_near(fast, slow);
        ++reused;
      }
    }
  }
  EXPECT_EQ(reused, ctx.geometry.num_layers * ctx.geometry.num_kv_heads * 4);
}

// Where the slots are not the survivors themselves the reuse refuses and the default path recomputes.
TEST(EvalReuse, RefusesMergedOrUnflaggedCaches) {
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  LayerData L(1, reader.read_layer(1), reader.read_decode_layer(1), ctx);
  L.prepare_steps();
  std::vector<int> keep;
  for (int t = 0; t < ctx.T; t += 3) keep.push_back(t);
  EvalScratch s;
  RowMetrics out;
  {
    Cache c = make_cache(L, ctx, 0, keep, /*merged_token=*/1);  // token 1 survives in slot 0
    c.view.exact_context = true;                                // even if a caller claims exactness
    EXPECT_FALSE(evaluate_prefill_rows_reuse(make_problem(L, ctx, 0, c.view), s, out));
  }
  {
    Cache c = make_cache(L, ctx, 0, keep, -1);
    c.view.exact_context = false;  // e.g. quantized slots
    EXPECT_FALSE(evaluate_prefill_rows_reuse(make_problem(L, ctx, 0, c.view), s, out));
  }
}

// Through the policy engine: eviction, eviction with a quantizer that leaves the slots exact (KIVI-2
// keeps its last 128 tokens exact, all of this trace) and a real quantizer give the same results as the
// per-step kernel path (ctx.batched_evaluation = false, no reuse).
TEST(EvalReuse, PolicyResultsMatchThePerStepKernel) {
  PolicyRegistry reg;
  trace::TraceReader reader(trace_path());
  for (const char* spec : {"window@0.3", "h2o@0.5", "fastv@0.2", "kivi2", "full", "snapkv+int4@0.4"}) {
    SCOPED_TRACE(spec);
    auto [name, budget] = split_policy_budget(spec);
    const PolicySpec p = reg.get(name);
    const double keep = budget.kind == Budget::Kind::kNone ? 1.0 : budget.value;
    TraceContext a_ctx = TraceContext::from_reader(reader), b_ctx = TraceContext::from_reader(reader);
    b_ctx.batched_evaluation = false;
    for (int layer = 0; layer < 4; ++layer) {
      std::vector<std::string> warnings;
      LayerData La(layer, reader.read_layer(layer), reader.read_decode_layer(layer), a_ctx);
      LayerData Lb(layer, reader.read_layer(layer), reader.read_decode_layer(layer), b_ctx);
      const LayerResult a = run_policy_on_layer(p, keep, La, a_ctx, warnings);
      const LayerResult b = run_policy_on_layer(p, keep, Lb, b_ctx, warnings);
      for (std::size_t h = 0; h < a.heads.size(); ++h) {
        const Quality& x = a.heads[h].quality;
        const Quality& y = b.heads[h].quality;
        EXPECT_NEAR(x.output_error, y.output_error, 2e-6 * std::max(1.0, y.output_error));
        EXPECT_DOUBLE_EQ(x.attention_recall, y.attention_recall);
        EXPECT_NEAR(x.kl, y.kl, 1e-6);
        EXPECT_NEAR(x.entropy_delta, y.entropy_delta, 2e-6);
      }
    }
  }
}

// ---- reuse across budgets (sim/src/budget_batch.hpp)

TEST(BudgetBatch, NestedIncrements) {
  const std::vector<std::int32_t> a{3, 5}, b{1, 3, 5, 8}, c{0, 1, 3, 5, 8, 9}, d{1, 2, 5};
  std::vector<std::vector<std::int32_t>> inc;
  // Given in any order: `order` sorts them by size.
  ASSERT_TRUE(nested_increments({&c, &a, &b}, {1, 2, 0}, 10, &inc));
  ASSERT_EQ(inc.size(), 3u);
  EXPECT_EQ(inc[0], (std::vector<std::int32_t>{3, 5}));
  EXPECT_EQ(inc[1], (std::vector<std::int32_t>{1, 8}));
  EXPECT_EQ(inc[2], (std::vector<std::int32_t>{0, 9}));
  EXPECT_TRUE(nested_increments({&a, &a}, {0, 1}, 10, &inc));  // equal sets: an empty increment
  EXPECT_TRUE(inc[1].empty());
  EXPECT_FALSE(nested_increments({&a, &d}, {0, 1}, 10, &inc));  // 3 is dropped by the larger set
  EXPECT_FALSE(nested_increments({&d, &c}, {0, 1}, 10, &inc));  // 2 is not in the larger set
}

// Every budget of the eviction presets from one pass per kv head equals the point-by-point evaluation
// (counts and bytes exactly, quality within float rounding), and the one-pass path is actually taken.
TEST(BudgetBatch, MatchesPointByPointEvaluation) {
  PolicyRegistry reg;
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  const std::vector<double> keeps{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  for (const char* name : {"window", "streamingllm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random",
                           "fastv", "vision-stride", "hybridkv"}) {
    SCOPED_TRACE(name);
    const PolicySpec p = reg.get(name);
    ASSERT_TRUE(budget_batch_eligible(p));
    BudgetBatchStats stats;
    for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
      LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
      L.prepare_steps();
      std::vector<std::vector<std::string>> wa(keeps.size()), wb(keeps.size());
      std::vector<std::vector<std::string>*> wp;
      for (auto& w : wa) wp.push_back(&w);
      const std::vector<LayerResult> batch = run_budgets_on_layer(p, keeps, L, ctx, wp, &stats);
      ASSERT_EQ(batch.size(), keeps.size());
      for (std::size_t b = 0; b < keeps.size(); ++b) {
        const LayerResult one = run_policy_on_layer(p, keeps[b], L, ctx, wb[b]);
        EXPECT_EQ(wa[b], wb[b]);
        EXPECT_TRUE(batch[b].token_maps.empty());
        ASSERT_EQ(batch[b].heads.size(), one.heads.size());
        for (std::size_t h = 0; h < one.heads.size(); ++h) {
          const HeadResult& x = batch[b].heads[h];
          const HeadResult& y = one.heads[h];
          EXPECT_EQ(x.bytes_kept.total(), y.bytes_kept.total());
          EXPECT_EQ(x.kept, y.kept);
          EXPECT_EQ(x.evicted, y.evicted);
          EXPECT_NEAR(x.quality.output_error, y.quality.output_error,
                      2e-6 * std::max(1.0, y.quality.output_error));
          EXPECT_NEAR(x.quality.attention_recall, y.quality.attention_recall, 1e-9);
          EXPECT_NEAR(x.quality.kl, y.quality.kl, 1e-6);
          EXPECT_NEAR(x.quality.entropy_delta, y.quality.entropy_delta, 2e-6);
          for (std::size_t m = 0; m < 4; ++m) {
            EXPECT_NEAR(x.quality.recall_modality[m], y.quality.recall_modality[m], 1e-6);
            EXPECT_NEAR(x.quality.share_before[m], y.quality.share_before[m], 1e-6);
            EXPECT_NEAR(x.quality.share_after[m], y.quality.share_after[m], 1e-6);
          }
        }
        EXPECT_EQ(batch[b].steps.size(), one.steps.size());
      }
    }
    EXPECT_GT(stats.nested_heads, 0);
    std::printf("%s: %d kv heads x layers nested, %d fell back\n", name, stats.nested_heads, stats.fallback_heads);
  }
}

// run_sweep with and without batching: the same points, counts and bytes, quality within float rounding.
TEST(BudgetBatch, SweepWithAndWithoutBatchingAgree) {
  trace::TraceReader reader(trace_path());
  PolicyRegistry reg;
  std::vector<PolicySpec> policies;
  for (const char* n : {"full", "window", "h2o", "h2o+int8", "look-m", "snapkv", "int4"})
    policies.push_back(reg.get(n));
  const auto points = make_sweep_points(policies, parse_budget_list("0.2:0.8:0.2"));
  SweepOptions a, b;
  a.alloc_search.enabled = b.alloc_search.enabled = false;  // the oracle-topk bound stays: batched too
  b.batch_budgets = false;
  const SweepOutput x = run_sweep(reader, points, a), y = run_sweep(reader, points, b);
  ASSERT_EQ(x.points.size(), y.points.size());
  for (std::size_t i = 0; i < x.points.size(); ++i) {
    SCOPED_TRACE(x.points[i].policy + "@" + x.points[i].budget);
    EXPECT_EQ(x.points[i].policy, y.points[i].policy);
    EXPECT_EQ(x.points[i].budget, y.points[i].budget);
    EXPECT_EQ(x.points[i].total.bytes_kept.total(), y.points[i].total.bytes_kept.total());
    EXPECT_EQ(x.points[i].total.kept, y.points[i].total.kept);
    EXPECT_NEAR(x.points[i].total.quality.output_error, y.points[i].total.quality.output_error, 2e-6);
    EXPECT_NEAR(x.points[i].total.quality.attention_recall, y.points[i].total.quality.attention_recall, 1e-9);
    EXPECT_NEAR(x.points[i].total.quality.entropy_delta, y.points[i].total.quality.entropy_delta, 2e-6);
    ASSERT_EQ(x.points[i].layers.size(), y.points[i].layers.size());
  }
  EXPECT_EQ(x.warnings, y.warnings);
}

// Per-token codes (LayerData::prepare_token_codes): points that share a per-token quantizer dequantize
// codes quantized once per layer; each point swept alone quantizes its own kept tokens. Same results
// bit for bit, bytes included.
TEST(TokenCodes, SharedCodesGiveTheResultsOfPointsSweptAlone) {
  trace::TraceReader reader(trace_path());
  PolicyRegistry reg;
  std::vector<SweepPoint> points;
  for (const char* n : {"int8", "int4", "kivi2"}) points.push_back({reg.get(n), Budget{}});
  for (const char* n : {"h2o+int8", "snapkv+int4", "h2o+kivi2", "look-m+int8"})
    for (const char* b : {"0.3", "0.6"}) points.push_back({reg.get(n), parse_budget(b)});
  SweepOptions o;
  o.alloc_search.enabled = false;
  o.bound.enabled = false;
  const SweepOutput all = run_sweep(reader, points, o);
  ASSERT_EQ(all.points.size(), points.size());
  for (std::size_t i = 0; i < points.size(); ++i) {
    const SweepOutput one = run_sweep(reader, {points[i]}, o);
    ASSERT_EQ(one.points.size(), 1u);
    const PointResult& a = all.points[i];
    const PointResult& b = one.points[0];
    SCOPED_TRACE(a.policy + "@" + a.budget);
    ASSERT_EQ(a.layers.size(), b.layers.size());
    for (std::size_t l = 0; l < a.layers.size(); ++l) {
      ASSERT_EQ(a.layers[l].heads.size(), b.layers[l].heads.size());
      for (std::size_t h = 0; h < a.layers[l].heads.size(); ++h) {
        const HeadResult& x = a.layers[l].heads[h];
        const HeadResult& y = b.layers[l].heads[h];
        EXPECT_EQ(x.bytes_kept.total(), y.bytes_kept.total());
        EXPECT_EQ(x.kept, y.kept);
        EXPECT_EQ(x.quality.output_error, y.quality.output_error);
        EXPECT_EQ(x.quality.attention_recall, y.quality.attention_recall);
        EXPECT_EQ(x.quality.kl, y.quality.kl);
        EXPECT_EQ(x.quality.entropy_delta, y.quality.entropy_delta);
        EXPECT_EQ(x.quality.share_after, y.quality.share_after);
      }
    }
  }
}
