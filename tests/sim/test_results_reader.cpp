// read_results_hdf5: round trip through write_hdf5 (every field of every point, layer, head and
// flag comes back), padding rows dropped, and typed errors naming the file and dataset.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "kvscope/sim/results_reader.hpp"
#include "sim/sample_results.hpp"
#include "scratch.hpp"

namespace kvscope::sim {
namespace {

std::string temp_path(const std::string& name) {
  return (kvscope::testing::scratch_dir() / name).string();
}

void expect_bytes_eq(const Bytes& a, const Bytes& b) {
  EXPECT_EQ(a.kv, b.kv);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(a.zeros, b.zeros);
  EXPECT_EQ(a.residual, b.residual);
  EXPECT_EQ(a.multiplicity, b.multiplicity);
  EXPECT_EQ(a.index, b.index);
}

void expect_head_eq(const HeadResult& a, const HeadResult& b) {
  EXPECT_EQ(a.kv_head, b.kv_head);
  expect_bytes_eq(a.bytes_full, b.bytes_full);
  expect_bytes_eq(a.bytes_kept, b.bytes_kept);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.kept, b.kept);
  EXPECT_EQ(a.merged, b.merged);
  EXPECT_EQ(a.evicted, b.evicted);
  EXPECT_EQ(a.bytes_full_modality, b.bytes_full_modality);
  EXPECT_EQ(a.bytes_kept_modality, b.bytes_kept_modality);
  // Doubles are stored as float64: exact equality.
  EXPECT_EQ(a.quality.output_error, b.quality.output_error);
  EXPECT_EQ(a.quality.attention_recall, b.quality.attention_recall);
  EXPECT_EQ(a.quality.kl, b.quality.kl);
  EXPECT_EQ(a.quality.entropy_delta, b.quality.entropy_delta);
  EXPECT_EQ(a.quality.recall_modality, b.quality.recall_modality);
  EXPECT_EQ(a.quality.share_before, b.quality.share_before);
  EXPECT_EQ(a.quality.share_after, b.quality.share_after);
  EXPECT_EQ(a.bytes_full_end, b.bytes_full_end);
  EXPECT_EQ(a.bytes_end, b.bytes_end);
  EXPECT_EQ(a.bytes_peak, b.bytes_peak);
}

// Distinct non-zero format-1.1 fields on every record, so that a reader ignoring or swapping them fails.
void set_decode_fields(std::vector<PointResult>& points) {
  std::int64_t x = 1000;
  auto set = [&](HeadResult& h) {
    h.bytes_full_end = x++;
    h.bytes_end = x++;
    h.bytes_peak = x++;
  };
  for (auto& p : points) {
    set(p.total);
    for (auto& l : p.layers) {
      set(l.total);
      for (auto& h : l.heads) set(h);
    }
  }
  points[1].mode = "decode";
}

TEST(ResultsReader, RoundTripsEveryField) {
  std::vector<PointResult> written = testing::sample_points();
  // Non-trivial components and merge counts so a swapped column would show.
  written[1].layers[2].heads[1].bytes_kept.scales = 7;
  written[1].layers[2].heads[1].bytes_kept.index = 11;
  written[1].layers[2].heads[1].merged[1] = 3;
  written[1].layers[0].merged_heads = 1;
  set_decode_fields(written);
  ResultsMeta meta = testing::sample_meta();
  meta.created = "2026-01-02T03:04:05Z";
  meta.command_line = "kvsim sweep 'a b'";
  const std::string path = temp_path("roundtrip.h5");
  write_hdf5(path, written, meta);

  ResultsMeta got_meta;
  const std::vector<PointResult> got = read_results_hdf5(path, &got_meta);
  EXPECT_EQ(got_meta.trace_path, meta.trace_path);
  EXPECT_EQ(got_meta.model_name, meta.model_name);
  EXPECT_EQ(got_meta.synthetic, meta.synthetic);
  EXPECT_EQ(got_meta.created, meta.created);
  EXPECT_EQ(got_meta.command_line, meta.command_line);
  EXPECT_EQ(got_meta.num_layers, meta.num_layers);
  EXPECT_EQ(got_meta.num_kv_heads, meta.num_kv_heads);
  EXPECT_EQ(got_meta.num_q_heads, meta.num_q_heads);
  EXPECT_EQ(got_meta.head_dim, meta.head_dim);
  EXPECT_EQ(got_meta.num_tokens, meta.num_tokens);
  EXPECT_EQ(got_meta.num_decode_steps, meta.num_decode_steps);
  EXPECT_EQ(got_meta.tokens_per_modality, meta.tokens_per_modality);

  ASSERT_EQ(got.size(), written.size());
  for (std::size_t p = 0; p < got.size(); ++p) {
    SCOPED_TRACE("point " + std::to_string(p));
    EXPECT_EQ(got[p].policy, written[p].policy);
    EXPECT_EQ(got[p].budget, written[p].budget);
    EXPECT_EQ(got[p].mode, written[p].mode);
    EXPECT_EQ(got[p].budget_value, written[p].budget_value);
    EXPECT_EQ(got[p].seconds, written[p].seconds);
    EXPECT_EQ(got[p].pareto, written[p].pareto);
    expect_head_eq(got[p].total, written[p].total);
    ASSERT_EQ(got[p].layers.size(), written[p].layers.size());
    for (std::size_t l = 0; l < got[p].layers.size(); ++l) {
      EXPECT_EQ(got[p].layers[l].layer, written[p].layers[l].layer);
      EXPECT_EQ(got[p].layers[l].merged_heads, written[p].layers[l].merged_heads);
      expect_head_eq(got[p].layers[l].total, written[p].layers[l].total);
      ASSERT_EQ(got[p].layers[l].heads.size(), written[p].layers[l].heads.size());
      for (std::size_t h = 0; h < got[p].layers[l].heads.size(); ++h) {
        expect_head_eq(got[p].layers[l].heads[h], written[p].layers[l].heads[h]);
      }
    }
    ASSERT_EQ(got[p].flags.size(), written[p].flags.size());
    for (std::size_t f = 0; f < got[p].flags.size(); ++f) {
      EXPECT_EQ(got[p].flags[f].mode, written[p].flags[f].mode);
      EXPECT_EQ(got[p].flags[f].layers, written[p].flags[f].layers);
      EXPECT_EQ(got[p].flags[f].evidence, written[p].flags[f].evidence);
      EXPECT_EQ(got[p].flags[f].suggested_fix, written[p].flags[f].suggested_fix);
    }
  }
  // The sample marks exactly three points Pareto-optimal; a reader ignoring the column would not.
  EXPECT_FALSE(got[2].pareto);
  EXPECT_TRUE(got[0].pareto);
}

TEST(ResultsReader, DropsPaddingOfShorterPoints) {
  std::vector<PointResult> written = testing::sample_points();
  written[3].layers.pop_back();           // 2 layers instead of 3
  written[2].layers[1].heads.pop_back();  // 1 head instead of 2 in one layer
  const std::string path = temp_path("padding.h5");
  write_hdf5(path, written, testing::sample_meta());
  const std::vector<PointResult> got = read_results_hdf5(path);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[3].layers.size(), 2u);
  EXPECT_EQ(got[0].layers.size(), 3u);
  EXPECT_EQ(got[2].layers[1].heads.size(), 1u);
  EXPECT_EQ(got[2].layers[0].heads.size(), 2u);
  EXPECT_FALSE(std::isnan(got[2].layers[1].heads[0].quality.output_error));
}

TEST(ResultsReader, EmptySweepHasNoPoints) {
  const std::string path = temp_path("empty.h5");
  write_hdf5(path, {}, testing::sample_meta());
  EXPECT_TRUE(read_results_hdf5(path).empty());
}

void expect_error(const std::string& path, const std::string& object, const std::string& fragment) {
  try {
    read_results_hdf5(path);
    FAIL() << "no error for " << path;
  } catch (const ResultsReadError& e) {
    EXPECT_EQ(e.file(), path);
    EXPECT_EQ(e.object(), object);
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(ResultsReader, MissingFileAndNonHdf5) {
  expect_error(temp_path("does-not-exist.h5"), "", "cannot open");
  const std::string text = temp_path("text.h5");
  FILE* f = std::fopen(text.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("not hdf5\n", f);
  std::fclose(f);
  expect_error(text, "", "cannot open");
}

// Edits a written file with the HDF5 C API to break one thing.
template <typename Edit>
std::string broken_file(const std::string& name, Edit edit) {
  const std::string path = temp_path(name);
  write_hdf5(path, testing::sample_points(), testing::sample_meta());
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  EXPECT_GE(file, 0);
  edit(file);
  H5Fclose(file);
  return path;
}

void set_root_string(hid_t file, const char* name, const char* value) {
  H5Adelete(file, name);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, type, &value);
  H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
}

TEST(ResultsReader, RefusesOtherFormatsAndMajorVersions) {
  expect_error(broken_file("format.h5", [](hid_t f) { set_root_string(f, "format", "kvscope-trace"); }),
               "/@format", "kvscope-trace");
  expect_error(broken_file("version.h5", [](hid_t f) { set_root_string(f, "version", "2.0"); }), "/@version",
               "2.0");
  const std::vector<std::string> malformed{"1.7abc", " 1.0", "1", "1.0.0", "1.-1", "x.1"};
  for (std::size_t i = 0; i < malformed.size(); ++i) {
    expect_error(broken_file("bad_version_" + std::to_string(i) + ".h5",
                             [&](hid_t f) { set_root_string(f, "version", malformed[i].c_str()); }),
                 "/@version", "is not MAJOR.MINOR");
  }
  // A newer minor version only adds things: still readable.
  const std::string minor = broken_file("minor.h5", [](hid_t f) { set_root_string(f, "version", "1.7"); });
  EXPECT_EQ(read_results_hdf5(minor).size(), 4u);
}

TEST(ResultsReader, ReadsFormat10FilesWithoutTheDecodeFields) {
  // A 1.0 file: no bytes_full_end / bytes_end / bytes_peak datasets, no /points/mode.
  const std::string path = temp_path("v10.h5");
  std::vector<PointResult> written = testing::sample_points();
  set_decode_fields(written);
  write_hdf5(path, written, testing::sample_meta());
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const char* g : {"/points", "/layers", "/heads"})
    for (const char* d : {"/bytes_full_end", "/bytes_end", "/bytes_peak"})
      EXPECT_GE(H5Ldelete(f, (std::string(g) + d).c_str(), H5P_DEFAULT), 0);
  EXPECT_GE(H5Ldelete(f, "/points/mode", H5P_DEFAULT), 0);
  set_root_string(f, "version", "1.0");
  H5Fclose(f);
  const std::vector<PointResult> got = read_results_hdf5(path);
  ASSERT_EQ(got.size(), written.size());
  for (const auto& p : got) {
    EXPECT_EQ(p.mode, "prefill");
    EXPECT_EQ(p.total.bytes_end, 0);
    EXPECT_EQ(p.total.bytes_peak, 0);
    EXPECT_EQ(p.layers[0].heads[0].bytes_full_end, 0);
  }
  // Everything 1.0 had still comes back.
  EXPECT_EQ(got[1].total.bytes_kept.total(), written[1].total.bytes_kept.total());
  EXPECT_EQ(got[2].layers[1].heads[1].quality.kl, written[2].layers[1].heads[1].quality.kl);
}

TEST(ResultsReader, KindsRoundTripAndOlderFilesReadTheirOracleRowsAsSearch) {
  std::vector<PointResult> written = testing::sample_points();
  written[2].kind = "bound";
  written[3].kind = "search";
  const std::string path = temp_path("kinds.h5");
  write_hdf5(path, written, testing::sample_meta());
  const std::vector<PointResult> got = read_results_hdf5(path);
  ASSERT_EQ(got.size(), written.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].kind, written[i].kind) << i;
  // A 1.1 file has no /points/kind: its oracle-* rows were the allocation search, the rest policies.
  std::vector<PointResult> before = testing::sample_points();
  before[3].policy = "oracle-h2o";
  const std::string v11 = temp_path("v11-kinds.h5");
  write_hdf5(v11, before, testing::sample_meta());
  const hid_t f = H5Fopen(v11.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  EXPECT_GE(H5Ldelete(f, "/points/kind", H5P_DEFAULT), 0);
  set_root_string(f, "version", "1.1");
  H5Fclose(f);
  const std::vector<PointResult> old = read_results_hdf5(v11);
  ASSERT_EQ(old.size(), before.size());
  for (std::size_t i = 0; i < old.size(); ++i) EXPECT_EQ(old[i].kind, i == 3 ? "search" : "policy") << i;
  expect_error(broken_file("no-kind.h5", [](hid_t f) { H5Ldelete(f, "/points/kind", H5P_DEFAULT); }), "/points/kind",
               "missing dataset");
}

TEST(ResultsReader, ReadsFormat11FilesWithoutTheQuerySets) {
  // A 1.1 file: no query-set datasets (output_error_answer, ...) and no role attributes.
  const std::string path = temp_path("v11.h5");
  std::vector<PointResult> written = testing::sample_points();
  written[1].layers[0].heads[1].quality.query_sets[kAnswerQueries].output_error = 0.125;
  ResultsMeta meta = testing::sample_meta();
  meta.has_roles = true;
  meta.query_set_steps = {3, 2};
  write_hdf5(path, written, meta);
  {
    ResultsMeta back;
    const std::vector<PointResult> got = read_results_hdf5(path, &back);
    EXPECT_TRUE(back.has_roles);
    EXPECT_EQ(back.query_set_steps[kQuestionQueries], 2);
    EXPECT_EQ(got[1].layers[0].heads[1].quality.query_sets[kAnswerQueries].output_error, 0.125);
  }
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const char* g : {"/points", "/layers", "/heads"})
    for (const char* m : {"output_error", "attention_recall", "kl", "entropy_delta"})
      for (const char* set : {"_answer", "_question"})
        EXPECT_GE(H5Ldelete(f, (std::string(g) + "/" + m + set).c_str(), H5P_DEFAULT), 0);
  for (const char* a : {"has_roles", "question_in_context", "answer_queries", "question_queries"})
    EXPECT_GE(H5Adelete(f, a), 0);
  set_root_string(f, "version", "1.1");
  H5Fclose(f);
  ResultsMeta back;
  const std::vector<PointResult> got = read_results_hdf5(path, &back);
  ASSERT_EQ(got.size(), written.size());
  EXPECT_FALSE(back.has_roles);
  EXPECT_TRUE(std::isnan(got[1].layers[0].heads[1].quality.query_sets[kAnswerQueries].output_error));
  EXPECT_TRUE(std::isnan(got[0].total.quality.query_sets[kQuestionQueries].kl));
  EXPECT_EQ(got[2].layers[1].heads[1].quality.kl, written[2].layers[1].heads[1].quality.kl);
  // From 1.2 on they are required.
  expect_error(broken_file("no-answer.h5", [](hid_t h) { H5Ldelete(h, "/layers/kl_answer", H5P_DEFAULT); }),
               "/layers/kl_answer", "missing dataset");
}

TEST(ResultsReader, ReadsTheProxiesOfFormat13AndNaNBefore) {
  const std::string path = temp_path("v13.h5");
  std::vector<PointResult> written = testing::sample_points();
  written[1].layers[0].heads[1].quality.proxies.topk_recall = 0.625;
  written[2].total.quality.proxies.error_worst_query = 1.5;
  write_hdf5(path, written, testing::sample_meta());
  {
    const std::vector<PointResult> got = read_results_hdf5(path);
    EXPECT_EQ(got[1].layers[0].heads[1].quality.proxies.topk_recall, 0.625);
    EXPECT_EQ(got[2].total.quality.proxies.error_worst_query, 1.5);
  }
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const char* g : {"/points", "/layers", "/heads"})
    for (int i = 0; i < kNumProxies; ++i)
      EXPECT_GE(H5Ldelete(f, (std::string(g) + "/" + proxy_name(i)).c_str(), H5P_DEFAULT), 0);
  set_root_string(f, "version", "1.2");
  H5Fclose(f);
  const std::vector<PointResult> got = read_results_hdf5(path);
  ASSERT_EQ(got.size(), written.size());
  EXPECT_TRUE(std::isnan(got[1].layers[0].heads[1].quality.proxies.topk_recall));
  EXPECT_TRUE(std::isnan(got[2].total.quality.proxies.error_worst_query));
  EXPECT_EQ(got[2].layers[1].heads[1].quality.kl, written[2].layers[1].heads[1].quality.kl);
  expect_error(broken_file("no-topk.h5", [](hid_t h) { H5Ldelete(h, "/heads/topk_recall", H5P_DEFAULT); }),
               "/heads/topk_recall", "missing dataset");
}

TEST(ResultsReader, Format11RequiresTheDecodeFields) {
  expect_error(broken_file("no-peak.h5", [](hid_t f) { H5Ldelete(f, "/heads/bytes_peak", H5P_DEFAULT); }),
               "/heads/bytes_peak", "missing dataset");
  expect_error(broken_file("no-mode.h5", [](hid_t f) { H5Ldelete(f, "/points/mode", H5P_DEFAULT); }),
               "/points/mode", "missing dataset");
}

TEST(ResultsReader, NamesMissingAndMisshapenDatasets) {
  expect_error(broken_file("no-kl.h5", [](hid_t f) { H5Ldelete(f, "/layers/kl", H5P_DEFAULT); }),
               "/layers/kl", "missing dataset");
  expect_error(broken_file("no-flags.h5", [](hid_t f) { H5Ldelete(f, "/flags", H5P_DEFAULT); }),
               "/flags/point", "missing dataset");
  const std::string shape = broken_file("shape.h5", [](hid_t f) {
    H5Ldelete(f, "/heads/output_error", H5P_DEFAULT);
    const hsize_t dims[1] = {3};
    const hid_t space = H5Screate_simple(1, dims, nullptr);
    const hid_t d =
        H5Dcreate2(f, "/heads/output_error", H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dclose(d);
    H5Sclose(space);
  });
  expect_error(shape, "/heads/output_error", "shape (3), expected (4, 3, 2)");
}

void set_root_i64(hid_t file, const char* name, std::int64_t value) {
  H5Adelete(file, name);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(file, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &value);
  H5Aclose(a);
  H5Sclose(space);
}

// Sizes a results file declares are checked before anything of that size is allocated.
TEST(ResultsReader, DeclaredSizesAreCheckedBeforeAllocation) {
  expect_error(broken_file("points-1e7.h5", [](hid_t f) { set_root_i64(f, "num_points", 10'000'000); }),
               "/@num_points", "10000000 is more than the limit of 100000");
  expect_error(broken_file("layers-1e5.h5", [](hid_t f) { set_root_i64(f, "num_layers", 100'000); }),
               "/@num_layers", "more than the limit of 1024");
  expect_error(broken_file("rows.h5",
                           [](hid_t f) {
                             set_root_i64(f, "num_points", 100'000);
                             set_root_i64(f, "num_layers", 1024);
                           }),
               "/@num_points", "head rows");
  expect_error(broken_file("points-fraction.h5",
                           [](hid_t f) {
                             H5Adelete(f, "num_points");
                             const double v = 4.5;
                             const hid_t space = H5Screate(H5S_SCALAR);
                             const hid_t at =
                                 H5Acreate2(f, "num_points", H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT);
                             H5Awrite(at, H5T_NATIVE_DOUBLE, &v);
                             H5Aclose(at);
                             H5Sclose(space);
                           }),
               "/@num_points", "must be an integer, got 4.5");
  // A dataset of the declared shape that stores nothing: its strings would be read as empty.
  const std::string unstored = broken_file("unstored.h5", [](hid_t f) {
    set_root_i64(f, "num_points", 20'000);
    H5Ldelete(f, "/points/policy", H5P_DEFAULT);
    const hsize_t dims[1] = {20'000};
    const hid_t space = H5Screate_simple(1, dims, nullptr);
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, H5T_VARIABLE);
    const hid_t d = H5Dcreate2(f, "/points/policy", type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dclose(d);
    H5Tclose(type);
    H5Sclose(space);
  });
  expect_error(unstored, "/points/policy", "the data is not in the file");
  // A corrupt length field of a variable-length string: refused before HDF5 allocates it.
  const std::string path = temp_path("string-length.h5");
  write_hdf5(path, testing::sample_points(), testing::sample_meta());
  haddr_t off = HADDR_UNDEF;
  {
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t d = H5Dopen2(f, "/points/budget", H5P_DEFAULT);
    off = H5Dget_offset(d);
    H5Dclose(d);
    H5Fclose(f);
  }
  ASSERT_NE(off, HADDR_UNDEF);
  {
    std::FILE* fp = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(fp, nullptr);
    const unsigned char huge[4] = {0x05, 0x00, 0x00, 0xF0};  // 4026531845 bytes
    ASSERT_EQ(std::fseek(fp, static_cast<long>(off) + 16, SEEK_SET), 0);
    ASSERT_EQ(std::fwrite(huge, 1, 4, fp), 4u);
    std::fclose(fp);
  }
  expect_error(path, "/points/budget", "string 1: stored length 4026531845 bytes");
}

}  // namespace
}  // namespace kvscope::sim
