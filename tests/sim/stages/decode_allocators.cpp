// Decode mode of the hybrid and vision-only allocators (sim/src/stages/allocators/): the cap is
// split by modality over the resident tokens (hybrid), or every non-vision resident token is kept
// and only vision is evicted, with the first fastv_layer layers never evicting (vision-only).
#include <gtest/gtest.h>

#include <cmath>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string decode_trace() {
  return kvscope::testing::tiny_trace("decode_allocators", 36, 30, 5, 9);
}

constexpr int kText = 0, kVision = 1;

}  // namespace

TEST(DecodeAllocators, VisionOnlyKeepsEveryNonVisionTokenAndEvictsVisionDownToTheCap) {
  trace::TraceReader reader(decode_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  const PolicySpec p = PolicyRegistry().get("fastv~decode");  // tova + vision-only from layer 2
  const int T = ctx.T, S = ctx.S;
  const int cap = static_cast<int>(std::lround(0.8 * T));
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    std::vector<std::string> warnings;
    const LayerResult r = run_decode_policy_on_layer(p, 1.0, 0.8, L, ctx, warnings, true);
    for (const TokenMap& tm : r.token_maps) {
      if (layer < 2) {  // fastv_layer 2: never evicted
        EXPECT_EQ(static_cast<int>(tm.slot_token.size()), T + S);
        continue;
      }
      int nonvision = 0, vision = 0;
      for (auto t : tm.slot_token)
        (t < T && ctx.modality[static_cast<std::size_t>(t)] == kVision ? vision : nonvision)++;
      int context_nonvision = 0;
      for (int t = 0; t < T; ++t) context_nonvision += ctx.modality[static_cast<std::size_t>(t)] != kVision;
      EXPECT_EQ(nonvision, context_nonvision + S) << "every text/special and decode token stays";
      EXPECT_EQ(vision, std::max(0, cap - nonvision)) << "vision fills the rest of the cap";
    }
  }
  EXPECT_THROW(PolicyRegistry().get("vision-stride~decode"), PolicyError);  // its scorer has no decode mode
}

TEST(DecodeAllocators, HybridSplitsTheCapByModalityOverTheResidentTokens) {
  trace::TraceReader reader(decode_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  // Interval 100: one eviction, at step 0, over the T context tokens and decode token 0.
  PolicySpec p = PolicyRegistry().get("hybridkv~decode:100");
  p.sinks = 0;  // no forced tokens: the modality budgets alone decide
  const int T = ctx.T, S = ctx.S, cap = static_cast<int>(std::lround(0.4 * T));
  int n_text = 1, n_other = 0;  // resident at step 0: the context and decode token 0 (text)
  for (int t = 0; t < T; ++t) (ctx.modality[static_cast<std::size_t>(t)] == kText ? n_text : n_other)++;
  const int want_text = std::min(n_text, static_cast<int>(std::lround(0.5 * cap)));
  ASSERT_LE(cap - want_text, n_other);
  LayerData L(1, reader.read_layer(1), reader.read_decode_layer(1), ctx);
  std::vector<std::string> warnings;
  const LayerResult r = run_decode_policy_on_layer(p, 1.0, 0.4, L, ctx, warnings, true);
  for (const TokenMap& tm : r.token_maps) {
    ASSERT_EQ(static_cast<int>(tm.slot_token.size()), cap + S - 1);
    int text = 0;
    for (int i = 0; i < cap; ++i) {  // the step-0 survivors (decode tokens 1.. are appended after)
      const int t = tm.slot_token[static_cast<std::size_t>(i)];
      text += t >= T || ctx.modality[static_cast<std::size_t>(t)] == kText;
    }
    EXPECT_EQ(text, want_text);
  }
}
