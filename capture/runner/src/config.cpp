// config.json parsing (nlohmann_json) with errors naming the file and field.
#include "kvscope/runner/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvscope/runner/error.hpp"

namespace kvscope::runner {
namespace {

using nlohmann::json;

constexpr const char* kArchitecture = "KvscopeTinyVlm";
constexpr const char* kModelType = "kvscope-tiny-vlm";
constexpr const char* kLlamaArchitecture = "LlamaForCausalLM";
constexpr const char* kLlamaModelType = "llama";

[[noreturn]] void fail(const std::string& origin, const std::string& msg) {
  throw RunnerError(ErrorKind::kModel, origin + ": " + msg);
}

int get_int(const json& j, const char* key, const std::string& origin, int min_value, bool required = true,
            int fallback = 0) {
  if (!j.contains(key) || j[key].is_null()) {
    if (!required) return fallback;
    fail(origin, std::string("missing field \"") + key + "\"");
  }
  if (!j[key].is_number_integer()) fail(origin, std::string("field \"") + key + "\" must be an integer");
  const long long v = j[key].get<long long>();
  if (v < min_value || v > 1'000'000'000) {
    fail(origin, std::string("field \"") + key + "\" = " + std::to_string(v) +
                     " is out of range (>= " + std::to_string(min_value) + ")");
  }
  return static_cast<int>(v);
}

double get_double(const json& j, const char* key, const std::string& origin, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number()) fail(origin, std::string("field \"") + key + "\" must be a number");
  const double v = j[key].get<double>();
  if (!std::isfinite(v) || v <= 0) fail(origin, std::string("field \"") + key + "\" must be positive");
  return v;
}

}  // namespace

double ModelConfig::rope_base() const {
  if (rope_scaling != RopeScaling::kNtk) return rope_theta;
  return rope_theta * std::pow(rope_factor, static_cast<double>(head_dim) / (head_dim - 2));
}

double ModelConfig::rope_position_scale() const {
  return rope_scaling == RopeScaling::kLinear ? rope_factor : 1.0;
}

bool ModelConfig::is_eos(int id) const {
  if (eos_token_ids.empty()) return id == eos_token_id;  // a config built in code
  return std::find(eos_token_ids.begin(), eos_token_ids.end(), id) != eos_token_ids.end();
}

namespace {

// "architectures" names the family; a config of another model family is rejected by name, not by a missing
// field.
ModelKind parse_kind(const json& j, const std::string& origin) {
  const std::string supported =
      std::string("this runner supports [\"") + kArchitecture + "\"] and [\"" + kLlamaArchitecture + "\"]";
  if (!j.contains("architectures")) fail(origin, "missing field \"architectures\" (" + supported + ")");
  const json& a = j["architectures"];
  ModelKind kind = ModelKind::kTinyVlm;
  if (a.is_array() && a.size() == 1 && a[0].is_string() && a[0].get<std::string>() == kArchitecture) {
    kind = ModelKind::kTinyVlm;
  } else if (a.is_array() && a.size() == 1 && a[0].is_string() &&
             a[0].get<std::string>() == kLlamaArchitecture) {
    kind = ModelKind::kLlama;
  } else {
    fail(origin, "unsupported architectures " + a.dump() + " (" + supported + ")");
  }
  const char* expected = kind == ModelKind::kTinyVlm ? kModelType : kLlamaModelType;
  if (!j.contains("model_type") || !j["model_type"].is_string() ||
      j["model_type"].get<std::string>() != expected) {
    fail(origin, "unsupported model_type " +
                     (j.contains("model_type") ? j["model_type"].dump() : "(missing)") +
                     " (this runner supports \"" + expected + "\" for architectures " + a.dump() + ")");
  }
  return kind;
}

// The tiny VLM's rope_scaling: null or {"type": "linear"|"ntk", "factor": f}.
void parse_tiny_rope_scaling(const json& j, const std::string& origin, ModelConfig& c) {
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) return;
  const json& rs = j["rope_scaling"];
  if (!rs.is_object() || !rs.contains("type") || !rs["type"].is_string()) {
    fail(origin, "rope_scaling must be null or {\"type\": \"linear\"|\"ntk\", \"factor\": f}");
  }
  const std::string type = rs["type"].get<std::string>();
  if (type == "linear") {
    c.rope_scaling = RopeScaling::kLinear;
  } else if (type == "ntk") {
    c.rope_scaling = RopeScaling::kNtk;
  } else {
    fail(origin, "unsupported rope_scaling type \"" + type + "\" (supported: linear, ntk)");
  }
  if (!rs.contains("factor")) fail(origin, "rope_scaling has no \"factor\"");
  c.rope_factor = get_double(rs, "factor", origin, 1.0);
}

// One HF RoPE description (transformers 4 "rope_scaling" or transformers 5 "rope_parameters"): rope_type
// (or type) "default" or "linear" (with "factor"); every other type (llama3, yarn, dynamic, longrope, ...)
// is refused by name. rope_parameters may also carry rope_theta.
void parse_hf_rope(const json& j, const char* key, const std::string& origin, ModelConfig& c) {
  if (!j.contains(key) || j[key].is_null()) return;
  const json& rs = j[key];
  const std::string field = std::string("\"") + key + "\"";
  if (!rs.is_object()) fail(origin, field + " must be null or an object");
  std::string type = "default";
  for (const char* name : {"rope_type", "type"}) {
    if (rs.contains(name)) {
      if (!rs[name].is_string()) fail(origin, field + " " + name + " must be a string");
      type = rs[name].get<std::string>();
      break;
    }
  }
  if (rs.contains("rope_theta")) c.rope_theta = get_double(rs, "rope_theta", origin + " " + key, 10000.0);
  if (type == "default") return;
  if (type == "linear") {
    if (!rs.contains("factor")) fail(origin, field + " of type linear has no \"factor\"");
    c.rope_scaling = RopeScaling::kLinear;
    c.rope_factor = get_double(rs, "factor", origin + " " + key, 1.0);
    return;
  }
  fail(origin, "unsupported " + field + " type \"" + type + "\" (this runner implements: default, linear)");
}

// bos_token_id / eos_token_id of a LLaMA: an int, a list of ints (eos) or absent/null (-1).
std::vector<int> get_ids(const json& j, const char* key, const std::string& origin) {
  std::vector<int> ids;
  if (!j.contains(key) || j[key].is_null()) return ids;
  const json& v = j[key];
  const auto one = [&](const json& x) {
    if (!x.is_number_integer() || x.get<long long>() < 0 || x.get<long long>() > 1'000'000'000) {
      fail(origin, std::string("field \"") + key + "\" must be a non-negative integer or a list of them");
    }
    ids.push_back(static_cast<int>(x.get<long long>()));
  };
  if (v.is_array()) {
    for (const json& x : v) one(x);
  } else {
    one(v);
  }
  return ids;
}

bool get_bool(const json& j, const char* key, const std::string& origin, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) fail(origin, std::string("field \"") + key + "\" must be true or false");
  return j[key].get<bool>();
}

void parse_llama(const json& j, const std::string& origin, ModelConfig& c) {
  if (j.contains("vision_config") && !j["vision_config"].is_null()) {
    fail(origin, "a vision_config in a LlamaForCausalLM config is not supported (text-only LLaMA models)");
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (get_bool(j, key, origin, false)) {
      fail(origin, std::string(key) + " = true is not supported (this runner's LLaMA has no biases)");
    }
  }
  if (j.contains("hidden_act")) {
    if (!j["hidden_act"].is_string() || j["hidden_act"].get<std::string>() != "silu") {
      fail(origin, "unsupported hidden_act " + j["hidden_act"].dump() + " (this runner implements \"silu\")");
    }
  }
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", origin, false);
  c.rope_theta = get_double(j, "rope_theta", origin, 10000.0);
  parse_hf_rope(j, "rope_parameters", origin, c);
  parse_hf_rope(j, "rope_scaling", origin, c);
  const std::vector<int> bos = get_ids(j, "bos_token_id", origin);
  if (bos.size() > 1) fail(origin, "field \"bos_token_id\" must be one integer");
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  c.eos_token_ids = get_ids(j, "eos_token_id", origin);
  if (c.eos_token_ids.empty()) fail(origin, "missing field \"eos_token_id\"");
  c.eos_token_id = c.eos_token_ids[0];
  c.image_start_token_id = c.image_end_token_id = c.sep_token_id = -1;
  std::vector<int> specials = c.eos_token_ids;
  if (c.bos_token_id >= 0) specials.push_back(c.bos_token_id);
  for (int id : specials) {
    if (id >= c.vocab_size) fail(origin, "special token id " + std::to_string(id) + " >= vocab_size");
  }
}

void parse_tiny_vlm(const json& j, const std::string& origin, ModelConfig& c) {
  c.rope_theta = get_double(j, "rope_theta", origin, 10000.0);
  c.bos_token_id = get_int(j, "bos_token_id", origin, 0);
  c.eos_token_id = get_int(j, "eos_token_id", origin, 0);
  c.eos_token_ids = {c.eos_token_id};
  c.image_start_token_id = get_int(j, "image_start_token_id", origin, 0);
  c.image_end_token_id = get_int(j, "image_end_token_id", origin, 0);
  c.sep_token_id = get_int(j, "sep_token_id", origin, 0);
  if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean() &&
      j["tie_word_embeddings"].get<bool>()) {
    fail(origin, "tie_word_embeddings = true is not supported (lm_head.weight is read separately)");
  }
  for (int id :
       {c.bos_token_id, c.eos_token_id, c.image_start_token_id, c.image_end_token_id, c.sep_token_id}) {
    if (id >= c.vocab_size) fail(origin, "special token id " + std::to_string(id) + " >= vocab_size");
  }
  parse_tiny_rope_scaling(j, origin, c);
  if (!j.contains("vision_config") || !j["vision_config"].is_object())
    fail(origin, "missing \"vision_config\"");
  const json& v = j["vision_config"];
  const std::string vorigin = origin + " vision_config";
  c.vision.image_size = get_int(v, "image_size", vorigin, 1);
  c.vision.patch_size = get_int(v, "patch_size", vorigin, 1);
  c.vision.num_channels = get_int(v, "num_channels", vorigin, 1, false, 3);
  c.vision.hidden_size = get_int(v, "hidden_size", vorigin, 1);
  if (c.vision.num_channels != 3) fail(vorigin, "num_channels must be 3 (RGB images)");
  if (c.vision.image_size % c.vision.patch_size != 0)
    fail(vorigin, "image_size is not a multiple of patch_size");
  if (v.contains("projector") &&
      (!v["projector"].is_string() || v["projector"].get<std::string>() != "mlp2x_gelu")) {
    fail(vorigin, "unsupported projector " + v["projector"].dump() + " (supported: \"mlp2x_gelu\")");
  }
}

}  // namespace

ModelConfig parse_config(const std::string& json_text, const std::string& origin) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(origin, std::string("not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) fail(origin, "not a JSON object");
  ModelConfig c;
  c.kind = parse_kind(j, origin);
  c.hidden_size = get_int(j, "hidden_size", origin, 1);
  c.intermediate_size = get_int(j, "intermediate_size", origin, 1);
  c.num_layers = get_int(j, "num_hidden_layers", origin, 1);
  c.num_q_heads = get_int(j, "num_attention_heads", origin, 1);
  c.num_kv_heads = get_int(j, "num_key_value_heads", origin, 1, false, c.num_q_heads);
  c.head_dim = get_int(j, "head_dim", origin, 2, false, c.hidden_size / c.num_q_heads);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", origin, 1e-5);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", origin, 1);
  c.vocab_size = get_int(j, "vocab_size", origin, c.kind == ModelKind::kTinyVlm ? 6 : 1);
  if (c.num_q_heads % c.num_kv_heads != 0) {
    fail(origin, "num_attention_heads (" + std::to_string(c.num_q_heads) +
                     ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0) fail(origin, "head_dim must be even for RoPE");
  if (c.kind == ModelKind::kTinyVlm) {
    parse_tiny_vlm(j, origin, c);
  } else {
    parse_llama(j, origin, c);
  }
  return c;
}

ModelConfig load_config(const std::string& dir) {
  const std::filesystem::path path = std::filesystem::path(dir) / "config.json";
  std::ifstream in(path);
  if (!in)
    throw RunnerError(ErrorKind::kModel, path.string() + ": cannot open (is --model a model directory?)");
  std::stringstream ss;
  ss << in.rdbuf();
  ModelConfig c = parse_config(ss.str(), path.string());
  std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  c.model_name = p.filename().string();
  if (c.model_name.empty() || c.model_name == ".")
    c.model_name = c.kind == ModelKind::kTinyVlm ? "kvscope-tiny-vlm" : "llama";
  return c;
}

}  // namespace kvscope::runner
