// safetensors reader: dtypes, shape checks, and clean errors for truncated or malformed files.
#include <filesystem>
#include <fstream>

#include "kvscope/kernels/common.hpp"
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/safetensors.hpp"
#include "runner_test_util.hpp"

namespace kvscope::runner {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("kvscope_st_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

void write_file(const fs::path& p, const std::string& header, const std::string& data) {
  std::ofstream out(p, std::ios::binary);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << data;
}

template <typename T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string message_of(const fs::path& p) {
  try {
    SafetensorsFile f(p.string());
  } catch (const RunnerError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kModel);
    return e.what();
  }
  return "";
}

TEST(Safetensors, ReadsF32F16Bf16) {
  TempDir dir;
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, 65504.0f};
  std::vector<std::uint16_t> f16, bf16;
  for (float x : f32) {
    f16.push_back(kernels::float_to_half(x));
    bf16.push_back(kernels::float_to_bf16(x));
  }
  const std::string data = bytes_of(f32) + bytes_of(f16) + bytes_of(bf16);
  const std::string header =
      R"({"__metadata__": {"k": "v"}, "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
      R"( "b": {"dtype": "F16", "shape": [6], "data_offsets": [24, 36]},)"
      R"( "c": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [36, 48]}})";
  write_file(dir.path / "t.safetensors", header, data);
  SafetensorsFile f((dir.path / "t.safetensors").string());
  EXPECT_EQ(f.metadata().at("k"), "v");
  EXPECT_EQ(f.to_f32("a", {2, 3}), f32);
  const auto b = f.to_f32("b");
  const auto c = f.to_f32("c");
  for (std::size_t i = 0; i < f32.size(); ++i) {
    EXPECT_NEAR(b[i], f32[i], std::abs(f32[i]) * 1e-3f) << i;
    EXPECT_NEAR(c[i], f32[i], std::abs(f32[i]) * 8e-3f) << i;
  }
  EXPECT_EQ(b[0], 1.5f);  // exactly representable in both
  EXPECT_EQ(c[1], -2.25f);
  try {
    (void)f.to_f32("a", {3, 2});
    ADD_FAILURE() << "shape mismatch not reported";
  } catch (const RunnerError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'a'"), std::string::npos) << m;
    EXPECT_NE(m.find("[2, 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("[3, 2]"), std::string::npos) << m;
  }
  try {
    (void)f.to_f32("missing.weight");
    ADD_FAILURE() << "missing tensor not reported";
  } catch (const RunnerError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.weight"), std::string::npos);
  }
}

TEST(Safetensors, TruncatedFilesAreCleanErrors) {
  TempDir dir;
  const std::vector<float> v(8, 1.0f);
  const std::string header = R"({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})";
  write_file(dir.path / "ok.safetensors", header, bytes_of(v));
  EXPECT_EQ(message_of(dir.path / "ok.safetensors"), "");
  // Data cut short: the tensor's range lies outside the file.
  write_file(dir.path / "short.safetensors", header, bytes_of(v).substr(0, 20));
  EXPECT_NE(message_of(dir.path / "short.safetensors").find("truncated"), std::string::npos);
  // Header cut short.
  {
    std::ofstream out(dir.path / "hdr.safetensors", std::ios::binary);
    const std::uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{\"a\":";
  }
  EXPECT_NE(message_of(dir.path / "hdr.safetensors").find("header length"), std::string::npos);
  // Fewer than 8 bytes.
  { std::ofstream(dir.path / "tiny.safetensors") << "abc"; }
  EXPECT_NE(message_of(dir.path / "tiny.safetensors").find("truncated"), std::string::npos);
  EXPECT_NE(message_of(dir.path / "absent.safetensors").find("absent.safetensors"), std::string::npos);
}

TEST(Safetensors, BadHeadersAreCleanErrors) {
  TempDir dir;
  const std::string data(16, '\0');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json {", "not JSON"},
      {"[1, 2]", "not a JSON object"},
      {R"({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})", "unsupported dtype"},
      {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", "does not match its shape"},
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}})", "outside"},
      {R"({"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 16]}})", "bad header entry"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const fs::path p = dir.path / ("bad" + std::to_string(i) + ".safetensors");
    write_file(p, cases[i].first, data);
    const std::string m = message_of(p);
    EXPECT_NE(m.find(cases[i].second), std::string::npos) << cases[i].first << " -> " << m;
    EXPECT_NE(m.find(p.filename().string()), std::string::npos) << m;
  }
}

std::string weights_message(const fs::path& dir) {
  try {
    SafetensorsWeights w(dir.string());
  } catch (const RunnerError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kModel);
    return e.what();
  }
  return "";
}

TEST(SafetensorsWeights, ShardsOfAnIndexReadLikeOneFile) {
  TempDir dir;
  const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6}, c = {-7, 8, 9};
  write_file(dir.path / "model-00001-of-00002.safetensors",
             R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},)"
             R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}})",
             bytes_of(a) + bytes_of(b));
  write_file(dir.path / "model-00002-of-00002.safetensors",
             R"({"c": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})", bytes_of(c));
  std::ofstream(dir.path / "model.safetensors.index.json")
      << R"({"metadata": {"total_size": 36}, "weight_map": {"a": "model-00001-of-00002.safetensors",)"
         R"( "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})";
  const SafetensorsWeights w(dir.path.string());
  EXPECT_EQ(w.num_files(), 2u);
  EXPECT_EQ(w.source(), (dir.path / "model.safetensors.index.json").string());
  EXPECT_EQ(w.to_f32("a", {2, 2}), a);
  EXPECT_EQ(w.to_f32("b", {2}), b);
  EXPECT_EQ(w.to_f32("c", {3}), c);
  EXPECT_FALSE(w.contains("d"));
  try {
    (void)w.to_f32("d", {1});
    ADD_FAILURE() << "no error for a tensor the index lacks";
  } catch (const RunnerError& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor 'd'"), std::string::npos) << e.what();
  }
  // A single model.safetensors next to an index wins, as in transformers.
  write_file(dir.path / "model.safetensors",
             R"({"z": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
             bytes_of(std::vector<float>{3.5f}));
  const SafetensorsWeights single(dir.path.string());
  EXPECT_EQ(single.num_files(), 1u);
  EXPECT_EQ(single.to_f32("z", {1}), std::vector<float>{3.5f});
}

TEST(SafetensorsWeights, BadFoldersAndIndexesAreCleanErrors) {
  TempDir dir;
  EXPECT_NE(weights_message(dir.path).find("model.safetensors: cannot open"), std::string::npos);
  const fs::path index = dir.path / "model.safetensors.index.json";
  const auto with_index = [&](const std::string& text) {
    std::ofstream(index, std::ios::trunc) << text;
    return weights_message(dir.path);
  };
  EXPECT_NE(with_index("{not json").find("not a JSON object"), std::string::npos);
  EXPECT_NE(with_index(R"({"metadata": {}})").find("no \"weight_map\""), std::string::npos);
  EXPECT_NE(with_index(R"({"weight_map": {"a": 3}})").find("is not a file name"), std::string::npos);
  EXPECT_NE(
      with_index(R"({"weight_map": {"a": "../outside.safetensors"}})").find("not a file name in the model"),
      std::string::npos);
  const std::string missing = with_index(R"({"weight_map": {"a": "gone.safetensors"}})");
  EXPECT_NE(missing.find("gone.safetensors: cannot open"), std::string::npos) << missing;
  write_file(dir.path / "s1.safetensors", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
             bytes_of(std::vector<float>{1.0f}));
  const std::string absent = with_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  EXPECT_NE(absent.find("s1.safetensors: has no tensor 'b'"), std::string::npos) << absent;
}

}  // namespace
}  // namespace kvscope::runner
