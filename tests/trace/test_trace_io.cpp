// Trace format v1: writer/reader round trips for every dtype, (layer, head)
// slices, profile records, bounded memory, and every bad-input case.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/resource.h>

#include <cstdlib>
#include <filesystem>

#include "bad_traces.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/validate.hpp"
#include "kvscope/trace/writer.hpp"
#include "scratch.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::trace;

namespace {

fs::path temp_dir() { return kvscope::testing::scratch_dir(); }

// A tiny hand-made trace: 2 layers, Hq 4, Hkv 2, D 3, T 5, S 2, values encode their index.
struct Handmade {
  TraceHeader header;
  Tokens tokens;
  std::size_t T = 5, S = 2;
  Handmade(DType dtype) {
    header.geometry = {2, 4, 2, 3, 500000.0, "handmade"};
    header.dtype = dtype;
    header.creator = "test";
    header.device = "cpu";
    tokens.modality = {3, 0, 1, 1, 0};
    tokens.position = {0, 1, 2, 3, 4};
    tokens.token_id = {1, 42, -1, -1, 7};
    tokens.segment = {0, 0, 1, 1, 2};
    tokens.grid_row = {-1, -1, 0, 0, -1};
    tokens.grid_col = {-1, -1, 0, 1, -1};
    tokens.text = {"<s>", "héllo", "", "", "?"};
  }
  static float value(int layer, int which, std::size_t i) { return 0.25f * static_cast<float>(i) + 100.0f * layer + 1000.0f * which; }
  std::vector<std::byte> tensor(int layer, int which, std::size_t n) const {
    std::vector<std::byte> b(n * kernels::dtype_bytes(header.dtype));
    for (std::size_t i = 0; i < n; ++i) kernels::store_element(b.data(), header.dtype, i, value(layer, which, i));
    return b;
  }
  void write(const std::string& path, bool close = true) const {
    TraceWriter w(path, header, T, S);
    w.write_tokens(tokens);
    w.write_decode_tokens({5, 6}, {5, 6}, {"a", "b"});
    for (int l = 0; l < 2; ++l) {
      const auto q = tensor(l, 0, 4 * T * 3), k = tensor(l, 1, 2 * T * 3), v = tensor(l, 2, 2 * T * 3);
      w.write_layer(l, {q.data(), header.dtype, {4, T, 3}}, {k.data(), header.dtype, {2, T, 3}},
                    {v.data(), header.dtype, {2, T, 3}});
      const auto dq = tensor(l, 3, 4 * S * 3), dk = tensor(l, 4, 2 * S * 3), dv = tensor(l, 5, 2 * S * 3);
      w.write_decode_layer(l, {dq.data(), header.dtype, {4, S, 3}}, {dk.data(), header.dtype, {2, S, 3}},
                           {dv.data(), header.dtype, {2, S, 3}});
    }
    Profile p;
    p.kernels.push_back({"flash_fwd", 10, 20, 7, 0, {1, 2, 3}, {128, 1, 1}, 0, "kernel"});
    p.kernels.push_back({"copy", 30, 45, 8, 0, {0, 0, 0}, {0, 0, 0}, 4096, "memcpy_dtoh"});
    p.ranges.push_back({"layer 0", 5, 50, 0, 1});
    p.ranges.push_back({"attention", 6, 25, 1, 1});
    w.write_profile(p);
    if (close) w.close();
  }
};

class TraceRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(TraceRoundTrip, EveryFieldReadsBackExactly) {
  const DType dt = GetParam();
  const std::string path = (temp_dir() / (std::string("rt_") + kernels::dtype_name(dt) + ".h5")).string();
  Handmade h(dt);
  h.write(path);
  TraceReader r(path);
  EXPECT_EQ(r.header().geometry.num_layers, 2);
  EXPECT_EQ(r.header().geometry.num_q_heads, 4);
  EXPECT_EQ(r.header().geometry.num_kv_heads, 2);
  EXPECT_EQ(r.header().geometry.head_dim, 3);
  EXPECT_DOUBLE_EQ(r.header().geometry.rope_theta, 500000.0);
  EXPECT_EQ(r.header().geometry.model_name, "handmade");
  EXPECT_EQ(r.header().dtype, dt);
  EXPECT_FALSE(r.header().synthetic);
  EXPECT_TRUE(r.header().complete);
  EXPECT_EQ(r.header().creator, "test");
  EXPECT_FALSE(r.header().created.empty());
  EXPECT_EQ(r.num_tokens(), 5u);
  EXPECT_EQ(r.num_decode_steps(), 2u);
  EXPECT_EQ(r.tokens().modality, h.tokens.modality);
  EXPECT_EQ(r.tokens().token_id, h.tokens.token_id);
  EXPECT_EQ(r.tokens().segment, h.tokens.segment);
  EXPECT_EQ(r.tokens().grid_col, h.tokens.grid_col);
  EXPECT_EQ(r.tokens().text, h.tokens.text);
  EXPECT_EQ(r.decode_tokens().token_id, (std::vector<std::int32_t>{5, 6}));
  for (int l = 0; l < 2; ++l) {
    const LayerTensors t = r.read_layer(l);
    ASSERT_EQ(t.q.shape, (std::vector<std::size_t>{4, 5, 3}));
    ASSERT_EQ(t.k.shape, (std::vector<std::size_t>{2, 5, 3}));
    for (std::size_t i = 0; i < t.k.numel(); ++i) {
      // 0.25 steps up to 2000 are exact in float16 only below 512; compare through the same rounding.
      std::vector<std::byte> want(kernels::dtype_bytes(dt));
      kernels::store_element(want.data(), dt, 0, Handmade::value(l, 1, i));
      ASSERT_EQ(t.k.at(i), kernels::load_element(want.data(), dt, 0)) << "layer " << l << " k[" << i << "]";
    }
    const Tensor head = r.read_head(l, TensorKind::kV, 1);
    ASSERT_EQ(head.shape, (std::vector<std::size_t>{1, 5, 3}));
    for (std::size_t i = 0; i < head.numel(); ++i) ASSERT_EQ(head.at(i), t.v.at(15 + i));
    const LayerTensors d = r.read_decode_layer(l);
    ASSERT_EQ(d.q.shape, (std::vector<std::size_t>{4, 2, 3}));
  }
  const Profile p = r.read_profile();
  ASSERT_EQ(p.kernels.size(), 2u);
  EXPECT_EQ(p.kernels[0].name, "flash_fwd");
  EXPECT_EQ(p.kernels[0].grid[2], 3);
  EXPECT_EQ(p.kernels[1].bytes, 4096);
  EXPECT_EQ(p.kernels[1].kind, "memcpy_dtoh");
  ASSERT_EQ(p.ranges.size(), 2u);
  EXPECT_EQ(p.ranges[1].name, "attention");
  EXPECT_EQ(p.ranges[1].depth, 1);
  EXPECT_TRUE(validate_trace(path).ok) << validate_trace(path).message;
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, TraceRoundTrip, ::testing::Values(DType::kF16, DType::kBF16, DType::kF32),
                         [](const auto& info) { return std::string(kernels::dtype_name(info.param)); });

TEST(TraceWriter, RejectsWrongShapeDtypeAndDoubleWrites) {
  const std::string path = (temp_dir() / "writer_errors.h5").string();
  Handmade h(DType::kF32);
  TraceWriter w(path, h.header, h.T, h.S);
  std::vector<float> buf(4 * 5 * 3);
  const TensorView q{buf.data(), DType::kF32, {4, 5, 3}}, kv{buf.data(), DType::kF32, {2, 5, 3}};
  EXPECT_THROW(w.write_layer(0, {buf.data(), DType::kF32, {4, 6, 3}}, kv, kv), TraceError);
  EXPECT_THROW(w.write_layer(0, {buf.data(), DType::kF16, {4, 5, 3}}, kv, kv), TraceError);
  EXPECT_THROW(w.write_layer(7, q, kv, kv), TraceError);
  w.write_layer(0, q, kv, kv);
  EXPECT_THROW(w.write_layer(0, q, kv, kv), TraceError);
  Tokens bad = h.tokens;
  bad.modality[1] = 9;
  EXPECT_THROW(w.write_tokens(bad), TraceError);
  // close() refuses to mark a trace complete while layers are missing.
  try {
    w.close();
    FAIL() << "close() accepted a trace without layer 1";
  } catch (const TraceError& e) {
    EXPECT_NE(std::string(e.what()).find("/tokens"), std::string::npos) << e.what();
  }
}

class BadTrace : public ::testing::TestWithParam<std::size_t> {};

TEST_P(BadTrace, RejectedWithOneLineNamingFileAndDataset) {
  const auto cases = kvscope::testing::bad_cases();
  const kvscope::testing::BadCase& c = cases[GetParam()];
  const std::string path = (temp_dir() / (c.name + ".h5")).string();
  fs::remove(path);
  c.make(path);
  const ValidationReport rep = validate_trace(path);
  EXPECT_FALSE(rep.ok) << c.name;
  EXPECT_NE(rep.message.find(path), std::string::npos) << c.name << ": " << rep.message;
  EXPECT_NE(rep.message.find(c.expect), std::string::npos) << c.name << ": '" << rep.message << "' lacks '" << c.expect << "'";
  EXPECT_EQ(rep.message.find('\n'), std::string::npos) << c.name << ": message is not one line";
  // The reader used by every tool rejects it the same way (or, for NaN, when the tensor is read).
  EXPECT_THROW(
      {
        TraceReader r(path);
        for (int l = 0; l < r.layers_present(); ++l) {
          (void)r.read_layer(l);
          (void)r.read_decode_layer(l);
        }
      },
      TraceError)
      << c.name;
}

INSTANTIATE_TEST_SUITE_P(AllCases, BadTrace, ::testing::Range<std::size_t>(0, kvscope::testing::bad_cases().size()),
                         [](const auto& info) { return kvscope::testing::bad_cases()[info.param].name; });

TEST(TraceValidate, IncompleteTraceSaysWhatItContains) {
  const std::string path = (temp_dir() / "partial.h5").string();
  Handmade h(DType::kF16);
  {
    TraceWriter w(path, h.header, h.T, h.S);
    w.write_tokens(h.tokens);
    const auto q = h.tensor(0, 0, 4 * 5 * 3), k = h.tensor(0, 1, 2 * 5 * 3);
    w.write_layer(0, {q.data(), DType::kF16, {4, 5, 3}}, {k.data(), DType::kF16, {2, 5, 3}},
                  {k.data(), DType::kF16, {2, 5, 3}});
  }  // destroyed without close(): the capture "crashed" after layer 0
  const ValidationReport rep = validate_trace(path);
  EXPECT_FALSE(rep.ok);
  EXPECT_TRUE(rep.incomplete);
  EXPECT_EQ(rep.layers_present, 1);
  EXPECT_NE(rep.message.find("incomplete trace"), std::string::npos) << rep.message;
  EXPECT_NE(rep.message.find("1 of 2 prefill layers"), std::string::npos) << rep.message;
}

long max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// What the reader would refuse, the writer refuses before creating the file.
TEST(TraceWriter, RefusesWhatTheReaderWouldRefuse) {
  const std::string path = (temp_dir() / "refused.h5").string();
  auto expect_usage = [&](TraceHeader hd, std::size_t T, std::size_t S, const std::string& fragment) {
    try {
      TraceWriter w(path, hd, T, S);
      ADD_FAILURE() << "accepted: " << fragment;
    } catch (const TraceError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUsage);
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(path));
  };
  TraceHeader hd;
  hd.geometry = {2, 4, 2, 32, 10000.0, "x"};
  TraceHeader bad = hd;
  bad.geometry.rope_theta = 0;
  expect_usage(bad, 8, 1, "rope_theta must be a finite number > 0");
  bad = hd;
  bad.geometry.num_q_heads = bad.geometry.num_kv_heads = 2048;
  expect_usage(bad, 8, 1, "limits");
  expect_usage(hd, std::size_t{1} << 25, 1, "limits");
}

TEST(TraceReader, PeakMemoryIsBoundedByOneLayer) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan's quarantine keeps freed memory resident: RSS says nothing here";
#endif
  // 24 layers x 12 MiB; reading all of them must not grow the peak RSS by more than a few layers.
  const std::string path = (temp_dir() / "deep.h5").string();
  TraceHeader hd;
  hd.geometry = {24, 8, 8, 64, 10000.0, "deep"};
  hd.dtype = DType::kF32;
  const std::size_t T = 2048, S = 1;
  const std::size_t layer_bytes = 3 * 8 * T * 64 * 4;
  {
    TraceWriter w(path, hd, T, S);
    Tokens t;
    t.modality.assign(T, 0);
    t.position.resize(T);
    t.token_id.assign(T, 0);
    t.segment.assign(T, 0);
    t.grid_row.assign(T, -1);
    t.grid_col.assign(T, -1);
    w.write_tokens(t);
    w.write_decode_tokens({0}, {static_cast<std::int32_t>(T)});
    std::vector<float> buf(8 * T * 64, 0.5f);
    const TensorView x{buf.data(), DType::kF32, {8, T, 64}}, d{buf.data(), DType::kF32, {8, S, 64}};
    for (int l = 0; l < 24; ++l) {
      w.write_layer(l, x, x, x);
      w.write_decode_layer(l, d, d, d);
    }
    w.close();
  }
  TraceReader r(path);
  (void)r.read_layer(0);  // warm up allocator and HDF5 caches
  const long before = max_rss_kib();
  double checksum = 0;
  for (int l = 0; l < 24; ++l) {
    const LayerTensors t = r.read_layer(l);
    checksum += t.k.at(t.k.numel() - 1);
  }
  const long grown_kib = max_rss_kib() - before;
  EXPECT_DOUBLE_EQ(checksum, 24 * 0.5);
  EXPECT_LT(static_cast<double>(grown_kib) * 1024.0, 2.0 * static_cast<double>(layer_bytes))
      << "peak RSS grew by " << grown_kib << " KiB while reading 24 layers of " << layer_bytes / 1024 << " KiB";
}

}  // namespace

// ---- token roles (format 1.1, docs/trace-format.md section 2a) ----
namespace {

// A role dataset written with h5py-like raw HDF5 (any integer type), to test what the reader refuses.
void write_raw_roles(const std::string& path, const char* dataset, const std::vector<std::int64_t>& values) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hsize_t n = values.size();
  const hid_t space = H5Screate_simple(1, &n, nullptr);
  const hid_t d = H5Dcreate2(f, dataset, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(d, 0);
  H5Dwrite(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
  H5Dclose(d);
  H5Sclose(space);
  H5Fclose(f);
}

TEST(TraceRoles, WithoutRolesTheTraceStaysVersion10AndReadsWithDefaults) {
  const std::string path = (temp_dir() / "roles_none.h5").string();
  Handmade(DType::kF16).write(path);
  TraceReader r(path);
  EXPECT_EQ(r.header().version_minor, 0);  // byte for byte what a 1.0 writer wrote
  EXPECT_FALSE(r.has_roles());
  EXPECT_EQ(r.tokens().role, std::vector<std::uint8_t>(5, static_cast<std::uint8_t>(Role::kContext)));
  EXPECT_EQ(r.decode_tokens().role, std::vector<std::uint8_t>(2, static_cast<std::uint8_t>(Role::kAnswer)));
}

TEST(TraceRoles, RolesRoundTripAndMakeTheTraceVersion11) {
  const std::string path = (temp_dir() / "roles_rt.h5").string();
  Handmade h(DType::kF32);
  h.tokens.role = {3, 0, 0, 0, 1};
  {
    TraceWriter w(path, h.header, h.T, h.S);
    w.write_tokens(h.tokens);
    w.write_decode_tokens({5, 6}, {5, 6}, {}, {1, 2});
    for (int l = 0; l < 2; ++l) {
      const auto q = h.tensor(l, 0, 4 * 5 * 3), k = h.tensor(l, 1, 2 * 5 * 3);
      w.write_layer(l, {q.data(), DType::kF32, {4, 5, 3}}, {k.data(), DType::kF32, {2, 5, 3}},
                    {k.data(), DType::kF32, {2, 5, 3}});
      const auto dq = h.tensor(l, 3, 4 * 2 * 3), dk = h.tensor(l, 4, 2 * 2 * 3);
      w.write_decode_layer(l, {dq.data(), DType::kF32, {4, 2, 3}}, {dk.data(), DType::kF32, {2, 2, 3}},
                           {dk.data(), DType::kF32, {2, 2, 3}});
    }
    w.close();
  }
  TraceReader r(path);
  EXPECT_EQ(r.header().version_minor, 1);
  EXPECT_TRUE(r.has_roles());
  EXPECT_EQ(r.tokens().role, (std::vector<std::uint8_t>{3, 0, 0, 0, 1}));
  EXPECT_EQ(r.decode_tokens().role, (std::vector<std::uint8_t>{1, 2}));
  const ValidationReport v = validate_trace(path);
  EXPECT_TRUE(v.ok) << v.message;
  EXPECT_NE(v.message.find("v1.1"), std::string::npos) << v.message;
}

TEST(TraceRoles, WriterAddsTokenRolesLaterAndRefusesBadCodes) {
  const std::string path = (temp_dir() / "roles_late.h5").string();
  Handmade h(DType::kF16);
  {
    TraceWriter w(path, h.header, h.T, h.S);
    w.write_tokens(h.tokens);
    w.write_token_roles({0, 0, 0, 1, 3});
    EXPECT_THROW(w.write_token_roles({0, 0, 0, 1, 3}), TraceError);  // twice
    try {
      w.write_decode_tokens({5, 6}, {5, 6}, {}, {2, 9});
      ADD_FAILURE() << "role code 9 accepted";
    } catch (const TraceError& e) {
      EXPECT_NE(std::string(e.what()).find("bad role code 9 at index 1"), std::string::npos) << e.what();
    }
  }
  TraceReader r(path, ReaderOptions{false, true});
  EXPECT_EQ(r.tokens().role, (std::vector<std::uint8_t>{0, 0, 0, 1, 3}));
  EXPECT_EQ(r.header().version_minor, 1);
}

TEST(TraceRoles, ReaderRefusesBadRoleCodesAndShapesInOneLine) {
  struct Case {
    const char* dataset;
    std::vector<std::int64_t> values;
    const char* expected;
  };
  const Case cases[] = {
      {"/tokens/role",
       {0, 0, 7, 0, 0},
       "/tokens/role: bad role code 7 at index 2 (allowed: 0 context, 1 question"},
      {"/tokens/role", {0, 0, 0, 0, -1}, "/tokens/role: bad role code -1 at index 4"},
      {"/decode/tokens/role", {2, 300}, "/decode/tokens/role: bad role code 300 at index 1"},
      {"/tokens/role", {0, 0}, "/tokens/role: shape (2)"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string path = (temp_dir() / ("roles_bad" + std::to_string(i++) + ".h5")).string();
    Handmade(DType::kF16).write(path);
    write_raw_roles(path, c.dataset, c.values);
    try {
      TraceReader r(path);
      ADD_FAILURE() << c.dataset << " accepted";
    } catch (const TraceError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      EXPECT_EQ(msg.rfind(path, 0), 0u) << msg;
      if (std::string(c.expected).find("shape") != std::string::npos) {
        EXPECT_NE(msg.find("/tokens/role: shape [2], expected [5]"), std::string::npos) << msg;
      } else {
        EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
      }
    }
  }
}

}  // namespace
