// Decode-time mode (docs/policies.md "Decode-time mode") and the compute backends, on
// synthetic traces: caps honoured after every eviction, forced tokens kept, evictions only
// every `interval` steps, exactness without eviction, H2O beats random, bad syntax rejected.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "kvscope/kernels/device.hpp"
#include "kvscope/sim/backend.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/synth/synth.hpp"
#include "scratch.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

// T = 1 + 40 + 145 = 186 context tokens (144 vision), 12 decode steps, 4 layers, 2 kv heads, D = 32.
const std::string& trace_path() {
  static const std::string path = [] {
    const fs::path dir = kvscope::testing::scratch_dir();
    const std::string p = (dir / "decode.h5").string();
    synth::SynthOptions o;
    o.preset = "tiny";
    o.image_tokens = 144;
    o.text = 40;
    o.decode = 12;
    o.seed = 7;
    synth::write_synthetic_trace(o, p);
    return p;
  }();
  return path;
}

std::vector<PointResult> sweep(const std::vector<std::string>& specs, Backend* backend = nullptr,
                               PolicyRegistry reg = PolicyRegistry()) {
  std::vector<SweepPoint> pts;
  for (const auto& s : specs) {
    auto [name, budget] = split_policy_budget(s);
    if (budget.kind == Budget::Kind::kNone) budget.text = "-";
    pts.push_back({reg.get(name), budget});
  }
  trace::TraceReader r(trace_path());
  SweepOptions o;
  o.backend = backend;
  return run_sweep(r, pts, o).points;
}

constexpr int kT = 186, kS = 12, kH = 2, kD = 32;

TEST(Decode, CapOfTheWholeContextIsExact) {
  for (const char* spec : {"h2o~decode@1", "tova~decode@186tok", "snapkv+int8~decode:2@1"}) {
    const auto r = sweep({spec});
    SCOPED_TRACE(spec);
    EXPECT_EQ(r[0].mode, "decode");
    for (const auto& l : r[0].layers)
      for (const auto& st : l.steps) EXPECT_EQ(st.evicted, 0);
    if (std::string(spec).find("int8") != std::string::npos) continue;  // quantization error remains
    EXPECT_NEAR(r[0].total.quality.output_error, 0.0, 1e-6);
    EXPECT_NEAR(r[0].total.quality.attention_recall, 1.0, 1e-6);
    // Nothing evicted: the cache ends with every context and decode token.
    EXPECT_EQ(r[0].total.bytes_end, r[0].total.bytes_full_end);
    EXPECT_EQ(r[0].total.bytes_full_end, 4ll * kH * (kT + kS) * kD * 2 * 2);
  }
}

TEST(Decode, CacheNeverExceedsTheCapAfterAnEviction) {
  const int cap = static_cast<int>(std::lround(0.3 * kT));
  for (const char* spec : {"h2o~decode@0.3", "snapkv~decode@0.3", "random~decode@0.3", "knorm+int4~decode@0.3"}) {
    SCOPED_TRACE(spec);
    const auto r = sweep({spec});
    ASSERT_EQ(r[0].layers.size(), 4u);
    for (const auto& l : r[0].layers) {
      ASSERT_EQ(l.steps.size(), static_cast<std::size_t>(kS));
      for (int s = 0; s < kS; ++s) {
        const DecodeStep& st = l.steps[static_cast<std::size_t>(s)];
        EXPECT_TRUE(st.eviction);
        EXPECT_EQ(st.max_slots, cap);  // above every forced set here (snapkv's window is 32)
        EXPECT_LE(st.bytes_after, st.bytes_before);
      }
      // Step 0 evicts the appended context down to the cap: T + 1 - cap tokens per head.
      EXPECT_EQ(l.steps[0].evicted, kH * (kT + 1 - cap));
    }
    // The peak is the full context plus the first decode token (before step 0's eviction).
    if (std::string(spec).find('+') == std::string::npos) {
      EXPECT_EQ(r[0].total.bytes_peak, 4ll * kH * (kT + 1) * kD * 2 * 2);
      EXPECT_EQ(r[0].total.bytes_end, 4ll * kH * cap * kD * 2 * 2);
    }
  }
}

TEST(Decode, EvictionsHappenOnlyEveryIntervalSteps) {
  const int cap = static_cast<int>(std::lround(0.25 * kT));
  const auto r = sweep({"h2o~decode:5@0.25"});
  for (const auto& l : r[0].layers) {
    for (int s = 0; s < kS; ++s) {
      const DecodeStep& st = l.steps[static_cast<std::size_t>(s)];
      EXPECT_EQ(st.eviction, s % 5 == 0) << "step " << s;
      if (s % 5 == 0) {
        EXPECT_GT(st.evicted, 0) << "step " << s;
        EXPECT_EQ(st.max_slots, cap);
      } else {
        EXPECT_EQ(st.evicted, 0) << "step " << s;
        EXPECT_EQ(st.max_slots, cap + s % 5);  // grows by one token per step between evictions
      }
    }
  }
}

TEST(Decode, ForcedTokensSurviveEveryStep) {
  PolicyRegistry reg;
  const fs::path ini = kvscope::testing::scratch_dir() / "forced.ini";
  std::ofstream(ini) << "[policy rnd-forced]\nbase = random\nsinks = 4\nrecent = 6\nmode = decode\ncap = 40tok\n";
  reg.load_ini(ini.string());
  const PolicySpec p = reg.get("rnd-forced");
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  for (int layer = 0; layer < 4; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    std::vector<std::string> warnings;
    const LayerResult r = run_decode_policy_on_layer(p, 1.0, 40.0 / kT, L, ctx, warnings, true);
    ASSERT_EQ(r.token_maps.size(), static_cast<std::size_t>(kH));
    for (const TokenMap& tm : r.token_maps) {
      EXPECT_EQ(tm.slot_token.size(), 40u);
      for (int t = 0; t < 4; ++t) EXPECT_GE(tm.slot[static_cast<std::size_t>(t)], 0) << "sink " << t;
      // The six newest tokens (decode steps 6..11) are the recent window of the last step.
      for (int j = kS - 6; j < kS; ++j) {
        EXPECT_NE(std::find(tm.slot_token.begin(), tm.slot_token.end(), kT + j), tm.slot_token.end()) << j;
      }
    }
  }
  fs::remove(ini);
}

TEST(Decode, H2OBeatsRandomOnOutputError) {
  const auto r = sweep({"h2o~decode@0.3", "random~decode@0.3"});
  EXPECT_LT(r[0].total.quality.output_error, r[1].total.quality.output_error);
}

TEST(Decode, FixedCapWithPrefillBudgetStartsCompressed) {
  PolicyRegistry reg;
  const fs::path ini = kvscope::testing::scratch_dir() / "cap.ini";
  std::ofstream(ini) << "[policy h2o-cap]\nbase = h2o\nmode = decode\ncap = 0.5\ninterval = 2\n";
  reg.load_ini(ini.string());
  const auto r = sweep({"h2o-cap@0.3", "h2o-cap"}, nullptr, reg);
  const int start = static_cast<int>(std::lround(0.3 * kT));
  // Starting from 0.3 T tokens, the cache grows one token per step and never reaches the 0.5 T cap.
  EXPECT_EQ(r[0].total.bytes_peak, 4ll * kH * (start + kS) * kD * 2 * 2);
  EXPECT_EQ(r[0].total.bytes_end, r[0].total.bytes_peak);
  // Without a budget the cache starts full and is evicted to the cap at step 0.
  EXPECT_EQ(r[1].total.bytes_peak, 4ll * kH * (kT + 1) * kD * 2 * 2);
  EXPECT_LT(r[1].total.bytes_end, r[1].total.bytes_peak);
  fs::remove(ini);
}

TEST(Decode, UniCacheRunsInDecodeModeWithItsInvariants) {
  PolicyRegistry reg;
  const fs::path ini = kvscope::testing::scratch_dir() / "unicache-decode.ini";
  std::ofstream(ini) << "[policy uc-exact]\nbase = unicache\nquant = none\nmode = decode\n";
  reg.load_ini(ini.string());
  // A cap of the whole context never evicts: without the quantizer the cache is exact.
  const auto exact = sweep({"uc-exact@1"}, nullptr, reg);
  EXPECT_NEAR(exact[0].total.quality.output_error, 0.0, 1e-6);
  // ... plus the merging executor's int32 multiplicity per slot.
  EXPECT_EQ(exact[0].total.bytes_end, exact[0].total.bytes_full_end + 4ll * kH * (kT + kS) * 4);
  fs::remove(ini);
  // Without a budget the cap is UniCache's own schedule (mean keep 0.40), so it evicts.
  const auto r = sweep({"unicache~decode", "unicache~decode@0.3", "unicache-long-video~decode@0.3",
                        "unicache-doc-qa~decode@0.3", "unicache-realtime-chat~decode:3@0.3"});
  for (const auto& p : r) {
    SCOPED_TRACE(p.policy);
    EXPECT_EQ(p.mode, "decode");
    EXPECT_LT(p.total.bytes_end, p.total.bytes_full_end);
    int evicted = 0;
    for (const auto& l : p.layers)
      for (const auto& st : l.steps) {
        evicted += st.evicted;
        EXPECT_LE(st.bytes_after, st.bytes_before);
      }
    EXPECT_GT(evicted, 0);
    EXPECT_LT(p.total.quality.output_error, 1.0);
  }
  EXPECT_NEAR(r[0].budget_value, 0.40, 0.01);
  // Sinks and the recent window survive every step; the cap (per layer: the cosine schedule)
  // holds unless the forced set exceeds it.
  const PolicySpec p = reg.get("unicache~decode");
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  int merged_total = 0;
  for (int layer = 0; layer < 4; ++layer) {
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    std::vector<std::string> warnings;
    const LayerResult lr = run_decode_policy_on_layer(p, 1.0, 0.3, L, ctx, warnings, true);
    for (const TokenMap& tm : lr.token_maps) {
      for (int t = 0; t < 4; ++t) EXPECT_GE(tm.slot[static_cast<std::size_t>(t)], 0) << "sink " << t;
      for (int j = kS - 8; j < kS; ++j)
        EXPECT_NE(std::find(tm.slot_token.begin(), tm.slot_token.end(), kT + j), tm.slot_token.end()) << j;
    }
    int merged = 0;
    for (const HeadResult& hr : lr.heads) {
      for (int m = 0; m < 4; ++m) merged += static_cast<int>(hr.merged[m]);
      EXPECT_GT(hr.bytes_kept.multiplicity, 0);
    }
    merged_total += merged;
  }
  EXPECT_GT(merged_total, 0);  // redundant dropped tokens merged at the default threshold
}

TEST(Decode, PrefillModeKeepsDecodeTokensExactly) {
  const auto r = sweep({"h2o@0.5", "full"});
  const std::int64_t decode_bytes = 4ll * kH * kS * kD * 2 * 2;
  for (const auto& p : r) {
    EXPECT_EQ(p.mode, "prefill");
    EXPECT_EQ(p.total.bytes_end, p.total.bytes_kept.total() + decode_bytes);
    EXPECT_EQ(p.total.bytes_peak, p.total.bytes_end);
    for (const auto& l : p.layers)
      for (const auto& st : l.steps) EXPECT_FALSE(st.eviction);
  }
  EXPECT_NEAR(r[1].total.quality.output_error, 0.0, 1e-6);
}

TEST(Decode, BadSyntaxIsRejectedWithTheValidForm) {
  PolicyRegistry reg;
  for (const char* bad : {"h2o~decod", "h2o~decode:0", "h2o~decode:x", "h2o~decode:", "h2o~", "h2o~decode~decode"}) {
    try {
      reg.get(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const PolicyError& e) {
      EXPECT_NE(std::string(e.what()).find("NAME~decode:INTERVAL"), std::string::npos) << e.what();
    }
  }
  for (const char* unsupported : {"adaptive~decode", "vision-stride~decode", "int8~decode", "adaptive-h2o~decode"}) {
    try {
      reg.get(unsupported);
      ADD_FAILURE() << unsupported << " accepted";
    } catch (const PolicyError& e) {
      EXPECT_NE(std::string(e.what()).find("decode mode does not support"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(reg.get("h2o+int8~decode:4").interval, 4);
  EXPECT_TRUE(reg.get("h2o+int8~decode:4").key_quant.has_value());
  const fs::path ini = kvscope::testing::scratch_dir() / "bad.ini";
  for (const auto& [body, want] : std::vector<std::pair<std::string, std::string>>{
           {"[policy a]\nbase = h2o\nmode = decode\ninterval = 0\n", "interval: 0 is outside"},
           {"[policy a]\nbase = h2o\nmode = decode\ncap = lots\n", "cap: malformed budget"},
           {"[policy a]\nbase = h2o\ncap = 0.3\n", "without 'mode = decode'"},
           {"[policy a]\nbase = h2o\nmode = sometimes\n", "mode: 'sometimes' is not one of prefill, decode"}}) {
    std::ofstream(ini) << body;
    PolicyRegistry r2;
    try {
      r2.load_ini(ini.string());
      ADD_FAILURE() << body << " accepted";
    } catch (const PolicyError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  fs::remove(ini);
}

TEST(Backend, SelectionFollowsTheBuildAndTheDevice) {
  EXPECT_EQ(parse_backend("cpu"), BackendKind::kCpu);
  EXPECT_THROW(parse_backend("gpu"), BackendError);
  std::unique_ptr<Backend> owned;
  EXPECT_EQ(select_backend(BackendKind::kCpu, owned).kind(), BackendKind::kCpu);
  const bool gpu = cuda_backend_built() && kernels::cuda_device_count() > 0;
  EXPECT_EQ(select_backend(BackendKind::kAuto, owned).kind(), BackendKind::kCpu);  // also with a GPU
  if (!gpu) {
    EXPECT_THROW(select_backend(BackendKind::kCuda, owned), BackendError);
  }
}

// The CUDA backend runs the cuda:: kernels; results must match the CPU backend within
// float reduction tolerance (atomics change summation order). Skips without a GPU.
TEST(Backend, CudaMatchesCpu) {
  if (!cuda_backend_built() || kernels::cuda_device_count() == 0) {
    GTEST_SKIP() << "no CUDA device (" << kernels::cuda_device_description() << "): CUDA backend not compared";
  }
  std::unique_ptr<Backend> cuda;
  Backend& gpu = select_backend(BackendKind::kCuda, cuda);
  const std::vector<std::string> specs = {"full", "h2o@0.3", "snapkv+int8@0.5", "tova~decode@0.3",
                                          "h2o+kivi2~decode:3@0.4", "int4"};
  const auto a = sweep(specs, &cpu_backend());
  const auto b = sweep(specs, &gpu);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].policy + "@" + a[i].budget);
    EXPECT_EQ(a[i].total.bytes_kept.total(), b[i].total.bytes_kept.total());
    EXPECT_NEAR(a[i].total.quality.output_error, b[i].total.quality.output_error, 2e-3);
    EXPECT_NEAR(a[i].total.quality.attention_recall, b[i].total.quality.attention_recall, 2e-3);
    EXPECT_NEAR(a[i].total.quality.kl, b[i].total.quality.kl, 2e-3);
  }
}

}  // namespace

// The batched prefill-mode evaluation (all decode steps of a kv head in two GEMMs) against one
// evaluate_attention kernel call per step: same per-row math, only the GEMMs' float rounding
// differs. Covers eviction, merging (multiplicities), quantization, head merging and GQA (G = 2).
TEST(Decode, BatchedPrefillEvaluationMatchesPerStepKernel) {
  PolicyRegistry reg;
  trace::TraceReader reader(trace_path());
  for (const char* spec : {"h2o@0.3", "look-m@0.4", "int4", "unicache@0.5", "full", "snapkv+int4@0.2"}) {
    SCOPED_TRACE(spec);
    auto [name, budget] = split_policy_budget(spec);
    const PolicySpec p = reg.get(name);
    const double keep = budget.kind == Budget::Kind::kNone ? 1.0 : budget.value;
    TraceContext batched = TraceContext::from_reader(reader);
    TraceContext stepwise = TraceContext::from_reader(reader);
    stepwise.batched_evaluation = false;
    for (int layer = 0; layer < 4; ++layer) {
      std::vector<std::string> warnings;
      LayerData La(layer, reader.read_layer(layer), reader.read_decode_layer(layer), batched);
      LayerData Lb(layer, reader.read_layer(layer), reader.read_decode_layer(layer), stepwise);
      const LayerResult a = run_policy_on_layer(p, keep, La, batched, warnings);
      const LayerResult b = run_policy_on_layer(p, keep, Lb, stepwise, warnings);
      ASSERT_EQ(a.heads.size(), b.heads.size());
      for (std::size_t h = 0; h < a.heads.size(); ++h) {
        const Quality& x = a.heads[h].quality;
        const Quality& y = b.heads[h].quality;
        EXPECT_EQ(a.heads[h].bytes_kept.total(), b.heads[h].bytes_kept.total());
        EXPECT_NEAR(x.output_error, y.output_error, 1e-5 * std::max(1.0, y.output_error));
        EXPECT_DOUBLE_EQ(x.attention_recall, y.attention_recall);  // full side only: bit-identical
        EXPECT_NEAR(x.kl, y.kl, 1e-6);
        EXPECT_NEAR(x.entropy_delta, y.entropy_delta, 1e-5);
        for (int m = 0; m < kModalities; ++m) {
          EXPECT_DOUBLE_EQ(x.recall_modality[m], y.recall_modality[m]);
          EXPECT_DOUBLE_EQ(x.share_before[m], y.share_before[m]);
          EXPECT_NEAR(x.share_after[m], y.share_after[m], 1e-6);
        }
      }
      if (std::string(spec) != "full") continue;
      for (const auto& h : a.heads) EXPECT_NEAR(h.quality.output_error, 0.0, 1e-6);  // nothing dropped
    }
  }
}

TEST(Decode, StatisticsAfterReleasingThePrefillTensorsAreRefused) {
  trace::TraceReader reader(trace_path());
  TraceContext ctx = TraceContext::from_reader(reader);
  LayerData L(0, reader.read_layer(0), reader.read_decode_layer(0), ctx);
  PolicyRegistry reg;
  L.prepare(reg.get("h2o"));
  L.release_prefill();
  std::vector<std::string> warnings;
  // h2o's statistics were prepared: it still runs; snapkv's were not: a clear logic error.
  EXPECT_NO_THROW(run_policy_on_layer(reg.get("h2o"), 0.5, L, ctx, warnings));
  EXPECT_THROW(run_policy_on_layer(reg.get("snapkv"), 0.5, L, ctx, warnings), std::logic_error);
}
