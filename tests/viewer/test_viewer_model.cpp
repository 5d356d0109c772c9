// kvview's UI-free model: background loading (trace, results, errors) and the layer recomputation
// behind the token map, attention and what-if views.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "kvscope/sim/report.hpp"
#include "layer_jobs.hpp"
#include "model.hpp"
#include "scratch.hpp"
#include "sim/sample_results.hpp"

namespace kvscope::viewer {
namespace {

std::string tiny_trace() { return KVSCOPE_TINY_TRACE; }  // set by tests/viewer/CMakeLists.txt

std::string temp_path(const std::string& name) { return (kvscope::testing::scratch_dir() / name).string(); }

TEST(ViewerModel, LoadsTraceInTheBackground) {
  Model m;
  EXPECT_EQ(m.state(), LoadState::kIdle);
  m.load(tiny_trace(), "");
  m.wait();
  ASSERT_EQ(m.state(), LoadState::kReady) << m.error();
  EXPECT_TRUE(m.has_trace());
  EXPECT_FALSE(m.has_results());
  EXPECT_EQ(m.tokens().size(), m.summary().num_tokens);
  EXPECT_EQ(static_cast<std::size_t>(m.context().T), m.summary().num_tokens);
  EXPECT_GT(m.geometry().num_layers, 0);
  // Synthetic traces carry one profile range per layer.
  EXPECT_EQ(m.profile().ranges.size(), static_cast<std::size_t>(m.geometry().num_layers));
  EXPECT_FLOAT_EQ(m.progress(), 1.0f);
  EXPECT_FALSE(m.registry_policies().empty());
}

TEST(ViewerModel, ReportsBadFilesWithTheirName) {
  const std::string bad = temp_path("garbage.h5");
  FILE* f = std::fopen(bad.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("garbage", f);
  std::fclose(f);
  Model m;
  m.load(bad, "");
  m.wait();
  EXPECT_EQ(m.state(), LoadState::kFailed);
  EXPECT_NE(m.error().find(bad), std::string::npos) << m.error();

  // Results of another model (3 layers) beside the 4-layer tiny trace.
  const std::string results = temp_path("sample.h5");
  sim::write_hdf5(results, testing::sample_points(), testing::sample_meta());
  Model mismatch;
  mismatch.load(tiny_trace(), results);
  mismatch.wait();
  EXPECT_EQ(mismatch.state(), LoadState::kFailed);
  EXPECT_NE(mismatch.error().find("not computed from this trace"), std::string::npos) << mismatch.error();
}

TEST(ViewerModel, FindsPointsAndOracles) {
  std::vector<sim::PointResult> pts = testing::sample_points();
  pts.push_back(testing::sample_point("alloc-search:h2o", "0.3", 0.3, 0.05, {}));
  pts.back().kind = "search";
  pts.push_back(testing::sample_point("oracle-topk", "0.3", 0.3, 0.01, {}));
  pts.back().kind = "bound";
  const std::string results = temp_path("with-oracle.h5");
  sim::write_hdf5(results, pts, testing::sample_meta());
  Model m;
  m.load("", results);
  m.wait();
  ASSERT_EQ(m.state(), LoadState::kReady) << m.error();
  EXPECT_EQ(m.find_point("random", "0.6"), 3);
  EXPECT_EQ(m.find_point("random", "0.7"), -1);
  EXPECT_EQ(m.search_point_for(0), 4);  // h2o@0.3 -> the allocation search at the same memory, not the bound
  EXPECT_EQ(m.points()[5].kind, "bound");  // the kind read back from the file
  EXPECT_EQ(m.policies(), (std::vector<std::string>{"h2o", "random", "alloc-search:h2o", "oracle-topk"}));
}

class LayerJobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_.load(tiny_trace(), "");
    model_.wait();
    ASSERT_EQ(model_.state(), LoadState::kReady) << model_.error();
  }
  LayerRequest request(const std::string& policy, double keep, int layer) const {
    LayerRequest r;
    r.policy = sim::PolicyRegistry().get(policy);
    r.keep = keep;
    r.layer = layer;
    return r;
  }
  Model model_;
};

TEST_F(LayerJobsTest, RecordsEveryTokenAndAttentionRowsAreDistributions) {
  const LayerOutcome out = LayerJobs::compute(model_, request("h2o", 0.3, 1));
  ASSERT_TRUE(out.error.empty()) << out.error;
  const int Hkv = model_.geometry().num_kv_heads, T = out.T, S = out.S, N = T + S;
  ASSERT_EQ(static_cast<int>(out.result.token_maps.size()), Hkv);
  for (int h = 0; h < Hkv; ++h) {
    const sim::TokenMap& map = out.result.token_maps[h];
    ASSERT_EQ(static_cast<int>(map.state.size()), T);
    std::int64_t kept = 0, merged = 0, evicted = 0;
    for (int t = 0; t < T; ++t) {
      kept += map.state[t] == 1;
      merged += map.state[t] == 2;
      evicted += map.state[t] == 0;
      EXPECT_EQ(map.slot[t] < 0, map.state[t] == 0) << "token " << t;
    }
    const sim::HeadResult& hr = out.result.heads[h];
    EXPECT_EQ(kept, hr.kept[0] + hr.kept[1] + hr.kept[2] + hr.kept[3]);
    EXPECT_EQ(merged + evicted, T - kept);
    EXPECT_GT(evicted, 0);  // keep 0.3 must drop something
  }
  // The layer total the views show is the sum over heads (bytes) and their mean (quality).
  std::int64_t head_bytes = 0;
  double head_error = 0;
  for (const sim::HeadResult& hr : out.result.heads) {
    head_bytes += hr.bytes_kept.total();
    head_error += hr.quality.output_error / Hkv;
  }
  EXPECT_EQ(out.result.total.bytes_kept.total(), head_bytes);
  EXPECT_NEAR(out.result.total.quality.output_error, head_error, 1e-12);
  EXPECT_LT(out.result.total.bytes_kept.total(), out.result.total.bytes_full.total());

  ASSERT_EQ(out.attn_full.size(), static_cast<std::size_t>(out.Hq) * S * N);
  const int group = model_.geometry().group_size();
  for (int q = 0; q < out.Hq; ++q) {
    const sim::TokenMap& map = out.result.token_maps[q / group];
    for (int s = 0; s < S; ++s) {
      double full = 0, comp = 0;
      const std::size_t row = (static_cast<std::size_t>(q) * S + s) * N;
      for (int j = 0; j < N; ++j) {
        full += out.attn_full[row + j];
        comp += out.attn_compressed[row + j];
        if (j > T + s) {
          EXPECT_EQ(out.attn_full[row + j], 0.0f) << "causal: later decode key " << j;
        }
        if (j < T && map.state[j] != 1) {
          EXPECT_EQ(out.attn_compressed[row + j], 0.0f) << "dropped token " << j;
        }
      }
      EXPECT_NEAR(full, 1.0, 1e-4);
      EXPECT_NEAR(comp, 1.0, 1e-4);
    }
  }
}

TEST_F(LayerJobsTest, FullPolicyLeavesAttentionUnchanged) {
  const LayerOutcome out = LayerJobs::compute(model_, request("full", 1.0, 0));
  ASSERT_TRUE(out.error.empty()) << out.error;
  ASSERT_EQ(out.attn_full.size(), out.attn_compressed.size());
  for (std::size_t i = 0; i < out.attn_full.size(); ++i)
    ASSERT_NEAR(out.attn_full[i], out.attn_compressed[i], 1e-6);
}

TEST_F(LayerJobsTest, RunsInTheBackgroundAndCaches) {
  LayerJobs jobs(model_);
  const LayerRequest req = request("snapkv", 0.4, 2);
  EXPECT_EQ(jobs.get(req), nullptr);  // never blocks: queued first
  EXPECT_TRUE(jobs.busy());
  std::shared_ptr<const LayerOutcome> out;
  for (int i = 0; i < 3000 && !out; ++i) {
    jobs.poll();
    out = jobs.get(req);
    if (!out) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(out, nullptr);
  EXPECT_FALSE(jobs.busy());
  EXPECT_EQ(jobs.get(req), out);  // cached: the same object
  const LayerOutcome direct = LayerJobs::compute(model_, req);
  EXPECT_EQ(direct.result.token_maps[0].state, out->result.token_maps[0].state);

  // An edited spec (what-if) with another tag is a different computation.
  LayerRequest edited = req;
  edited.keep = 0.9;
  edited.tag = "whatif#1";
  EXPECT_EQ(jobs.get(edited), nullptr);
  std::shared_ptr<const LayerOutcome> out2;
  for (int i = 0; i < 3000 && !out2; ++i) {
    jobs.poll();
    out2 = jobs.get(edited);
    if (!out2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(out2, nullptr);
  EXPECT_GT(out2->result.total.bytes_kept.total(), out->result.total.bytes_kept.total());
}

TEST_F(LayerJobsTest, BadLayerIsAnErrorValueNotACrash) {
  const LayerOutcome out = LayerJobs::compute(model_, request("h2o", 0.3, 99));
  EXPECT_FALSE(out.error.empty());
}

}  // namespace
}  // namespace kvscope::viewer
