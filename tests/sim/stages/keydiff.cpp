// The keydiff scorer (sim/src/stages/scorers/keydiff.cpp): -cos(k, mean normalised key) per kv
// head, checked against a direct float64 computation; the kept set is the most dissimilar keys;
// decode mode evicts by the same score over the resident keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string keydiff_trace() {
  return kvscope::testing::tiny_trace("keydiff", 36, 24, 6, 11);
}

// kvpress KeyDiffPress.score: anchor = F.normalize(keys).mean(tokens); -F.cosine_similarity(keys, anchor).
std::vector<double> reference(const std::vector<float>& kall, int h, int T, int S, int D) {
  const float* k = kall.data() + static_cast<std::size_t>(h) * (T + S) * D;
  std::vector<double> anchor(D, 0.0), out(T);
  for (int t = 0; t < T; ++t) {
    double n = 0;
    for (int d = 0; d < D; ++d) n += double(k[t * D + d]) * k[t * D + d];
    for (int d = 0; d < D; ++d) anchor[d] += k[t * D + d] / std::sqrt(n) / T;
  }
  double an = 0;
  for (double a : anchor) an += a * a;
  for (int t = 0; t < T; ++t) {
    double dot = 0, n = 0;
    for (int d = 0; d < D; ++d) {
      dot += k[t * D + d] * anchor[d];
      n += double(k[t * D + d]) * k[t * D + d];
    }
    out[t] = -dot / std::sqrt(n * an);
  }
  return out;
}

}  // namespace

TEST(KeyDiff, ScoresAreNegativeCosineToTheMeanNormalisedKeyAndTheMostDissimilarAreKept) {
  trace::TraceReader reader(keydiff_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  const PolicySpec p = PolicyRegistry().get("keydiff");  // the scorer's own preset
  EXPECT_EQ(p.stages.scorer, "keydiff");
  EXPECT_EQ(p.stages.allocator, "uniform");
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim;
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    std::vector<std::string> warnings;
    const LayerResult r = run_policy_on_layer(p, 0.3, L, ctx, warnings, true);
    const int k = static_cast<int>(std::lround(0.3 * T));
    for (int h = 0; h < ctx.geometry.num_kv_heads; ++h) {
      const TokenMap& tm = r.token_maps[static_cast<std::size_t>(h)];
      const std::vector<double> ref = reference(L.k_all(), h, T, S, D);
      ASSERT_EQ(static_cast<int>(tm.score.size()), T);
      for (int t = 0; t < T; ++t)
        EXPECT_NEAR(tm.score[t], ref[t], 1e-5) << "layer " << layer << " head " << h;
      // Kept: the k largest scores (least similar keys); every evicted score is at most the smallest kept.
      ASSERT_EQ(static_cast<int>(tm.slot_token.size()), k);
      double min_kept = 1e9, max_evicted = -1e9;
      for (int t = 0; t < T; ++t) {
        if (tm.state[t] == 1)
          min_kept = std::min(min_kept, ref[t]);
        else
          max_evicted = std::max(max_evicted, ref[t]);
      }
      EXPECT_GE(min_kept, max_evicted - 1e-6);
    }
  }
}

TEST(KeyDiff, DecodeModeEvictsTheMostSimilarResidentKeys) {
  trace::TraceReader reader(keydiff_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  // Interval 100: only step 0 evicts, over the T context tokens and decode token 0.
  const PolicySpec p = PolicyRegistry().get("keydiff~decode:100");
  LayerData L(1, reader.read_layer(1), reader.read_decode_layer(1), ctx);
  std::vector<std::string> warnings;
  const LayerResult r = run_decode_policy_on_layer(p, 1.0, 0.5, L, ctx, warnings, true);
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim, cap = static_cast<int>(std::lround(0.5 * T));
  for (int h = 0; h < ctx.geometry.num_kv_heads; ++h) {
    const TokenMap& tm = r.token_maps[static_cast<std::size_t>(h)];
    ASSERT_EQ(static_cast<int>(tm.slot_token.size()), cap + S - 1);
    // The score over the T + 1 resident keys at step 0 (rows 0..T of kv head h, which are contiguous).
    const std::vector<double> ref = reference(L.k_all(), h, T + 1, S - 1, D);
    std::vector<int> order(static_cast<std::size_t>(T + 1));
    for (int i = 0; i <= T; ++i) order[static_cast<std::size_t>(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ref[a] > ref[b]; });
    std::vector<int> want(order.begin(), order.begin() + cap);
    std::sort(want.begin(), want.end());
    std::vector<int> got(tm.slot_token.begin(), tm.slot_token.begin() + cap);
    EXPECT_EQ(got, want) << "head " << h;
  }
  EXPECT_EQ(r.steps[0].evicted, ctx.geometry.num_kv_heads * (T + 1 - cap));
}
