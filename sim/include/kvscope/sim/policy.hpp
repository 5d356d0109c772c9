// Compression policies as pipelines of stages:
//   head merge -> scorer -> budget allocator (layer x modality) -> executor
//   (keep / merge / evict, sinks and recent window forced) -> quantizer.
// Named presets (docs/policies.md), compositions "a+b" and INI files build a
// PolicySpec; budgets are fractions of tokens ("0.3"), tokens ("512tok") or
// bytes ("64MiB").
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/scores.hpp"

namespace kvscope::sim {

// Bad policy names, parameters, budgets or INI files.
class PolicyError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class ScorerKind {
  kNone,          // keeps everything (full, quantization-only)
  kRecency,       // newest tokens first (window, streamingllm)
  kH2O,           // accumulated attention over all prefill queries
  kSnapKV,        // observation-window attention, pooled
  kTOVA,          // attention of the last prefill query
  kKeyNorm,       // lowest key norm first
  kRandom,        // seeded uniform
  kVisionStride,  // structured spatial drop: coarsest patch grid first
  kUniCache,      // s = w_a a~ + w_c c~ - w_d d + w_r r
  kOracleTopK,    // oracle: attention mass from the trace's own evaluation queries
                  // (LayerData::decode_attention_mass)
};

enum class AllocatorKind {
  kUniform,   // every layer keeps the budget fraction of every head
  kPyramid,   // PyramidKV: more tokens in shallow layers, fewer in deep ones, same total
  kHybrid,    // HybridKV: text dense (a share alpha of the budget), vision sparse
  kVisionOnly,// FastV / vision-stride / LOOK-M: text, audio and special tokens all kept, budget spent on vision
  kUniCache,  // cosine layer schedule + density-driven cross-modal split with caps
  kExplicit,  // per-layer x per-modality keep fractions given in PolicySpec::layer_modality_keep (oracle)
};

enum class ExecutorKind {
  kEvict,         // drop what is not selected
  kMergeEvicted,  // LOOK-M: fold evicted tokens into the most similar kept one
  kUniCache,      // redundancy d > merge threshold -> merge, else evict
};

// Budget of an eviction/merge stage.
struct Budget {
  enum class Kind { kNone, kFraction, kTokens, kBytes };
  Kind kind = Kind::kNone;
  double value = 1.0;  // fraction in (0, 1], tokens per layer and head, or total bytes
  std::string text;    // as written ("0.3", "512tok", "64MiB", "-")
};

// When the policy runs: once on the prefill cache, or continuously during the decode steps
// (docs/policies.md "Decode-time mode").
enum class PolicyMode { kPrefill, kDecode };

struct UniCacheConfig {
  float w_a = 0.4f, w_c = 0.3f, w_d = 0.2f, w_r = 0.1f;  // middle layers
  float shallow_w_d = 0.3f;   // first third of the layers
  float deep_w_a = 0.5f;      // last third of the layers
  float rate_shallow = 0.75f; // compression rate (fraction removed) of layer 0
  float rate_deep = 0.45f;    // ... of the last layer, cosine curve in between
  float vision_cap = 0.80f;   // maximum vision compression rate
  float text_cap = 0.40f;     // maximum text compression rate
  float align_threshold = 0.3f;  // cross-modal attention share that makes a token an alignment token
  float align_discount = 0.5f;   // alignment tokens get this fraction of their modality's rate
  float merge_threshold = 0.8f;  // redundancy above which a dropped token is merged, not evicted
  int seq_radius = 4;         // redundancy neighbours in sequence order
  int grid_radius = 1;        // redundancy neighbours on the patch grid
  float rate_offset = 0.0f;   // added to every token rate (realtime-chat: -0.05)
};

struct PolicySpec {
  std::string name;  // canonical name, e.g. "h2o+int8"
  bool compress_tokens = true;
  bool adaptive = false;  // budget from input complexity (rate in [0.40, 0.75]), ignores the given budget
  bool head_merge = false;
  float head_merge_threshold = 0.88f;
  ScorerKind scorer = ScorerKind::kNone;
  AllocatorKind allocator = AllocatorKind::kUniform;
  ExecutorKind executor = ExecutorKind::kEvict;
  int sinks = 0;                 // first tokens always kept
  int recent = 0;                // last tokens always kept (absolute)
  float recent_fraction = 0.0f;  // share of the budget given to the most recent tokens (H2O: 0.5)
  bool shared_heads = false;     // one kept set for all kv heads of a layer
  kernels::SnapKVParams snapkv{};
  int fastv_layer = 2;           // FastV: layers before this keep everything
  float hybrid_text_share = 0.5f;
  float pyramid_spread = 0.5f;   // PyramidKV: budget of layer l = b * (1 + spread * (1 - 2 l / (L - 1)))
  float merge_threshold = 0.8f;  // LOOK-M
  int merge_window = 8;          // LOOK-M / UniCache merge window (positions)
  UniCacheConfig unicache;
  std::optional<kernels::QuantSpec> key_quant, value_quant;
  bool proportional_attention = true;
  std::uint64_t seed = 0;
  // kExplicit allocator: keep fraction of each modality's tokens, per layer ([num_layers][4]).
  std::vector<std::array<double, 4>> layer_modality_keep;
  // Decode-time mode: every `interval` decode steps the cache is evicted down to `cap`.
  // cap.kind == kNone: the point's budget is the cap (the cache starts with the full context);
  // otherwise the point's budget, if any, compresses the context once after prefill.
  PolicyMode mode = PolicyMode::kPrefill;
  Budget cap;
  int interval = 1;
  std::string description;       // one line, for --help and docs
  std::string source;            // paper / seed section
};

// "0.3", "512tok", "64MiB", "1.5GB", "4096B". Throws PolicyError naming the text.
Budget parse_budget(const std::string& text);
// "h2o@0.3" -> ("h2o", budget); "int8" -> ("int8", none).
std::pair<std::string, Budget> split_policy_budget(const std::string& text);

class PolicyRegistry {
 public:
  PolicyRegistry();  // the built-in presets
  // A preset, a composition "a+b" (eviction/merge policy + quantizer), or a policy
  // defined by load_ini. Throws PolicyError listing valid names.
  PolicySpec get(const std::string& name) const;
  // Adds the [policy NAME] sections of an INI file. Throws PolicyError "FILE:LINE: ...".
  void load_ini(const std::string& path);
  std::vector<std::string> names() const;  // presets and INI policies, sorted
  const std::map<std::string, PolicySpec>& presets() const { return specs_; }

 private:
  std::map<std::string, PolicySpec> specs_;
};

// Throws PolicyError when `policy` (in decode mode) uses a stage decode mode does not
// support; `where` prefixes the message. Supported: scorers none, recency, h2o, snapkv, tova,
// knorm, random; allocators uniform, pyramid; executor evict; no head merge, not adaptive.
void check_decode_support(const PolicySpec& policy, const std::string& where);
// The syntax of the decode suffix, for messages and --help.
constexpr const char* kDecodeSuffixSyntax = "NAME~decode or NAME~decode:INTERVAL (INTERVAL a whole number >= 1), "
                                            "e.g. h2o~decode@0.3, h2o+int8~decode:4@512tok";

// The quantizer presets int8, int4, kivi2 as (key, value) specs.
bool quantizer_preset(const std::string& name, kernels::QuantSpec* key, kernels::QuantSpec* value);

// The parameter keys an INI section may set, with one-line meanings (for errors and docs).
const std::vector<std::pair<std::string, std::string>>& policy_parameters();

}  // namespace kvscope::sim
