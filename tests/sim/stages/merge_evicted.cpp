// Decode mode of the merge-evicted executor (LOOK-M, sim/src/stages/executors/merge_evicted.cpp and
// sim/src/decode_exec.cpp): at an eviction each dropped resident token joins the kept token within
// merge_window resident slots whose key is most similar, if that cosine is > merge_threshold;
// merged tokens are reported as merged, map to their slot, and the slots' multiplicities are stored.
#include <gtest/gtest.h>

#include <cmath>

#include "kvscope/sim/closed_loop.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string merge_trace() {
  return kvscope::testing::tiny_trace("merge_evicted", 64, 16, 4, 4);
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

TEST(MergeEvicted, DecodeModeMergesDroppedTokensIntoSimilarKeptSlots) {
  trace::TraceReader reader(merge_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  // Interval 100: one eviction, at step 0, over the context and decode token 0 (resident index =
  // token id, keys as captured), so the merge rule can be checked on the trace's keys.
  const PolicySpec p = PolicyRegistry().get("look-m~decode:100");
  const int T = ctx.T, S = ctx.S, D = ctx.geometry.head_dim;
  const float threshold = p.params.real("merge_threshold");
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

TEST(MergeEvicted, TheClosedLoopRefusesDecodeModeMergingItCannotCarry) {
  trace::ModelGeometry g;
  g.num_layers = 2;
  g.num_q_heads = 2;
  g.num_kv_heads = 1;
  g.head_dim = 8;
  ContextLabels labels;
  labels.modality.assign(8, 0);
  labels.position = {0, 1, 2, 3, 4, 5, 6, 7};
  labels.segment.assign(8, 0);
  labels.grid_row.assign(8, -1);
  labels.grid_col.assign(8, -1);
  try {
    DecodeCompressor c(PolicyRegistry().get("look-m~decode"), parse_budget("0.5"), g, trace::DType::kF32,
                       labels);
    ADD_FAILURE() << "accepted";
  } catch (const PolicyError& e) {
    EXPECT_NE(
        std::string(e.what()).find("merging executor 'merge-evicted' is not supported in the closed loop"),
        std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(DecodeCompressor(PolicyRegistry().get("fastv~decode"), parse_budget("0.5"), g,
                                   trace::DType::kF32, labels));
}
