// Capacity planner (`kvsim plan`): how many requests of a given shape, and how
// long a context, fit in the KV cache of one GPU once the weights and a
// workspace reserve are loaded, with and without a compression policy.
//
// KV bytes per token (all layers) = 2 (K and V) x layers x kv_heads x head_dim x element bytes.
// A compression policy enters as bytes ratios kept / full per modality (measured by
// `kvsim run` or configured), applied to the prompt tokens of each modality; generated
// tokens use their own ratio (1 = kept in full, a prefill-time policy).
// Every byte count is an exact integer; docs/planner.md gives the formulas and sources.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscope/sim/results.hpp"

namespace kvscope::sim {

// Invalid planner input. parameter() names the offending field or option.
class PlanError : public std::invalid_argument {
 public:
  PlanError(std::string parameter, const std::string& message)
      : std::invalid_argument(message), parameter_(std::move(parameter)) {}
  const std::string& parameter() const { return parameter_; }

 private:
  std::string parameter_;
};

// Model geometry and size. params counts every weight loaded on the GPU
// (language model, vision tower, projector).
struct ModelSpec {
  std::string name;
  int layers = 0;
  int q_heads = 0;  // informational (GQA group); 0 = unknown
  int kv_heads = 0;
  int head_dim = 0;
  double params = 0;   // total parameter count
  std::string source;  // where the numbers come from (one line)
};

// Known models: llava-1.5-7b, qwen2-vl-7b (geometry from the synthetic-trace presets).
const std::vector<ModelSpec>& model_presets();
// Throws PlanError("model", ...) listing the valid names when `name` is unknown.
const ModelSpec& find_model_preset(const std::string& name);
// Generic model from its geometry; throws PlanError naming the bad field.
ModelSpec generic_model(int layers, int kv_heads, int head_dim, double params, int q_heads = 0);

// Weight storage: fp16/bf16 2 bytes per parameter, int8 1 byte, int4 half a byte
// plus one fp16 scale per group of 128 parameters.
enum class WeightsDType { kF16, kBF16, kInt8, kInt4 };
// KV cache element type (payload only, see docs/planner.md for quantization scales).
enum class KvDType { kF16, kBF16, kF32, kInt8, kInt4 };

const char* weights_dtype_name(WeightsDType t);
const char* kv_dtype_name(KvDType t);
// Parse "fp16" / "bf16" / "int8" / "int4" (and "fp32" for KV); throw PlanError(parameter, ...) listing valid
// names.
WeightsDType parse_weights_dtype(const std::string& s, const std::string& parameter = "weights-dtype");
KvDType parse_kv_dtype(const std::string& s, const std::string& parameter = "kv-dtype");
int kv_dtype_bits(KvDType t);

// Exact bytes of the weights: ceil(params) x bytes per parameter (+ int4 group scales).
std::int64_t weights_bytes(double params, WeightsDType dtype);
// K plus V bytes of one token in one layer: 2 x kv_heads x head_dim x bits / 8.
std::int64_t kv_bytes_per_token_layer(const ModelSpec& m, KvDType dtype);
// ... and over all layers.
std::int64_t kv_bytes_per_token(const ModelSpec& m, KvDType dtype);

// Byte sizes: "24GiB" (2^30), "80GB" (10^9), "512MiB", "1.5TB", "4096B" or a plain
// number of bytes; units are case-insensitive, binary with "i". Throws PlanError(parameter, ...)
// on garbage, negative or zero sizes, fractional bytes and overflow.
std::int64_t parse_byte_size(const std::string& text, const std::string& parameter);

// One request: its prompt tokens per modality and the tokens it generates.
struct RequestShape {
  std::int64_t images = 0;
  std::int64_t image_tokens = 0;  // tokens per image
  std::int64_t text_tokens = 0;   // prompt text
  std::int64_t audio_tokens = 0;
  std::int64_t special_tokens = 0;  // separators / special tokens of the prompt
  std::int64_t output_tokens = 0;   // generated tokens (--max-new)
  // Prompt tokens per modality code (0 text, 1 vision, 2 audio, 3 special).
  PerModalityCount prompt_tokens() const;
  std::int64_t total_tokens() const;
};

// Bytes kept / bytes full, in (0, 1], per modality of the prompt and for generated tokens.
struct KeepRatios {
  PerModality prompt{1.0, 1.0, 1.0, 1.0};
  double output = 1.0;
  // The same ratio for every prompt modality (generated tokens stay full).
  static KeepRatios uniform(double r);
  bool is_identity() const;
};

struct PlanInput {
  ModelSpec model;
  std::int64_t gpu_mem_bytes = 0;
  WeightsDType weights = WeightsDType::kF16;
  double reserve_fraction = 0.10;  // of GPU memory, for activations / workspace
  KvDType kv_dtype = KvDType::kF16;
  RequestShape request;
  std::optional<KeepRatios> compression;  // none: only the uncompressed plan
};

// Capacity under one setting (uncompressed or compressed).
struct Capacity {
  PerModalityCount prompt_bytes{};      // per modality of one request
  std::int64_t output_bytes = 0;        // generated tokens of one request
  std::int64_t request_bytes = 0;       // everything one request holds
  std::int64_t max_requests = 0;        // floor(kv budget / request bytes)
  std::int64_t max_context_tokens = 0;  // one request of text tokens only
  std::int64_t max_images = -1;  // images that fit in one request with its text and output; -1: no images
};

struct PlanResult {
  PlanInput input;
  std::int64_t kv_bytes_per_token_layer = 0;
  std::int64_t kv_bytes_per_token = 0;
  std::int64_t weights_bytes = 0;
  std::int64_t reserve_bytes = 0;
  std::int64_t kv_budget_bytes = 0;  // GPU memory - weights - reserve
  Capacity full;
  std::optional<Capacity> compressed;
  std::vector<std::string> notes;  // assumptions worth printing (e.g. from a trace)
  // compressed / full requests (0 when none fit uncompressed); 1 without compression.
  double request_gain() const;
};

// Throws PlanError naming the bad field, including "weights alone need X, GPU has Y".
PlanResult plan(const PlanInput& input);

// Bytes of one request under `ratios` (nullptr = uncompressed).
Capacity request_bytes(const RequestShape& r, std::int64_t bytes_per_token, const KeepRatios* ratios);

// What a trace says about the model and a request: geometry, model name and tokens per modality.
struct TraceRequest {
  ModelSpec model;  // params from the preset of the same name, else 0
  RequestShape request;
  std::vector<std::string> notes;
};
TraceRequest request_from_trace(const std::string& path);

// Human-readable table (what `kvsim plan` prints), CSV (one row per setting) and JSON.
std::string format_plan(const PlanResult& r);
std::string plan_csv(const PlanResult& r);
std::string plan_json(const PlanResult& r);

}  // namespace kvscope::sim
