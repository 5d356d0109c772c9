// The CPU runner against the PyTorch reference (logits, generation, layer-0 Q/K/V), KV-cache decode against
// full recompute, and the cache hook (no-op, eviction, merge bias).
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvscope/runner/error.hpp"
#include "kvscope/runner/model.hpp"
#include "runner_test_util.hpp"

namespace kvscope::runner {
namespace {

namespace fs = std::filesystem;
using testing::max_abs_diff;

constexpr float kTol = 1e-3f;

int reference_max_new(const SafetensorsFile& ref) { return std::stoi(ref.metadata().at("max_new")); }

// Records layer-0 prefill tensors (as [heads, T, D] contiguous), decode steps and ranges.
class RecordingObserver : public RunObserver {
 public:
  static std::vector<float> copy(const TensorRef& r) {
    std::vector<float> out;
    for (std::int64_t h = 0; h < r.shape[0]; ++h)
      for (std::int64_t t = 0; t < r.shape[1]; ++t)
        for (std::int64_t d = 0; d < r.shape[2]; ++d) out.push_back(r.at(h, t, d));
    return out;
  }
  void on_prefill_layer(int layer, const TensorRef& q, const TensorRef& k, const TensorRef& v) override {
    prefill_layers.push_back(layer);
    if (layer == 0) {
      q0 = copy(q);
      k0 = copy(k);
      v0 = copy(v);
    }
  }
  void on_decode_layer(int layer, int step, const TensorRef& q, const TensorRef& k,
                       const TensorRef&) override {
    EXPECT_EQ(q.shape[1], 1);
    EXPECT_EQ(k.shape[1], 1);
    decode_layers.emplace_back(step, layer);
  }
  void on_decode_token(int step, std::int32_t id, std::int32_t position) override {
    decode_tokens.push_back({step, id, position});
  }
  void range_push(const char* name) override {
    ranges.push_back(name);
    ++depth;
    max_depth = std::max(max_depth, depth);
  }
  void range_pop() override {
    --depth;
    EXPECT_GE(depth, 0);
  }
  std::vector<int> prefill_layers;
  std::vector<std::pair<int, int>> decode_layers;
  std::vector<std::array<int, 3>> decode_tokens;
  std::vector<std::string> ranges;
  std::vector<float> q0, k0, v0;
  int depth = 0, max_depth = 0;
};

TEST(ReferenceModel, LogitsGenerationAndQkvMatchPyTorch) {
  for (const fs::path& dir : testing::reference_model_dirs()) {
    SCOPED_TRACE(dir.string());
    Model model = Model::load(dir.string());
    SafetensorsFile ref((dir / "reference.safetensors").string());
    const auto samples = testing::load_samples(ref);
    ASSERT_GE(samples.size(), 4u);
    for (const auto& s : samples) {
      SCOPED_TRACE(s.family + ": " + s.question);
      const Prompt p = model.build_prompt(s.images, s.question);
      const std::vector<float> logits = model.forward_logits(p);
      EXPECT_LT(max_abs_diff(logits, s.logits), kTol);
      RecordingObserver obs;
      GenerateOptions opt;
      opt.max_new = reference_max_new(ref);
      opt.keep_logits = true;
      opt.observer = &obs;
      const Generation g = model.generate(p, opt);
      EXPECT_EQ(std::vector<std::int64_t>(g.tokens.begin(), g.tokens.end()), s.generated);
      std::vector<float> steps;
      for (const auto& row : g.logits) steps.insert(steps.end(), row.begin(), row.end());
      EXPECT_LT(max_abs_diff(steps, s.step_logits), kTol);
      EXPECT_LT(max_abs_diff(obs.q0, s.q0), kTol);
      EXPECT_LT(max_abs_diff(obs.k0, s.k0), kTol);
      EXPECT_LT(max_abs_diff(obs.v0, s.v0), kTol);
    }
  }
}

TEST(ReferenceModel, VisionEmbeddingsMatchPyTorch) {
  Model model = Model::load(testing::fixture_dir("none").string());
  SafetensorsFile ref((testing::fixture_dir("none") / "reference.safetensors").string());
  const auto samples = testing::load_samples(ref);
  const std::vector<float> expected = ref.to_f32("sample.2.vision_embeds");
  ASSERT_EQ(samples[2].images.size(), 2u);
  std::vector<float> got = model.embed_image(samples[2].images[0]);
  const std::vector<float> second = model.embed_image(samples[2].images[1]);
  got.insert(got.end(), second.begin(), second.end());
  EXPECT_LT(max_abs_diff(got, expected), 1e-4f);
}

TEST(Generation, ObserverSeesEveryLayerStepAndNestedRanges) {
  Model model = Model::load(testing::fixture_dir("ntk").string());
  const Prompt p = model.build_prompt({render_scene(7).image}, "how many shapes ?");
  RecordingObserver obs;
  GenerateOptions opt;
  opt.max_new = 5;
  opt.observer = &obs;
  const Generation g = model.generate(p, opt);
  const int layers = model.config().num_layers;
  EXPECT_EQ(obs.prefill_layers.size(), static_cast<std::size_t>(layers));
  EXPECT_EQ(obs.decode_layers.size(), static_cast<std::size_t>(layers * g.decode_steps));
  ASSERT_EQ(obs.decode_tokens.size(), static_cast<std::size_t>(g.decode_steps));
  for (int s = 0; s < g.decode_steps; ++s) {
    EXPECT_EQ(obs.decode_tokens[static_cast<std::size_t>(s)][0], s);
    EXPECT_EQ(obs.decode_tokens[static_cast<std::size_t>(s)][1], g.tokens[static_cast<std::size_t>(s)]);
    EXPECT_EQ(obs.decode_tokens[static_cast<std::size_t>(s)][2], p.size() + s);
  }
  EXPECT_EQ(obs.depth, 0);
  EXPECT_EQ(obs.max_depth, 3);  // prefill/decode > layer > attention|mlp
  EXPECT_NE(std::find(obs.ranges.begin(), obs.ranges.end(), "layer 001/attention"), obs.ranges.end());
  EXPECT_NE(std::find(obs.ranges.begin(), obs.ranges.end(), "layer 000/mlp"), obs.ranges.end());
}

// Appends the generated tokens to the prompt as text tokens, for a full forward pass.
Prompt extend(const Prompt& p, const std::vector<std::int32_t>& tokens, int n) {
  Prompt out = p;
  for (int i = 0; i < n; ++i) {
    TokenInfo t;
    t.token_id = tokens[static_cast<std::size_t>(i)];
    t.position = t.index = p.size() + i;
    out.tokens.push_back(t);
    out.text.emplace_back();
  }
  return out;
}

TEST(Generation, KvCacheDecodeEqualsFullRecompute) {
  for (const auto& name : testing::fixture_names()) {
    Model model = Model::load(testing::fixture_dir(name).string());
    const Prompt p =
        model.build_prompt({render_scene(42).image, render_scene(3).image}, "which image has more shapes ?");
    GenerateOptions opt;
    opt.max_new = 6;
    opt.keep_logits = true;
    const Generation g = model.generate(p, opt);
    ASSERT_GE(g.decode_steps, 2) << name;
    const std::vector<float> full = model.forward_logits(extend(p, g.tokens, g.decode_steps));
    const std::size_t v = static_cast<std::size_t>(model.config().vocab_size);
    for (std::size_t s = 0; s < g.logits.size(); ++s) {
      const std::size_t row = static_cast<std::size_t>(p.size() - 1) + s;
      const std::vector<float> expected(full.begin() + static_cast<std::ptrdiff_t>(row * v),
                                        full.begin() + static_cast<std::ptrdiff_t>((row + 1) * v));
      EXPECT_LT(max_abs_diff(g.logits[s], expected), 1e-4f) << name << " step " << s;
    }
  }
}

TEST(Generation, PrefillLogitsEqualForwardLogitsAndDoNotChangeTheAnswer) {
  Model model = Model::load(testing::fixture_dir("linear").string());
  const Prompt p = model.build_prompt({render_scene(5).image}, "how many shapes ?");
  GenerateOptions opt;
  opt.max_new = 4;
  opt.keep_logits = true;
  const Generation plain = model.generate(p, opt);
  std::vector<float> all;
  opt.prefill_logits = &all;
  const Generation with = model.generate(p, opt);
  EXPECT_EQ(with.tokens, plain.tokens);
  const std::vector<float> full = model.forward_logits(p);
  ASSERT_EQ(all.size(), full.size());
  EXPECT_LT(max_abs_diff(all, full), 1e-5f);
  ASSERT_FALSE(with.logits.empty());
  EXPECT_LT(max_abs_diff(with.logits[0], plain.logits[0]), 1e-6f);
}

TEST(Prompts, IdsPromptsAreLabelledAndCheckedAndTextPromptsNeedATextModel) {
  Model model = Model::load(testing::fixture_dir("none").string());
  const Vocabulary& vocab = dynamic_cast<const Vocabulary&>(model.tokenizer());
  const std::vector<std::int32_t> ids = {1, vocab.id("how"), vocab.id("many"), 5};
  const Prompt p = model.build_prompt_from_ids(ids);
  ASSERT_EQ(p.size(), 4);
  EXPECT_EQ(p.tokens[0].modality, 3);  // <bos>: special
  EXPECT_EQ(p.tokens[1].modality, 0);
  EXPECT_EQ(p.tokens[3].modality, 3);
  EXPECT_EQ(p.text[1], "how");
  EXPECT_EQ(p.tokens[2].position, 2);
  EXPECT_EQ(p.tokens[2].segment, 0);
  auto kind_of = [](auto&& f) {
    try {
      f();
    } catch (const RunnerError& e) {
      return std::make_pair(e.kind(), std::string(e.what()));
    }
    return std::make_pair(ErrorKind::kModel, std::string("no error"));
  };
  auto [k1, m1] = kind_of([&] { model.build_prompt_from_ids({}); });
  EXPECT_EQ(k1, ErrorKind::kInput);
  EXPECT_NE(m1.find("empty"), std::string::npos) << m1;
  auto [k2, m2] = kind_of([&] { model.build_prompt_from_ids({1, 49}); });
  EXPECT_EQ(k2, ErrorKind::kInput);
  EXPECT_NE(m2.find("token id 49 is outside the vocabulary (49 tokens)"), std::string::npos) << m2;
  const std::vector<std::int32_t> too_long(
      static_cast<std::size_t>(model.config().max_position_embeddings) + 1, 1);
  auto [k3, m3] = kind_of([&] { model.build_prompt_from_ids(too_long); });
  EXPECT_EQ(k3, ErrorKind::kInput);
  EXPECT_NE(m3.find("the prompt has 513 tokens, more than max_position_embeddings = 512"), std::string::npos)
      << m3;
  auto [k4, m4] = kind_of([&] { model.build_text_prompt("how many shapes ?"); });
  EXPECT_EQ(k4, ErrorKind::kInput);
  EXPECT_NE(m4.find("is the tiny VLM"), std::string::npos) << m4;
}

TEST(Generation, NeverFeedsATokenPastTheContext) {
  Model model = Model::load(testing::fixture_dir("none").string());
  const int n = model.config().max_position_embeddings;  // 512
  const Prompt full = model.build_prompt_from_ids(std::vector<std::int32_t>(static_cast<std::size_t>(n), 6));
  GenerateOptions opt;
  opt.max_new = 5;
  const Generation g = model.generate(full, opt);
  EXPECT_EQ(g.decode_steps, 0);  // the one generated token has no position left to be fed at
  EXPECT_EQ(g.tokens.size(), 1u);
  const Prompt almost =
      model.build_prompt_from_ids(std::vector<std::int32_t>(static_cast<std::size_t>(n - 2), 6));
  const Generation g2 = model.generate(almost, opt);
  EXPECT_LE(g2.decode_steps, 2);
}

// The tiny VLM fixture "none" as a text-only LLaMA directory (its decoder tensors; vision tensors and the
// image/sep ids unused; vocab.json as the tokenizer).
fs::path llama_from_fixture(bool tied) {
  const fs::path src = testing::fixture_dir("none");
  const fs::path dst = fs::temp_directory_path() /
                       ("kvscope_llama_fixture_" + std::to_string(tied) + "_" + std::to_string(::getpid()));
  fs::create_directories(dst);
  for (const char* f : {"model.safetensors", "vocab.json"})
    fs::copy_file(src / f, dst / f, fs::copy_options::overwrite_existing);
  std::ifstream in(src / "config.json");
  nlohmann::json c = nlohmann::json::parse(in);
  c["architectures"] = {"LlamaForCausalLM"};
  c["model_type"] = "llama";
  c["tie_word_embeddings"] = tied;
  c["hidden_act"] = "silu";
  for (const char* k : {"vision_config", "image_start_token_id", "image_end_token_id", "sep_token_id"})
    c.erase(k);
  std::ofstream(dst / "config.json") << c.dump(2);
  return dst;
}

TEST(TextLlama, SameDecoderAsTheTinyVlmAndTiedEmbeddingsReadEmbedTokens) {
  const fs::path untied_dir = llama_from_fixture(false), tied_dir = llama_from_fixture(true);
  Model tiny = Model::load(testing::fixture_dir("none").string());
  Model untied = Model::load(untied_dir.string());
  Model tied = Model::load(tied_dir.string());
  fs::remove_all(untied_dir);
  fs::remove_all(tied_dir);
  EXPECT_EQ(untied.config().kind, ModelKind::kLlama);
  EXPECT_TRUE(untied.weights().patch_embed_w.empty());
  EXPECT_FALSE(untied.weights().lm_head.empty());
  EXPECT_TRUE(tied.weights().lm_head.empty());
  const std::vector<std::int32_t> ids = {1, 6, 7, 8, 9, 10};
  // Text tokens through the same decoder: the same logits as the tiny VLM.
  const std::vector<float> a = tiny.forward_logits(tiny.build_prompt_from_ids(ids));
  const std::vector<float> b = untied.forward_logits(untied.build_prompt_from_ids(ids));
  EXPECT_EQ(a, b);
  // Tied: the output projection is embed_tokens, as in an untied model whose lm_head is a copy of it.
  ModelWeights w = untied.weights();
  w.lm_head = w.embed_tokens;
  Model copied(untied.config(), std::move(w), load_tokenizer(testing::fixture_dir("none").string()),
               Device::kCpu);
  const std::vector<float> t = tied.forward_logits(tied.build_prompt_from_ids(ids));
  EXPECT_EQ(t, copied.forward_logits(copied.build_prompt_from_ids(ids)));
  EXPECT_NE(t, b);
}

// Splits `dir`/model.safetensors into `shards` files (tensors dealt round-robin, bytes copied as stored)
// with a model.safetensors.index.json, as save_pretrained writes a model above its max_shard_size.
void shard_weights(const fs::path& dir, int shards) {
  std::ifstream in(dir / "model.safetensors", std::ios::binary);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i)
    header_len |= static_cast<std::uint64_t>(static_cast<unsigned char>(in.get())) << (8 * i);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const nlohmann::json h = nlohmann::json::parse(header);
  std::vector<nlohmann::json> headers(static_cast<std::size_t>(shards), nlohmann::json::object());
  std::vector<std::string> bodies(static_cast<std::size_t>(shards));
  nlohmann::json index = {{"metadata", {{"total_size", data.size()}}},
                          {"weight_map", nlohmann::json::object()}};
  int next = 0;
  for (const auto& [name, t] : h.items()) {
    if (name == "__metadata__") continue;
    const auto k = static_cast<std::size_t>(next++ % shards);
    const std::uint64_t b = t["data_offsets"][0], e = t["data_offsets"][1];
    nlohmann::json moved = t;
    moved["data_offsets"] = {bodies[k].size(), bodies[k].size() + (e - b)};
    headers[k][name] = moved;
    bodies[k] += data.substr(b, e - b);
    index["weight_map"][name] =
        "model-0000" + std::to_string(k + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
  }
  for (std::size_t k = 0; k < headers.size(); ++k) {
    const std::string hs = headers[k].dump();
    std::ofstream out(
        dir / ("model-0000" + std::to_string(k + 1) + "-of-0000" + std::to_string(shards) + ".safetensors"),
        std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((hs.size() >> (8 * i)) & 0xff));
    out << hs << bodies[k];
  }
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(2);
  fs::remove(dir / "model.safetensors");
}

TEST(TextLlama, ShardedWeightsLoadAsTheSameModel) {
  const fs::path one = llama_from_fixture(false);
  const fs::path sharded = one.string() + "_sharded";
  fs::remove_all(sharded);
  fs::copy(one, sharded);
  shard_weights(sharded, 3);
  Model a = Model::load(one.string());
  Model b = Model::load(sharded.string());
  const bool only_shards =
      !fs::exists(sharded / "model.safetensors") && fs::exists(sharded / "model-00003-of-00003.safetensors");
  fs::remove_all(one);
  fs::remove_all(sharded);
  EXPECT_TRUE(only_shards);
  EXPECT_EQ(a.weights().embed_tokens, b.weights().embed_tokens);
  EXPECT_EQ(a.weights().lm_head, b.weights().lm_head);
  const std::vector<std::int32_t> ids = {1, 6, 7, 8, 9, 10};
  EXPECT_EQ(a.forward_logits(a.build_prompt_from_ids(ids)), b.forward_logits(b.build_prompt_from_ids(ids)));
}

TEST(SmolLm2, TiedEmbeddingsAreNotCopiedAndNoVisionIsLoaded) {
  KVSCOPE_SKIP_WITHOUT_SMOLLM2();
  Model model = Model::load(testing::smollm2_dir().string());
  const ModelWeights& w = model.weights();
  EXPECT_TRUE(model.config().tie_word_embeddings);
  EXPECT_TRUE(w.lm_head.empty());
  EXPECT_EQ(&w.output(), &w.embed_tokens);
  EXPECT_EQ(w.embed_tokens.size(), 49152u * 576u);
  EXPECT_TRUE(w.patch_embed_w.empty());
  EXPECT_TRUE(w.proj2_w.empty());
  EXPECT_EQ(w.layers.size(), 30u);
  // A text prompt: specials labelled 3 with their text, the rest text (0).
  const Prompt p = model.build_text_prompt("<|im_start|>user\nHello<|im_end|>");
  ASSERT_GE(p.size(), 4);
  EXPECT_EQ(p.tokens.front().token_id, 1);
  EXPECT_EQ(p.tokens.front().modality, 3);
  EXPECT_EQ(p.text.front(), "<|im_start|>");
  EXPECT_EQ(p.tokens.back().token_id, 2);
  EXPECT_EQ(p.tokens.back().modality, 3);
  EXPECT_EQ(p.tokens[1].modality, 0);
  EXPECT_EQ(p.text[1], "user");
  std::string joined;
  for (const auto& t : p.text) joined += t;
  EXPECT_EQ(joined, "<|im_start|>user\nHello<|im_end|>");
  try {
    model.build_text_prompt("");
    ADD_FAILURE() << "an empty prompt was accepted";
  } catch (const RunnerError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
  }
  try {
    model.build_prompt({}, "how many shapes ?");
    ADD_FAILURE() << "a tiny-VLM prompt was accepted by a text model";
  } catch (const RunnerError& e) {
    EXPECT_NE(std::string(e.what()).find("is a text model"), std::string::npos) << e.what();
  }
  // The chat prompt is the template's rendering, tokenized.
  const Prompt chat = model.build_chat_prompt("Hi");
  std::string chat_text;
  for (const auto& t : chat.text) chat_text += t;
  EXPECT_EQ(chat_text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

class KeepAllHook : public CacheHook {
 public:
  void after_prefill(KvCache& cache, const std::vector<TokenInfo>& context) override {
    for (int l = 0; l < cache.num_layers(); ++l) {
      for (int h = 0; h < cache.num_kv_heads(); ++h) {
        HeadCache& hc = cache.head(l, h);
        EXPECT_EQ(hc.size(), static_cast<int>(context.size()));
        for (int s = 0; s < hc.size(); ++s) {
          EXPECT_EQ(hc.info(s).token.position, context[static_cast<std::size_t>(s)].position);
          EXPECT_EQ(hc.info(s).token.modality, context[static_cast<std::size_t>(s)].modality);
          EXPECT_EQ(hc.bias(s), 0.0f);
        }
        hc.keep(std::vector<bool>(static_cast<std::size_t>(hc.size()), true));
      }
    }
  }
  void after_decode_step(KvCache& cache, int step, const TokenInfo& token) override {
    EXPECT_EQ(step, steps++);
    EXPECT_EQ(cache.head(0, 0).info(cache.head(0, 0).size() - 1).token.position, token.position);
  }
  int steps = 0;
};

// Evicts every vision slot in every head after prefill.
class EvictVisionHook : public CacheHook {
 public:
  void after_prefill(KvCache& cache, const std::vector<TokenInfo>&) override {
    for (int l = 0; l < cache.num_layers(); ++l) {
      for (int h = 0; h < cache.num_kv_heads(); ++h) {
        HeadCache& hc = cache.head(l, h);
        std::vector<bool> keep;
        for (int s = 0; s < hc.size(); ++s) keep.push_back(hc.info(s).token.modality != 1);
        hc.keep(keep);
        remaining = hc.size();
      }
    }
  }
  void after_decode_step(KvCache&, int, const TokenInfo&) override {}
  int remaining = 0;
};

Generation run(Model& model, const Prompt& p, CacheHook* hook, int max_new = 6) {
  GenerateOptions opt;
  opt.max_new = max_new;
  opt.keep_logits = true;
  opt.hook = hook;
  return model.generate(p, opt);
}

// Every layer's q/k/v per token (prefill rows and decode steps), [layer][token] -> q|k|v rows concatenated.
class TokenObserver : public RunObserver {
 public:
  static std::vector<float> row(const TensorRef& q, const TensorRef& k, const TensorRef& v, std::int64_t t) {
    std::vector<float> out;
    for (const TensorRef* r : {&q, &k, &v})
      for (std::int64_t h = 0; h < r->shape[0]; ++h)
        for (std::int64_t d = 0; d < r->shape[2]; ++d) out.push_back(r->at(h, t, d));
    return out;
  }
  void on_prefill_layer(int layer, const TensorRef& q, const TensorRef& k, const TensorRef& v) override {
    for (std::int64_t t = 0; t < q.shape[1]; ++t) prefill[layer].push_back(row(q, k, v, t));
  }
  void on_decode_layer(int layer, int step, const TensorRef& q, const TensorRef& k,
                       const TensorRef& v) override {
    EXPECT_EQ(static_cast<std::size_t>(step), decode[layer].size());  // steps in order, none skipped
    for (std::int64_t t = 0; t < q.shape[1]; ++t) decode[layer].push_back(row(q, k, v, t));
    widest = std::max<std::int64_t>(widest, q.shape[1]);
  }
  void on_decode_token(int step, std::int32_t id, std::int32_t position) override {
    tokens.push_back({step, id, position});
  }
  std::map<int, std::vector<std::vector<float>>> prefill, decode;
  std::vector<std::array<int, 3>> tokens;
  std::int64_t widest = 0;
};

TEST(Generation, TokensFedAfterThePrefillAreCausalDecodeStepsEqualToFeedingThemOneAtATime) {
  Model model = Model::load(testing::fixture_dir("ntk").string());
  const Prompt whole = model.build_prompt({render_scene(7).image}, "how many shapes are there ?");
  const int k = 5, T = whole.size() - k;  // the last 5 prompt tokens (question words and <sep>) fed after
  Prompt context = whole;
  context.tokens.resize(static_cast<std::size_t>(T));
  context.text.resize(static_cast<std::size_t>(T));
  std::vector<std::int32_t> rest;
  for (int i = T; i < whole.size(); ++i) rest.push_back(whole.tokens[static_cast<std::size_t>(i)].token_id);
  GenerateOptions base;
  base.max_new = 4;
  TokenObserver ref_obs, one_obs, each_obs;
  GenerateOptions ref = base, one = base, each = base;
  ref.observer = &ref_obs;
  one.observer = &one_obs;
  one.after_prefill = rest;  // one forward of 5 tokens
  each.observer = &each_obs;
  each.after_prefill = rest;
  each.after_prefill_chunk = 1;  // one token per forward
  const Generation g_ref = model.generate(whole, ref);
  const Generation g_one = model.generate(context, one);
  const Generation g_each = model.generate(context, each);
  EXPECT_EQ(one_obs.widest, k);
  EXPECT_EQ(each_obs.widest, 1);
  EXPECT_EQ(g_one.after_prefill_steps, k);
  EXPECT_EQ(g_one.decode_steps, k + g_ref.decode_steps);
  EXPECT_EQ(g_one.tokens, g_ref.tokens);  // the same answer
  EXPECT_EQ(g_each.tokens, g_ref.tokens);
  ASSERT_EQ(one_obs.tokens.size(), static_cast<std::size_t>(g_one.decode_steps));
  for (int s = 0; s < k; ++s) {
    EXPECT_EQ(one_obs.tokens[static_cast<std::size_t>(s)][0], s);
    EXPECT_EQ(one_obs.tokens[static_cast<std::size_t>(s)][1], rest[static_cast<std::size_t>(s)]);
    EXPECT_EQ(one_obs.tokens[static_cast<std::size_t>(s)][2], T + s);
  }
  for (int l = 0; l < model.config().num_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    ASSERT_EQ(one_obs.decode[l].size(), static_cast<std::size_t>(g_one.decode_steps));
    ASSERT_EQ(each_obs.decode[l].size(), one_obs.decode[l].size());
    for (int s = 0; s < k; ++s) {
      const auto& got = one_obs.decode[l][static_cast<std::size_t>(s)];
      // = the prefill of the whole prompt at that token, and = feeding the tokens one at a time
      EXPECT_LT(max_abs_diff(got, ref_obs.prefill[l][static_cast<std::size_t>(T + s)]), 1e-4f)
          << "step " << s;
      EXPECT_LT(max_abs_diff(got, each_obs.decode[l][static_cast<std::size_t>(s)]), 1e-4f) << "step " << s;
    }
    for (std::size_t s = k; s < one_obs.decode[l].size(); ++s)  // the generated steps follow
      EXPECT_LT(max_abs_diff(one_obs.decode[l][s], ref_obs.decode[l][s - k]), 1e-4f) << "step " << s;
  }
  // Not with a cache hook: the hook's decode-step contract is one token per step.
  class NoHook : public CacheHook {
    void after_prefill(KvCache&, const std::vector<TokenInfo>&) override {}
    void after_decode_step(KvCache&, int, const TokenInfo&) override {}
  } hook;
  GenerateOptions with_hook = one;
  with_hook.hook = &hook;
  EXPECT_THROW(model.generate(context, with_hook), RunnerError);
}

// forward_batch: requests of 1 and 3 new tokens over three caches of different lengths give each request's
// own forward() (logits, every layer's appended K/V and what its observer sees) up to float rounding, and
// push no ranges.
TEST(Generation, BatchedForwardEqualsEachRequestsOwnForward) {
  Model model = Model::load(testing::fixture_dir("ntk").string());
  const auto& cfg = model.config();
  const std::vector<Prompt> prompts = {model.build_prompt({render_scene(3).image}, "what color is the circle ?"),
                                       model.build_prompt({render_scene(4).image}, "how many shapes are there ?"),
                                       model.build_prompt({render_scene(5).image, render_scene(6).image},
                                                          "which image has more shapes ?")};
  const std::vector<std::vector<std::int32_t>> fed = {{5}, {7, 8, 9}, {11}};
  std::vector<KvCache> one, batched;
  for (const Prompt& p : prompts) {
    KvCache cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
    const std::vector<float> x = model.embed(p);
    ForwardRequest req;
    req.x = x.data();
    req.tokens = p.tokens.data();
    req.num_tokens = p.size();
    std::vector<float> logits;
    model.backend().forward(req, cache, nullptr, logits);
    one.push_back(cache);
    batched.push_back(cache);
  }
  ASSERT_NE(prompts[0].size(), prompts[2].size());
  const int d = cfg.hidden_size;
  std::vector<std::vector<TokenInfo>> toks(3);
  std::vector<std::vector<float>> x(3), own(3), got(3);
  struct RangeCounter : TokenObserver {
    void range_push(const char*) override { ++ranges; }
    int ranges = 0;
  };
  std::vector<RangeCounter> own_obs(3), batch_obs(3);
  std::vector<BatchedRequest> batch(3);
  for (std::size_t i = 0; i < 3; ++i) {
    for (std::size_t j = 0; j < fed[i].size(); ++j) {
      TokenInfo t;
      t.token_id = fed[i][j];
      t.position = t.index = prompts[i].size() + static_cast<int>(j);
      t.segment = static_cast<int>(prompts[i].images.size());
      toks[i].push_back(t);
      x[i].insert(x[i].end(), model.weights().embed_tokens.data() + static_cast<std::size_t>(t.token_id) * d,
                  model.weights().embed_tokens.data() + static_cast<std::size_t>(t.token_id + 1) * d);
    }
    ForwardRequest req;
    req.x = x[i].data();
    req.tokens = toks[i].data();
    req.num_tokens = static_cast<int>(fed[i].size());
    req.decode_step = 0;
    req.all_logits = i == 1;
    model.backend().forward(req, one[i], &own_obs[i], own[i]);
    batch[i] = BatchedRequest{req, &batched[i], &batch_obs[i], &got[i]};
  }
  model.backend().forward_batch(batch);
  for (std::size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    ASSERT_EQ(got[i].size(), own[i].size());
    EXPECT_EQ(got[i].size(), (i == 1 ? 3u : 1u) * static_cast<std::size_t>(cfg.vocab_size));
    EXPECT_LT(max_abs_diff(got[i], own[i]), 1e-4f);
    EXPECT_GT(own_obs[i].ranges, 0);
    EXPECT_EQ(batch_obs[i].ranges, 0);
    for (int l = 0; l < cfg.num_layers; ++l) {
      ASSERT_EQ(batch_obs[i].decode[l].size(), own_obs[i].decode[l].size());
      for (std::size_t s = 0; s < own_obs[i].decode[l].size(); ++s)
        EXPECT_LT(max_abs_diff(batch_obs[i].decode[l][s], own_obs[i].decode[l][s]), 1e-4f) << "layer " << l;
      for (int h = 0; h < cfg.num_kv_heads; ++h) {
        const HeadCache &a = batched[i].head(l, h), &b = one[i].head(l, h);
        ASSERT_EQ(a.size(), prompts[i].size() + static_cast<int>(fed[i].size()));
        ASSERT_EQ(a.size(), b.size());
        const std::size_t n = static_cast<std::size_t>(a.size()) * cfg.head_dim;
        EXPECT_LT(max_abs_diff(std::vector<float>(a.keys(), a.keys() + n), std::vector<float>(b.keys(), b.keys() + n)),
                  1e-4f);
      }
    }
  }
}

TEST(CacheHook, KeepingEverythingChangesNothing) {
  Model model = Model::load(testing::fixture_dir("linear").string());
  const Prompt p = model.build_prompt({render_scene(1).image}, "where is the red circle ?");
  const Generation plain = run(model, p, nullptr);
  KeepAllHook hook;
  const Generation hooked = run(model, p, &hook);
  EXPECT_EQ(hooked.tokens, plain.tokens);
  EXPECT_EQ(hooked.logits, plain.logits);  // bit-identical
  EXPECT_EQ(hook.steps, plain.decode_steps);
}

// Every product runs on one BLAS thread whatever the caller left set: OpenBLAS's Haswell and Zen kernels
// round differently when threads split a product, which once made the first run of a process (vision front
// end on the default thread count) differ from later ones. Fails without the pinning under
// OPENBLAS_CORETYPE=Haswell or Zen; the SkylakeX kernels agree either way.
TEST(CacheHook, RunsAreIndependentOfTheBlasThreadsTheCallerSet) {
  Model model = Model::load(testing::fixture_dir("linear").string());
  const Prompt p = model.build_prompt({render_scene(1).image}, "where is the red circle ?");
  openblas_set_num_threads(static_cast<int>(std::max(2u, std::thread::hardware_concurrency())));
  const Generation many = run(model, p, nullptr);
  EXPECT_EQ(openblas_get_num_threads(), 1);
  openblas_set_num_threads(1);
  const Generation one = run(model, p, nullptr);
  EXPECT_EQ(many.tokens, one.tokens);
  EXPECT_EQ(many.logits, one.logits);  // bit-identical
}

TEST(CacheHook, EvictingVisionChangesDecodeLogits) {
  Model model = Model::load(testing::fixture_dir("none").string());
  const Prompt p = model.build_prompt({render_scene(1).image}, "where is the red circle ?");
  const Generation plain = run(model, p, nullptr);
  EvictVisionHook hook;
  const Generation evicted = run(model, p, &hook);
  EXPECT_EQ(hook.remaining, p.size() - 64);
  ASSERT_GE(evicted.logits.size(), 2u);
  EXPECT_EQ(evicted.logits[0], plain.logits[0]);  // chosen from the prefill, before the hook
  ASSERT_EQ(evicted.tokens[0], plain.tokens[0]);  // so step 1 feeds the same token to both caches
  EXPECT_GT(max_abs_diff(evicted.logits[1], plain.logits[1]), 1e-3f);
}

// A slot with bias log 2 attends exactly like two copies of that slot: the merge ("proportional attention")
// semantics policies rely on.
class DuplicateSlotHook : public CacheHook {
 public:
  explicit DuplicateSlotHook(bool use_bias) : use_bias_(use_bias) {}
  void after_prefill(KvCache& cache, const std::vector<TokenInfo>&) override {
    for (int l = 0; l < cache.num_layers(); ++l) {
      for (int h = 0; h < cache.num_kv_heads(); ++h) {
        HeadCache& hc = cache.head(l, h);
        const int s = 10;
        if (use_bias_) {
          const std::vector<float> k(hc.key(s), hc.key(s) + hc.head_dim()),
              v(hc.value(s), hc.value(s) + hc.head_dim());
          hc.set_slot(s, k.data(), v.data(), std::log(2.0f), 2);
        } else {
          const std::vector<float> k(hc.key(s), hc.key(s) + hc.head_dim()),
              v(hc.value(s), hc.value(s) + hc.head_dim());
          hc.append(k.data(), v.data(), 0.0f, hc.info(s));
        }
      }
    }
  }
  void after_decode_step(KvCache&, int, const TokenInfo&) override {}

 private:
  bool use_bias_;
};

TEST(CacheHook, LogMultiplicityBiasEqualsDuplicatedSlot) {
  Model model = Model::load(testing::fixture_dir("none").string());
  const Prompt p = model.build_prompt({render_scene(2).image}, "how many shapes ?");
  DuplicateSlotHook dup(false), bias(true);
  const Generation a = run(model, p, &dup, 4), b = run(model, p, &bias, 4), plain = run(model, p, nullptr, 4);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  ASSERT_GE(a.logits.size(), 2u);
  for (std::size_t s = 0; s < a.logits.size(); ++s)
    EXPECT_LT(max_abs_diff(a.logits[s], b.logits[s]), 1e-5f) << s;
  EXPECT_GT(max_abs_diff(b.logits[1], plain.logits[1]), 1e-6f);  // and the bias does change something
}

}  // namespace
}  // namespace kvscope::runner

namespace kvscope::runner {
namespace {

// Not a benchmark (the CI machine is shared): records prefill/decode times for the perf notes, and checks
// that a decode step is cheaper than a prefill of the whole prompt (the cache is really used).
TEST(Timing, PrefillAndDecodeOnFixture) {
  Model model = Model::load(testing::fixture_dir("none").string());
  const Prompt p =
      model.build_prompt({render_scene(3).image, render_scene(8).image}, "which image has more shapes ?");
  GenerateOptions opt;
  opt.max_new = 16;
  double best_prefill = 1e30, best_decode = 1e30;
  int steps = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const Generation g = model.generate(p, opt);
    best_prefill = std::min(best_prefill, g.prefill_ms);
    best_decode = std::min(best_decode, g.decode_ms / std::max(1, g.decode_steps));
    steps = g.decode_steps;
  }
  std::printf("[timing] prefill %d tokens: %.3f ms; decode: %.4f ms/step over %d steps (best of 5)\n",
              p.size(), best_prefill, best_decode, steps);
  RecordProperty("prefill_ms", std::to_string(best_prefill));
  RecordProperty("decode_ms_per_step", std::to_string(best_decode));
  EXPECT_LT(best_decode, best_prefill);
}

}  // namespace
}  // namespace kvscope::runner
