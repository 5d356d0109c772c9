// Edge traces in kvsim (docs/robustness.md, "Edge traces and numerical range in kvsim"): tiny and
// single-modality traces through every policy and the oracle, traces without context tokens or
// decode steps, and values at the edge of the range the float32 kernels compute in.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/trace/writer.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

const fs::path& temp_dir() {
  static const fs::path d = fs::temp_directory_path() / ("kvscope_edge_test_" + std::to_string(::getpid()));
  return d;
}

class TempDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(temp_dir(), ec);
  }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

// bfloat16 bits of a float (round to nearest even; finite inputs whose rounding stays finite).
std::uint16_t to_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// Writes a trace with the given context modalities (codes 0..3), S decode steps, 2 layers, 4 query /
// 2 kv heads, head_dim 16, in bfloat16, every q/k/v element a standard normal times `scale`
// (clamped to the largest finite bfloat16).
std::string write_trace(const std::string& name, const std::vector<std::uint8_t>& modality, int S,
                        double scale = 1.0) {
  fs::create_directories(temp_dir());
  const std::string path = (temp_dir() / (name + ".h5")).string();
  trace::TraceHeader h;
  h.geometry = {2, 4, 2, 16, 10000.0, "edge"};
  h.dtype = trace::DType::kBF16;
  h.synthetic = true;
  h.creator = "test_edge_traces";
  h.device = "synthetic";
  const std::size_t T = modality.size(), D = 16;
  trace::TraceWriter w(path, h, T, static_cast<std::size_t>(S));
  trace::Tokens tok;
  tok.modality = modality;
  int col = 0;
  for (std::size_t t = 0; t < T; ++t) {
    tok.position.push_back(static_cast<std::int32_t>(t));
    tok.token_id.push_back(modality[t] == 1 ? -1 : 500);
    tok.segment.push_back(0);
    tok.grid_row.push_back(modality[t] == 1 ? 0 : -1);
    tok.grid_col.push_back(modality[t] == 1 ? col++ : -1);
  }
  w.write_tokens(tok);
  std::vector<std::int32_t> ids, pos;
  for (int s = 0; s < S; ++s) {
    ids.push_back(11 + s);
    pos.push_back(static_cast<std::int32_t>(T) + s);
  }
  w.write_decode_tokens(ids, pos);
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  const double big = 3.3895313892515355e38;  // largest finite bfloat16
  auto tensor = [&](std::size_t heads, std::size_t n) {
    std::vector<std::uint16_t> x(heads * n * D);
    for (auto& e : x) e = to_bf16(static_cast<float>(std::clamp(normal(rng) * scale, -big, big)));
    return x;
  };
  for (int l = 0; l < 2; ++l) {
    const auto q = tensor(4, T), k = tensor(2, T), v = tensor(2, T);
    w.write_layer(l, {q.data(), trace::DType::kBF16, {4, T, D}}, {k.data(), trace::DType::kBF16, {2, T, D}},
                  {v.data(), trace::DType::kBF16, {2, T, D}});
    const std::size_t s = static_cast<std::size_t>(S);
    const auto dq = tensor(4, s), dk = tensor(2, s), dv = tensor(2, s);
    w.write_decode_layer(l, {dq.data(), trace::DType::kBF16, {4, s, D}}, {dk.data(), trace::DType::kBF16, {2, s, D}},
                         {dv.data(), trace::DType::kBF16, {2, s, D}});
  }
  w.close();
  return path;
}

// Every preset, compositions with each quantizer, adaptive and decode-time variants, at low, middle
// and high budgets (budget-free policies run once).
std::vector<SweepPoint> all_points() {
  PolicyRegistry reg;
  std::vector<PolicySpec> pols;
  for (const auto& [name, p] : reg.presets()) pols.push_back(p);
  for (const char* n : {"h2o+int8", "snapkv+int4", "tova+kivi2", "streamingllm+int8-head", "adaptive-h2o",
                        "h2o~decode", "tova~decode:2", "knorm~decode", "random~decode", "pyramidkv~decode"}) {
    pols.push_back(reg.get(n));
  }
  return make_sweep_points(pols, parse_budget_list("0.05,0.1,0.5,0.9,1,1tok"));
}

void expect_sane(const SweepOutput& out, const std::string& what) {
  ASSERT_FALSE(out.points.empty()) << what;
  for (const auto& pt : out.points) {
    const std::string where = what + " " + pt.policy + "@" + pt.budget;
    EXPECT_TRUE(std::isfinite(pt.total.quality.output_error)) << where;
    EXPECT_GE(pt.total.quality.attention_recall, 0.0) << where;
    EXPECT_LE(pt.total.quality.attention_recall, 1.0 + 1e-6) << where;
    if (pt.mode != "prefill") continue;  // a decode-time cache may end holding only decode tokens
    for (const auto& l : pt.layers) {
      for (const auto& h : l.heads) {
        std::int64_t kept = 0;
        for (auto c : h.kept) kept += c;
        EXPECT_GE(kept, 1) << where << " layer " << l.layer << ": a cache keeps at least one context token";
      }
    }
  }
}

// Every policy, the oracle-topk bound and the allocation search of tova.
SweepOutput sweep_with_oracle(const std::string& path) {
  trace::TraceReader r(path);
  SweepOptions o;
  o.bound.enabled = true;
  o.alloc_search.enabled = true;
  o.alloc_search.scorer = PolicyRegistry().get("tova");
  return run_sweep(r, all_points(), o);
}

// min(bound rows, search rows): both report the sweep's budgets.
std::size_t oracle_points(const SweepOutput& out) {
  std::size_t bound = 0, search = 0;
  for (const auto& pt : out.points) {
    bound += pt.kind == "bound" && pt.policy == "oracle-topk" ? 1 : 0;
    search += pt.kind == "search" && pt.policy == "alloc-search:tova" ? 1 : 0;
  }
  return std::min(bound, search);
}

TEST(EdgeTraces, TinySingleModalityTracesSweepEveryPolicyAndTheOracle) {
  for (std::uint8_t m : {0, 1, 2, 3}) {
    for (int T = 1; T <= 8; ++T) {
      const std::string name = "single_m" + std::to_string(m) + "_t" + std::to_string(T);
      const std::string path = write_trace(name, std::vector<std::uint8_t>(static_cast<std::size_t>(T), m), 2);
      try {
        const SweepOutput out = sweep_with_oracle(path);
        expect_sane(out, name);
        EXPECT_GE(oracle_points(out), 1u) << name << ": the oracle reports its budgets";
      } catch (const std::exception& e) {
        ADD_FAILURE() << name << ": " << e.what();
      }
    }
  }
}

TEST(EdgeTraces, TinyMixedTracesSweepEveryPolicyAndTheOracle) {
  const std::vector<std::vector<std::uint8_t>> layouts = {
      {3, 0}, {3, 1}, {0, 1, 2}, {3, 1, 1, 0}, {1, 1, 1, 1, 0}, {3, 0, 0, 0, 0, 2}, {3, 1, 1, 1, 1, 3, 0},
      {3, 0, 1, 1, 1, 1, 2, 0}};
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    const std::string name = "mixed_" + std::to_string(i);
    try {
      const SweepOutput out = sweep_with_oracle(write_trace(name, layouts[i], 3));
      expect_sane(out, name);
      EXPECT_GE(oracle_points(out), 1u) << name;
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": " << e.what();
    }
  }
}

TEST(EdgeTraces, OracleAtFivePercentOfFourTextTokensKeepsOneToken) {
  // An explicit (per-modality) keep fraction of 5% of a 4-token modality rounds to 0 tokens; the cache
  // keeps one. The allocation search replays such allocations; so do its rows at that budget.
  const std::string path = write_trace("text4", {0, 0, 0, 0}, 2);
  trace::TraceReader r(path);
  PolicyRegistry reg;
  {
    TraceContext ctx = TraceContext::from_reader(r);
    PolicySpec p = reg.get("tova");
    p.stages.allocator = "explicit";
    p.layer_modality_keep.assign(static_cast<std::size_t>(ctx.geometry.num_layers), {0.05, 1.0, 1.0, 1.0});
    LayerData layer(0, r.read_layer(0), r.read_decode_layer(0), ctx);
    layer.prepare(p);
    std::vector<std::string> warnings;
    const LayerResult lr = run_policy_on_layer(p, 0.05, layer, ctx, warnings);
    for (const auto& h : lr.heads) EXPECT_EQ(h.kept[0], 1) << "explicit 5%, head " << h.kv_head;
  }
  SweepOptions o;
  o.bound.enabled = true;
  o.alloc_search.enabled = true;
  o.alloc_search.scorer = reg.get("tova");
  o.alloc_search.levels = {0.05};
  o.alloc_search.modality_levels = {1.0, 0.05};
  const SweepOutput out = run_sweep(r, make_sweep_points({reg.get("tova")}, parse_budget_list("0.05")), o);
  ASSERT_EQ(out.points.size(), 3u);
  EXPECT_EQ(out.points[1].policy, "oracle-topk");
  EXPECT_EQ(out.points[2].policy, "alloc-search:tova");
  for (std::size_t i = 1; i < 3; ++i)
    for (const auto& l : out.points[i].layers)
      for (const auto& h : l.heads)
        EXPECT_EQ(h.kept[0], 1) << out.points[i].policy << " layer " << l.layer << " head " << h.kv_head;
}

TEST(EdgeTraces, ZeroDecodeStepsIsRejectedInOneLine) {
  const std::string path = write_trace("nodecode", {3, 0, 1, 1}, 0);
  trace::TraceReader r(path);
  try {
    require_replayable(r, "kvsim run");
    FAIL() << "S = 0 accepted";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(path + ": ", 0), 0u) << m;
    EXPECT_NE(m.find("S = 0 decode steps; kvsim run needs at least one"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  EXPECT_THROW(run_sweep(r, all_points(), SweepOptions{}), std::runtime_error);
}

TEST(EdgeTraces, ValuesNearTheLimitGiveFiniteMetricsForEveryPolicy) {
  // 10 tokens + 3 steps, head_dim 16: the limit is sqrt(2^124 / 208) = 3.2e17; values up to ~4e15.
  EXPECT_NEAR(kernels_value_limit(13, 16), std::sqrt(std::ldexp(1.0, 124) / 208.0), 1e3);
  const std::string path = write_trace("large", {3, 0, 0, 1, 1, 1, 1, 2, 2, 0}, 3, 1e15);
  try {
    expect_sane(sweep_with_oracle(path), "values ~1e15");
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
}

TEST(EdgeTraces, ValuesBeyondTheLimitFailInOneLineNamingTheTensor) {
  for (double scale : {1e18, 1e38, 3.4e38}) {
    const std::string path = write_trace("huge", {3, 0, 0, 1, 1, 1, 1, 2, 2, 0}, 3, scale);
    trace::TraceReader r(path);
    PolicyRegistry reg;
    try {
      run_sweep(r, make_sweep_points({reg.get("full"), reg.get("h2o")}, parse_budget_list("0.5")), SweepOptions{});
      ADD_FAILURE() << "values of " << scale << " gave results";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(path + ": /", 0), 0u) << m;
      EXPECT_NE(m.find("layers/000/"), std::string::npos) << "layer 0 is checked first: " << m;
      EXPECT_NE(m.find("outside the range kvsim computes metrics in"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  }
}

TEST(EdgeTraces, NonFiniteMetricIsNeverReturned) {
  SweepOutput out;
  PointResult pt;
  pt.policy = "h2o";
  pt.budget = "0.5";
  LayerResult l;
  l.layer = 3;
  HeadResult h;
  h.kv_head = 1;
  l.heads = {HeadResult{}, h};
  pt.layers.push_back(l);
  out.points.push_back(pt);
  EXPECT_NO_THROW(check_finite(out, "t.h5"));
  for (int which = 0; which < 4; ++which) {
    SweepOutput bad = out;
    Quality& q = bad.points[0].layers[0].heads[1].quality;
    const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
    if (which == 0) q.output_error = nan;
    if (which == 1) q.kl = inf;
    if (which == 2) q.share_after[1] = nan;
    if (which == 3) q.entropy_delta = -inf;
    try {
      check_finite(bad, "t.h5");
      ADD_FAILURE() << "metric " << which << " not caught";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("t.h5: h2o@0.5: layer 3, kv head 1: the ", 0), 0u) << e.what();
    }
  }
  SweepOutput bad = out;
  bad.points[0].layers[0].token_maps.resize(1);
  bad.points[0].layers[0].token_maps[0].score = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_THROW(check_finite(bad, "t.h5"), std::runtime_error);
  bad = out;
  bad.points[0].total.quality.attention_recall = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(check_finite(bad, "t.h5"), std::runtime_error);
}

}  // namespace
