// Decode mode of the unicache scorer (sim/src/stages/scorers/unicache.cpp): on the whole context
// before any decode query it is the prefill score; redundancy is over the resident neighbours; the
// decode queries' attention enters the accumulated and the cross-modal terms.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"
#include "stages/stage.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string scorer_trace() {
  return kvscope::testing::tiny_trace("unicache_scorer", 36, 24, 3, 11);
}

// The resident cache of kv head h holding `ids` (ascending), keys as captured.
struct Resident {
  std::vector<std::int32_t> ids;
  std::vector<float> k;  // [K, D]
  kernels::AttentionProblem query;
};
Resident resident(LayerData& L, const TraceContext& ctx, int h, std::vector<std::int32_t> ids, int step) {
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim, G = ctx.geometry.group_size();
  Resident r;
  r.ids = std::move(ids);
  const float* kh = L.k_all().data() + static_cast<std::size_t>(h) * (T + S) * D;
  for (auto t : r.ids)
    r.k.insert(r.k.end(), kh + static_cast<std::size_t>(t) * D, kh + static_cast<std::size_t>(t + 1) * D);
  r.query.q =
      L.q_steps().data() +
      (static_cast<std::size_t>(step) * ctx.geometry.num_q_heads + static_cast<std::size_t>(h) * G) * D;
  r.query.k = r.k.data();
  r.query.num_q_heads = G;
  r.query.num_kv_heads = 1;
  r.query.q_len = 1;
  r.query.k_len = static_cast<int>(r.ids.size());
  r.query.head_dim = D;
  r.query.dtype = kernels::DType::kF32;
  r.query.causal = false;
  return r;
}

double cosine(const float* a, const float* b, int D) {
  double ab = 0, aa = 0, bb = 0;
  for (int d = 0; d < D; ++d) {
    ab += double(a[d]) * b[d];
    aa += double(a[d]) * a[d];
    bb += double(b[d]) * b[d];
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

}  // namespace

TEST(UniCacheScorer, DecodeScoreOfTheWholeContextBeforeAnyDecodeQueryIsThePrefillScore) {
  trace::TraceReader reader(scorer_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  const PolicySpec p = PolicyRegistry().get("unicache~decode");
  const int T = ctx.T, H = ctx.geometry.num_kv_heads;
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {  // shallow, middle and deep weights
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    L.prepare_steps();
    const stages::LayerView view(p, L, ctx);
    std::vector<float> prefill(static_cast<std::size_t>(H) * T);
    stages::scorer_of(p).score(view, prefill);
    for (int h = 0; h < H; ++h) {
      std::vector<std::int32_t> all(static_cast<std::size_t>(T));
      std::iota(all.begin(), all.end(), 0);
      Resident r = resident(L, ctx, h, all, 0);
      auto scoring = stages::scorer_of(p).decode_scoring(view, h);
      ASSERT_TRUE(scoring);
      const stages::DecodeStepView step{0, h, r.ids, r.query, L.q_steps(), *ctx.backend};
      std::vector<float> got;
      scoring->score(step, got);
      ASSERT_EQ(got.size(), static_cast<std::size_t>(T));
      for (int t = 0; t < T; ++t)
        EXPECT_NEAR(got[static_cast<std::size_t>(t)], prefill[static_cast<std::size_t>(h) * T + t], 1e-5)
            << "layer " << layer << " head " << h << " token " << t;
      // A decode query's attention raises the accumulated term: the scores move.
      scoring->observe(step);
      std::vector<float> after;
      scoring->score(step, after);
      double moved = 0;
      for (int t = 0; t < T; ++t)
        moved += std::abs(after[static_cast<std::size_t>(t)] - got[static_cast<std::size_t>(t)]);
      EXPECT_GT(moved, 1e-4);
    }
  }
}

TEST(UniCacheScorer, RedundancyIsTheMaxCosineToTheResidentNeighbours) {
  trace::TraceReader reader(scorer_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  // Only the redundancy term (layer 1 of 4 is a middle layer: w_d as given): score = -clamp(d, 0, 1).
  PolicySpec p = PolicyRegistry().get("unicache~decode");
  for (const char* w : {"unicache.w_a", "unicache.w_c", "unicache.w_r"}) p.set(w, "0");
  p.set("unicache.w_d", "1");
  const int T = ctx.T, D = ctx.geometry.head_dim;
  LayerData L(1, reader.read_layer(1), reader.read_decode_layer(1), ctx);
  L.prepare_steps();
  const stages::LayerView view(p, L, ctx);
  // Every other context token and the first two decode tokens are resident.
  std::vector<std::int32_t> ids;
  for (int t = 0; t < T; t += 2) ids.push_back(t);
  ids.push_back(T);
  ids.push_back(T + 1);
  const int h = 1;
  Resident r = resident(L, ctx, h, ids, 1);
  auto scoring = stages::scorer_of(p).decode_scoring(view, h);
  const stages::DecodeStepView step{1, h, r.ids, r.query, L.q_steps(), *ctx.backend};
  std::vector<float> got;
  scoring->score(step, got);
  int grid_checked = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const int t = ids[i];
    const bool grid = t < T && ctx.grid_row[static_cast<std::size_t>(t)] >= 0 &&
                      ctx.grid_col[static_cast<std::size_t>(t)] >= 0;
    double best = -2;
    for (std::size_t j = 0; j < ids.size(); ++j) {
      const int u = ids[j];
      if (j == i) continue;
      bool neighbour;
      if (grid) {
        neighbour =
            u < T && ctx.grid_row[static_cast<std::size_t>(u)] >= 0 &&
            ctx.segment[static_cast<std::size_t>(u)] == ctx.segment[static_cast<std::size_t>(t)] &&
            std::abs(ctx.grid_row[static_cast<std::size_t>(u)] - ctx.grid_row[static_cast<std::size_t>(t)]) <=
                1 &&
            std::abs(ctx.grid_col[static_cast<std::size_t>(u)] - ctx.grid_col[static_cast<std::size_t>(t)]) <=
                1;
      } else {
        neighbour = std::abs(u - t) <= 4;
      }
      if (neighbour) best = std::max(best, cosine(&r.k[i * D], &r.k[j * D], D));
    }
    const double d = best < -1.5 ? 0.0 : best;
    grid_checked += grid && best > -1.5;
    EXPECT_NEAR(got[i], -std::clamp(d, 0.0, 1.0), 1e-5) << "token " << t;
  }
  EXPECT_GT(grid_checked, 0);  // grid tokens with a resident grid neighbour were checked
}
