// The fidelity proxies (docs/metrics.md "Proxies", results format 1.3): their definitions checked on a
// synthetic trace through kvsim's sweep. Without roles every decode step is an answer step, so the answer's
// top-k statistic is the oracle-topk bound's own score: the bound at k tokens keeps exactly the top-k set.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/trace/reader.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

// T = 1 + 24 + 65 = 90 context tokens (64 vision), 6 decode steps, 4 layers, 2 kv heads (G = 2), D = 32.
SweepOutput sweep(const std::vector<std::string>& points) {
  static const std::string& path = kvscope::testing::tiny_trace("proxies", 64, 24, 6, 5);
  PolicyRegistry reg;
  std::vector<SweepPoint> pts;
  for (const auto& text : points) {
    auto [name, budget] = split_policy_budget(text);
    const auto more = make_sweep_points({reg.get(name)}, {budget.text.empty() ? parse_budget("1") : budget});
    pts.insert(pts.end(), more.begin(), more.end());
  }
  trace::TraceReader r(path);
  return run_sweep(r, pts, SweepOptions{});
}

const QuerySetQuality& answer(const Quality& q) { return q.query_sets[kAnswerQueries]; }

}  // namespace

TEST(Proxies, FullCacheKeepsTheTopKAndHasNoError) {
  const SweepOutput out = sweep({"full"});
  ASSERT_EQ(out.points.size(), 1u);
  const PointResult& p = out.points[0];
  for (const LayerResult& l : p.layers) {
    for (const HeadResult& h : l.heads) {
      EXPECT_EQ(h.quality.proxies.topk_recall, 1.0);
      EXPECT_LT(h.quality.proxies.error_worst_query, 1e-5);
      EXPECT_GT(h.quality.proxies.topk_mass, 0.0);
      EXPECT_LE(h.quality.proxies.topk_mass, 1.0 + 1e-9);
    }
  }
  EXPECT_EQ(p.total.quality.proxies.topk_recall, 1.0);
  EXPECT_EQ(p.total.quality.proxies.topk_recall_min, 1.0);
  EXPECT_EQ(p.total.quality.proxies.specific_recall, 1.0);
  EXPECT_EQ(p.total.quality.proxies.specific_recall_min, 1.0);
  EXPECT_LT(p.total.quality.proxies.error_propagated, 1e-4);
}

TEST(Proxies, TheBoundAtKTokensKeepsExactlyTheAnswersTopK) {
  const SweepOutput out =
      sweep({"oracle-topk@" + std::to_string(kTopK) + "tok", "knorm@" + std::to_string(kTopK) + "tok"});
  ASSERT_EQ(out.points.size(), 2u);
  for (const LayerResult& l : out.points[0].layers)
    for (const HeadResult& h : l.heads) EXPECT_EQ(h.quality.proxies.topk_recall, 1.0) << "layer " << l.layer;
  // A query-agnostic scorer at the same budget misses some of them.
  EXPECT_LT(out.points[1].total.quality.proxies.topk_recall, 1.0);
}

TEST(Proxies, AggregateByTheirOwnRules) {
  const SweepOutput out = sweep({"h2o@0.3", "streamingllm@0.2", "random@0.4"});
  for (const PointResult& p : out.points) {
    const Proxies& P = p.total.quality.proxies;
    double worst_head = 0, worst_query = 0, topk = 0, topk_min = 0, keep = 1, spec = 0, spec_min = 0;
    const double L = static_cast<double>(p.layers.size());
    for (const LayerResult& l : p.layers) {
      const Proxies& x = l.total.quality.proxies;
      double max_err = 0, max_row = 0, min_topk = 1, sum_topk = 0, lo = 1e300, hi = -1e300;
      double min_spec = 1, sum_spec = 0;
      for (const HeadResult& h : l.heads) {
        const Proxies& y = h.quality.proxies;
        EXPECT_EQ(y.error_worst_head, answer(h.quality).output_error);
        EXPECT_GE(y.error_worst_query, answer(h.quality).output_error - 1e-12);
        EXPECT_GE(y.concentration, 0.0);
        EXPECT_LE(y.concentration, 1.0);
        max_err = std::max(max_err, answer(h.quality).output_error);
        max_row = std::max(max_row, y.error_worst_query);
        min_topk = std::min(min_topk, y.topk_recall);
        sum_topk += y.topk_recall;
        EXPECT_EQ(y.specific_recall_min, y.specific_recall);
        min_spec = std::min(min_spec, y.specific_recall);
        sum_spec += y.specific_recall;
        lo = std::min(lo, y.error_retrieval);
        hi = std::max(hi, y.error_retrieval);
      }
      EXPECT_EQ(x.error_worst_head, max_err);
      EXPECT_EQ(x.error_worst_query, max_row);
      EXPECT_EQ(x.topk_recall_min, min_topk);
      EXPECT_EQ(x.specific_recall_min, min_spec);
      EXPECT_NEAR(x.specific_recall, sum_spec / static_cast<double>(l.heads.size()), 1e-12);
      spec += x.specific_recall / L;
      spec_min += x.specific_recall_min / L;
      EXPECT_NEAR(x.topk_recall, sum_topk / static_cast<double>(l.heads.size()), 1e-12);
      EXPECT_GE(x.error_retrieval, lo - 1e-12);  // a weighted mean of the heads'
      EXPECT_LE(x.error_retrieval, hi + 1e-12);
      keep *= 1 - std::min(answer(l.total.quality).output_error, 1.0);
      EXPECT_NEAR(x.error_propagated, 1 - keep, 1e-12);
      worst_head += x.error_worst_head / L;
      worst_query += x.error_worst_query / L;
      topk += x.topk_recall / L;
      topk_min += x.topk_recall_min / L;
    }
    EXPECT_NEAR(P.error_worst_head, worst_head, 1e-12) << p.policy;
    EXPECT_NEAR(P.error_worst_query, worst_query, 1e-12);
    EXPECT_NEAR(P.topk_recall, topk, 1e-12);
    EXPECT_NEAR(P.topk_recall_min, topk_min, 1e-12);
    EXPECT_NEAR(P.specific_recall, spec, 1e-12);
    EXPECT_NEAR(P.specific_recall_min, spec_min, 1e-12);
    EXPECT_NEAR(P.error_propagated, 1 - keep, 1e-12);
    EXPECT_LT(P.topk_recall, 1.0) << p.policy << ": compressing to <= 40% loses some of the answer's top-k";
  }
}

// The specific top-k: the k tokens of largest a(t) - c(t), a the answer rows' mean attention on t (every
// decode step here), c the mean attention of the prefill queries that see t; ties to the lower index.
TEST(Proxies, SpecificTopKIsWhatTheAnswerReadsMoreThanTheContextReadsIt) {
  trace::TraceReader reader(kvscope::testing::tiny_trace("proxies", 64, 24, 6, 5));
  TraceContext ctx = TraceContext::from_reader(reader);
  const int T = ctx.T, S = ctx.S, G = ctx.geometry.group_size(), H = ctx.geometry.num_kv_heads;
  bool differs = false;
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    const std::vector<float> answer = L.decode_attention_mass(), context = L.h2o();  // [Hkv, T]
    const LayerData::AnswerTopK& top = L.answer_topk();
    ASSERT_EQ(top.specific.size(), static_cast<std::size_t>(H));
    for (int h = 0; h < H; ++h) {
      std::vector<std::pair<double, int>> sigma;
      for (int t = 0; t < T; ++t) {
        const std::size_t i = static_cast<std::size_t>(h) * T + t;
        sigma.emplace_back(-(answer[i] / (static_cast<double>(G) * S) - context[i] / (static_cast<double>(G) * (T - t))), t);
      }
      std::sort(sigma.begin(), sigma.end());
      std::vector<std::int32_t> want;
      for (int r = 0; r < std::min(kTopK, T); ++r) want.push_back(sigma[static_cast<std::size_t>(r)].second);
      std::sort(want.begin(), want.end());
      EXPECT_EQ(top.specific[static_cast<std::size_t>(h)], want) << "layer " << layer << " head " << h;
      differs = differs || top.specific[static_cast<std::size_t>(h)] != top.tokens[static_cast<std::size_t>(h)];
    }
  }
  EXPECT_TRUE(differs) << "the specific top-k equals the plain top-k everywhere: the test shows nothing";
}

TEST(Proxies, BudgetsEvaluatedTogetherGiveTheSameProxies) {
  // The budgets of an eviction-only policy are evaluated in one pass (budget_batch.hpp); a point alone
  // takes the per-point path. Both must report the same proxies and query-set metrics.
  const SweepOutput alone = sweep({"h2o@0.3"}), together = sweep({"h2o@0.3", "h2o@0.6", "h2o@0.8"});
  const PointResult &a = alone.points[0], &b = together.points[0];
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (int i = 0; i < kNumProxies; ++i) {
    EXPECT_NEAR(proxy_value(a.total.quality.proxies, i), proxy_value(b.total.quality.proxies, i), 1e-5)
        << proxy_name(i);
  }
  EXPECT_NEAR(answer(a.total.quality).output_error, answer(b.total.quality).output_error, 1e-6);
  EXPECT_GT(answer(b.total.quality).output_error, 0.0);
  EXPECT_LT(b.total.quality.proxies.topk_recall, 1.0);
}
