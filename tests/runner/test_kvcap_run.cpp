// kvcap run end to end: a valid trace whose tensors match the PyTorch reference, PNG input, and bad input
// (one line on stderr, exit 2, no trace left behind).
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "kvscope/runner/model.hpp"
#include "kvscope/trace/reader.hpp"
#include "runner_test_util.hpp"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>

namespace kvscope::runner {
namespace {

namespace fs = std::filesystem;

struct Result {
  int status = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class KvcapRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kvscope_run_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
            "_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `kvcap ARGS` (arguments already shell-quoted), capturing stdout and stderr.
  Result kvcap(const std::string& args) const {
    const fs::path bin = testing::binary_dir() / "bin" / "kvcap";
    const std::string cmd = "'" + bin.string() + "' " + args + " >'" + (dir_ / "stdout").string() + "' 2>'" +
                            (dir_ / "stderr").string() + "'";
    Result r;
    const int raw = std::system(cmd.c_str());
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    r.out = slurp(dir_ / "stdout");
    r.err = slurp(dir_ / "stderr");
    return r;
  }

  // Expects exit 2 with one stderr line containing `needle`, and no trace at `out`.
  void expect_bad(const std::string& args, const std::string& needle, const fs::path& out) const {
    const Result r = kvcap(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_FALSE(fs::exists(out)) << args;
  }

  // A copy of a fixture model directory to break.
  fs::path copy_model(const std::string& fixture) const {
    const fs::path m = dir_ / ("model-" + fixture);
    fs::create_directories(m);
    for (const char* f : {"config.json", "model.safetensors", "vocab.json"}) {
      fs::copy_file(testing::fixture_dir(fixture) / f, m / f, fs::copy_options::overwrite_existing);
    }
    return m;
  }

  fs::path dir_;
};

std::string q(const fs::path& p) {
  std::string s(1, '\'');  // built by appending: GCC 12 warns (-Wrestrict) on "'" + string
  s += p.string();
  s += '\'';
  return s;
}

// `text` with the first `from` replaced by `to` (fails the test when absent).
std::string replaced(const std::string& text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at == std::string::npos) return text;
  return text.substr(0, at) + to + text.substr(at + from.size());
}

TEST_F(KvcapRun, WritesValidTraceMatchingReference) {
  const fs::path model = testing::fixture_dir("none");
  SafetensorsFile ref((model / "reference.safetensors").string());
  const auto samples = testing::load_samples(ref);
  const auto& s = samples[2];  // two images
  ASSERT_EQ(s.image_seeds.size(), 2u);
  const fs::path out = dir_ / "t.h5";
  const Result r =
      kvcap("run --model " + q(model) + " --scene " + std::to_string(s.image_seeds[0]) + "," +
            std::to_string(s.image_seeds[1]) + " --question '" + s.question + "' --max-new 8 -o " + q(out));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("answer: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefill: "), std::string::npos) << r.out;
  const Result v = kvcap("validate -q " + q(out));
  EXPECT_EQ(v.status, 0) << v.err;

  trace::TraceReader reader(out.string());
  const trace::Tokens& tok = reader.tokens();
  ASSERT_EQ(tok.size(), s.input_ids.size());
  for (std::size_t t = 0; t < tok.size(); ++t) {
    EXPECT_EQ(tok.token_id[t], s.input_ids[t]) << t;
    EXPECT_EQ(tok.modality[t], s.input_ids[t] < 0 ? 1 : (s.input_ids[t] <= 5 ? 3 : 0)) << t;
  }
  EXPECT_EQ(tok.segment[2], 0);
  EXPECT_EQ(tok.segment[2 + 66], 1);  // first patch of the second image
  EXPECT_EQ(tok.grid_row[2 + 66 + 63], 7);
  EXPECT_EQ(tok.text[0], "<bos>");
  // Decode tokens: the reference's generated ids, except the final <eos>, at positions T, T+1, ...
  std::vector<std::int32_t> fed(s.generated.begin(), s.generated.end());
  if (!fed.empty() && fed.back() == 2) fed.pop_back();
  EXPECT_EQ(reader.decode_tokens().token_id, fed);
  ASSERT_EQ(reader.num_decode_steps(), fed.size());
  EXPECT_EQ(reader.decode_tokens().position[0], static_cast<std::int32_t>(tok.size()));
  const trace::LayerTensors l0 = reader.read_layer(0);
  EXPECT_LT(testing::max_abs_diff(l0.q.to_float(), s.q0), 1e-3f);
  EXPECT_LT(testing::max_abs_diff(l0.k.to_float(), s.k0), 1e-3f);
  EXPECT_LT(testing::max_abs_diff(l0.v.to_float(), s.v0), 1e-3f);
  const trace::Profile prof = reader.read_profile();
  bool has_attention = false;
  for (const auto& rr : prof.ranges) has_attention = has_attention || rr.name == "layer 001/attention";
  EXPECT_TRUE(has_attention);
}

TEST_F(KvcapRun, PngInputEqualsScene) {
  const Scene scene = render_scene(7);
  const fs::path png = dir_ / "s7.png";
  ASSERT_NE(stbi_write_png(png.c_str(), 64, 64, 3, scene.image.rgb.data(), 64 * 3), 0);
  const fs::path model = testing::fixture_dir("linear");
  const Result a = kvcap("run --model " + q(model) + " --image " + q(png) +
                         " --question 'how many shapes ?' -o " + q(dir_ / "a.h5"));
  const Result b =
      kvcap("run --model " + q(model) + " --scene 7 --question 'how many shapes ?' -o " + q(dir_ / "b.h5"));
  ASSERT_EQ(a.status, 0) << a.err;
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(a.out.substr(0, a.out.find('\n')), b.out.substr(0, b.out.find('\n')));  // same answer line
}

TEST_F(KvcapRun, BadInputExitsTwoAndLeavesNoTrace) {
  const fs::path good = testing::fixture_dir("none");
  const fs::path out = dir_ / "bad.h5";
  const std::string tail = " -o " + q(out);
  const std::string qn = " --question 'how many shapes ?'";
  expect_bad("run --model " + q(good) + " --scene 7 --question '  '" + tail, "question is empty", out);
  expect_bad("run --model " + q(good) + " --scene 7 --question 'how many dogs ?'" + tail,
             "unknown word 'dogs'", out);
  expect_bad("run --model " + q(good) + qn + tail, "give --image PNG or --scene SEED", out);
  expect_bad("run --model " + q(good) + " --scene 7 --image x.png" + qn + tail, "not both", out);
  expect_bad("run --model " + q(good) + " --scene 7x" + qn + tail, "not an unsigned 64-bit seed", out);
  expect_bad("run --model " + q(good) + " --scene 7" + qn + " -o " + q(dir_ / "no" / "such" / "dir" / "t.h5"),
             "cannot create the trace", dir_ / "no" / "such" / "dir" / "t.h5");
  expect_bad("run --model " + q(dir_ / "nomodel") + " --scene 7" + qn + tail, "not a model directory", out);
  if (!cuda_backend_available(nullptr)) {
    expect_bad("run --model " + q(good) + " --scene 7 --device cuda" + qn + tail, "--device cuda", out);
  }

  // Wrong image size.
  std::vector<std::uint8_t> small(32 * 32 * 3, 100);
  const fs::path png = dir_ / "small.png";
  ASSERT_NE(stbi_write_png(png.c_str(), 32, 32, 3, small.data(), 32 * 3), 0);
  expect_bad("run --model " + q(good) + " --image " + q(png) + qn + tail, "32x32, the model expects 64x64",
             out);

  // Unsupported architecture.
  fs::path m = copy_model("none");
  {
    const std::string cfg = replaced(slurp(m / "config.json"), "KvscopeTinyVlm", "LlamaForCausalLM");
    std::ofstream(m / "config.json") << cfg;
  }
  expect_bad("run --model " + q(m) + " --scene 7" + qn + tail,
             "unsupported architectures [\"LlamaForCausalLM\"]", out);

  // Mismatched weights: the config promises a wider MLP than the weights have.
  m = copy_model("ntk");
  {
    const std::string cfg =
        replaced(slurp(m / "config.json"), "\"intermediate_size\": 64", "\"intermediate_size\": 96");
    std::ofstream(m / "config.json") << cfg;
  }
  expect_bad("run --model " + q(m) + " --scene 7" + qn + tail,
             "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 32], expected [96, 32]", out);

  // Missing weight: drop lm_head.weight from the header (the data section stays as it is).
  m = copy_model("linear");
  {
    const std::string bytes = slurp(m / "model.safetensors");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i)
      n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
    nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
    ASSERT_TRUE(header.contains("lm_head.weight"));
    header.erase("lm_head.weight");
    std::string h = header.dump();
    h.resize(n, ' ');  // same length, so the data offsets stay valid
    std::ofstream f(m / "model.safetensors", std::ios::binary);
    f << bytes.substr(0, 8) << h << bytes.substr(8 + n);
  }
  expect_bad("run --model " + q(m) + " --scene 7" + qn + tail, "missing tensor 'lm_head.weight'", out);

  // A failed run does not leave a previous file claiming to be a new trace: the path is untouched on
  // input errors found before the capture opens.
  { std::ofstream(out) << "old"; }
  const Result r = kvcap("run --model " + q(good) + " --scene 7 --question 'how many dogs ?'" + tail);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(slurp(out), "old");
}

// The dataset's answer for a counting question about scene `seed` (spec: "there are N shapes").
std::string counting_answer(std::uint64_t seed) {
  static const char* const kNumbers[] = {"zero", "one", "two", "three", "four", "five", "six"};
  const std::size_t n = render_scene(seed).objects.size();
  return n == 1 ? "there is one shape" : std::string("there are ") + kNumbers[n] + " shapes";
}

TEST_F(KvcapRun, TrainedModelAnswersScene7) {
  if (!testing::trained_present()) GTEST_SKIP() << "no trained model at " << testing::trained_dir();
  const fs::path out = dir_ / "t7.h5";
  const Result r = kvcap("run --model " + q(testing::trained_dir()) +
                         " --scene 7 --question 'how many shapes ?' -o " + q(out));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("answer: " + counting_answer(7) + "\n"), std::string::npos) << r.out;
  const Result v = kvcap("validate -q " + q(out));
  EXPECT_EQ(v.status, 0) << v.err;
}

}  // namespace
}  // namespace kvscope::runner
