// Decode mode of the unicache allocator (sim/src/stages/allocators/unicache.cpp): the density-driven
// modality split and the alignment protection run on the resident tokens; on the whole context they
// are the prefill allocation; in a decode run the cosine schedule scales the cap per layer.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "kvscope/sim/closed_loop.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"
#include "stages/stage.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string allocator_trace() {
  return kvscope::testing::tiny_trace("unicache_allocator", 64, 40, 6, 5);
}

stages::TokenView resident_view(const TraceContext& ctx, const std::vector<std::int32_t>& ids,
                                std::vector<std::uint8_t>& mod) {
  mod.resize(ids.size());
  stages::TokenView r;
  r.count = static_cast<int>(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    mod[i] = ctx.modality_all[static_cast<std::size_t>(ids[i])];
    ++r.per_modality[mod[i]];
  }
  r.modality = mod.data();
  r.id = ids.data();
  return r;
}

}  // namespace

TEST(UniCacheAllocator, ResidentAllocationOfTheWholeContextIsThePrefillAllocation) {
  trace::TraceReader reader(allocator_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  const PolicySpec p = PolicyRegistry().get("unicache~decode");
  const int T = ctx.T;
  LayerData L(2, reader.read_layer(2), reader.read_decode_layer(2), ctx);
  const stages::LayerView view(p, L, ctx);
  std::vector<float> all(static_cast<std::size_t>(ctx.geometry.num_kv_heads) * T);
  stages::scorer_of(p).score(view, all);
  const std::vector<float> scores(all.begin(), all.begin() + T);  // kv head 0: one working head
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T));
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<std::uint8_t> mod;
  const stages::TokenView r = resident_view(ctx, ids, mod);
  for (double keep : {0.2, 0.5, 0.8}) {
    int k1 = static_cast<int>(std::lround(keep * T)), k2 = k1;
    kernels::SelectParams s1, s2;
    std::vector<std::uint8_t> p1(static_cast<std::size_t>(T), 0), p2(p1);
    stages::allocator_of(p).allocate(view, scores, 1, k1, s1, p1);
    stages::allocator_of(p).allocate_resident(view, r, scores, k2, s2, p2);
    EXPECT_EQ(k1, k2) << keep;
    EXPECT_TRUE(s2.use_modality_budgets);
    for (int m = 0; m < kModalities; ++m)
      EXPECT_EQ(s1.modality_budget[m], s2.modality_budget[m]) << keep << " " << m;
    EXPECT_EQ(p1, p2) << keep;
  }
}

TEST(UniCacheAllocator, ResidentSplitCountsTheResidentTokensAndProtectsOnlyContextAlignmentTokens) {
  trace::TraceReader reader(allocator_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  PolicySpec p = PolicyRegistry().get("unicache~decode");
  p.set("unicache.align_threshold", "0.05");  // many alignment tokens
  p.set("unicache.align_discount", "0");      // every resident alignment token is protected
  const int T = ctx.T, H = ctx.geometry.num_kv_heads;
  LayerData L(1, reader.read_layer(1), reader.read_decode_layer(1), ctx);
  const stages::LayerView view(p, L, ctx);
  std::vector<std::int32_t> ids;
  for (int t = 0; t < T; ++t)
    if (t % 3 != 0) ids.push_back(t);
  for (int j = 0; j < 4; ++j) ids.push_back(T + j);  // decode tokens (text)
  std::vector<std::uint8_t> mod;
  const stages::TokenView r = resident_view(ctx, ids, mod);
  std::vector<float> scores(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) scores[i] = static_cast<float>((i * 7) % 11);
  const int cap = static_cast<int>(ids.size()) / 2;
  int k = cap;
  kernels::SelectParams sp;
  std::vector<std::uint8_t> protect(ids.size(), 0);
  stages::allocator_of(p).allocate_resident(view, r, scores, k, sp, protect);
  ASSERT_TRUE(sp.use_modality_budgets);
  int sum = 0;
  for (int m = 0; m < kModalities; ++m) {
    EXPECT_LE(sp.modality_budget[m], r.per_modality[static_cast<std::size_t>(m)]) << m;
    sum += sp.modality_budget[m];
  }
  EXPECT_EQ(sum, k);
  EXPECT_NEAR(k, cap, 2);  // the split of the cap (rounding per modality)
  // Text is compressed at most by text_cap of its resident count (decode tokens included).
  const double n_text = static_cast<double>(r.per_modality[0]);
  EXPECT_GE(sp.modality_budget[0], std::lround(n_text * (1 - p.params.real("unicache.text_cap"))) - 1);
  const auto& given = L.cross_given();  // [Hkv, T]
  int protected_count = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const int t = ids[i];
    bool align = false;
    if (t < T) {
      float g = 0;
      for (int h = 0; h < H; ++h) g += given[static_cast<std::size_t>(h) * T + t];
      align = g / H > 0.05f;
    }
    EXPECT_EQ(protect[i] != 0, align) << "token " << t;
    protected_count += protect[i] != 0;
  }
  EXPECT_GT(protected_count, 0);
}

TEST(UniCacheAllocator, DecodeCapFollowsTheCosineLayerSchedule) {
  trace::TraceReader reader(allocator_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  PolicySpec p = PolicyRegistry().get("unicache~decode");
  p.sinks = 0;
  p.recent = 0;
  p.set("unicache.align_threshold", "1");  // no alignment tokens: nothing forced
  const int T = ctx.T, S = ctx.S, L = ctx.geometry.num_layers;
  std::vector<int> slots;
  for (int layer = 0; layer < L; ++layer) {
    LayerData data(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    const stages::LayerView view(p, data, ctx);
    const double frac = stages::allocator_of(p).layer_fraction(view, 0.7);
    const int cap = static_cast<int>(std::lround(frac * T));
    std::vector<std::string> warnings;
    const LayerResult r = run_decode_policy_on_layer(p, 1.0, 0.7, data, ctx, warnings, true);
    for (int s = 0; s < S; ++s) {
      EXPECT_TRUE(r.steps[static_cast<std::size_t>(s)].eviction);
      // The modality split of the cap rounds per modality: within 2 tokens of the layer's cap.
      EXPECT_NEAR(r.steps[static_cast<std::size_t>(s)].max_slots, cap, 2)
          << "layer " << layer << " step " << s;
    }
    slots.push_back(r.steps.back().max_slots);
  }
  EXPECT_GT(slots.front(), 0);
  EXPECT_LT(slots.front(), slots.back());  // shallow layers compressed more (rate 0.75 -> 0.45)
}

TEST(UniCacheAllocator, WithoutABudgetTheDecodeCapIsTheOwnScheduleMeanKeep) {
  // The closed loop's decode compressor (the sweep: test_decode) caps a point without a budget at the
  // unicache schedule's mean keep, here (0.25 + 0.55) / 2 over 2 layers; h2o~decode never evicts then.
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
  const std::filesystem::path ini = kvscope::testing::scratch_dir() / "unicache_evict.ini";
  std::ofstream(ini) << "[policy uc-evict]\nbase = unicache\nexecutor = evict\nmode = decode\n";
  PolicyRegistry reg;
  reg.load_ini(ini.string());
  const Budget none = parse_budget("");
  EXPECT_NEAR(DecodeCompressor(reg.get("uc-evict"), none, g, trace::DType::kF32, labels).cap_keep(), 0.40,
              1e-6);
  EXPECT_EQ(DecodeCompressor(reg.get("h2o~decode"), none, g, trace::DType::kF32, labels).cap_keep(), 1.0);
  EXPECT_NEAR(
      DecodeCompressor(reg.get("uc-evict"), parse_budget("0.3"), g, trace::DType::kF32, labels).cap_keep(),
      0.3, 1e-9);
  std::filesystem::remove(ini);
}
