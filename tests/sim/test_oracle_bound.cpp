// The oracle-topk bound and the allocation search on the shipped traces (traces/*.h5 and, where
// present, the real-model traces in ~/.cache/kvscope/traces): docs/policies.md "Bound and search rows
// in sweeps" states the numbers these tests measure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "alloc_search.hpp"  // sim/src: the search on measured tables
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::vector<std::string> shipped_traces() {
  std::vector<std::string> out;
  std::vector<fs::path> dirs = {fs::path(KVSCOPE_TEST_SOURCE_DIR) / "traces"};
  if (const char* home = std::getenv("HOME")) dirs.push_back(fs::path(home) / ".cache/kvscope/traces");
  for (const auto& d : dirs) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    std::vector<std::string> here;
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().extension() == ".h5") here.push_back(e.path().string());
    std::sort(here.begin(), here.end());
    out.insert(out.end(), here.begin(), here.end());
  }
  return out;
}

// The eviction presets: a scorer, an allocator and the evict executor, no quantizer, no head merge.
std::vector<PolicySpec> eviction_presets() {
  std::vector<PolicySpec> out;
  const PolicyRegistry registry;
  for (const auto& [name, p] : registry.presets()) {
    if (!p.compress_tokens || p.adaptive || p.stages.head_merge != "none" || p.key_quant ||
        p.stages.executor != "evict" || p.stages.scorer == "oracle-topk" || p.mode != PolicyMode::kPrefill)
      continue;
    out.push_back(p);
  }
  return out;
}

const std::vector<double> kDefaultBudgets = {0.1, 0.2, 0.3, 0.4, 0.5,
                                             0.6, 0.7, 0.8, 0.9};  // the default sweep's

// The budgets a trace is tested at: every default budget on traces/*.h5; on the larger real-model
// traces 0.2 and 0.6 (a minute more for all nine: KVSCOPE_TEST_ALL_BUDGETS=1, as docs/policies.md measured).
std::vector<double> budgets_for(const std::string& path) {
  if (path.find("/.cache/") == std::string::npos || std::getenv("KVSCOPE_TEST_ALL_BUDGETS"))
    return kDefaultBudgets;
  return {0.2, 0.6};
}

// Measured (docs/policies.md): on the four traces/*.h5, a preset beats the bound on one kv head of one
// layer in 5.1 % of the comparisons (237 of 4,608, worst by 0.56), on a layer (mean over its kv heads)
// in 3.5 % (81 of 2,304), on a point (the mean over layers and heads) never. Every preset does, random
// included (11 to 27 heads each), so the share is the bound's own distance from each head's
// output-error optimum, not one preset's strength. The limits catch a bound that got worse: with h2o in
// the bound's place 30 % of the heads and 28 % of the layers are beaten, with random 54 % and 59 %.
constexpr double kMaxHeadBeatenShare = 0.075;
constexpr double kMaxLayerBeatenShare = 0.05;

TEST(OracleBound, NoEvictionPresetBeatsTheBoundAtEqualKeptTokens) {
  const auto traces = shipped_traces();
  ASSERT_GE(traces.size(), 4u) << "the shipped traces/*.h5";
  const auto presets = eviction_presets();
  ASSERT_GE(presets.size(), 8u);
  const PolicySpec bound = PolicyRegistry().get("oracle-topk");
  std::size_t heads_compared = 0, heads_beaten = 0, layers_compared = 0, layers_beaten = 0, points_compared = 0,
              points_beaten = 0;
  std::map<std::string, int> heads_beaten_by;  // preset -> kv heads on which it beats the bound
  double worst_head = 0, worst_point = 0;
  std::string worst_head_at, worst_point_at;
  for (const auto& path : traces) {
    trace::TraceReader reader(path);
    TraceContext ctx = TraceContext::from_reader(reader);
    const int L = ctx.geometry.num_layers, T = ctx.T;
    // [preset][budget] summed layer errors of the preset and of the bound at the preset's kept tokens
    const std::vector<double> kBudgets = budgets_for(path);
    std::vector<std::vector<double>> pe(presets.size(), std::vector<double>(kBudgets.size(), 0.0)), be = pe;
    for (int l = 0; l < L; ++l) {
      LayerData layer(l, reader.read_layer(l), reader.read_decode_layer(l), ctx);
      std::vector<const PolicySpec*> specs{&bound};
      for (const auto& p : presets) specs.push_back(&p);
      layer.prepare_and_release(specs);
      std::map<int, LayerResult> bound_at;  // kept tokens per head -> the bound's layer result
      auto bound_run = [&](int k) -> const LayerResult& {
        auto it = bound_at.find(k);
        if (it != bound_at.end()) return it->second;
        std::vector<std::string> w;
        return bound_at.emplace(k, run_policy_on_layer(bound, static_cast<double>(k) / T, layer, ctx, w))
            .first->second;
      };
      for (std::size_t i = 0; i < presets.size(); ++i) {
        for (std::size_t b = 0; b < kBudgets.size(); ++b) {
          std::vector<std::string> w;
          const LayerResult r = run_policy_on_layer(presets[i], kBudgets[b], layer, ctx, w);
          double sum_p = 0, sum_b = 0;
          for (const auto& h : r.heads) {
            int kept = 0;
            for (auto c : h.kept) kept += static_cast<int>(c);
            const LayerResult& o = bound_run(kept);
            const HeadResult& oh = o.heads[static_cast<std::size_t>(h.kv_head)];
            int okept = 0;
            for (auto c : oh.kept) okept += static_cast<int>(c);
            ASSERT_EQ(okept, kept) << path << " layer " << l << ": the bound keeps as many tokens";
            const double margin =
                h.quality.output_error - oh.quality.output_error;  // < 0: the preset is better
            ++heads_compared;
            if (margin < 0) {
              ++heads_beaten;
              ++heads_beaten_by[presets[i].name];
            }
            if (-margin > worst_head) {
              worst_head = -margin;
              worst_head_at = fs::path(path).filename().string() + " " + presets[i].name + "@" +
                              std::to_string(kBudgets[b]).substr(0, 3) + " layer " + std::to_string(l) +
                              " head " + std::to_string(h.kv_head) + ": " +
                              std::to_string(h.quality.output_error) + " vs bound " +
                              std::to_string(oh.quality.output_error);
            }
            sum_p += h.quality.output_error;
            sum_b += oh.quality.output_error;
          }
          ++layers_compared;
          if (sum_p < sum_b) ++layers_beaten;
          pe[i][b] += sum_p / static_cast<double>(r.heads.size());
          be[i][b] += sum_b / static_cast<double>(r.heads.size());
        }
      }
    }
    for (std::size_t i = 0; i < presets.size(); ++i) {
      for (std::size_t b = 0; b < kBudgets.size(); ++b) {
        const double margin = (pe[i][b] - be[i][b]) / L;
        ++points_compared;
        if (margin < 0) ++points_beaten;
        if (-margin > worst_point) {
          worst_point = -margin;
          worst_point_at = fs::path(path).filename().string() + " " + presets[i].name + "@" +
                           std::to_string(kBudgets[b]).substr(0, 3) + ": " + std::to_string(pe[i][b] / L) +
                           " vs bound " + std::to_string(be[i][b] / L);
        }
        // A point (mean over layers) beaten by more than rounding would be a failure of the bound.
        EXPECT_LE(be[i][b] / L, pe[i][b] / L + 1e-9) << path << " " << presets[i].name << "@" << kBudgets[b];
      }
    }
  }
  std::printf("bound vs %zu eviction presets on %zu traces:\n", presets.size(), traces.size());
  std::printf("  kv heads: %zu of %zu beaten by a preset; worst by %.4f (%s)\n", heads_beaten, heads_compared,
              worst_head, worst_head_at.c_str());
  std::printf("   by preset:");
  for (const auto& [name, n] : heads_beaten_by) std::printf(" %s %d", name.c_str(), n);
  std::printf("\n  layers (mean over kv heads): %zu of %zu beaten\n", layers_beaten, layers_compared);
  std::printf("  points (mean over layers): %zu of %zu beaten; worst by %.4f (%s)\n", points_beaten,
              points_compared, worst_point, worst_point_at.c_str());
  // Top-k attention mass is not the output-error optimum of one head: a preset may beat it there.
  EXPECT_LE(static_cast<double>(heads_beaten), kMaxHeadBeatenShare * static_cast<double>(heads_compared));
  EXPECT_LE(static_cast<double>(layers_beaten), kMaxLayerBeatenShare * static_cast<double>(layers_compared));
  EXPECT_GT(heads_compared, 1000u);
}

// The allocation search starts from the scorer's own allocation and only accepts moves that lower the
// replayed error within its bytes: never worse than the scorer at the same budget, never more bytes.
TEST(AllocSearch, NeverWorseThanTheScorerOnEveryShippedTraceAndDefaultBudget) {
  PolicyRegistry reg;
  std::size_t compared = 0, improved = 0;
  for (const auto& path : shipped_traces()) {
    trace::TraceReader reader(path);
    SweepOptions o;
    o.alloc_search.enabled = true;
    o.alloc_search.scorer = reg.get("tova");
    // The scorer's own rows evaluated one by one, as the search replays them: batched budgets
    // (budget_batch.cpp) would differ from the replay by float rounding (docs/determinism.md).
    o.batch_budgets = false;
    std::vector<Budget> budgets;
    for (double b : kDefaultBudgets) budgets.push_back(parse_budget(std::to_string(b).substr(0, 3)));
    const SweepOutput out = run_sweep(reader, make_sweep_points({reg.get("tova")}, budgets), o);
    ASSERT_EQ(out.points.size(), 2 * budgets.size()) << path;
    for (std::size_t b = 0; b < budgets.size(); ++b) {
      const PointResult& uniform = out.points[b];
      const PointResult& search = out.points[budgets.size() + b];
      ASSERT_EQ(search.policy, "alloc-search:tova");
      ASSERT_EQ(search.kind, "search");
      ASSERT_EQ(search.budget, uniform.budget);
      EXPECT_LE(search.total.quality.output_error, uniform.total.quality.output_error)
          << path << " @" << uniform.budget;
      EXPECT_LE(search.total.bytes_kept.total(), uniform.total.bytes_kept.total())
          << path << " @" << uniform.budget;
      ++compared;
      improved += search.total.quality.output_error < uniform.total.quality.output_error ? 1 : 0;
      if (path.find("tiny-shapes-two") != std::string::npos && uniform.budget == "0.4") {
        // The allocation oracle before the search was 0.3535 here, above tova@0.4 (0.3487).
        EXPECT_NEAR(uniform.total.quality.output_error, 0.3487, 5e-5);
        EXPECT_LT(search.total.quality.output_error, 0.3487);
      }
    }
  }
  std::printf("alloc-search:tova below tova at %zu of %zu (trace, budget) pairs\n", improved, compared);
  EXPECT_GT(improved, compared / 2) << "the search finds better allocations on most points";
}

// The statistic, recomputed independently in double from the float32 copies: A(t) = sum over decode
// steps s and the G query heads of kv head h of softmax over tokens 0..T+s of q.k / sqrt(D), at t < T.
// And the bound keeps exactly the tokens with the largest A(t) of each kv head.
TEST(OracleBound, StatisticIsTheEvaluationQueriesAttentionMassAndTheBoundKeepsItsTopK) {
  trace::TraceReader reader(std::string(KVSCOPE_TEST_SOURCE_DIR) + "/traces/tiny-shapes-two.h5");
  TraceContext ctx = TraceContext::from_reader(reader);
  const auto& g = ctx.geometry;
  const int H = g.num_kv_heads, Hq = g.num_q_heads, G = g.group_size(), D = g.head_dim, T = ctx.T, S = ctx.S;
  const PolicySpec bound = PolicyRegistry().get("oracle-topk");
  for (int l = 0; l < g.num_layers; ++l) {
    LayerData layer(l, reader.read_layer(l), reader.read_decode_layer(l), ctx);
    layer.prepare(bound);
    const std::vector<float>& k = layer.k_all();                     // [H, T + S, D]
    const std::vector<float>& q = layer.q_steps();                   // [S, Hq, D]
    const std::vector<float>& mass = layer.decode_attention_mass();  // [H, T]
    ASSERT_EQ(mass.size(), static_cast<std::size_t>(H) * T);
    const std::size_t N = static_cast<std::size_t>(T) + S;
    for (int h = 0; h < H; ++h) {
      std::vector<double> want(static_cast<std::size_t>(T), 0.0);
      for (int s = 0; s < S; ++s) {
        for (int j = 0; j < G; ++j) {
          const float* qq = &q[(static_cast<std::size_t>(s) * Hq + static_cast<std::size_t>(h) * G + j) * D];
          std::vector<double> z(static_cast<std::size_t>(T + s + 1));
          double mx = -1e300, sum = 0;
          for (int t = 0; t <= T + s; ++t) {
            double dot = 0;
            for (int d = 0; d < D; ++d)
              dot += static_cast<double>(qq[d]) *
                     k[(static_cast<std::size_t>(h) * N + static_cast<std::size_t>(t)) * D + d];
            z[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, z[static_cast<std::size_t>(t)]);
          }
          for (double& x : z) sum += (x = std::exp(x - mx));
          for (int t = 0; t < T; ++t)
            want[static_cast<std::size_t>(t)] += z[static_cast<std::size_t>(t)] / sum;
        }
      }
      for (int t = 0; t < T; ++t)
        EXPECT_NEAR(mass[static_cast<std::size_t>(h) * T + t], want[static_cast<std::size_t>(t)], 1e-5)
            << "layer " << l << " head " << h << " token " << t;
    }
    std::vector<std::string> warnings;
    const LayerResult r = run_policy_on_layer(bound, 0.3, layer, ctx, warnings, /*record_tokens=*/true);
    EXPECT_TRUE(warnings.empty()) << "nothing is forced";
    ASSERT_EQ(r.token_maps.size(), static_cast<std::size_t>(H));
    for (int h = 0; h < H; ++h) {
      float min_kept = 1e30f, max_evicted = -1e30f;
      int kept = 0;
      for (int t = 0; t < T; ++t) {
        const float a = mass[static_cast<std::size_t>(h) * T + t];
        if (r.token_maps[static_cast<std::size_t>(h)].state[static_cast<std::size_t>(t)] == 1) {
          min_kept = std::min(min_kept, a);
          ++kept;
        } else {
          max_evicted = std::max(max_evicted, a);
        }
      }
      EXPECT_EQ(kept, static_cast<int>(std::lround(0.3 * T)));
      EXPECT_GE(min_kept, max_evicted) << "layer " << l << " head " << h << ": the top-k of the statistic";
    }
  }
}

TEST(AllocSearch, AcceptsOnlyMovesThatLowerTheErrorWithinTheStartBytes) {
  // Two layers, candidates 0 (small), 1 (the start), 2 (large). Layer 0 gains much from more bytes,
  // layer 1 loses little from fewer: the pair move (0 -> 2, 1 -> 0) fits the start's bytes.
  const std::vector<std::vector<std::int64_t>> bytes = {{10, 20, 30}, {10, 20, 30}};
  const std::vector<std::vector<double>> error = {{0.9, 0.5, 0.1}, {0.31, 0.3, 0.29}};
  EXPECT_EQ(detail::AllocSearch::search(bytes, error, 1), (std::vector<int>{2, 0}));
  // A layer-1 loss larger than the layer-0 gain: no move.
  const std::vector<std::vector<double>> flat = {{0.9, 0.5, 0.45}, {0.9, 0.3, 0.29}};
  EXPECT_EQ(detail::AllocSearch::search(bytes, flat, 1), (std::vector<int>{1, 1}));
  // A candidate with fewer bytes and lower error is taken alone; more bytes than the start never.
  const std::vector<std::vector<double>> cheap = {{0.4, 0.5, 0.6}, {0.3, 0.3, 0.31}};
  EXPECT_EQ(detail::AllocSearch::search(bytes, cheap, 1), (std::vector<int>{0, 1}));
}

}  // namespace
