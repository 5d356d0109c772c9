// Compression policies as compositions of stages:
//   head merge -> scorer -> budget allocator (layer x modality) -> executor
//   (keep / merge / evict, sinks and recent window forced) -> quantizer.
// Each stage method is one file under sim/src/stages/ that declares its parameters
// (kvscope/sim/stages.hpp). Named presets (docs/policies.md), compositions "a+b" and INI
// files build a PolicySpec; budgets are fractions of tokens ("0.3"), tokens ("512tok") or
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

// The parameter values a policy's stages read, by parameter name (the names the stages declare,
// sim/include/kvscope/sim/stages.hpp). A value not set here is the declaration's default.
// Values are kept as written (validated when set), so printing a policy shows what was asked.
class StageParams {
 public:
  void set(const std::string& key, const std::string& value) { values_[key] = value; }
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  // The value as written, or the declared default. Throws std::logic_error for an undeclared key.
  std::string text(const std::string& key) const;
  double number(const std::string& key) const;
  float real(const std::string& key) const { return static_cast<float>(number(key)); }
  int integer(const std::string& key) const { return static_cast<int>(number(key)); }
  bool flag(const std::string& key) const;
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  std::map<std::string, std::string> values_;
};

// The stages a policy is composed of, by registered name (kvsim stages lists them).
struct StageNames {
  std::string head_merge = "none";  // none, cosine
  std::string scorer = "none";
  std::string allocator = "uniform";
  std::string executor = "evict";
  std::string quantizer = "none";
};

// A policy: a composition of named stages with their parameters, plus the pipeline's own
// parameters (forced set, evaluation, mode). Presets are compositions too (docs/policies.md).
struct PolicySpec {
  std::string name;  // canonical name, e.g. "h2o+int8"
  bool compress_tokens = true;   // false: every token kept (full, quantization only)
  bool adaptive = false;  // budget from input complexity (rate in [0.40, 0.75]), ignores the given budget
  StageNames stages;
  StageParams params;            // parameters of the stages (snap_window, pyramid_spread, unicache.w_a, ...)
  int sinks = 0;                 // first tokens always kept
  int recent = 0;                // last tokens always kept (absolute)
  float recent_fraction = 0.0f;  // share of the budget given to the most recent tokens (H2O: 0.5)
  bool shared_heads = false;     // one kept set for all kv heads of a layer
  bool floor_keep = false;       // keep_rounding = kvpress: k = int(T * (1 - (1 - keep))) instead of lround
  // The quantizer stage's (key, value) specs; both empty: no quantization. reset() both to run a
  // policy without its quantizer.
  std::optional<kernels::QuantSpec> key_quant, value_quant;
  bool proportional_attention = true;
  // "explicit" allocator: keep fraction of each modality's tokens, per layer ([num_layers][4]).
  std::vector<std::array<double, 4>> layer_modality_keep;
  // Decode-time mode: every `interval` decode steps the cache is evicted down to `cap`.
  // cap.kind == kNone: the point's budget is the cap (the cache starts with the full context);
  // otherwise the point's budget, if any, compresses the context once after prefill.
  PolicyMode mode = PolicyMode::kPrefill;
  Budget cap;
  int interval = 1;
  std::string description;       // one line, for --help and docs
  std::string source;            // paper / seed section

  // Sets one parameter (a pipeline key, a stage selector or a stage parameter) from its text,
  // validated against its declaration. `where` prefixes errors ("FILE:LINE"). Throws PolicyError.
  void set(const std::string& key, const std::string& value, const std::string& where = "policy");
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
// support; `where` prefixes the message. What is supported comes from the stages' declarations
// (StageInfo::decode).
void check_decode_support(const PolicySpec& policy, const std::string& where);
// The syntax of the decode suffix, for messages and --help.
constexpr const char* kDecodeSuffixSyntax = "NAME~decode or NAME~decode:INTERVAL (INTERVAL a whole number >= 1), "
                                            "e.g. h2o~decode@0.3, h2o+int8~decode:4@512tok";

// The quantizer presets int8, int4, kivi2 as (key, value) specs.
bool quantizer_preset(const std::string& name, kernels::QuantSpec* key, kernels::QuantSpec* value);

// The parameter keys an INI section may set, with one-line meanings (for errors and docs): the
// pipeline's keys, then every stage's, from their declarations.
std::vector<std::pair<std::string, std::string>> policy_parameters();

// True when `policy` needs a budget to run (a token policy whose allocator has no schedule of
// its own, not adaptive, no fixed decode cap).
bool policy_needs_budget(const PolicySpec& policy);

}  // namespace kvscope::sim
