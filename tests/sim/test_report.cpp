// Results reports: Pareto marking, the stdout table, the CSV file, the HDF5 results file
// (read back with the HDF5 C API) and failing writes that must leave no file behind.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvscope/sim/pareto.hpp"
#include "kvscope/sim/report.hpp"
#include "scratch.hpp"
#include "sim/sample_results.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using kvscope::testing::sample_meta;
using kvscope::testing::sample_points;

namespace {

// A fresh directory per test under the system temp dir.
fs::path temp_dir(const std::string& name) {
  const fs::path d = kvscope::testing::scratch_dir(name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

std::vector<std::string> split(const std::string& line, char sep = ',') {
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace

// ------------------------------------------------------------------------- Pareto

TEST(Pareto, SinglePointIsOnTheFront) {
  EXPECT_EQ(sim::pareto_front({{0.5, 0.2}}), std::vector<bool>({true}));
  EXPECT_TRUE(sim::pareto_front({}).empty());
}

TEST(Pareto, DominatedPointsAreOff) {
  // (0.3, 0.2) loses to (0.3, 0.1) on error; (0.5, 0.1) loses to (0.3, 0.1) on memory;
  // (0.2, 0.4) trades memory for error and stays on.
  const std::vector<sim::ParetoPoint> p = {{0.3, 0.2}, {0.3, 0.1}, {0.5, 0.1}, {0.2, 0.4}, {0.9, 0.05}};
  EXPECT_EQ(sim::pareto_front(p), std::vector<bool>({false, true, false, true, true}));
  EXPECT_TRUE(sim::dominates({0.3, 0.1}, {0.3, 0.2}));
  EXPECT_FALSE(sim::dominates({0.3, 0.1}, {0.3, 0.1}));
  EXPECT_FALSE(sim::dominates({0.2, 0.4}, {0.3, 0.1}));
}

TEST(Pareto, EqualPointsAreOnTheFrontTogether) {
  const std::vector<sim::ParetoPoint> p = {{0.4, 0.1}, {0.4, 0.1}, {0.4, 0.1}, {0.6, 0.1}};
  EXPECT_EQ(sim::pareto_front(p), std::vector<bool>({true, true, true, false}));
}

TEST(Pareto, NaNIsNeverOnTheFrontAndDominatesNothing) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<sim::ParetoPoint> p = {{0.1, nan}, {0.5, 0.5}, {nan, 0.0}};
  EXPECT_EQ(sim::pareto_front(p), std::vector<bool>({false, true, false}));
}

TEST(Pareto, MatchesTheDefinitionOnRandomPointsWithTiesInAnyOrder) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> coord(0, 5);  // a coarse grid makes ties frequent
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % 17;
    std::vector<sim::ParetoPoint> p;
    for (int i = 0; i < n; ++i) p.push_back({coord(rng) * 0.1, coord(rng) * 0.05});
    std::vector<bool> want(n, true);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        const bool dom = p[j].memory <= p[i].memory && p[j].error <= p[i].error &&
                         (p[j].memory < p[i].memory || p[j].error < p[i].error);
        if (dom) want[i] = false;
      }
    }
    ASSERT_EQ(sim::pareto_front(p), want) << "trial " << trial << " n " << n;
    // Reversing the input reverses the answer (no order dependence).
    std::vector<sim::ParetoPoint> rev(p.rbegin(), p.rend());
    std::vector<bool> got = sim::pareto_front(rev);
    std::reverse(got.begin(), got.end());
    ASSERT_EQ(got, want) << "trial " << trial << " reversed";
  }
}

TEST(Pareto, MarkParetoUsesBytesRatioAndOutputError) {
  std::vector<sim::PointResult> points = sample_points();  // marks the front
  ASSERT_EQ(points.size(), 4u);
  EXPECT_TRUE(points[0].pareto);   // h2o@0.3
  EXPECT_TRUE(points[1].pareto);   // h2o@0.6
  EXPECT_FALSE(points[2].pareto);  // random@0.3: same bytes as h2o@0.3, twice the error
  EXPECT_TRUE(points[3].pareto);   // random@0.6 == h2o@0.6
  EXPECT_DOUBLE_EQ(points[0].bytes_ratio(), 0.3);
  // Make random@0.3 cheaper than everything: it joins the front and h2o@0.3 stays (lower error).
  points[2].total.bytes_kept.kv /= 2;
  sim::mark_pareto(points);
  EXPECT_TRUE(points[2].pareto);
  EXPECT_TRUE(points[0].pareto);
}

// ------------------------------------------------------------------------- table

TEST(Table, HelpersFormatLayersAndFlagNames) {
  EXPECT_EQ(sim::format_layer_ranges({9, 3, 4, 5, 12, 4}), "L3-L5,L9,L12");
  EXPECT_EQ(sim::format_layer_ranges({7}), "L7");
  EXPECT_EQ(sim::format_layer_ranges({}), "");
  EXPECT_EQ(sim::flag_short_name("visual_blindness"), "blind");
  EXPECT_EQ(sim::flag_short_name("over_compression"), "overcomp");
  EXPECT_EQ(sim::flag_short_name("custom_mode"), "custom_mode");
}

TEST(Table, OneRowPerPointWithParetoMarkAndFlags) {
  sim::TableOptions run_order;
  run_order.rank_by = "none";
  const std::string table = sim::format_table(sample_points(), run_order);
  const std::vector<std::string> lines = lines_of(table);
  ASSERT_GE(lines.size(), 6u);
  EXPECT_NE(lines[0].find("policy"), std::string::npos);
  EXPECT_NE(lines[0].find("R_vision"), std::string::npos);
  EXPECT_EQ(lines[0].find("R_audio"), std::string::npos) << "no audio tokens, no audio column";
  const char* want_start[] = {"h2o     0.3", "h2o     0.6", "random  0.3", "random  0.6"};
  for (int r = 0; r < 4; ++r) {
    const std::string& row = lines[2 + r];
    EXPECT_EQ(row.rfind(want_start[r], 0), 0u) << row;
  }
  EXPECT_NE(lines[2].find("70.0"), std::string::npos) << lines[2];  // memory saved at ratio 0.3
  EXPECT_NE(lines[3].find("40.0"), std::string::npos) << lines[3];
  EXPECT_NE(lines[2].find(" * "), std::string::npos) << lines[2];
  EXPECT_EQ(lines[4].find(" * "), std::string::npos) << lines[4];
  EXPECT_NE(lines[2].find("blind(L1-L2)"), std::string::npos) << lines[2];
  EXPECT_NE(lines[4].find("blind(L0-L2) overcomp(L2)"), std::string::npos) << lines[4];
  EXPECT_NE(table.find("Pareto"), std::string::npos) << "legend";
  for (const std::string& l : lines) EXPECT_LE(l.size(), 140u) << l;
}

TEST(Table, AudioColumnAndWidthLimit) {
  sim::TableOptions o;
  o.show_audio = true;
  o.max_width = 110;
  o.legend = false;
  o.rank_by = "none";
  const std::vector<std::string> lines = lines_of(sim::format_table(sample_points(), o));
  ASSERT_EQ(lines.size(), 6u);  // header, rule, 4 rows
  EXPECT_NE(lines[0].find("R_audio"), std::string::npos);
  for (const std::string& l : lines) EXPECT_LE(l.size(), 110u) << l;
  EXPECT_EQ(lines[4].substr(lines[4].size() - 3), "...") << "flags cut at the width limit: " << lines[4];
  EXPECT_NE(lines[2].find("blind(L1-L2)"), std::string::npos) << "short rows are not cut: " << lines[2];
}

TEST(Table, RanksThePoliciesByTheBestProxyAndSaysWhich) {
  std::vector<sim::PointResult> points = sample_points();
  const double recall[] = {0.2, 0.9, 0.5, 0.7};  // h2o 0.3, h2o 0.6, random 0.3, random 0.6
  int rank = -1;                                 // the default rank proxy's index in Proxies
  for (int k = 0; k < sim::kNumProxies; ++k)
    if (std::string(sim::proxy_name(k)) == sim::kDefaultRankProxy) rank = k;
  ASSERT_GE(rank, 0) << "the default rank proxy is a recall of Proxies";
  for (std::size_t i = 0; i < points.size() && i < 4; ++i)
    sim::proxy_value(points[i].total.quality.proxies, rank) = recall[i];
  const std::vector<std::string> lines = lines_of(sim::format_table(points));
  ASSERT_GE(lines.size(), 6u);
  EXPECT_EQ(lines[0].rfind(std::string("ranked by ") + sim::kDefaultRankProxy + ", best first", 0), 0u)
      << lines[0];
  EXPECT_NE(lines[1].find(sim::kDefaultRankProxy), std::string::npos) << "its column: " << lines[1];
  const char* want_start[] = {"h2o     0.6", "random  0.6", "random  0.3", "h2o     0.3"};
  for (int r = 0; r < 4; ++r) EXPECT_EQ(lines[3 + r].rfind(want_start[r], 0), 0u) << lines[3 + r];
  // An error proxy ranks smaller first; an unknown name is refused.
  sim::TableOptions o;
  o.rank_by = "error_worst_head";
  for (std::size_t i = 0; i < points.size() && i < 4; ++i)
    points[i].total.quality.proxies.error_worst_head = recall[i];
  const std::vector<std::string> by_err = lines_of(sim::format_table(points, o));
  EXPECT_EQ(by_err[3].rfind("h2o     0.3", 0), 0u) << by_err[3];
  o.rank_by = "nope";
  EXPECT_THROW(sim::format_table(points, o), std::invalid_argument);
}

// ------------------------------------------------------------------------- CSV

TEST(Csv, RowsColumnsAndValues) {
  const fs::path dir = temp_dir("csv");
  const std::string path = (dir / "r.csv").string();
  const std::vector<sim::PointResult> points = sample_points();
  sim::write_csv(path, points, sample_meta());
  EXPECT_FALSE(fs::exists(path + ".partial"));
  std::ifstream is(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(is, l);) lines.push_back(l);
  // points x (layers + all) x (text, vision, all) + header
  ASSERT_EQ(lines.size(), 1u + 4u * (3u + 1u) * (2u + 1u));
  EXPECT_EQ(
      lines[0],
      "policy,budget,layer,modality,bytes_full,bytes_kept,bytes_ratio,output_error,attention_recall,kl,"
      "entropy_delta,flags,tokens,kept,merged,evicted,share_before,share_after,pareto,budget_value,"
      "bytes_full_end,bytes_end,bytes_peak,mode,kind,error_worst_query,error_worst_head,error_retrieval,"
      "concentration,error_propagated,topk_recall,topk_recall_min,topk_recall_retrieval,topk_mass");
  const std::vector<std::string> header = split(lines[0]);
  auto col = [&](const std::string& name) {
    return static_cast<std::size_t>(std::find(header.begin(), header.end(), name) - header.begin());
  };
  // Row order: point, layer (0..2 then all), modality (text, vision, all).
  const std::vector<std::string> r = split(lines[1 + 0 * 12 + 1 * 3 + 1]);  // h2o@0.3, layer 1, vision
  ASSERT_EQ(r.size(), header.size());
  const sim::LayerResult& l1 = points[0].layers[1];
  EXPECT_EQ(r[col("policy")], "h2o");
  EXPECT_EQ(r[col("budget")], "0.3");
  EXPECT_EQ(r[col("layer")], "1");
  EXPECT_EQ(r[col("modality")], "vision");
  EXPECT_EQ(std::stoll(r[col("bytes_full")]), 2 * 80 * 32);
  EXPECT_EQ(std::stoll(r[col("bytes_kept")]), 2 * 24 * 32);
  EXPECT_EQ(std::stod(r[col("bytes_ratio")]), 0.3);
  EXPECT_EQ(std::stod(r[col("attention_recall")]), l1.total.quality.recall_modality[1]);  // round trip exact
  EXPECT_EQ(std::stod(r[col("output_error")]), l1.total.quality.output_error);
  EXPECT_EQ(std::stod(r[col("kl")]), l1.total.quality.kl);
  EXPECT_EQ(r[col("flags")], "visual_blindness");
  EXPECT_EQ(r[col("tokens")], "160");
  EXPECT_EQ(r[col("kept")], "48");
  EXPECT_EQ(r[col("evicted")], "112");
  EXPECT_EQ(r[col("pareto")], "1");
  EXPECT_EQ(r[col("mode")], points[0].mode);
  EXPECT_EQ(std::stoll(r[col("bytes_end")]), l1.total.bytes_end);  // per layer, repeated on modality rows
  EXPECT_EQ(std::stoll(r[col("bytes_peak")]), l1.total.bytes_peak);
  EXPECT_EQ(std::stoll(r[col("bytes_full_end")]), l1.total.bytes_full_end);
  EXPECT_EQ(split(lines[1 + 0 * 12 + 0 * 3 + 0])[col("flags")], "") << "h2o@0.3 layer 0 has no flag";

  const std::vector<std::string> a = split(lines[1 + 2 * 12 + 3 * 3 + 2]);  // random@0.3, all, all
  EXPECT_EQ(a[col("layer")], "all");
  EXPECT_EQ(a[col("modality")], "all");
  EXPECT_EQ(std::stoll(a[col("bytes_full")]), 3 * 2 * 100 * 32);
  EXPECT_EQ(std::stod(a[col("attention_recall")]), points[2].total.quality.attention_recall);
  EXPECT_EQ(a[col("flags")], "visual_blindness;over_compression");
  EXPECT_EQ(a[col("pareto")], "0");
  EXPECT_EQ(std::stod(a[col("share_before")]), 0.3 + 0.7);
  fs::remove_all(dir);
}

TEST(Csv, QuotesNamesWithCommas) {
  const fs::path dir = temp_dir("csv_quote");
  std::vector<sim::PointResult> points = {sample_points()[0]};
  points[0].policy = "my,policy \"x\"";
  sim::write_csv((dir / "q.csv").string(), points, sample_meta());
  std::ifstream is(dir / "q.csv");
  std::string header, row;
  std::getline(is, header);
  std::getline(is, row);
  EXPECT_EQ(row.rfind("\"my,policy \"\"x\"\"\",0.3,0,text,", 0), 0u) << row;
  fs::remove_all(dir);
}

// ------------------------------------------------------------------------- HDF5

namespace {

struct H5 {
  hid_t id;
  herr_t (*close)(hid_t);
  ~H5() {
    if (id >= 0) close(id);
  }
};

std::string read_attr_string(hid_t obj, const char* name) {
  H5 a{H5Aopen(obj, name, H5P_DEFAULT), H5Aclose};
  EXPECT_GE(a.id, 0) << name;
  H5 t{H5Aget_type(a.id), H5Tclose};
  EXPECT_TRUE(H5Tis_variable_str(t.id) > 0) << name;
  char* s = nullptr;
  H5 mt{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(mt.id, H5T_VARIABLE);
  H5Tset_cset(mt.id, H5T_CSET_UTF8);
  EXPECT_GE(H5Aread(a.id, mt.id, &s), 0) << name;
  std::string out = s ? s : "";
  H5free_memory(s);
  return out;
}

std::int64_t read_attr_i64(hid_t obj, const char* name) {
  H5 a{H5Aopen(obj, name, H5P_DEFAULT), H5Aclose};
  std::int64_t v = -99;
  EXPECT_GE(H5Aread(a.id, H5T_NATIVE_INT64, &v), 0) << name;
  return v;
}

template <typename T>
std::vector<T> read_dataset(hid_t file, const char* path, hid_t memtype, std::vector<hsize_t>* dims) {
  H5 d{H5Dopen2(file, path, H5P_DEFAULT), H5Dclose};
  EXPECT_GE(d.id, 0) << path;
  H5 s{H5Dget_space(d.id), H5Sclose};
  dims->assign(static_cast<std::size_t>(H5Sget_simple_extent_ndims(s.id)), 0);
  H5Sget_simple_extent_dims(s.id, dims->data(), nullptr);
  std::vector<T> v(static_cast<std::size_t>(H5Sget_simple_extent_npoints(s.id)));
  if (!v.empty()) {
    EXPECT_GE(H5Dread(d.id, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0) << path;
  }
  return v;
}

std::vector<std::string> read_strings(hid_t file, const char* path) {
  std::vector<hsize_t> dims;
  H5 mt{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(mt.id, H5T_VARIABLE);
  H5Tset_cset(mt.id, H5T_CSET_UTF8);
  std::vector<char*> raw = read_dataset<char*>(file, path, mt.id, &dims);
  std::vector<std::string> out;
  for (char* s : raw) {
    out.push_back(s ? s : "");
    H5free_memory(s);
  }
  return out;
}

}  // namespace

TEST(Hdf5, RoundTripWithTheCApi) {
  const fs::path dir = temp_dir("h5");
  const std::string path = (dir / "r.h5").string();
  std::vector<sim::PointResult> points = sample_points();
  points[3].layers[2].heads.pop_back();  // a missing head row is padded, not invented
  sim::write_hdf5(path, points, sample_meta());
  EXPECT_FALSE(fs::exists(path + ".partial"));

  H5 f{H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose};
  ASSERT_GE(f.id, 0);
  EXPECT_EQ(read_attr_string(f.id, "format"), "kvscope-results");
  EXPECT_EQ(read_attr_string(f.id, "version"), "1.5");
  EXPECT_EQ(read_attr_string(f.id, "model_name"), "tiny");
  EXPECT_EQ(read_attr_string(f.id, "created"), "2024-01-02T03:04:05Z");
  EXPECT_EQ(read_attr_string(f.id, "command_line"), sample_meta().command_line);
  EXPECT_EQ(read_attr_i64(f.id, "num_points"), 4);
  EXPECT_EQ(read_attr_i64(f.id, "num_layers"), 3);
  EXPECT_EQ(read_attr_i64(f.id, "num_kv_heads"), 2);
  EXPECT_EQ(read_attr_i64(f.id, "synthetic"), 1);

  EXPECT_EQ(read_strings(f.id, "/points/policy"),
            std::vector<std::string>({"h2o", "h2o", "random", "random"}));
  EXPECT_EQ(read_strings(f.id, "/points/budget"), std::vector<std::string>({"0.3", "0.6", "0.3", "0.6"}));
  std::vector<hsize_t> dims;
  const auto pareto = read_dataset<std::uint8_t>(f.id, "/points/pareto", H5T_NATIVE_UINT8, &dims);
  EXPECT_EQ(pareto, std::vector<std::uint8_t>({1, 1, 0, 1}));
  const auto ratio = read_dataset<double>(f.id, "/points/bytes_ratio", H5T_NATIVE_DOUBLE, &dims);
  const auto err = read_dataset<double>(f.id, "/points/output_error", H5T_NATIVE_DOUBLE, &dims);
  for (int p = 0; p < 4; ++p) {
    EXPECT_EQ(ratio[p], points[p].bytes_ratio());
    EXPECT_EQ(err[p], points[p].total.quality.output_error);
  }

  const auto lerr = read_dataset<double>(f.id, "/layers/output_error", H5T_NATIVE_DOUBLE, &dims);
  ASSERT_EQ(dims, std::vector<hsize_t>({4, 3}));
  EXPECT_EQ(lerr[2 * 3 + 1], points[2].layers[1].total.quality.output_error);
  const auto lrec = read_dataset<double>(f.id, "/layers/recall_modality", H5T_NATIVE_DOUBLE, &dims);
  ASSERT_EQ(dims, std::vector<hsize_t>({4, 3, 4}));
  EXPECT_EQ(lrec[(1 * 3 + 2) * 4 + 1], points[1].layers[2].total.quality.recall_modality[1]);
  const auto ltok = read_dataset<std::int64_t>(f.id, "/layers/kept", H5T_NATIVE_INT64, &dims);
  EXPECT_EQ(ltok[(0 * 3 + 0) * 4 + 1], 2 * 24);

  const auto hkept = read_dataset<std::int64_t>(f.id, "/heads/bytes_kept", H5T_NATIVE_INT64, &dims);
  ASSERT_EQ(dims, std::vector<hsize_t>({4, 3, 2}));
  EXPECT_EQ(hkept[(1 * 3 + 0) * 2 + 1], 60 * 32);
  const auto hhead = read_dataset<std::int32_t>(f.id, "/heads/kv_head", H5T_NATIVE_INT32, &dims);
  EXPECT_EQ(hhead[(3 * 3 + 2) * 2 + 0], 0);
  EXPECT_EQ(hhead[(3 * 3 + 2) * 2 + 1], -1) << "padding for the missing head";
  const auto herr = read_dataset<double>(f.id, "/heads/output_error", H5T_NATIVE_DOUBLE, &dims);
  EXPECT_TRUE(std::isnan(herr[(3 * 3 + 2) * 2 + 1]));
  EXPECT_EQ(herr[(0 * 3 + 1) * 2 + 1], points[0].layers[1].heads[1].quality.output_error);

  EXPECT_EQ(read_strings(f.id, "/flags/mode"),
            std::vector<std::string>({"visual_blindness", "visual_blindness", "over_compression"}));
  EXPECT_EQ(read_strings(f.id, "/flags/layers"), std::vector<std::string>({"1,2", "0,1,2", "2"}));
  const auto fpoint = read_dataset<std::int32_t>(f.id, "/flags/point", H5T_NATIVE_INT32, &dims);
  EXPECT_EQ(fpoint, std::vector<std::int32_t>({0, 2, 2}));
  const auto mask = read_dataset<std::uint8_t>(f.id, "/flags/layer_mask", H5T_NATIVE_UINT8, &dims);
  ASSERT_EQ(dims, std::vector<hsize_t>({3, 3}));
  EXPECT_EQ(mask, std::vector<std::uint8_t>({0, 1, 1, 1, 1, 1, 0, 0, 1}));
  {
    H5 d{H5Dopen2(f.id, "/layers/kl", H5P_DEFAULT), H5Dclose};
    EXPECT_FALSE(read_attr_string(d.id, "description").empty());
  }
  f.close(f.id);
  f.id = -1;
  fs::remove_all(dir);
}

TEST(Hdf5, EmptyResultsStillMakeAValidFile) {
  const fs::path dir = temp_dir("h5_empty");
  const std::string path = (dir / "e.h5").string();
  sim::write_hdf5(path, {}, sample_meta());
  H5 f{H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose};
  ASSERT_GE(f.id, 0);
  EXPECT_EQ(read_attr_i64(f.id, "num_points"), 0);
  std::vector<hsize_t> dims;
  read_dataset<std::int32_t>(f.id, "/flags/point", H5T_NATIVE_INT32, &dims);
  EXPECT_EQ(dims, std::vector<hsize_t>({0}));
  read_dataset<double>(f.id, "/layers/output_error", H5T_NATIVE_DOUBLE, &dims);
  EXPECT_EQ(dims, std::vector<hsize_t>({0, 3}));
}

// ------------------------------------------------------------------------- failing writes

TEST(FailingWrite, UnwritableDirectoryThrowsAndLeavesNoFile) {
  const fs::path dir = temp_dir("fail");
  const fs::path missing = dir / "no" / "such" / "dir";
  for (const char* ext : {"r.h5", "r.csv"}) {
    const std::string path = (missing / ext).string();
    try {
      if (std::string(ext).ends_with(".h5")) {
        sim::write_hdf5(path, sample_points(), sample_meta());
      } else {
        sim::write_csv(path, sample_points(), sample_meta());
      }
      ADD_FAILURE() << "no exception for " << path;
    } catch (const sim::ReportError& e) {
      EXPECT_EQ(e.path(), path);
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(path));
    EXPECT_FALSE(fs::exists(path + ".partial"));
  }
  fs::remove_all(dir);
}

TEST(FailingWrite, RenameOntoADirectoryRemovesThePartialFile) {
  const fs::path dir = temp_dir("fail_rename");
  for (const char* name : {"taken.h5", "taken.csv"}) {
    const fs::path target = dir / name;
    fs::create_directories(target / "inside");  // a non-empty directory cannot be replaced by a file
    const std::string path = target.string();
    if (std::string(name).ends_with(".h5")) {
      EXPECT_THROW(sim::write_hdf5(path, sample_points(), sample_meta()), sim::ReportError);
    } else {
      EXPECT_THROW(sim::write_csv(path, sample_points(), sample_meta()), sim::ReportError);
    }
    EXPECT_TRUE(fs::is_directory(target));
    EXPECT_FALSE(fs::exists(path + ".partial"));
  }
  fs::remove_all(dir);
}
