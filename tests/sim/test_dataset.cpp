// Datasets of traces: the manifest (read, write, lists and globs) and the aggregation of a dataset
// sweep (mean points, per-sample and aggregate tables, the bootstrap intervals).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <fstream>

#include "kvscope/sim/dataset.hpp"
#include "kvscope/sim/results_reader.hpp"
#include "kvscope/trace/dataset.hpp"
#include "scratch.hpp"

namespace kvscope::sim {
namespace {

using trace::TraceError;

std::string write_file(const std::string& dir, const std::string& name, const std::string& text) {
  const auto path = testing::scratch_dir(dir) / name;
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

// Appends sample "sI" (trace sI.h5) to a dataset with the columns sample, trace.
void add_dataset_sample(trace::Dataset& ds, int i) {
  trace::DatasetSample s;
  s.sample = "s" + std::to_string(i);
  s.trace = s.sample + ".h5";
  s.values = {s.sample, s.trace};
  ds.samples.push_back(s);
}

TEST(Manifest, RoundTripsQuotedFields) {
  const std::string dir = testing::scratch_dir("rt").string();
  const std::vector<std::string> cols = {"sample", "trace", "question"};
  trace::write_manifest(dir, cols,
                        {{"s0", "s0.h5", "how many, \"really\" ?\nsecond line"}, {"s1", "s1.h5", " x "}});
  const trace::Dataset ds = trace::read_manifest(dir);
  ASSERT_EQ(ds.samples.size(), 2u);
  EXPECT_TRUE(ds.has_manifest);
  EXPECT_EQ(ds.value(0, "question"), "how many, \"really\" ?\nsecond line");
  EXPECT_EQ(ds.value(1, "question"), " x ");
  EXPECT_EQ(ds.value(1, "nosuch"), "");
  EXPECT_EQ(ds.samples[1].path, (std::filesystem::path(dir) / "s1.h5").string());
  EXPECT_FALSE(std::filesystem::exists(dir + "/manifest.csv.partial"));
}

TEST(Manifest, RefusesMalformedOnes) {
  auto error = [](const std::string& name, const std::string& text) {
    write_file(name, "manifest.csv", text);
    try {
      trace::read_manifest(testing::scratch_dir(name).string());
    } catch (const TraceError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("m1", "sample,trace\ns0,a.h5\ns0,b.h5\n").find("row 2: sample id 's0' appears twice"),
            std::string::npos);
  EXPECT_NE(error("m2", "sample,trace\n,a.h5\n").find("row 1: empty sample id"), std::string::npos);
  EXPECT_NE(error("m3", "sample,trace\n").find("no samples"), std::string::npos);
  EXPECT_NE(error("m4", "id,trace\ns0,a.h5\n").find("no 'sample' column"), std::string::npos);
  EXPECT_NE(error("m5", std::string("sample,trace\ns0,a\0b\n", 20)).find("binary data"), std::string::npos);
  EXPECT_THROW(trace::read_manifest(testing::scratch_dir("none").string()), TraceError);
}

TEST(Manifest, ListsAndGlobsOfTraces) {
  const std::string a = write_file("glob", "x1.h5", "a"), b = write_file("glob", "x2.h5", "b");
  write_file("glob", "y.txt", "c");
  const trace::Dataset ds = trace::open_dataset(testing::scratch_dir("glob").string() + "/x*.h5," + a);
  ASSERT_EQ(ds.samples.size(), 3u);
  EXPECT_FALSE(ds.has_manifest);
  EXPECT_EQ(ds.samples[0].path, a);
  EXPECT_EQ(ds.samples[1].path, b);
  EXPECT_EQ(ds.samples[0].sample, "x1#0");  // the same stem twice: made unique by position
  EXPECT_EQ(ds.samples[1].sample, "x2");
  EXPECT_EQ(ds.samples[2].sample, "x1#2");
  EXPECT_THROW(trace::open_dataset(testing::scratch_dir("glob").string() + "/z*.h5"), TraceError);
  EXPECT_THROW(trace::open_dataset(a + ",," + b), TraceError);
}

TEST(Bootstrap, IntervalsAreSeededAndContainTheMean) {
  std::vector<double> x;
  for (int i = 0; i < 40; ++i) x.push_back(std::sin(i * 1.7) + 0.1 * i);
  BootstrapOptions o;
  const Interval a = bootstrap_interval(x, o, 7), b = bootstrap_interval(x, o, 7),
                 c = bootstrap_interval(x, o, 8);
  double mean = 0;
  for (double v : x) mean += v / 40;
  EXPECT_NEAR(a.mean, mean, 1e-12);
  EXPECT_EQ(a.lo, b.lo);
  EXPECT_EQ(a.hi, b.hi);
  EXPECT_NE(a.lo, c.lo);
  EXPECT_LT(a.lo, a.mean);
  EXPECT_GT(a.hi, a.mean);
  // About mean -/+ 1.96 standard errors for a sample this size.
  double var = 0;
  for (double v : x) var += (v - mean) * (v - mean) / 39;
  const double se = std::sqrt(var / 40);
  EXPECT_NEAR(a.hi - a.lo, 2 * 1.96 * se, 0.6 * se);
  // A constant sample has a zero-width interval; NaN values are left out; one value has no spread.
  EXPECT_EQ(bootstrap_interval({2, 2, 2}, o, 1).lo, 2.0);
  const Interval nan = bootstrap_interval({1, std::nan(""), 3}, o, 1);
  EXPECT_DOUBLE_EQ(nan.mean, 2.0);
  EXPECT_GE(nan.lo, 1.0);
  EXPECT_LE(nan.hi, 3.0);
  EXPECT_TRUE(std::isnan(bootstrap_interval({std::nan("")}, o, 1).mean));
}

TEST(Bootstrap, LengthBuckets) {
  EXPECT_EQ(length_bucket(0), "0-0");
  EXPECT_EQ(length_bucket(1), "1-1");
  EXPECT_EQ(length_bucket(130), "128-255");
  EXPECT_EQ(length_bucket(255), "128-255");
  EXPECT_EQ(length_bucket(256), "256-511");
}

// One sample's result: two points (h2o@0.5, the bound at 0.5), two layers of one kv head.
SampleResult sample(double err, std::int64_t tokens) {
  SampleResult r;
  r.ok = true;
  r.meta.num_layers = 2;
  r.meta.num_kv_heads = 1;
  r.meta.num_tokens = tokens;
  r.meta.tokens_per_modality = {tokens, 0, 0, 0};
  for (const char* kind : {"policy", "bound"}) {
    PointResult p;
    p.policy = kind[0] == 'p' ? "h2o" : "oracle-topk";
    p.kind = kind;
    p.budget = "0.5";
    p.budget_value = 0.5;
    for (int l = 0; l < 2; ++l) {
      LayerResult lr;
      lr.layer = l;
      HeadResult h;
      h.tokens = {tokens, 0, 0, 0};
      h.bytes_full.kv = 100;
      h.bytes_kept.kv = 50;
      h.bytes_full_modality = {100, 0, 0, 0};
      h.bytes_kept_modality = {50, 0, 0, 0};
      h.quality.output_error = (kind[0] == 'p' ? 1.0 : 0.5) * err * (l + 1);
      h.quality.attention_recall = 1 - err;
      h.quality.recall_modality = {1 - err, 1, 1, 1};
      lr.heads.push_back(h);
      lr.total = h;
      p.layers.push_back(lr);
      accumulate(p.total, h, 0.5);
    }
    r.points.push_back(p);
  }
  return r;
}

ResultsMeta results_meta_without_dataset(ResultsMeta m) {
  m.dataset = false;
  return m;
}

TEST(Aggregate, MeanPointsTablesAndGroups) {
  trace::Dataset ds;
  ds.source = "ds";
  ds.has_manifest = true;
  ds.columns = {"sample", "trace", "family"};
  std::vector<SampleResult> rs;
  for (int i = 0; i < 6; ++i) {
    trace::DatasetSample s;
    s.sample = "s" + std::to_string(i);
    s.trace = s.sample + ".h5";
    s.values = {s.sample, s.trace, i % 2 ? "odd" : "even"};
    ds.samples.push_back(s);
    rs.push_back(sample(0.1 * (i + 1), i < 3 ? 100 : 300));
  }
  rs[5].ok = false;  // --skip-bad: recorded, not aggregated
  rs[5].error = "s5.h5: corrupt";
  BootstrapOptions o;
  o.resamples = 200;
  omp_set_num_threads(1);
  const DatasetResults a = aggregate_dataset(ds, rs, {"family", "length"}, o, {});
  omp_set_num_threads(2);
  const DatasetResults b = aggregate_dataset(ds, rs, {"family", "length"}, o, {});
  ASSERT_EQ(a.points.size(), 2u);
  // Mean of 0.1..0.5 per layer x (l + 1), averaged over the two layers: 0.3 x 1.5.
  EXPECT_NEAR(a.points[0].total.quality.output_error, 0.45, 1e-12);
  EXPECT_EQ(a.points[0].total.bytes_full.kv, 5 * 200);  // sums over samples
  EXPECT_TRUE(a.points[0].pareto);
  EXPECT_FALSE(a.points[1].pareto);  // the bound is never on the front
  EXPECT_EQ(a.meta.num_samples, 6);
  EXPECT_EQ(a.meta.failed_samples, 1);
  ASSERT_EQ(a.tables.size(), 3u);
  EXPECT_EQ(a.tables[0].rows(), 6u);
  EXPECT_EQ(a.tables[1].rows(), 5u * 2 * 3 * 2);  // samples x points x (layers + all) x (text + all)
  const ResultsTable& agg = a.tables[2];
  // all: 1 group, family: even/odd, length: 64-127 / 256-511 -> 5 groups x 2 points x 3 x 2 rows.
  EXPECT_EQ(agg.rows(), 5u * 2 * 3 * 2);
  for (std::size_t c = 0; c < agg.columns.size(); ++c) {  // thread count changes nothing
    EXPECT_EQ(agg.columns[c].f64, b.tables[2].columns[c].f64) << agg.columns[c].name;
  }
  const std::string summary = format_dataset_summary(a, 3);
  EXPECT_NE(summary.find("5 of 6 samples replayed (1 failed)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("family = odd (n = 2)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("length = 256-511 (n = 2)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("oracle-topk (bound)"), std::string::npos) << summary;
  EXPECT_THROW(check_groupings(ds, {"nosuch"}), std::runtime_error);
  // The results file (format 1.4) reads back: mean points, dataset attributes, the intervals kvview draws.
  const std::string file = (testing::scratch_dir("h5") / "r.h5").string();
  write_hdf5(file, a.points, a.meta, a.tables);
  ResultsMeta meta;
  const std::vector<PointResult> back = read_results_hdf5(file, &meta);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].total.quality.output_error, a.points[0].total.quality.output_error);
  EXPECT_TRUE(meta.dataset);
  EXPECT_EQ(meta.num_samples, 6);
  EXPECT_EQ(meta.failed_samples, 1);
  EXPECT_EQ(meta.group_by, "family,length");
  EXPECT_DOUBLE_EQ(meta.confidence, 0.95);
  const std::vector<PointIntervals> iv = read_point_intervals(file);
  ASSERT_EQ(iv.size(), 2u);
  EXPECT_EQ(iv[0].n, 5);
  EXPECT_NEAR(iv[0].output_error.mean, a.points[0].total.quality.output_error, 1e-12);
  EXPECT_LT(iv[0].output_error.lo, iv[0].output_error.mean);
  EXPECT_GT(iv[0].output_error.hi, iv[0].output_error.mean);
  // A single-trace results file has no intervals.
  write_hdf5(file, a.points, results_meta_without_dataset(a.meta));
  EXPECT_TRUE(read_point_intervals(file).empty());
  for (auto& r : rs) r.ok = false;
  EXPECT_THROW(aggregate_dataset(ds, rs, {}, o, {}), std::runtime_error);
}

// The aggregator folds one sample at a time and streams /sample_points when it is written: the same
// rows as the held table of aggregate_dataset, in the CSV and in the HDF5 file; samples past the
// dataset's, or a finish before the last, are refused.
TEST(Aggregate, StreamedSamplePointsEqualTheHeldTable) {
  trace::Dataset ds;
  ds.source = "ds";
  ds.columns = {"sample", "trace"};
  std::vector<SampleResult> rs;
  for (int i = 0; i < 5; ++i) {
    add_dataset_sample(ds, i);
    rs.push_back(sample(0.05 * (i + 1), 100 + 40 * i));
  }
  rs[1].points.pop_back();  // a sample without the bound row: that point's mean is over 4 samples
  BootstrapOptions o;
  o.resamples = 100;
  const DatasetResults held = aggregate_dataset(ds, rs, {"length"}, o, {});
  DatasetAggregator agg(ds, {"length"}, o, {});
  EXPECT_THROW(agg.finish(), std::logic_error);
  for (const SampleResult& r : rs) agg.add(r);
  EXPECT_THROW(agg.add(rs[0]), std::logic_error);
  const DatasetResults streamed = agg.finish();
  ASSERT_EQ(streamed.tables.size(), 3u);
  const ResultsTable& sp = streamed.tables[1];
  ASSERT_TRUE(static_cast<bool>(sp.stream));
  EXPECT_NE(sp.find("topk_recall"), nullptr);  // the proxies per sample (results format 1.5)
  EXPECT_EQ(sp.columns.back().name, "flags");
  EXPECT_FALSE(static_cast<bool>(held.tables[1].stream));
  EXPECT_EQ(sp.rows(), held.tables[1].rows());
  EXPECT_EQ(sp.rows(), (5u + 4u) * 3 * 2);  // (samples of h2o + of the bound) x (layers + all) x (text + all)
  const auto dir = testing::scratch_dir("stream");
  const std::string a = (dir / "held.csv").string(), b = (dir / "streamed.csv").string();
  write_table_csv(a, held.tables[1]);
  write_table_csv(b, sp);
  auto text = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(text(a), text(b));
  EXPECT_NE(text(b).find("\n4,1,0,text,"), std::string::npos);  // sample 4's rows of the bound
  const ResultsTable back = sp.materialized();
  for (std::size_t c = 0; c < back.columns.size(); ++c) {
    EXPECT_EQ(back.columns[c].f64.size() + back.columns[c].i64.size() + back.columns[c].str.size(),
              sp.rows());
  }
  // The mean of the bound (4 samples) and of h2o (5), and the aggregates, are those of the held run.
  ASSERT_EQ(streamed.points.size(), 2u);
  for (std::size_t p = 0; p < 2; ++p)
    EXPECT_EQ(streamed.points[p].total.quality.output_error, held.points[p].total.quality.output_error);
  EXPECT_NEAR(streamed.points[1].total.quality.output_error, 0.5 * 1.5 * 0.05 * (1 + 3 + 4 + 5) / 4, 1e-12);
  for (std::size_t c = 0; c < held.tables[2].columns.size(); ++c)
    EXPECT_EQ(held.tables[2].columns[c].f64, streamed.tables[2].columns[c].f64)
        << held.tables[2].columns[c].name;
  // The HDF5 file takes the streamed rows block by block (dataset_cli compares them with the CSV).
  const std::string h5 = (dir / "streamed.h5").string();
  write_hdf5(h5, streamed.points, streamed.meta, streamed.tables);
  EXPECT_TRUE(std::filesystem::exists(h5));
}

// The summary ranks a policy at a budget only when its bytes are within it (up to half a token of the
// shortest context): a policy keeping more (FastV's early layers) is listed as not ranked, however low
// its error.
TEST(Aggregate, SummaryRanksOnlyPoliciesWithinTheBudget) {
  trace::Dataset ds;
  ds.source = "ds";
  ds.columns = {"sample", "trace"};
  std::vector<SampleResult> rs;
  // Copy of point 0 (h2o: 50 of 100 bytes per head) as `name`, keeping `kept` bytes with `err_scale`.
  auto variant = [](const PointResult& base, const char* name, std::int64_t kept, double err_scale) {
    PointResult p = base;
    p.policy = name;
    p.total = HeadResult{};
    for (LayerResult& lr : p.layers) {
      for (HeadResult* h : {&lr.heads[0], &lr.total}) {
        h->bytes_kept.kv = kept;
        h->bytes_kept_modality = {kept, 0, 0, 0};
        h->quality.output_error *= err_scale;
      }
      accumulate(p.total, lr.total, 0.5);
    }
    return p;
  };
  for (int i = 0; i < 4; ++i) {
    add_dataset_sample(ds, i);
    SampleResult r = sample(0.1 * (i + 1), 100);  // slack: half a token of 100
    const PointResult h2o = r.points[0];
    r.points.push_back(variant(h2o, "fastv", 90, 0.1));  // 0.9 of the bytes at budget 0.5
    r.points.push_back(variant(h2o, "tova", 50, 2.0));   // within, worse than h2o
    r.points.push_back(variant(h2o, "knorm", 51, 0.5));  // 0.51 > 0.5 + 0.005: over
    rs.push_back(r);
  }
  BootstrapOptions o;
  o.resamples = 50;
  const DatasetResults a = aggregate_dataset(ds, rs, {}, o, {});
  const std::string summary = format_dataset_summary(a, 3);
  const auto row = [&](const std::string& name) { return summary.find("  " + name + " "); };
  ASSERT_NE(row("h2o"), std::string::npos) << summary;
  ASSERT_NE(row("tova"), std::string::npos) << summary;
  EXPECT_LT(row("h2o"), row("tova")) << summary;  // ranked by error among the policies within
  EXPECT_EQ(row("fastv"), std::string::npos) << summary;  // never a ranked row
  EXPECT_NE(summary.find("not ranked (bytes above the budget): fastv 0.900, knorm 0.510"), std::string::npos)
      << summary;
  // Half a token of the shortest context is rounding, not over the budget: 50.4 of 100 bytes at T = 100.
  for (SampleResult& r : rs) {
    for (LayerResult& lr : r.points[4].layers)
      for (HeadResult* h : {&lr.heads[0], &lr.total}) h->bytes_full.kv = 1000, h->bytes_kept.kv = 504;
    r.points[4].total = HeadResult{};
    for (LayerResult& lr : r.points[4].layers) accumulate(r.points[4].total, lr.total, 0.5);
  }
  const std::string again = format_dataset_summary(aggregate_dataset(ds, rs, {}, o, {}), 3);
  EXPECT_NE(again.find("not ranked (bytes above the budget): fastv 0.900\n"), std::string::npos) << again;
  EXPECT_NE(again.find("  knorm "), std::string::npos) << again;
}

}  // namespace
}  // namespace kvscope::sim
