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
    const std::string cfg = replaced(slurp(m / "config.json"), "KvscopeTinyVlm", "Qwen2ForCausalLM");
    std::ofstream(m / "config.json") << cfg;
  }
  expect_bad("run --model " + q(m) + " --scene 7" + qn + tail,
             "unsupported architectures [\"Qwen2ForCausalLM\"]", out);

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

// ---- text LLaMA models (SmolLM2-135M-Instruct as scripts/setup imports it) ----

// A directory holding only a text LLaMA's config.json: enough for every check made before the weights load.
fs::path llama_config_only(const fs::path& dir) {
  const fs::path m = dir / "llama-config-only";
  fs::create_directories(m);
  std::ofstream(m / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 300, "rope_theta": 10000.0,
    "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2})";
  return m;
}

TEST_F(KvcapRun, PromptOptionsMatchTheModelKind) {
  const fs::path out = dir_ / "bad.h5";
  const std::string tail = " -o " + q(out);
  const fs::path llama = llama_config_only(dir_);
  const fs::path tiny = testing::fixture_dir("none");
  expect_bad("run --model " + q(llama) + " --scene 7 --prompt hi" + tail,
             "--scene is for the tiny VLM; " + llama.string() + " is a text model", out);
  expect_bad("run --model " + q(llama) + " --image x.png --prompt hi" + tail, "--image is for the tiny VLM",
             out);
  expect_bad("run --model " + q(llama) + " --question 'how many shapes ?'" + tail,
             "--question is for the tiny VLM", out);
  expect_bad("run --model " + q(llama) + tail, "give --prompt TEXT or --prompt-file F", out);
  expect_bad("run --model " + q(llama) + " --prompt hi --prompt-file x.txt" + tail, "not both", out);
  expect_bad("run --model " + q(llama) + " --prompt ''" + tail, "--prompt is empty", out);
  expect_bad("run --model " + q(llama) + " --chat --prompt ' \n '" + tail, "--prompt is empty", out);
  expect_bad("run --model " + q(llama) + " --prompt-file " + q(dir_ / "missing.txt") + tail,
             (dir_ / "missing.txt").string() + ": cannot open the prompt file", out);
  expect_bad("run --model " + q(llama) + " --prompt-file " + q(dir_) + tail, "(not a regular file)", out);
  {
    std::ofstream(dir_ / "huge.txt") << "x";
    fs::resize_file(dir_ / "huge.txt", (16u << 20) + 1);  // sparse
  }
  expect_bad("run --model " + q(llama) + " --prompt-file " + q(dir_ / "huge.txt") + tail,
             "the prompt file is larger than 16 MiB", out);
  { std::ofstream(dir_ / "blank.txt") << "\n\n"; }
  expect_bad("run --model " + q(llama) + " --prompt-file " + q(dir_ / "blank.txt") + tail,
             "the prompt is empty", out);
  expect_bad("run --model " + q(llama) + " --prompt hi --max-new 0" + tail, "--max-new must be in 1..1024",
             out);
  expect_bad("run --model " + q(tiny) + " --scene 7 --prompt hi" + tail,
             "--prompt is for text models; " + tiny.string() + " is the tiny VLM", out);
  expect_bad("run --model " + q(tiny) + " --scene 7 --chat --question 'how many shapes ?'" + tail,
             "--chat is for text models", out);
  expect_bad("run --model " + q(tiny) + " --prompt-file x.txt" + tail, "--prompt-file is for text models",
             out);
  // A config-only directory gets past the option checks and fails on the missing tokenizer/weights.
  expect_bad("run --model " + q(llama) + " --prompt hi" + tail, "tokenizer.json", out);
}

TEST_F(KvcapRun, HelpShowsBothModels) {
  const Result r = kvcap("run --help");
  ASSERT_EQ(r.status, 0);
  for (const char* s : {"--prompt ", "--prompt-file", "--chat", "--scene", "--question", "--max-new",
                        "smollm2-135m-instruct --chat", "tiny-shapes --scene 7", "LlamaForCausalLM"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  }
}

TEST_F(KvcapRun, SmolLm2ChatAnswersParis) {
  KVSCOPE_SKIP_WITHOUT_SMOLLM2();
  const fs::path model = testing::smollm2_dir(), out = dir_ / "paris.h5";
  const Result r =
      kvcap("run --model " + q(model) +
            " --chat --prompt 'What is the capital of France?' --max-new 24 --threads 2 -o " + q(out));
  ASSERT_EQ(r.status, 0) << r.err;
  const std::size_t at = r.out.find("answer: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_NE(r.out.substr(at, r.out.find('\n', at) - at).find("Paris"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefill: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("30 layers, 9/3 heads"), std::string::npos) << r.out;
  const Result v = kvcap("validate -q " + q(out));
  EXPECT_EQ(v.status, 0) << v.err;

  trace::TraceReader reader(out.string());
  const trace::ModelGeometry& g = reader.header().geometry;
  EXPECT_EQ(g.num_layers, 30);
  EXPECT_EQ(g.num_q_heads, 9);
  EXPECT_EQ(g.num_kv_heads, 3);
  EXPECT_EQ(g.head_dim, 64);
  EXPECT_DOUBLE_EQ(g.rope_theta, 100000.0);
  EXPECT_EQ(g.model_name, "smollm2-135m-instruct");
  EXPECT_EQ(reader.layers_present(), 30);
  const trace::Tokens& tok = reader.tokens();
  ASSERT_GT(tok.size(), 20u);
  // ChatML: <|im_start|>system\n...<|im_end|>\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n
  EXPECT_EQ(tok.token_id[0], 1);
  EXPECT_EQ(tok.modality[0], 3);
  EXPECT_EQ(tok.text[0], "<|im_start|>");
  EXPECT_EQ(tok.text[1], "system");
  EXPECT_EQ(tok.modality[1], 0);
  std::string joined;
  int specials = 0;
  for (std::size_t i = 0; i < tok.size(); ++i) {
    joined += tok.text[i];
    specials += tok.modality[i] == 3;
    EXPECT_TRUE(tok.modality[i] == 0 || tok.modality[i] == 3) << i;
    EXPECT_EQ(tok.position[i], static_cast<std::int32_t>(i));
  }
  EXPECT_EQ(specials, 5);  // <|im_start|> of system, user and assistant; <|im_end|> of system and user
  EXPECT_NE(
      joined.find("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
      std::string::npos)
      << joined;
  EXPECT_GT(reader.num_decode_steps(), 0u);

  const fs::path kvsim = testing::binary_dir() / "bin" / "kvsim";
  const std::string cmd =
      "'" + kvsim.string() + "' info " + q(out) + " >'" + (dir_ / "info").string() + "' 2>&1";
  const int raw = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(raw) && WEXITSTATUS(raw) == 0) << slurp(dir_ / "info");
  EXPECT_NE(slurp(dir_ / "info").find("30"), std::string::npos) << slurp(dir_ / "info");
}

TEST_F(KvcapRun, SmolLm2RefusesPromptLongerThanContext) {
  KVSCOPE_SKIP_WITHOUT_SMOLLM2();
  const fs::path out = dir_ / "long.h5", file = dir_ / "long.txt";
  {
    std::ofstream f(file);
    for (int i = 0; i < 9000; ++i) f << " the";  // 9,000 tokens (" the" is one token)
  }
  expect_bad("run --model " + q(testing::smollm2_dir()) + " --prompt-file " + q(file) + " -o " + q(out),
             "the prompt has 9000 tokens, more than max_position_embeddings = 8192", out);
}

}  // namespace
}  // namespace kvscope::runner
