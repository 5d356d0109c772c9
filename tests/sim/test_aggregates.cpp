// Stored attention aggregates (trace format 1.2, /aggregates; docs/trace-format.md section 3a):
// writing them safely (a run that never commits leaves the trace as it was; a capture writes them
// directly), and kvsim using them where their definition is a policy's, recomputing otherwise, with
// the same results either way (to float rounding), and ignoring bad ones with a warning.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

#include "kvscope/aggregate/aggregate.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/trace/aggregates.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/writer.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

// T = 1 + 24 + 65 = 90 tokens (64 vision), 6 decode steps, 4 layers, 2 kv heads (G = 2), D = 32.
std::string fresh_copy(const std::string& name) {
  const std::string& src = kvscope::testing::tiny_trace("aggregates", 64, 24, 6, 5);
  const std::string dst = (kvscope::testing::scratch_dir() / (name + ".h5")).string();
  fs::copy_file(src, dst, fs::copy_options::overwrite_existing);
  return dst;
}

// Every policy whose stages read a prefill attention statistic, a few that read none, and a byte
// budget; at budgets 0.2 .. 0.8.
SweepOutput sweep(const std::string& path) {
  trace::TraceReader reader(path);
  PolicyRegistry reg;
  std::vector<PolicySpec> policies;
  for (const char* n : {"full", "window", "h2o", "snapkv", "pyramidkv", "tova", "fastv", "hybridkv", "look-m",
                        "unicache", "adaptive", "h2o+int8", "snapkv+int4"})
    policies.push_back(reg.get(n));
  // snapkv pooling each side of its window on its own (snap_pool_span = split), from the stored window sums
  PolicySpec split = reg.get("snapkv");
  split.set("snap_pool_span", "split");
  split.name = "snapkv-split";
  policies.push_back(split);
  SweepOptions o;
  return run_sweep(reader, make_sweep_points(policies, parse_budget_list("0.2:0.8:0.3")), o);
}

// Same points, kept tokens and bytes exactly (no score near-tie flips on this trace), quality to float
// rounding of the statistics (the stored ones are the same kernels' sums; not asserted bit-identical).
void expect_same_results(const SweepOutput& x, const SweepOutput& y) {
  ASSERT_EQ(x.points.size(), y.points.size());
  for (std::size_t i = 0; i < x.points.size(); ++i) {
    SCOPED_TRACE(x.points[i].policy + "@" + x.points[i].budget);
    EXPECT_EQ(x.points[i].policy, y.points[i].policy);
    EXPECT_EQ(x.points[i].total.kept, y.points[i].total.kept);
    EXPECT_EQ(x.points[i].total.bytes_kept.total(), y.points[i].total.bytes_kept.total());
    const Quality &a = x.points[i].total.quality, &b = y.points[i].total.quality;
    EXPECT_NEAR(a.output_error, b.output_error, 1e-5 + 1e-4 * std::fabs(b.output_error));
    EXPECT_NEAR(a.attention_recall, b.attention_recall, 1e-5);
    EXPECT_NEAR(a.kl, b.kl, 1e-6 + 1e-4 * std::fabs(b.kl));
    EXPECT_NEAR(a.entropy_delta, b.entropy_delta, 1e-5);
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

// Writes one float into /aggregates/NNN/NAME (element 0) or deletes the dataset (value unset).
void damage(const std::string& path, const std::string& dataset, std::optional<float> value) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  if (value) {
    const hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
    ASSERT_GE(d, 0);
    const hid_t space = H5Dget_space(d);
    const hsize_t start[2] = {0, 0}, count[2] = {1, 1};
    H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, count, nullptr);
    const hid_t mem = H5Screate_simple(2, count, nullptr);
    const float x = *value;
    EXPECT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &x), 0);
    H5Sclose(mem);
    H5Sclose(space);
    H5Dclose(d);
  } else {
    EXPECT_GE(H5Ldelete(f, dataset.c_str(), H5P_DEFAULT), 0);
  }
  H5Fclose(f);
}

}  // namespace

TEST(Aggregates, StoredAggregatesGiveTheRecomputedResults) {
  const std::string plain = fresh_copy("plain"), stored = fresh_copy("stored");
  const aggregate::AggregateRun run = aggregate::aggregate_trace(stored, 32, "test");
  EXPECT_EQ(run.layers, 4);
  EXPECT_EQ(run.window, 32);
  EXPECT_FALSE(fs::exists(stored + ".aggregates.partial"));
  {
    trace::TraceReader r(stored);
    ASSERT_EQ(r.aggregate_state(), trace::AggregateState::kPresent);
    EXPECT_EQ(r.header().version_minor, trace::kVersionMinorAggregates);
    const trace::AggregateDefinition d = r.aggregate_definition();
    EXPECT_EQ(d.num_tokens, 90);
    EXPECT_EQ(d.window, 32);
    EXPECT_EQ(d.gqa_group, 2);
    EXPECT_FLOAT_EQ(static_cast<float>(d.softmax_scale), 1.0f / std::sqrt(32.0f));
    EXPECT_EQ(trace::aggregate_definition_problem(d, r.geometry(), r.header().dtype, r.num_tokens()), "");
    // Each query head's last-query row is a softmax row; H2O sums to the number of queries.
    const trace::LayerAttentionAggregates a = r.read_attention_aggregates(1, d);
    double last = 0, h2o = 0;
    for (int t = 0; t < 90; ++t)
      last += a.last_query[static_cast<std::size_t>(t)], h2o += a.h2o[static_cast<std::size_t>(t)];
    EXPECT_NEAR(last, 1.0, 1e-5);
    EXPECT_NEAR(h2o, 90.0, 1e-3);
  }
  const SweepOutput with = sweep(stored), without = sweep(plain);
  expect_same_results(with, without);
  SCOPED_TRACE(with.attention_statistics);
  EXPECT_TRUE(contains(with.attention_statistics, "stored /aggregates (window 32) for "));
  for (const char* s : {"h2o", "tova", "cross-modal", "snapkv window 32", "redundancy 4/1"})
    EXPECT_TRUE(contains(with.attention_statistics, s)) << s;
  EXPECT_FALSE(contains(with.attention_statistics, "recomputed")) << with.attention_statistics;
  EXPECT_TRUE(contains(without.attention_statistics, "recomputed: ")) << without.attention_statistics;
  EXPECT_TRUE(contains(without.attention_statistics, "the trace has no /aggregates"))
      << without.attention_statistics;
  EXPECT_EQ(joined(with.warnings), joined(without.warnings));
}

TEST(Aggregates, ADifferentDefinitionIsRecomputed) {
  const std::string plain = fresh_copy("plain2"), w8 = fresh_copy("window8");
  aggregate::aggregate_trace(w8, 8, "test");
  const SweepOutput with = sweep(w8), without = sweep(plain);
  expect_same_results(with, without);
  // snapkv's window is 32: recomputed; the other statistics are the stored ones.
  EXPECT_TRUE(contains(with.attention_statistics, "recomputed: snapkv window 32 [stored window is 8]"))
      << with.attention_statistics;
  EXPECT_TRUE(contains(with.attention_statistics, "stored /aggregates (window 8) for cross-modal, h2o"))
      << with.attention_statistics;
  // Replacing them: aggregating again with window 32 leaves one complete set of the new definition.
  aggregate::aggregate_trace(w8, 32, "test");
  const SweepOutput again = sweep(w8);
  EXPECT_FALSE(contains(again.attention_statistics, "recomputed")) << again.attention_statistics;
}

TEST(Aggregates, BadAggregatesAreIgnoredWithAWarning) {
  const std::string plain = fresh_copy("plain3");
  const SweepOutput reference = sweep(plain);
  struct Case {
    const char* dataset;
    std::optional<float> value;
    const char* warning;
  };
  const Case cases[] = {
      {"/aggregates/002/h2o", std::numeric_limits<float>::quiet_NaN(),
       "/aggregates/002/h2o: value nan at element 0"},
      {"/aggregates/001/last_query", 7.0f, "/aggregates/001/last_query: value 7 at element 0"},
      {"/aggregates/003/redundancy", std::nullopt, "/aggregates/003/redundancy: dataset is missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dataset);
    const std::string path = fresh_copy("bad");
    aggregate::aggregate_trace(path, 32, "test");
    damage(path, c.dataset, c.value);
    const SweepOutput out = sweep(path);
    expect_same_results(out, reference);
    EXPECT_TRUE(contains(joined(out.warnings), c.warning)) << joined(out.warnings);
    EXPECT_TRUE(contains(joined(out.warnings), "stored aggregates ignored from layer"))
        << joined(out.warnings);
    EXPECT_TRUE(contains(out.attention_statistics, "recomputed: ")) << out.attention_statistics;
  }
}

TEST(Aggregates, AnUncommittedWriterLeavesTheTraceAsItWas) {
  const std::string path = fresh_copy("uncommitted");
  const auto size = fs::file_size(path);
  {
    trace::TraceReader r(path);
    const aggregate::AggregateComputer c(r.geometry(), r.header().dtype, r.tokens(), 32, "test");
    trace::AggregateWriter w(path, c.definition());
    const trace::LayerTensors t = r.read_layer(0);
    w.write_layer(0, c.compute(t.q.data.data(), t.k.data.data()));
    EXPECT_TRUE(fs::exists(w.staging_path()));
    // commit() refuses while layers are missing, and changes nothing.
    EXPECT_THROW(w.commit(), trace::TraceError);
  }
  EXPECT_FALSE(fs::exists(path + ".aggregates.partial"));
  EXPECT_EQ(fs::file_size(path), size);
  trace::TraceReader r(path);
  EXPECT_EQ(r.aggregate_state(), trace::AggregateState::kAbsent);
  EXPECT_TRUE(contains(sweep(path).attention_statistics, "the trace has no /aggregates"));
}

// The capture path (TraceWriter::write_attention_aggregates, what the capture library calls with
// config.aggregate_window): the same datasets, complete only when every layer has them.
TEST(Aggregates, ACaptureWritesThemDirectly) {
  const std::string src = fresh_copy("capture_src");
  trace::TraceReader r(src);
  const aggregate::AggregateComputer c(r.geometry(), r.header().dtype, r.tokens(), 32, "test");
  for (int layers_with : {4, 3}) {
    const std::string out =
        (kvscope::testing::scratch_dir() / ("captured" + std::to_string(layers_with) + ".h5")).string();
    {
      trace::TraceWriter w(out, r.header(), r.num_tokens(), r.num_decode_steps());
      w.write_tokens(r.tokens());
      for (int l = 0; l < 4; ++l) {
        const trace::LayerTensors t = r.read_layer(l), d = r.read_decode_layer(l);
        auto view = [](const trace::Tensor& x) {
          return trace::TensorView{x.data.data(), x.dtype, {x.shape[0], x.shape[1], x.shape[2]}};
        };
        w.write_layer(l, view(t.q), view(t.k), view(t.v));
        if (l < layers_with)
          w.write_attention_aggregates(l, c.definition(), c.compute(t.q.data.data(), t.k.data.data()));
        w.write_decode_layer(l, view(d.q), view(d.k), view(d.v));
      }
      const trace::DecodeTokens& dt = r.decode_tokens();
      w.write_decode_tokens(dt.token_id, dt.position, dt.text);
      w.close();
    }
    trace::TraceReader cr(out);
    if (layers_with == 4) {
      ASSERT_EQ(cr.aggregate_state(), trace::AggregateState::kPresent);
      EXPECT_FALSE(contains(sweep(out).attention_statistics, "recomputed"));
    } else {
      EXPECT_EQ(cr.aggregate_state(), trace::AggregateState::kIncomplete);
      const SweepOutput s = sweep(out);
      EXPECT_TRUE(contains(joined(s.warnings), "/aggregates is incomplete")) << joined(s.warnings);
      EXPECT_TRUE(contains(s.attention_statistics, "recomputed: ")) << s.attention_statistics;
    }
  }
}
