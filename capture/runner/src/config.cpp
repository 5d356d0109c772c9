// config.json parsing (nlohmann_json) with errors naming the file and field.
#include "kvscope/runner/config.hpp"

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

ModelConfig parse_config(const std::string& json_text, const std::string& origin) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(origin, std::string("not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) fail(origin, "not a JSON object");
  // Architecture first: a config of another model family is rejected by name, not by a missing field.
  if (j.contains("architectures")) {
    const json& a = j["architectures"];
    if (!a.is_array() || a.size() != 1 || !a[0].is_string() || a[0].get<std::string>() != kArchitecture) {
      fail(origin,
           "unsupported architectures " + a.dump() + " (this runner supports [\"" + kArchitecture + "\"])");
    }
  } else {
    fail(origin, std::string("missing field \"architectures\" (expected [\"") + kArchitecture + "\"])");
  }
  if (!j.contains("model_type") || !j["model_type"].is_string() ||
      j["model_type"].get<std::string>() != kModelType) {
    fail(origin, "unsupported model_type " +
                     (j.contains("model_type") ? j["model_type"].dump() : "(missing)") +
                     " (this runner supports \"" + kModelType + "\")");
  }
  ModelConfig c;
  c.hidden_size = get_int(j, "hidden_size", origin, 1);
  c.intermediate_size = get_int(j, "intermediate_size", origin, 1);
  c.num_layers = get_int(j, "num_hidden_layers", origin, 1);
  c.num_q_heads = get_int(j, "num_attention_heads", origin, 1);
  c.num_kv_heads = get_int(j, "num_key_value_heads", origin, 1, false, c.num_q_heads);
  c.head_dim = get_int(j, "head_dim", origin, 2, false, c.hidden_size / c.num_q_heads);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", origin, 1e-5);
  c.rope_theta = get_double(j, "rope_theta", origin, 10000.0);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", origin, 1);
  c.vocab_size = get_int(j, "vocab_size", origin, 6);
  c.bos_token_id = get_int(j, "bos_token_id", origin, 0);
  c.eos_token_id = get_int(j, "eos_token_id", origin, 0);
  c.image_start_token_id = get_int(j, "image_start_token_id", origin, 0);
  c.image_end_token_id = get_int(j, "image_end_token_id", origin, 0);
  c.sep_token_id = get_int(j, "sep_token_id", origin, 0);
  if (j.contains("tie_word_embeddings") && j["tie_word_embeddings"].is_boolean() &&
      j["tie_word_embeddings"].get<bool>()) {
    fail(origin, "tie_word_embeddings = true is not supported (lm_head.weight is read separately)");
  }
  if (c.num_q_heads % c.num_kv_heads != 0) {
    fail(origin, "num_attention_heads (" + std::to_string(c.num_q_heads) +
                     ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_kv_heads) + ")");
  }
  if (c.head_dim % 2 != 0) fail(origin, "head_dim must be even for RoPE");
  for (int id :
       {c.bos_token_id, c.eos_token_id, c.image_start_token_id, c.image_end_token_id, c.sep_token_id}) {
    if (id >= c.vocab_size) fail(origin, "special token id " + std::to_string(id) + " >= vocab_size");
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
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
  if (c.model_name.empty() || c.model_name == ".") c.model_name = "kvscope-tiny-vlm";
  return c;
}

}  // namespace kvscope::runner
