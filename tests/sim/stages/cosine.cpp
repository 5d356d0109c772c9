// The cosine head merge (sim/src/stages/head_merge/cosine.cpp) is prefill-only: a decode-mode
// policy with it is accepted and runs its kv heads unmerged, with a warning, exactly as the same
// policy with head_merge = none.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/stages.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/synth/synth.hpp"
#include "scratch.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

TEST(CosineHeadMerge, DecodeModeRunsTheKvHeadsUnmergedWithAWarning) {
  const std::string trace = (kvscope::testing::scratch_dir() / "cosine_decode.h5").string();
  synth::SynthOptions o;
  o.preset = "tiny";
  o.image_tokens = 36;
  o.text = 20;
  o.decode = 4;
  o.seed = 6;
  synth::write_synthetic_trace(o, trace);
  EXPECT_FALSE(find_stage_info(StageKind::kHeadMerge, "cosine")->decode);
  PolicyRegistry reg;
  const fs::path ini = kvscope::testing::scratch_dir() / "cosine_decode.ini";
  // A threshold of -1 merges every kv head in prefill mode.
  std::ofstream(ini) << "[policy merged]\nbase = unicache\nhead_merge_threshold = -1\nmode = decode\n"
                     << "[policy unmerged]\nbase = unicache\nhead_merge = none\nmode = decode\n"
                     << "[policy merged-prefill]\nbase = unicache\nhead_merge_threshold = -1\n";
  reg.load_ini(ini.string());
  std::vector<SweepPoint> pts;
  for (const char* name : {"merged", "unmerged", "merged-prefill"})
    pts.push_back({reg.get(name), parse_budget("0.5")});
  trace::TraceReader r(trace);
  const SweepOutput res = run_sweep(r, pts, SweepOptions{});
  const PointResult &merged = res.points[0], &unmerged = res.points[1], &prefill = res.points[2];
  EXPECT_EQ(merged.mode, "decode");
  EXPECT_EQ(merged.total.quality.output_error, unmerged.total.quality.output_error);
  EXPECT_EQ(merged.total.bytes_end, unmerged.total.bytes_end);
  EXPECT_EQ(merged.total.bytes_peak, unmerged.total.bytes_peak);
  for (std::size_t l = 0; l < merged.layers.size(); ++l) EXPECT_EQ(merged.layers[l].merged_heads, 2);
  EXPECT_EQ(prefill.layers[0].merged_heads, 1);  // prefill mode merges both kv heads
  bool warned = false;
  for (const auto& w : res.warnings) {
    if (w.find("merged@0.5: decode mode runs the kv heads unmerged (head_merge 'cosine'") !=
        std::string::npos) {
      warned = true;
      EXPECT_EQ(w.find("more layers"), std::string::npos)
          << "a line of its own, not counted as a layer: " << w;
    }
  }
  EXPECT_TRUE(warned);
  for (const auto& w : res.warnings) {
    if (w.rfind("unmerged@", 0) == 0) {
      EXPECT_EQ(w.find("runs the kv heads unmerged"), std::string::npos) << w;
    }
  }
  fs::remove(ini);
}
