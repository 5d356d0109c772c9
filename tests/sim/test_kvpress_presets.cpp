// The kvpress-compatible presets (docs/policies.md "Mapping onto kvpress presses"): snapkv-kvpress,
// tova-kvpress, random-kvpress and the keep_rounding parameter, checked on the selections they make.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/trace/reader.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

// T = 1 + 24 + 65 = 90 context tokens, 6 decode steps, 4 layers, 2 kv heads (G = 2).
const std::string& trace_path() { return kvscope::testing::tiny_trace("kvpress", 64, 24, 6, 11); }

struct Selections {
  int T = 0;
  std::vector<LayerSelection> layers;
};

Selections select(const std::string& policy, double keep) {
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  const PolicySpec p = PolicyRegistry().get(policy);
  Selections out;
  out.T = ctx.T;
  for (int l = 0; l < ctx.geometry.num_layers; ++l) {
    LayerData L(l, reader.read_layer(l), reader.read_decode_layer(l), ctx);
    std::vector<std::string> warnings;
    out.layers.push_back(select_on_layer(p, keep, L, ctx, warnings));
  }
  return out;
}

std::vector<std::int32_t> kept(const LayerSelection& s, int w) {
  const auto* b = s.kept.data() + static_cast<std::size_t>(w) * static_cast<std::size_t>(s.k);
  return {b, b + s.counts[static_cast<std::size_t>(w)]};
}

}  // namespace

TEST(KvpressPresets, KeepTheTruncatedCount) {
  // 0.25 x 90 = 22.5: kvscope rounds to 23, kvpress keeps int(90 x (1 - 0.75)) = 22.
  const Selections ours = select("tova", 0.25), theirs = select("tova-kvpress", 0.25);
  EXPECT_EQ(ours.layers[0].k, 23);
  EXPECT_EQ(theirs.layers[0].k, 22);
  EXPECT_EQ(select("random-kvpress", 0.25).layers[0].k, 22);
  // 0.75 x 90 = 67.5 (above snapkv-kvpress's 64 forced tokens): 68 against kvpress's 67.
  EXPECT_EQ(select("snapkv", 0.75).layers[0].k, 68);
  EXPECT_EQ(select("snapkv-kvpress", 0.75).layers[0].k, 67);
}

TEST(KvpressPresets, TovaKeepsOneSetPerLayerWithTheLastToken) {
  const Selections s = select("tova-kvpress", 0.3);
  bool differs_from_tova = false;
  const Selections plain = select("tova", 0.3);
  for (std::size_t l = 0; l < s.layers.size(); ++l) {
    const LayerSelection& x = s.layers[l];
    ASSERT_EQ(x.working_heads, 2);
    EXPECT_EQ(kept(x, 0), kept(x, 1)) << "layer " << l << ": one set for every kv head";
    EXPECT_EQ(kept(x, 0).back(), s.T - 1) << "the last token is forced";
    differs_from_tova = differs_from_tova || kept(plain.layers[l], 0) != kept(plain.layers[l], 1);
  }
  EXPECT_TRUE(differs_from_tova) << "kvscope's tova keeps a set per kv head";
}

TEST(KvpressPresets, RandomDrawsTheSamePositionsInEveryLayer) {
  const Selections s = select("random-kvpress", 0.3), plain = select("random", 0.3);
  for (std::size_t l = 1; l < s.layers.size(); ++l)
    for (int w = 0; w < 2; ++w) EXPECT_EQ(kept(s.layers[l], w), kept(s.layers[0], w)) << "layer " << l;
  EXPECT_NE(kept(s.layers[0], 0), kept(s.layers[0], 1)) << "kv heads draw their own positions";
  EXPECT_NE(kept(plain.layers[1], 0), kept(plain.layers[0], 0)) << "kvscope's random: every layer its own";
}

TEST(KvpressPresets, SnapKVKeepsTheWindowOf64) {
  const PolicySpec p = PolicyRegistry().get("snapkv-kvpress");
  EXPECT_EQ(p.params.integer("snap_window"), 64);
  EXPECT_EQ(p.params.integer("snap_kernel"), 5);
  EXPECT_EQ(p.params.text("snap_pool"), "avg");
  const Selections s = select("snapkv-kvpress", 0.8);  // k = int(72.0) = 72 >= 64
  for (const LayerSelection& x : s.layers) {
    for (int w = 0; w < x.working_heads; ++w) {
      const std::vector<std::int32_t> k = kept(x, w);
      const std::set<std::int32_t> set(k.begin(), k.end());
      for (int t = s.T - 64; t < s.T; ++t) EXPECT_TRUE(set.count(t)) << "token " << t;
    }
  }
  // The plain preset (window 32, max-pool 7) selects differently on this trace.
  const Selections plain = select("snapkv", 0.3), kvp = select("snapkv-kvpress", 0.3);
  bool differs = false;
  for (std::size_t l = 0; l < plain.layers.size(); ++l)
    differs = differs || kept(plain.layers[l], 0) != kept(kvp.layers[l], 0);
  EXPECT_TRUE(differs);
}
