#include "kvscope/sim/policy.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kvscope/sim/stages.hpp"
#include "stages/stage.hpp"

namespace kvscope::sim {

namespace {

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool parse_bool(const std::string& v, const std::string& where) {
  const std::string l = lower(v);
  if (l == "true" || l == "1" || l == "yes" || l == "on") return true;
  if (l == "false" || l == "0" || l == "no" || l == "off") return false;
  throw PolicyError(where + ": '" + v + "' is not a boolean (true/false)");
}

double parse_number(const std::string& v, const std::string& where, double lo, double hi) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || !std::isfinite(x)) throw PolicyError(where + ": '" + v + "' is not a number");
  if (x < lo || x > hi) {
    std::ostringstream o;
    o << where << ": " << v << " is outside [" << lo << ", " << hi << "]";
    throw PolicyError(o.str());
  }
  return x;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::vector<std::string> stage_name_list(StageKind k) {
  std::vector<std::string> out;
  for (const auto* i : stage_infos(k)) out.push_back(i->name);
  return out;
}

// Validates `v` against a declaration; `w` = "WHERE: key". Throws PolicyError.
void check_value(const ParamDecl& d, const std::string& v, const std::string& w) {
  switch (d.type) {
    case ParamType::kInt: {
      // Counts must be whole numbers: "sinks = 2.7" is a mistake, not 2.
      const double x = parse_number(v, w, d.lo, d.hi);
      if (x != std::floor(x)) throw PolicyError(w + ": '" + v + "' is not a whole number");
      if (d.odd && std::fmod(x, 2.0) == 0.0) throw PolicyError(w + ": must be odd");
      break;
    }
    case ParamType::kFloat: parse_number(v, w, d.lo, d.hi); break;
    case ParamType::kBool: parse_bool(v, w); break;
    case ParamType::kChoice:
      if (std::find(d.choices.begin(), d.choices.end(), v) == d.choices.end()) {
        throw PolicyError(w + ": '" + v + "' is not one of " + join(d.choices));
      }
      break;
    case ParamType::kText:
    case ParamType::kBudget: break;
  }
}

ParamDecl pipeline_param(std::string name, ParamType type, std::string def, double lo, double hi,
                         std::vector<std::string> choices, std::string meaning) {
  ParamDecl d;
  d.name = std::move(name);
  d.type = type;
  d.default_text = std::move(def);
  d.lo = lo;
  d.hi = hi;
  d.choices = std::move(choices);
  d.meaning = std::move(meaning);
  d.source = "kvscope";
  return d;
}

}  // namespace

bool quantizer_preset(const std::string& name, kernels::QuantSpec* key, kernels::QuantSpec* value) {
  if (name == "none") return false;
  const auto* q = stages::registry().find(StageKind::kQuantizer, name);
  return q && static_cast<const stages::Quantizer*>(q)->specs(key, value);
}

const std::vector<ParamDecl>& pipeline_parameters() {
  using T = ParamType;
  static const std::vector<ParamDecl> p = {
      pipeline_param("base", T::kText, "", 0, 0, {},
                     "preset (or composition) the policy starts from (required)"),
      pipeline_param("description", T::kText, "", 0, 0, {}, "one-line description"),
      pipeline_param("head_merge", T::kText, "none", 0, 0, {},
                     "head merge stage (true = cosine, false = none)"),
      pipeline_param("scorer", T::kText, "none", 0, 0, {}, "scorer stage"),
      pipeline_param("allocator", T::kText, "uniform", 0, 0, {}, "budget allocator stage"),
      pipeline_param("executor", T::kText, "evict", 0, 0, {},
                     "executor stage (what happens to dropped tokens)"),
      pipeline_param("quant", T::kText, "none", 0, 0, {}, "quantizer stage (none removes a preset's)"),
      pipeline_param("sinks", T::kInt, "0", 0, 1e6, {}, "first N tokens always kept"),
      pipeline_param("recent", T::kInt, "0", 0, 1e6, {}, "last N tokens always kept"),
      pipeline_param("recent_fraction", T::kFloat, "0", 0, 1, {},
                     "last lround(f k) tokens always kept (the larger of the two recent counts)"),
      pipeline_param("shared_heads", T::kBool, "false", 0, 0, {},
                     "true: one kept set for all kv heads of a layer"),
      pipeline_param(
          "keep_rounding", T::kChoice, "round", 0, 0, {"round", "kvpress"},
          "tokens kept of keep fraction b: round = lround(b T); kvpress = int(T (1 - r)), r = 1 - b "
          "(kvpress's compression ratio, truncated)"),
      pipeline_param("proportional_attention", T::kBool, "true", 0, 0, {},
                     "add log n to the logits of merged slots"),
      pipeline_param("adaptive", T::kBool, "false", 0, 0, {},
                     "true: rate from input complexity, the budget is ignored"),
      pipeline_param("mode", T::kChoice, "prefill", 0, 0, {"prefill", "decode"},
                     "prefill (compress once after prefill) or decode (evict during the decode steps)"),
      pipeline_param("cap", T::kBudget, "", 0, 0, {}, "decode mode: cache cap; unset = the point's budget"),
      pipeline_param("interval", T::kInt, "1", 1, 1e6, {}, "decode mode: decode steps between evictions"),
  };
  return p;
}

std::string StageParams::text(const std::string& key) const {
  const auto it = values_.find(key);
  if (it != values_.end()) return it->second;
  const ParamDecl* d = find_parameter(key);
  if (!d) throw std::logic_error("undeclared stage parameter '" + key + "'");
  return d->default_text;
}

double StageParams::number(const std::string& key) const { return std::stod(text(key)); }

bool StageParams::flag(const std::string& key) const { return parse_bool(text(key), key); }

std::vector<std::pair<std::string, std::string>> policy_parameters() {
  std::vector<std::pair<std::string, std::string>> out;
  std::vector<std::string> seen;
  auto add = [&](const ParamDecl& d) {
    if (std::find(seen.begin(), seen.end(), d.name) != seen.end()) return;
    seen.push_back(d.name);
    out.emplace_back(d.name, d.meaning);
  };
  for (const auto& d : pipeline_parameters()) add(d);
  for (StageKind k : kStageKinds)
    for (const auto* i : stage_infos(k))
      for (const auto& d : i->params) add(d);
  return out;
}

void PolicySpec::set(const std::string& key, const std::string& v, const std::string& where) {
  const std::string w = where + ": " + key;
  auto selector = [&](StageKind kind, std::string& slot) {
    if (!find_stage_info(kind, v)) throw PolicyError(w + ": '" + v + "' is not one of " + join(stage_name_list(kind)));
    slot = v;
  };
  const ParamDecl* d = find_parameter(key);
  if (!d || key == "base") {
    std::string valid;
    for (const auto& [k, _] : policy_parameters()) valid += (valid.empty() ? "" : ", ") + k;
    throw PolicyError(where + ": unknown parameter '" + key + "' (valid: " + valid + ")");
  }
  if (key == "description") description = v;
  else if (key == "scorer") selector(StageKind::kScorer, stages.scorer);
  else if (key == "allocator") selector(StageKind::kAllocator, stages.allocator);
  else if (key == "executor") selector(StageKind::kExecutor, stages.executor);
  else if (key == "head_merge") {
    const std::string l = lower(v);
    if (l == "true" || l == "1" || l == "yes" || l == "on") stages.head_merge = "cosine";
    else if (l == "false" || l == "0" || l == "no" || l == "off") stages.head_merge = "none";
    else selector(StageKind::kHeadMerge, stages.head_merge);
  } else if (key == "quant") {
    selector(StageKind::kQuantizer, stages.quantizer);
    kernels::QuantSpec k, vq;
    if (quantizer_preset(v, &k, &vq)) {
      key_quant = k;
      value_quant = vq;
    } else {
      key_quant.reset();
      value_quant.reset();
    }
  } else if (key == "cap") {
    try {
      cap = parse_budget(v);
    } catch (const PolicyError& e) {
      throw PolicyError(w + ": " + e.what());
    }
    if (cap.kind == Budget::Kind::kNone) throw PolicyError(w + ": '" + v + "' is not a budget (0.3, 512tok, 64MiB)");
  } else {
    check_value(*d, v, w);
    if (key == "sinks") sinks = static_cast<int>(std::stod(v));
    else if (key == "recent") recent = static_cast<int>(std::stod(v));
    else if (key == "recent_fraction") recent_fraction = static_cast<float>(std::stod(v));
    else if (key == "shared_heads") shared_heads = parse_bool(v, w);
    else if (key == "keep_rounding")
      floor_keep = v == "kvpress";
    else if (key == "proportional_attention") proportional_attention = parse_bool(v, w);
    else if (key == "adaptive") adaptive = parse_bool(v, w);
    else if (key == "mode") mode = v == "decode" ? PolicyMode::kDecode : PolicyMode::kPrefill;
    else if (key == "interval") interval = static_cast<int>(std::stod(v));
    else params.set(key, v);  // a stage's parameter
  }
  if (stages.scorer != "none") compress_tokens = true;
}

namespace {

// A preset: a composition of stages with parameters, built through the same parameter path as
// an INI section (PolicySpec::set), optionally on top of another preset.
struct Preset {
  const char* name;
  const char* base;  // "" or an earlier preset
  bool tokens;       // compresses tokens (false: full, quantization only)
  const char* description;
  const char* source;
  std::vector<std::pair<const char*, const char*>> params;
};

const std::vector<Preset>& preset_list() {
  static const std::vector<Preset> presets = {
      {"full", "", false, "no compression: every token kept in the trace's dtype", "baseline", {}},
      {"window",
       "",
       true,
       "sliding window: keep the most recent tokens",
       "Beltagy et al. 2020 (Longformer); baseline",
       {{"scorer", "recency"}}},
      {"streamingllm",
       "",
       true,
       "attention sinks (first 4 tokens) + most recent tokens",
       "Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks",
       {{"scorer", "recency"}, {"sinks", "4"}}},
      {"h2o",
       "",
       true,
       "heavy hitters by accumulated attention (half the budget) + recent tokens (half)",
       "Zhang et al. 2023, H2O: Heavy-Hitter Oracle",
       {{"scorer", "h2o"}, {"recent_fraction", "0.5"}}},
      {"snapkv",
       "",
       true,
       "attention of the last 32 prefill queries, max-pooled (kernel 7); window kept",
       "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation",
       {{"scorer", "snapkv"}, {"snap_pool", "max"}, {"recent", "32"}}},
      {"pyramidkv",
       "snapkv",
       true,
       "SnapKV scores with pyramid layer budgets: shallow layers keep more, deep fewer, same total",
       "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
       {{"allocator", "pyramid"}}},
      {"tova",
       "",
       true,
       "attention of the last prefill query",
       "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA)",
       {{"scorer", "tova"}}},
      {"knorm",
       "",
       true,
       "lowest key L2 norm first",
       "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
       {{"scorer", "knorm"}}},
      {"random", "", true, "uniformly random tokens (seeded)", "baseline", {{"scorer", "random"}}},
      {"snapkv-kvpress",
       "snapkv",
       true,
       "SnapKV as kvpress's SnapKVPress: window 64, avg-pooled (kernel 5) up to the window's edge, the window "
       "kept, int(T(1-r)) tokens",
       "kvpress 0.5.5 SnapKVPress (Li et al. 2024)",
       {{"snap_window", "64"},
        {"snap_kernel", "5"},
        {"snap_pool", "avg"},
        {"snap_pool_span", "split"},
        {"recent", "64"},
        {"keep_rounding", "kvpress"}}},
      {"tova-kvpress",
       "tova",
       true,
       "TOVA as kvpress's TOVAPress: one set per layer from the last query's attention averaged over all "
       "query "
       "heads, the last token kept, int(T(1-r)) tokens",
       "kvpress 0.5.5 TOVAPress (Oren et al. 2024)",
       {{"shared_heads", "true"}, {"recent", "1"}, {"keep_rounding", "kvpress"}}},
      {"random-kvpress",
       "random",
       true,
       "random as kvpress's RandomPress: the same positions in every layer (per kv head), int(T(1-r)) tokens",
       "kvpress 0.5.5 RandomPress",
       {{"random_layers", "same"}, {"keep_rounding", "kvpress"}}},
      {"fastv",
       "",
       true,
       "from layer 2 on, drop the vision tokens the last query attends to least; text kept",
       "Chen et al. 2024, An Image is Worth 1/2 Tokens After Layer 2 (FastV)",
       {{"scorer", "tova"}, {"allocator", "vision-only"}, {"fastv_layer", "2"}}},
      {"vision-stride",
       "",
       true,
       "structured spatial drop: keep an evenly strided patch grid; text kept",
       "structured vision token pruning baseline (spatial stride / pooling)",
       {{"scorer", "vision-stride"}, {"allocator", "vision-only"}, {"fastv_layer", "0"}}},
      {"hybridkv",
       "",
       true,
       "text dense, vision sparse: alpha = 0.5 of the budget reserved for text, SnapKV scores",
       "HybridKV-style modality split (design.md); alpha split of the budget",
       {{"scorer", "snapkv"}, {"snap_pool", "max"}, {"allocator", "hybrid"}, {"sinks", "4"}}},
      {"look-m",
       "",
       true,
       "SnapKV-scored vision eviction, evicted vision tokens merged into similar kept ones",
       "Wan et al. 2024, LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context "
       "Inference",
       {{"scorer", "snapkv"},
        {"snap_pool", "max"},
        {"allocator", "vision-only"},
        {"fastv_layer", "0"},
        {"executor", "merge-evicted"},
        {"merge_threshold", "0.5"},
        {"merge_window", "64"}}},
      {"unicache",
       "",
       true,
       "UniCache: head merge, modality-normalised importance, cosine layer schedule, "
       "density-driven modality budgets, alignment protection, merge/evict, int8 per head",
       "seed 000 (UniCache), design.md Policies",
       {{"head_merge", "cosine"},
        {"scorer", "unicache"},
        {"allocator", "unicache"},
        {"executor", "unicache"},
        {"sinks", "4"},
        {"recent", "8"},
        {"quant", "int8-head"}}},
      {"unicache-long-video",
       "unicache",
       true,
       "UniCache long-video scene: vision rate 0.75-0.80",
       "seed 000, scene presets",
       {{"unicache.vision_cap", "0.80"}, {"unicache.rate_shallow", "0.80"}, {"unicache.rate_deep", "0.75"}}},
      {"unicache-doc-qa",
       "unicache",
       true,
       "UniCache document-QA scene: text rate capped at 0.20, alignment discount 0.4",
       "seed 000, scene presets",
       {{"unicache.text_cap", "0.20"}, {"unicache.align_discount", "0.4"}}},
      {"unicache-realtime-chat",
       "unicache",
       true,
       "UniCache real-time chat scene: head merge threshold 0.85, token rates -5 points",
       "seed 000, scene presets",
       {{"head_merge_threshold", "0.85"}, {"unicache.rate_offset", "-0.05"}}},
      {"adaptive",
       "unicache",
       true,
       "UniCache with the adaptive fallback: rate in [0.40, 0.75] from input complexity "
       "(log V + log T + 2 N_align / (T + V)); ignores the given budget",
       "seed 000, adaptive fallback",
       {{"adaptive", "true"}}},
      {"int8",
       "",
       false,
       "int8 symmetric, one scale per token (K and V)",
       "standard per-token int8 KV quantization",
       {{"quant", "int8"}}},
      {"int4",
       "",
       false,
       "int4 asymmetric, one scale and zero per group of 32 channels of a token",
       "group-wise int4 KV quantization (e.g. FlexGen, KIVI's baseline)",
       {{"quant", "int4"}}},
      {"kivi2",
       "",
       false,
       "KIVI 2-bit: keys per channel, values per token, groups of 32, last 128 tokens full precision",
       "Liu et al. 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
       {{"quant", "kivi2"}}},
  };
  return presets;
}

}  // namespace

PolicyRegistry::PolicyRegistry() {
  for (const Preset& d : preset_list()) {
    PolicySpec p = *d.base ? specs_.at(d.base) : PolicySpec{};
    for (const auto& [k, v] : d.params) p.set(k, v, std::string("preset ") + d.name);
    p.compress_tokens = d.tokens;
    p.name = d.name;
    p.description = d.description;
    p.source = d.source;
    specs_[p.name] = std::move(p);
  }
  // Scorers that declare a preset of their own name (StageInfo::preset).
  for (const StageInfo* i : stage_infos(StageKind::kScorer)) {
    if (!i->preset || specs_.count(i->name)) continue;
    PolicySpec p;
    p.set("scorer", i->name, "preset " + i->name);
    p.name = i->name;
    p.description = i->meaning;
    p.source = i->source;
    specs_[p.name] = std::move(p);
  }
}

std::vector<std::string> PolicyRegistry::names() const {
  std::vector<std::string> n;
  for (const auto& [k, _] : specs_) n.push_back(k);
  return n;
}

PolicySpec PolicyRegistry::get(const std::string& raw) const {
  const std::string name = trim(raw);
  auto list = [&] {
    std::string s;
    for (const auto& n : names()) s += (s.empty() ? "" : ", ") + n;
    return s + "; compose an eviction policy with a quantizer as NAME+int8|int8-head|int4|kivi2; adaptive-NAME wraps NAME; NAME~decode[:INTERVAL] evicts during decoding";
  };
  if (name.empty()) throw PolicyError("empty policy name (valid: " + list() + ")");
  // "A~decode[:N]": policy A run continuously during decoding. Split before '+', so that
  // "h2o+int8~decode" is (h2o+int8) in decode mode.
  const auto tilde = name.find('~');
  if (tilde != std::string::npos) {
    const std::string suffix = name.substr(tilde + 1);
    int interval = 1;
    bool ok = suffix == "decode";
    if (!ok && suffix.rfind("decode:", 0) == 0 && suffix.size() > 7 && suffix.size() < 17) {
      const std::string digits = suffix.substr(7);
      ok = digits.find_first_not_of("0123456789") == std::string::npos && digits != "0";
      if (ok) interval = static_cast<int>(std::stol(digits));
      ok = ok && interval >= 1;
    }
    if (!ok) {
      throw PolicyError("malformed mode suffix '~" + suffix + "' in '" + name + "' (use " + kDecodeSuffixSyntax + ")");
    }
    PolicySpec p = get(name.substr(0, tilde));
    p.mode = PolicyMode::kDecode;
    p.interval = interval;
    p.name = name;
    check_decode_support(p, "'" + name + "'");
    return p;
  }
  const auto plus = name.find('+');
  if (plus != std::string::npos) {
    PolicySpec p = get(name.substr(0, plus));
    const std::string q = name.substr(plus + 1);
    kernels::QuantSpec k, v;
    if (!quantizer_preset(q, &k, &v)) {
      std::string valid;
      for (const auto* i : stage_infos(StageKind::kQuantizer))
        if (i->name != "none") valid += (valid.empty() ? "" : ", ") + i->name;
      throw PolicyError("unknown quantizer '" + q + "' in '" + name + "' (valid: " + valid + ")");
    }
    // "+Q" sets the quantizer (replacing one the base policy may have, e.g. unicache's int8).
    p.set("quant", q, "'" + name + "'");
    p.name = name;
    return p;
  }
  if (name.rfind("adaptive-", 0) == 0) {
    PolicySpec p = get(name.substr(9));
    if (!p.compress_tokens) throw PolicyError("'" + name + "': adaptive needs a token policy, not '" + p.name + "'");
    p.adaptive = true;
    p.name = name;
    return p;
  }
  const auto it = specs_.find(name);
  if (it == specs_.end()) throw PolicyError("unknown policy '" + name + "' (valid: " + list() + ")");
  return it->second;
}

void PolicyRegistry::load_ini(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
    // A FIFO would block the read forever; a directory reads as empty.
    throw PolicyError(path + ": policy file is not a regular file");
  }
  std::ifstream in(path);
  if (!in) throw PolicyError(path + ": cannot open policy file");
  struct Section {
    std::string name;
    int line = 0;
    std::vector<std::tuple<std::string, std::string, int>> kv;
  };
  std::vector<Section> sections;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const std::string where = path + ":" + std::to_string(n);
    std::string s = trim(line);
    if (s.empty() || s[0] == '#' || s[0] == ';') continue;
    if (s.front() == '[') {
      if (s.back() != ']') throw PolicyError(where + ": section header must end with ']'");
      std::string inner = trim(s.substr(1, s.size() - 2));
      if (inner.rfind("policy", 0) != 0 || inner.size() < 8 || !std::isspace(static_cast<unsigned char>(inner[6]))) {
        throw PolicyError(where + ": section must be [policy NAME]");
      }
      std::string name = trim(inner.substr(6));
      if (name.empty() || name.find_first_of("+@~, \t") != std::string::npos) {
        throw PolicyError(where + ": policy name '" + name + "' must be non-empty without '+', '@', '~', ',' or spaces");
      }
      if (name.rfind("adaptive-", 0) == 0) {
        throw PolicyError(where + ": policy name '" + name + "' must not start with 'adaptive-' (that prefix wraps a policy)");
      }
      if (specs_.count(name)) {
        throw PolicyError(where + ": [policy " + name + "] redefines an existing policy; choose another name");
      }
      for (const auto& other : sections) {
        if (other.name == name) throw PolicyError(where + ": [policy " + name + "] is defined twice in this file");
      }
      sections.push_back({name, n, {}});
      continue;
    }
    const auto eq = s.find('=');
    if (eq == std::string::npos) throw PolicyError(where + ": expected 'key = value'");
    if (sections.empty()) throw PolicyError(where + ": 'key = value' before any [policy NAME] section");
    sections.back().kv.emplace_back(trim(s.substr(0, eq)), trim(s.substr(eq + 1)), n);
  }
  if (sections.empty()) throw PolicyError(path + ": no [policy NAME] section");
  for (const auto& sec : sections) {
    const std::string where = path + ":" + std::to_string(sec.line);
    std::string base_name;
    for (const auto& [k, v, ln] : sec.kv) {
      if (k == "base") base_name = v;
    }
    if (base_name.empty()) throw PolicyError(where + ": [policy " + sec.name + "] needs 'base = PRESET'");
    PolicySpec p;
    try {
      p = get(base_name);
    } catch (const PolicyError& e) {
      throw PolicyError(where + ": base: " + e.what());
    }
    p.name = sec.name;
    p.source = "policy file " + path + " (base " + base_name + ")";
    for (const auto& [k, v, ln] : sec.kv) {
      if (k != "base") p.set(k, v, path + ":" + std::to_string(ln));
    }
    if (p.mode == PolicyMode::kDecode) check_decode_support(p, where + ": [policy " + sec.name + "]");
    if (p.mode == PolicyMode::kPrefill && (p.cap.kind != Budget::Kind::kNone || p.interval != 1)) {
      throw PolicyError(where + ": [policy " + sec.name + "] sets cap or interval without 'mode = decode'");
    }
    specs_[sec.name] = p;
  }
}

void check_decode_support(const PolicySpec& p, const std::string& where) {
  std::string bad;
  const std::pair<StageKind, const std::string*> used[] = {{StageKind::kHeadMerge, &p.stages.head_merge},
                                                           {StageKind::kScorer, &p.stages.scorer},
                                                           {StageKind::kAllocator, &p.stages.allocator},
                                                           {StageKind::kExecutor, &p.stages.executor},
                                                           {StageKind::kQuantizer, &p.stages.quantizer}};
  if (!p.compress_tokens) bad = "it does not evict tokens (decode mode needs a token scorer)";
  else if (p.adaptive)
    bad = "adaptive budgets (the adaptive rate replaces the point's budget, which decode mode needs as its cap; "
          "give a cap instead, e.g. unicache~decode@0.4)";
  else {
    for (const auto& [kind, name] : used) {
      const StageInfo* info = find_stage_info(kind, *name);
      // A head merge without a decode mode is not refused: decode mode runs the kv heads unmerged
      // (run_decode_policy_on_layer warns).
      if (info && !info->decode && kind != StageKind::kHeadMerge) {
        bad = std::string("its ") + stage_kind_name(kind) + " '" + *name + "'";
        break;
      }
    }
  }
  if (bad.empty()) return;
  auto supported = [](StageKind k) {
    std::vector<std::string> n;
    for (const auto* i : stage_infos(k))
      if (i->decode) n.push_back(i->name);
    return n;
  };
  auto words = [](const std::vector<std::string>& n, const char* sep) {
    std::string s;
    for (std::size_t i = 0; i < n.size(); ++i) s += (i == 0 ? "" : (i + 1 == n.size() ? sep : ", ")) + n[i];
    return s;
  };
  const std::vector<std::string> quant = supported(StageKind::kQuantizer);
  const bool every_quantizer = quant.size() == stage_infos(StageKind::kQuantizer).size();
  throw PolicyError(where + ": decode mode does not support " + bad + "; it supports scorers " +
                    join(supported(StageKind::kScorer)) + " with the " + words(supported(StageKind::kAllocator), " or ") +
                    " allocator, the " + words(supported(StageKind::kExecutor), " or ") + " executor and " +
                    (every_quantizer ? std::string("any quantizer") : "the quantizers " + join(quant)) +
                    " (e.g. h2o~decode, snapkv+int8~decode)");
}

bool policy_needs_budget(const PolicySpec& p) {
  if (!p.compress_tokens || p.adaptive) return false;
  if (p.mode == PolicyMode::kDecode && p.cap.kind != Budget::Kind::kNone) return false;
  return !stages::allocator_of(p).own_schedule();
}

Budget parse_budget(const std::string& raw) {
  const std::string text = trim(raw);
  Budget b;
  b.text = text;
  if (text.empty() || text == "-") return b;
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(text, &used);
  } catch (const std::exception&) {
    throw PolicyError("malformed budget '" + text + "' (use a fraction in (0, 1] like 0.3, tokens like 512tok, or bytes like 64MiB)");
  }
  const std::string unit = lower(trim(text.substr(used)));
  if (!std::isfinite(x)) throw PolicyError("budget '" + text + "' is not a finite number");
  if (x <= 0) throw PolicyError("budget '" + text + "' must be positive");
  if (unit.empty()) {
    if (x > 1) throw PolicyError("budget fraction '" + text + "' must be in (0, 1] (use 512tok for tokens)");
    b.kind = Budget::Kind::kFraction;
    b.value = x;
    return b;
  }
  if (unit == "tok" || unit == "tokens") {
    if (x != std::floor(x)) throw PolicyError("token budget '" + text + "' must be a whole number");
    b.kind = Budget::Kind::kTokens;
    b.value = x;
    return b;
  }
  static const std::pair<const char*, double> units[] = {
      {"b", 1}, {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
  for (const auto& [u, f] : units) {
    if (unit == u) {
      b.kind = Budget::Kind::kBytes;
      b.value = x * f;
      return b;
    }
  }
  throw PolicyError("malformed budget '" + text + "': unknown unit '" + unit + "' (tok, B, KiB, MiB, GiB, KB, MB, GB)");
}

std::pair<std::string, Budget> split_policy_budget(const std::string& text) {
  const auto at = text.find('@');
  if (at == std::string::npos) return {trim(text), Budget{}};
  return {trim(text.substr(0, at)), parse_budget(text.substr(at + 1))};
}

}  // namespace kvscope::sim
