// Decode mode of the unicache executor (sim/src/stages/executors/unicache.cpp and
// sim/src/decode_exec.cpp): at an eviction each dropped resident token joins the kept slot within
// merge_window resident slots whose key is most similar if that cosine is >
// unicache.merge_threshold, else it is evicted; multiplicities are stored and counted in the bytes
// with the int8-head quantizer's.
#include <gtest/gtest.h>

#include <cmath>

#include "kvscope/kernels/quantize.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string executor_trace() {
  return kvscope::testing::tiny_trace("unicache_executor", 64, 16, 4, 4);
}

double cosine(const float* a, const float* b, int D) {
  double ab = 0, aa = 0, bb = 0;
  for (int d = 0; d < D; ++d) {
    ab += double(a[d]) * b[d];
    aa += double(a[d]) * a[d];
    bb += double(b[d]) * b[d];
  }
  return ab / std::sqrt(aa * bb);
}

}  // namespace

TEST(UniCacheExecutor, DecodeModeMergesRedundantDroppedTokensAndCountsMultiplicities) {
  trace::TraceReader reader(executor_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  // Interval 100: one eviction, at step 0, over the context and decode token 0 (resident index =
  // token id, keys as captured), so the merge rule can be checked on the trace's keys.
  PolicySpec p = PolicyRegistry().get("unicache~decode:100");
  p.set("unicache.merge_threshold", "0.5");
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim;
  const float threshold = p.params.real("unicache.merge_threshold");
  const int window = p.params.integer("merge_window");
  int merged_total = 0, evicted_total = 0;
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    std::vector<std::string> warnings;
    const LayerResult r = run_decode_policy_on_layer(p, 1.0, 0.5, L, ctx, warnings, true);
    for (int h = 0; h < ctx.geometry.num_kv_heads; ++h) {
      const TokenMap& tm = r.token_maps[static_cast<std::size_t>(h)];
      const HeadResult& hr = r.heads[static_cast<std::size_t>(h)];
      const float* k = L.k_all().data() + static_cast<std::size_t>(h) * (T + S) * D;
      for (int m = 0; m < 4; ++m) EXPECT_EQ(hr.kept[m] + hr.merged[m] + hr.evicted[m], hr.tokens[m]);
      // Bytes at the end: the int8-head codes and scales of the K slots plus an int32 multiplicity each.
      const int K = static_cast<int>(tm.slot_token.size());
      const kernels::QuantSpec q{8, true, kernels::Granularity::kPerHead, 0, 0};
      const auto qb = kernels::quantized_bytes(q, 1, K, D, ctx.dtype);
      EXPECT_EQ(hr.bytes_end, 2 * qb.total + 4ll * K);
      EXPECT_GT(hr.bytes_kept.multiplicity, 0);
      for (int t = 0; t < T; ++t) {
        if (tm.state[t] == 2) {  // merged: into a kept slot within the window, cosine above the threshold
          ++merged_total;
          const int host = tm.slot_token[static_cast<std::size_t>(tm.slot[t])];
          EXPECT_LE(std::abs(host - t), window);
          EXPECT_GT(cosine(k + static_cast<std::size_t>(t) * D, k + static_cast<std::size_t>(host) * D, D),
                    threshold - 1e-6);
        } else if (tm.state[t] == 0) {  // evicted: no kept token within the window is similar enough
          ++evicted_total;
          for (int u : tm.slot_token) {
            if (u > T || std::abs(u - t) > window) continue;  // decode tokens appended after the eviction
            EXPECT_LE(cosine(k + static_cast<std::size_t>(t) * D, k + static_cast<std::size_t>(u) * D, D),
                      threshold + 1e-6)
                << "layer " << layer << " head " << h << " token " << t << " could have joined " << u;
          }
        }
      }
    }
  }
  EXPECT_GT(merged_total, 0);
  EXPECT_GT(evicted_total, 0);
}

TEST(UniCacheExecutor, MergedTokensFollowTheirSlotOverRepeatedEvictions) {
  trace::TraceReader reader(executor_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  PolicySpec p = PolicyRegistry().get("unicache~decode");  // evicts at every step
  p.set("unicache.merge_threshold", "-1");                 // every dropped token merges
  const int T = ctx.T;
  LayerData L(2, reader.read_layer(2), reader.read_decode_layer(2), ctx);
  std::vector<std::string> warnings;
  const LayerResult r = run_decode_policy_on_layer(p, 1.0, 0.5, L, ctx, warnings, true);
  for (const HeadResult& hr : r.heads) {
    int evicted = 0;
    for (int m = 0; m < 4; ++m) evicted += static_cast<int>(hr.evicted[m]);
    EXPECT_EQ(evicted, 0) << "with threshold -1 nothing is evicted, all dropped tokens merge";
  }
  for (const TokenMap& tm : r.token_maps)
    for (int t = 0; t < T; ++t) EXPECT_GE(tm.slot[static_cast<std::size_t>(t)], 0) << "token " << t;
}
