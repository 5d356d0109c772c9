// Policies replayed on synthetic traces: budgets, forced tokens, exact bytes,
// and the behaviour the synthetic structure is designed to reveal.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "kvscope/kernels/quantize.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/synth/synth.hpp"
#include "kvscope/trace/writer.hpp"
#include "scratch.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

constexpr int kText = 0, kVision = 1, kSpecial = 3;

std::string make_trace(const std::string& name, int image_tokens, int text, int decode, std::uint64_t seed = 5) {
  const fs::path dir = kvscope::testing::scratch_dir();
  const std::string path = (dir / (name + ".h5")).string();
  if (!fs::exists(path)) {
    synth::SynthOptions o;
    o.preset = "tiny";
    o.image_tokens = image_tokens;
    o.text = text;
    o.decode = decode;
    o.seed = seed;
    synth::write_synthetic_trace(o, path);
  }
  return path;
}

// T = 1 + 40 + 145 = 186 tokens, 144 vision (12x12), 8 decode queries.
const std::string& standard_trace() {
  static const std::string p = make_trace("standard", 144, 40, 8);
  return p;
}

std::vector<PointResult> sweep(const std::string& trace, const std::vector<std::string>& points) {
  PolicyRegistry reg;
  std::vector<SweepPoint> pts;
  for (const auto& s : points) {
    auto [name, budget] = split_policy_budget(s);
    if (budget.kind == Budget::Kind::kNone) budget.text = "-";
    pts.push_back({reg.get(name), budget});
  }
  trace::TraceReader r(trace);
  return run_sweep(r, pts, SweepOptions{}).points;
}

bool has_flag(const PointResult& p, const std::string& mode) {
  for (const auto& f : p.flags)
    if (f.mode == mode) return true;
  return false;
}

TEST(Policies, FullIsExactAndCostsEverything) {
  const auto r = sweep(standard_trace(), {"full"});
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NEAR(r[0].total.quality.output_error, 0.0, 1e-6);
  EXPECT_NEAR(r[0].total.quality.attention_recall, 1.0, 1e-6);
  EXPECT_EQ(r[0].total.bytes_kept.total(), r[0].total.bytes_full.total());
  // 4 layers x 2 kv heads x 186 tokens x 32 dims x 2 (K, V) x 2 bytes
  EXPECT_EQ(r[0].total.bytes_full.total(), 4ll * 2 * 186 * 32 * 2 * 2);
  EXPECT_TRUE(r[0].flags.empty());
}

TEST(Policies, EvictionBudgetsAreHonouredExactly) {
  for (const char* name : {"h2o", "snapkv", "tova", "knorm", "random", "window", "streamingllm"}) {
    const auto r = sweep(standard_trace(), {std::string(name) + "@0.5"});
    const int k = static_cast<int>(std::lround(0.5 * 186));
    for (const auto& l : r[0].layers) {
      for (const auto& h : l.heads) {
        std::int64_t kept = 0, merged = 0, evicted = 0;
        for (int m = 0; m < 4; ++m) {
          kept += h.kept[m];
          merged += h.merged[m];
          evicted += h.evicted[m];
        }
        EXPECT_EQ(kept, k) << name << " layer " << l.layer << " head " << h.kv_head;
        EXPECT_EQ(merged, 0) << name;
        EXPECT_EQ(evicted, 186 - k) << name;
        EXPECT_EQ(h.bytes_kept.total(), 2ll * k * 32 * 2) << name << ": fp16 K+V of the kept tokens";
      }
    }
  }
}

TEST(Policies, TokenAndByteBudgetsConvert) {
  const auto r = sweep(standard_trace(), {"h2o@50tok", "h2o@47616B"});
  for (const auto& h : r[0].layers[0].heads) EXPECT_EQ(h.kept[0] + h.kept[1] + h.kept[2] + h.kept[3], 50);
  // 47616 bytes over 4 layers x 2 heads = 5952 B per head = 46.5 tokens of fp16 K+V -> 47 (0.25 of 186 = 46.5)
  EXPECT_NEAR(r[1].bytes_ratio(), 0.25, 0.01);
}

TEST(Policies, ForcedSinksAreKept) {
  // At 0.1 the 19 most recent tokens are all question text: only sinks can keep <s>.
  const auto r = sweep(standard_trace(), {"streamingllm@0.1", "window@0.1"});
  for (const auto& l : r[0].layers)
    for (const auto& h : l.heads) EXPECT_GE(h.kept[kSpecial], 1) << "streamingllm keeps the <s> sink";
  for (const auto& l : r[1].layers)
    for (const auto& h : l.heads) EXPECT_EQ(h.kept[kSpecial], 0) << "a pure window drops <s>";
}

TEST(Policies, QuantizedBytesMatchAnIndependentCount) {
  const auto r = sweep(standard_trace(), {"h2o+int8@0.5", "int4"});
  const int k = 93;
  for (const auto& h : r[0].layers[1].heads) {
    // int8 per token symmetric: one code byte per element, one float scale per (token) row; K and V.
    EXPECT_EQ(h.bytes_kept.kv, 2ll * k * 32);
    EXPECT_EQ(h.bytes_kept.scales, 2ll * k * 4);
    EXPECT_EQ(h.bytes_kept.zeros, 0);
  }
  const auto q = kernels::quantized_bytes(kernels::QuantSpec{4, false, kernels::Granularity::kPerToken, 32, 0}, 1, 186, 32,
                                          kernels::DType::kF16);
  for (const auto& h : r[1].layers[2].heads) {
    EXPECT_EQ(h.bytes_kept.total(), 2 * q.total);
    EXPECT_EQ(h.bytes_kept.kv, 2ll * 186 * 16) << "int4 packs two codes per byte";
  }
  EXPECT_LT(r[1].total.quality.output_error, 0.2);
  EXPECT_GT(r[1].total.quality.output_error, 0.0);
}

TEST(Policies, AttentionScorersBeatRandomAtEqualBudget) {
  const auto r = sweep(standard_trace(), {"random@0.3", "h2o@0.3", "snapkv@0.3", "tova@0.3"});
  const double rnd = r[0].total.quality.output_error;
  EXPECT_LT(r[1].total.quality.output_error, rnd) << "h2o vs random";
  EXPECT_LT(r[2].total.quality.output_error, rnd) << "snapkv vs random";
  EXPECT_LT(r[3].total.quality.output_error, rnd) << "tova vs random";
}

// Fraction of a modality's tokens that keep their own slot (merged tokens are not counted).
double kept_fraction(const PointResult& p, int m) {
  return static_cast<double>(p.total.kept[m]) / static_cast<double>(p.total.tokens[m]);
}

TEST(Policies, HybridAndUniCacheKeepTextDenserThanVision) {
  const auto r = sweep(standard_trace(), {"hybridkv@0.4", "unicache@0.4"});
  for (const auto& p : r) {
    EXPECT_GT(kept_fraction(p, kText), kept_fraction(p, kVision) + 0.1)
        << p.policy << ": text " << kept_fraction(p, kText) << " vision " << kept_fraction(p, kVision);
  }
}

TEST(Policies, AggressiveVisionEvictionIsFlaggedAsVisualBlindness) {
  const auto r = sweep(standard_trace(), {"vision-stride@0.25", "full"});
  EXPECT_TRUE(has_flag(r[0], "visual_blindness"));
  EXPECT_LT(r[0].total.quality.recall_modality[kVision], 0.5);
  EXPECT_FALSE(has_flag(r[1], "visual_blindness"));
}

TEST(Policies, MergingPreservesMultiplicityAndCountsItsBytes) {
  const auto r = sweep(standard_trace(), {"look-m@0.4"});
  std::int64_t merged = 0;
  for (const auto& l : r[0].layers) {
    for (const auto& h : l.heads) {
      std::int64_t total = 0;
      for (int m = 0; m < 4; ++m) total += h.kept[m] + h.merged[m] + h.evicted[m];
      EXPECT_EQ(total, 186);
      merged += h.merged[kVision];
      std::int64_t slots = 0;
      for (int m = 0; m < 4; ++m) slots += h.kept[m];
      EXPECT_EQ(h.bytes_kept.multiplicity, 4 * slots) << "one int32 multiplicity per slot";
    }
  }
  EXPECT_GT(merged, 0) << "LOOK-M merges evicted vision tokens on smooth patch grids";
}

TEST(Policies, UniCacheLayerScheduleIsASmoothCosine) {
  UniCacheConfig u;
  const int L = 32;
  EXPECT_NEAR(unicache_rate(u, 0, L), 0.75, 1e-6);  // rates are stored as float
  EXPECT_NEAR(unicache_rate(u, L - 1, L), 0.45, 1e-6);
  double prev = 1;
  for (int l = 0; l < L; ++l) {
    const double r = unicache_rate(u, l, L);
    EXPECT_LT(r, prev) << "strictly decreasing: a curve, not a step";
    EXPECT_NEAR(r + unicache_rate(u, L - 1 - l, L), 1.2, 1e-6) << "cosine symmetry around the middle";
    prev = r;
  }
  // Slope is flat at both ends and steepest in the middle (cosine, not linear).
  const double first = unicache_rate(u, 0, L) - unicache_rate(u, 1, L);
  const double middle = unicache_rate(u, 15, L) - unicache_rate(u, 16, L);
  EXPECT_GT(middle, 5 * first);
}

TEST(Policies, AdaptiveIsGentlerOnMoreComplexInputs) {
  EXPECT_NEAR(adaptive_rate(0.0), 0.75, 1e-12);
  EXPECT_NEAR(adaptive_rate(100.0), 0.40, 1e-12);
  EXPECT_GT(adaptive_rate(8.0), adaptive_rate(12.0));
  const auto simple = sweep(make_trace("simple", 16, 8, 3), {"adaptive"});
  const auto complex = sweep(make_trace("complex", 400, 120, 3), {"adaptive"});
  EXPECT_GT(complex[0].budget_value, simple[0].budget_value + 0.05)
      << "keep fraction: simple " << simple[0].budget_value << ", complex " << complex[0].budget_value;
}

TEST(Policies, BadInputIsRejectedWithClearMessages) {
  PolicyRegistry reg;
  try {
    reg.get("h2oo");
    FAIL();
  } catch (const PolicyError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown policy 'h2oo'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("snapkv"), std::string::npos) << "lists the valid names";
  }
  EXPECT_THROW(reg.get("h2o+int3"), PolicyError);
  EXPECT_THROW(parse_budget("1.5"), PolicyError);
  EXPECT_THROW(parse_budget("0"), PolicyError);
  EXPECT_THROW(parse_budget("12parsecs"), PolicyError);
  EXPECT_THROW(parse_budget("abc"), PolicyError);
  EXPECT_THROW(parse_budget_list("0.9:0.1:0.1"), PolicyError);
  EXPECT_EQ(parse_budget_list("0.1:0.5:0.1,64MiB").size(), 6u);
  EXPECT_EQ(parse_budget("64MiB").value, 64.0 * 1024 * 1024);
  EXPECT_EQ(parse_budget("512tok").kind, Budget::Kind::kTokens);
}

TEST(Policies, IniPoliciesBuildFromStagesAndRejectMistakes) {
  const fs::path dir = kvscope::testing::scratch_dir("ini");
  const std::string good = (dir / "good.ini").string();
  std::ofstream(good) << "# my policies\n[policy my-h2o]\nbase = h2o\nsinks = 4\nrecent_fraction = 0.25\nquant = int8\n";
  PolicyRegistry reg;
  reg.load_ini(good);
  const PolicySpec p = reg.get("my-h2o");
  EXPECT_EQ(p.sinks, 4);
  EXPECT_FLOAT_EQ(p.recent_fraction, 0.25f);
  ASSERT_TRUE(p.key_quant.has_value());
  EXPECT_EQ(p.key_quant->bits, 8);
  const auto r = sweep(standard_trace(), {"h2o@0.5"});
  (void)r;
  auto expect_error = [&](const std::string& text, const std::string& fragment) {
    const std::string path = (dir / "bad.ini").string();
    std::ofstream(path) << text;
    PolicyRegistry reg2;
    try {
      reg2.load_ini(path);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const PolicyError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error("[policy a]\nsinks = 4\n", "needs 'base = PRESET'");
  expect_error("[policy a]\nbase = h2o\nsinkz = 4\n", "bad.ini:3: unknown parameter 'sinkz'");
  expect_error("[policy a]\nbase = h2o\nsinks = many\n", "'many' is not a number");
  expect_error("[policy a]\nbase = nope\n", "unknown policy 'nope'");
  expect_error("sinks = 4\n", "before any [policy NAME] section");
  expect_error("[strategy a]\n", "section must be [policy NAME]");
  expect_error("[policy a]\nbase = h2o\nsinks = 2.7\n", "'2.7' is not a whole number");
  expect_error("[policy h2o]\nbase = snapkv\n", "redefines an existing policy");
  expect_error("[policy adaptive-x]\nbase = h2o\n", "must not start with 'adaptive-'");
  expect_error("[policy a]\nbase = h2o\n[policy a]\nbase = tova\n", "defined twice");
}

TEST(Policies, TraceWithoutDecodeQueriesIsRejected) {
  const fs::path dir = kvscope::testing::scratch_dir("nodecode");
  const std::string path = (dir / "nodecode.h5").string();
  synth::SynthOptions o;
  o.dtype = trace::DType::kF32;
  synth::SynthGenerator gen(o);
  const auto& g = gen.header().geometry;
  {
    trace::TraceWriter w(path, gen.header(), gen.num_tokens(), 0);
    w.write_tokens(gen.tokens());
    w.write_decode_tokens({}, {});
    const std::size_t T = gen.num_tokens(), D = static_cast<std::size_t>(g.head_dim);
    const std::size_t Hq = static_cast<std::size_t>(g.num_q_heads), Hkv = static_cast<std::size_t>(g.num_kv_heads);
    for (int l = 0; l < g.num_layers; ++l) {
      const auto L = gen.prefill_layer(l);
      w.write_layer(l, {L.q.data(), trace::DType::kF32, {Hq, T, D}}, {L.k.data(), trace::DType::kF32, {Hkv, T, D}},
                    {L.v.data(), trace::DType::kF32, {Hkv, T, D}});
      w.write_decode_layer(l, {nullptr, trace::DType::kF32, {Hq, 0, D}}, {nullptr, trace::DType::kF32, {Hkv, 0, D}},
                           {nullptr, trace::DType::kF32, {Hkv, 0, D}});
    }
    w.close();
  }
  try {
    sweep(path, {"h2o@0.5"});
    FAIL() << "a trace without decode queries was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("S = 0 decode steps"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--decode"), std::string::npos) << "says how to capture them: " << e.what();
  }
}

}  // namespace
