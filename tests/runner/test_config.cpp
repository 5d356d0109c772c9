// config.json parsing: the tiny VLM and text-only HF LLaMA configs (tied embeddings, rope_theta or
// transformers-5 rope_parameters, eos lists) and the LLaMA features the runner refuses by name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kvscope/runner/config.hpp"
#include "kvscope/runner/error.hpp"

namespace kvscope::runner {
namespace {

using nlohmann::json;

// SmolLM2-135M-Instruct's config.json as the importer writes it.
json llama() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0, "rope_scaling": null, "attention_bias": false, "mlp_bias": false,
    "vocab_size": 49152, "tie_word_embeddings": true, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2})");
}

json tiny() {
  return json::parse(R"({
    "architectures": ["KvscopeTinyVlm"], "model_type": "kvscope-tiny-vlm", "vocab_size": 49,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": null, "max_position_embeddings": 512, "tie_word_embeddings": false, "bos_token_id": 1,
    "eos_token_id": 2, "image_start_token_id": 3, "image_end_token_id": 4, "sep_token_id": 5,
    "vision_config": {"image_size": 64, "patch_size": 8, "num_channels": 3, "hidden_size": 48,
                      "projector": "mlp2x_gelu"}})");
}

ModelConfig parse(const json& j) { return parse_config(j.dump(), "cfg.json"); }

// The error message of parsing `j` ("" when it parses).
std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const RunnerError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kModel);
    return e.what();
  }
  return "";
}

void expect_error(const json& j, const std::string& needle) {
  const std::string msg = error_of(j);
  EXPECT_NE(msg.find(needle), std::string::npos) << "message: '" << msg << "', expected '" << needle << "'";
  EXPECT_EQ(msg.rfind("cfg.json: ", 0), 0u) << msg;
}

TEST(Config, SmolLm2Llama) {
  const ModelConfig c = parse(llama());
  EXPECT_EQ(c.kind, ModelKind::kLlama);
  EXPECT_FALSE(c.has_vision());
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.num_q_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope_theta, 100000.0);
  EXPECT_DOUBLE_EQ(c.rope_base(), 100000.0);
  EXPECT_DOUBLE_EQ(c.rope_position_scale(), 1.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{2});
  EXPECT_TRUE(c.is_eos(2));
  EXPECT_FALSE(c.is_eos(1));
  EXPECT_EQ(c.sep_token_id, -1);
  EXPECT_EQ(c.image_start_token_id, -1);
}

TEST(Config, EosWithoutAListIsEosTokenId) {
  ModelConfig c;  // built in code: no eos_token_ids
  c.eos_token_id = 7;
  EXPECT_TRUE(c.is_eos(7));
  EXPECT_FALSE(c.is_eos(2));
}

TEST(Config, TinyVlmStillParses) {
  const ModelConfig c = parse(tiny());
  EXPECT_EQ(c.kind, ModelKind::kTinyVlm);
  EXPECT_TRUE(c.has_vision());
  EXPECT_EQ(c.vision.hidden_size, 48);
  EXPECT_EQ(c.sep_token_id, 5);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{2});
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(Config, LlamaDefaultsAndVariants) {
  json j = llama();
  j.erase("head_dim");
  j.erase("tie_word_embeddings");
  j.erase("bos_token_id");
  ModelConfig c = parse(j);
  EXPECT_EQ(c.head_dim, 64);  // hidden_size / heads
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, -1);

  j = llama();
  j["eos_token_id"] = json::array({2, 7});
  c = parse(j);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_TRUE(c.is_eos(7));
  EXPECT_TRUE(c.is_eos(2));

  // transformers 5: rope_parameters carries the theta.
  j = llama();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  EXPECT_DOUBLE_EQ(parse(j).rope_theta, 500000.0);
  j.erase("rope_parameters");
  EXPECT_DOUBLE_EQ(parse(j).rope_theta, 10000.0);  // HF's default

  j = llama();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
  c = parse(j);
  EXPECT_EQ(c.rope_scaling, RopeScaling::kLinear);
  EXPECT_DOUBLE_EQ(c.rope_position_scale(), 4.0);
  j["rope_scaling"] = {{"type", "default"}};
  EXPECT_EQ(parse(j).rope_scaling, RopeScaling::kNone);
}

TEST(Config, LlamaRefusals) {
  json j = llama();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect_error(j, "unsupported \"rope_scaling\" type \"llama3\" (this runner implements: default, linear)");
  j = llama();
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0}};
  expect_error(j, "unsupported \"rope_parameters\" type \"yarn\"");
  j = llama();
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  expect_error(j, "type \"dynamic\"");
  j = llama();
  j["rope_scaling"] = {{"rope_type", "linear"}};
  expect_error(j, "of type linear has no \"factor\"");
  j = llama();
  j["attention_bias"] = true;
  expect_error(j, "attention_bias = true is not supported");
  j = llama();
  j["mlp_bias"] = true;
  expect_error(j, "mlp_bias = true is not supported");
  j = llama();
  j["hidden_act"] = "gelu";
  expect_error(j, "unsupported hidden_act \"gelu\"");
  j = llama();
  j["vision_config"] = tiny()["vision_config"];
  expect_error(j, "vision_config in a LlamaForCausalLM config is not supported");
  j = llama();
  j["eos_token_id"] = "two";
  expect_error(j, "\"eos_token_id\" must be a non-negative integer or a list of them");
  j = llama();
  j.erase("eos_token_id");
  expect_error(j, "missing field \"eos_token_id\"");
  j = llama();
  j["eos_token_id"] = 49152;
  expect_error(j, "special token id 49152 >= vocab_size");
  j = llama();
  j["tie_word_embeddings"] = "yes";
  expect_error(j, "\"tie_word_embeddings\" must be true or false");
  j = llama();
  j["num_key_value_heads"] = 4;
  expect_error(j, "num_attention_heads (9) is not a multiple of num_key_value_heads (4)");
}

TEST(Config, ArchitectureAndModelType) {
  json j = llama();
  j["architectures"] = json::array({"Qwen2ForCausalLM"});
  expect_error(j,
               "unsupported architectures [\"Qwen2ForCausalLM\"] (this runner supports [\"KvscopeTinyVlm\"] "
               "and [\"LlamaForCausalLM\"])");
  j = llama();
  j["model_type"] = "mistral";
  expect_error(j, "unsupported model_type \"mistral\" (this runner supports \"llama\"");
  j = tiny();
  j["architectures"] = json::array({"LlamaForCausalLM"});
  expect_error(j, "unsupported model_type \"kvscope-tiny-vlm\" (this runner supports \"llama\"");
  j = llama();
  j.erase("architectures");
  expect_error(j, "missing field \"architectures\"");
}

TEST(Config, TinyVlmErrorsKept) {
  json j = tiny();
  j["tie_word_embeddings"] = true;
  expect_error(j, "tie_word_embeddings = true is not supported");
  j = tiny();
  j.erase("vision_config");
  expect_error(j, "missing \"vision_config\"");
  j = tiny();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}};
  expect_error(j, "unsupported rope_scaling type \"yarn\" (supported: linear, ntk)");
  j = tiny();
  j.erase("sep_token_id");
  expect_error(j, "missing field \"sep_token_id\"");
}

}  // namespace
}  // namespace kvscope::runner
