#include "kvscope/sim/policy.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

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

PolicySpec base(const std::string& name, const std::string& description, const std::string& source) {
  PolicySpec p;
  p.name = name;
  p.description = description;
  p.source = source;
  return p;
}

void add(std::map<std::string, PolicySpec>& m, PolicySpec p) { m[p.name] = std::move(p); }

}  // namespace

bool quantizer_preset(const std::string& name, kernels::QuantSpec* key, kernels::QuantSpec* value) {
  using kernels::Granularity;
  if (name == "int8") {
    *key = *value = kernels::QuantSpec{8, true, Granularity::kPerToken, 0, 0};
    return true;
  }
  if (name == "int8-head") {
    *key = *value = kernels::QuantSpec{8, true, Granularity::kPerHead, 0, 0};
    return true;
  }
  if (name == "int4") {
    *key = *value = kernels::QuantSpec{4, false, Granularity::kPerToken, 32, 0};
    return true;
  }
  if (name == "kivi2") {
    *key = kernels::kivi_key_spec(2, 32, 128);
    *value = kernels::kivi_value_spec(2, 32, 128);
    return true;
  }
  return false;
}

PolicyRegistry::PolicyRegistry() {
  auto& m = specs_;
  {
    auto p = base("full", "no compression: every token kept in the trace's dtype", "baseline");
    p.compress_tokens = false;
    add(m, p);
  }
  {
    auto p = base("window", "sliding window: keep the most recent tokens", "Beltagy et al. 2020 (Longformer); baseline");
    p.scorer = ScorerKind::kRecency;
    add(m, p);
  }
  {
    auto p = base("streamingllm", "attention sinks (first 4 tokens) + most recent tokens",
                  "Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks");
    p.scorer = ScorerKind::kRecency;
    p.sinks = 4;
    add(m, p);
  }
  {
    auto p = base("h2o", "heavy hitters by accumulated attention (half the budget) + recent tokens (half)",
                  "Zhang et al. 2023, H2O: Heavy-Hitter Oracle");
    p.scorer = ScorerKind::kH2O;
    p.recent_fraction = 0.5f;
    add(m, p);
  }
  {
    auto p = base("snapkv", "attention of the last 32 prefill queries, max-pooled (kernel 7); window kept",
                  "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation");
    p.scorer = ScorerKind::kSnapKV;
    p.snapkv = {32, 7, kernels::PoolKind::kMax};
    p.recent = 32;
    add(m, p);
  }
  {
    auto p = m["snapkv"];
    p.name = "pyramidkv";
    p.description = "SnapKV scores with pyramid layer budgets: shallow layers keep more, deep fewer, same total";
    p.source = "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling";
    p.allocator = AllocatorKind::kPyramid;
    add(m, p);
  }
  {
    auto p = base("tova", "attention of the last prefill query", "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA)");
    p.scorer = ScorerKind::kTOVA;
    add(m, p);
  }
  {
    auto p = base("knorm", "lowest key L2 norm first", "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression");
    p.scorer = ScorerKind::kKeyNorm;
    add(m, p);
  }
  {
    auto p = base("random", "uniformly random tokens (seeded)", "baseline");
    p.scorer = ScorerKind::kRandom;
    add(m, p);
  }
  {
    auto p = base("fastv", "from layer 2 on, drop the vision tokens the last query attends to least; text kept",
                  "Chen et al. 2024, An Image is Worth 1/2 Tokens After Layer 2 (FastV)");
    p.scorer = ScorerKind::kTOVA;
    p.allocator = AllocatorKind::kVisionOnly;
    p.fastv_layer = 2;
    add(m, p);
  }
  {
    auto p = base("vision-stride", "structured spatial drop: keep an evenly strided patch grid; text kept",
                  "structured vision token pruning baseline (spatial stride / pooling)");
    p.scorer = ScorerKind::kVisionStride;
    p.allocator = AllocatorKind::kVisionOnly;
    p.fastv_layer = 0;
    add(m, p);
  }
  {
    auto p = base("hybridkv", "text dense, vision sparse: alpha = 0.5 of the budget reserved for text, SnapKV scores",
                  "HybridKV-style modality split (design.md); alpha split of the budget");
    p.scorer = ScorerKind::kSnapKV;
    p.snapkv = {32, 7, kernels::PoolKind::kMax};
    p.allocator = AllocatorKind::kHybrid;
    p.sinks = 4;
    add(m, p);
  }
  {
    auto p = base("look-m", "SnapKV-scored vision eviction, evicted vision tokens merged into similar kept ones",
                  "Wan et al. 2024, LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context Inference");
    p.scorer = ScorerKind::kSnapKV;
    p.snapkv = {32, 7, kernels::PoolKind::kMax};
    p.allocator = AllocatorKind::kVisionOnly;
    p.fastv_layer = 0;
    p.executor = ExecutorKind::kMergeEvicted;
    p.merge_threshold = 0.5f;
    p.merge_window = 64;
    add(m, p);
  }
  {
    auto p = base("unicache", "UniCache: head merge, modality-normalised importance, cosine layer schedule, "
                  "density-driven modality budgets, alignment protection, merge/evict, int8 per head",
                  "seed 000 (UniCache), design.md Policies");
    p.head_merge = true;
    p.scorer = ScorerKind::kUniCache;
    p.allocator = AllocatorKind::kUniCache;
    p.executor = ExecutorKind::kUniCache;
    p.sinks = 4;
    p.recent = 8;
    kernels::QuantSpec k, v;
    quantizer_preset("int8-head", &k, &v);
    p.key_quant = k;
    p.value_quant = v;
    add(m, p);
    auto lv = p;
    lv.name = "unicache-long-video";
    lv.description = "UniCache long-video scene: vision rate 0.75-0.80";
    lv.source = "seed 000, scene presets";
    lv.unicache.vision_cap = 0.80f;
    lv.unicache.rate_shallow = 0.80f;
    lv.unicache.rate_deep = 0.75f;
    add(m, lv);
    auto dq = p;
    dq.name = "unicache-doc-qa";
    dq.description = "UniCache document-QA scene: text rate capped at 0.20, alignment discount 0.4";
    dq.source = "seed 000, scene presets";
    dq.unicache.text_cap = 0.20f;
    dq.unicache.align_discount = 0.4f;
    add(m, dq);
    auto rc = p;
    rc.name = "unicache-realtime-chat";
    rc.description = "UniCache real-time chat scene: head merge threshold 0.85, token rates -5 points";
    rc.source = "seed 000, scene presets";
    rc.head_merge_threshold = 0.85f;
    rc.unicache.rate_offset = -0.05f;
    add(m, rc);
    auto ad = p;
    ad.name = "adaptive";
    ad.adaptive = true;
    ad.description = "UniCache with the adaptive fallback: rate in [0.40, 0.75] from input complexity "
                     "(log V + log T + 2 N_align / (T + V)); ignores the given budget";
    ad.source = "seed 000, adaptive fallback";
    add(m, ad);
  }
  {
    // The query-aware bound: not a policy (it reads the evaluation queries), reported by every sweep.
    auto p =
        base("oracle-topk",
             "BOUND, not a policy: per layer and kv head the tokens with the most attention from the trace's "
             "own evaluation queries (uniform budget, nothing forced)",
             "query-aware oracle (docs/policies.md, Bound and search rows in sweeps)");
    p.scorer = ScorerKind::kOracleTopK;
    add(m, p);
  }
  for (const char* q : {"int8", "int4", "kivi2"}) {
    auto p = base(q, "", "");
    p.compress_tokens = false;
    kernels::QuantSpec k, v;
    quantizer_preset(q, &k, &v);
    p.key_quant = k;
    p.value_quant = v;
    if (std::string(q) == "int8") {
      p.description = "int8 symmetric, one scale per token (K and V)";
      p.source = "standard per-token int8 KV quantization";
    } else if (std::string(q) == "int4") {
      p.description = "int4 asymmetric, one scale and zero per group of 32 channels of a token";
      p.source = "group-wise int4 KV quantization (e.g. FlexGen, KIVI's baseline)";
    } else {
      p.description = "KIVI 2-bit: keys per channel, values per token, groups of 32, last 128 tokens full precision";
      p.source = "Liu et al. 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache";
    }
    add(m, p);
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
      throw PolicyError("unknown quantizer '" + q + "' in '" + name + "' (valid: int8, int8-head, int4, kivi2)");
    }
    // "+Q" sets the quantizer (replacing one the base policy may have, e.g. unicache's int8).
    p.key_quant = k;
    p.value_quant = v;
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

const std::vector<std::pair<std::string, std::string>>& policy_parameters() {
  static const std::vector<std::pair<std::string, std::string>> p = {
      {"base", "preset (or composition) the policy starts from"},
      {"description", "one-line description"},
      {"sinks", "first N tokens always kept"},
      {"recent", "last N tokens always kept"},
      {"recent_fraction", "share of the budget given to the most recent tokens (0..1)"},
      {"shared_heads", "true: one kept set for all kv heads of a layer"},
      {"scorer", "none, recency, h2o, snapkv, tova, knorm, random, vision-stride, unicache"},
      {"allocator", "uniform, pyramid, hybrid, vision-only, unicache"},
      {"executor", "evict, merge-evicted, unicache"},
      {"snap_window", "SnapKV observation window (queries)"},
      {"snap_kernel", "SnapKV pooling kernel (odd)"},
      {"snap_pool", "avg or max"},
      {"fastv_layer", "layers before this keep everything (vision-only allocator)"},
      {"hybrid_text_share", "share of the budget reserved for text (hybrid allocator)"},
      {"pyramid_spread", "pyramid allocator: budget_l = b (1 + spread (1 - 2 l / (L - 1)))"},
      {"merge_threshold", "cosine above which an evicted token is merged (merge-evicted executor)"},
      {"merge_window", "positions within which tokens may merge"},
      {"head_merge", "true: merge kv heads whose key cosine exceeds head_merge_threshold"},
      {"head_merge_threshold", "cosine threshold of head merging (0.85 - 0.92)"},
      {"quant", "none, int8, int8-head, int4, kivi2"},
      {"proportional_attention", "add log n to the logits of merged slots"},
      {"adaptive", "true: rate from input complexity, the budget is ignored"},
      {"seed", "seed of the random scorer"},
      {"mode", "prefill (compress once after prefill) or decode (evict during the decode steps)"},
      {"cap", "decode mode: cache cap, a budget (0.3, 512tok, 64MiB); unset = the point's budget"},
      {"interval", "decode mode: decode steps between evictions (whole number >= 1)"},
      {"unicache.w_a", "UniCache attention weight"},
      {"unicache.w_c", "UniCache cross-modal weight"},
      {"unicache.w_d", "UniCache redundancy weight"},
      {"unicache.w_r", "UniCache recency weight"},
      {"unicache.rate_shallow", "compression rate of the first layer"},
      {"unicache.rate_deep", "compression rate of the last layer"},
      {"unicache.vision_cap", "maximum vision compression rate"},
      {"unicache.text_cap", "maximum text compression rate"},
      {"unicache.align_threshold", "cross-modal share that makes an alignment token"},
      {"unicache.align_discount", "fraction of the rate applied to alignment tokens"},
      {"unicache.merge_threshold", "redundancy above which dropped tokens merge"},
  };
  return p;
}

namespace {

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

template <typename E>
E parse_enum(const std::string& v, const std::string& where, std::initializer_list<std::pair<const char*, E>> opts) {
  std::string valid;
  for (const auto& [n, e] : opts) {
    if (v == n) return e;
    valid += (valid.empty() ? "" : ", ") + std::string(n);
  }
  throw PolicyError(where + ": '" + v + "' is not one of " + valid);
}

void apply_parameter(PolicySpec& p, const std::string& key, const std::string& v, const std::string& where) {
  const std::string w = where + ": " + key;
  auto num = [&](double lo, double hi) { return parse_number(v, w, lo, hi); };
  // Counts must be whole numbers: "sinks = 2.7" is a mistake, not 2.
  auto whole = [&](double lo, double hi) {
    const double x = parse_number(v, w, lo, hi);
    if (x != std::floor(x)) throw PolicyError(w + ": '" + v + "' is not a whole number");
    return x;
  };
  if (key == "description") p.description = v;
  else if (key == "sinks") p.sinks = static_cast<int>(whole(0, 1e6));
  else if (key == "recent") p.recent = static_cast<int>(whole(0, 1e6));
  else if (key == "recent_fraction") p.recent_fraction = static_cast<float>(num(0, 1));
  else if (key == "shared_heads") p.shared_heads = parse_bool(v, w);
  else if (key == "scorer")
    p.scorer = parse_enum<ScorerKind>(v, w, {{"none", ScorerKind::kNone}, {"recency", ScorerKind::kRecency},
                                             {"h2o", ScorerKind::kH2O}, {"snapkv", ScorerKind::kSnapKV},
                                             {"tova", ScorerKind::kTOVA}, {"knorm", ScorerKind::kKeyNorm},
                                             {"random", ScorerKind::kRandom},
                                             {"vision-stride", ScorerKind::kVisionStride},
                                             {"unicache", ScorerKind::kUniCache}});
  else if (key == "allocator")
    p.allocator = parse_enum<AllocatorKind>(v, w, {{"uniform", AllocatorKind::kUniform},
                                                   {"pyramid", AllocatorKind::kPyramid},
                                                   {"hybrid", AllocatorKind::kHybrid},
                                                   {"vision-only", AllocatorKind::kVisionOnly},
                                                   {"unicache", AllocatorKind::kUniCache}});
  else if (key == "executor")
    p.executor = parse_enum<ExecutorKind>(v, w, {{"evict", ExecutorKind::kEvict},
                                                 {"merge-evicted", ExecutorKind::kMergeEvicted},
                                                 {"unicache", ExecutorKind::kUniCache}});
  else if (key == "snap_window") p.snapkv.window = static_cast<int>(whole(1, 1e6));
  else if (key == "snap_kernel") {
    p.snapkv.kernel_size = static_cast<int>(whole(1, 1001));
    if (p.snapkv.kernel_size % 2 == 0) throw PolicyError(w + ": must be odd");
  } else if (key == "snap_pool")
    p.snapkv.pool = parse_enum<kernels::PoolKind>(v, w, {{"avg", kernels::PoolKind::kAvg}, {"max", kernels::PoolKind::kMax}});
  else if (key == "fastv_layer") p.fastv_layer = static_cast<int>(whole(0, 1e6));
  else if (key == "hybrid_text_share") p.hybrid_text_share = static_cast<float>(num(0, 1));
  else if (key == "pyramid_spread") p.pyramid_spread = static_cast<float>(num(0, 1));
  else if (key == "merge_threshold") p.merge_threshold = static_cast<float>(num(-1, 1));
  else if (key == "merge_window") p.merge_window = static_cast<int>(whole(0, 1e6));
  else if (key == "head_merge") p.head_merge = parse_bool(v, w);
  else if (key == "head_merge_threshold") p.head_merge_threshold = static_cast<float>(num(-1, 1));
  else if (key == "quant") {
    if (v == "none") {
      p.key_quant.reset();
      p.value_quant.reset();
    } else {
      kernels::QuantSpec k, vq;
      if (!quantizer_preset(v, &k, &vq)) throw PolicyError(w + ": '" + v + "' is not one of none, int8, int8-head, int4, kivi2");
      p.key_quant = k;
      p.value_quant = vq;
    }
  } else if (key == "proportional_attention") p.proportional_attention = parse_bool(v, w);
  else if (key == "adaptive") p.adaptive = parse_bool(v, w);
  else if (key == "seed") p.seed = static_cast<std::uint64_t>(whole(0, 1.8e19));
  else if (key == "mode")
    p.mode = parse_enum<PolicyMode>(v, w, {{"prefill", PolicyMode::kPrefill}, {"decode", PolicyMode::kDecode}});
  else if (key == "cap") {
    try {
      p.cap = parse_budget(v);
    } catch (const PolicyError& e) {
      throw PolicyError(w + ": " + e.what());
    }
    if (p.cap.kind == Budget::Kind::kNone) throw PolicyError(w + ": '" + v + "' is not a budget (0.3, 512tok, 64MiB)");
  } else if (key == "interval") p.interval = static_cast<int>(whole(1, 1e6));
  else if (key == "unicache.w_a") p.unicache.w_a = static_cast<float>(num(0, 10));
  else if (key == "unicache.w_c") p.unicache.w_c = static_cast<float>(num(0, 10));
  else if (key == "unicache.w_d") p.unicache.w_d = static_cast<float>(num(0, 10));
  else if (key == "unicache.w_r") p.unicache.w_r = static_cast<float>(num(0, 10));
  else if (key == "unicache.rate_shallow") p.unicache.rate_shallow = static_cast<float>(num(0, 0.99));
  else if (key == "unicache.rate_deep") p.unicache.rate_deep = static_cast<float>(num(0, 0.99));
  else if (key == "unicache.vision_cap") p.unicache.vision_cap = static_cast<float>(num(0, 0.99));
  else if (key == "unicache.text_cap") p.unicache.text_cap = static_cast<float>(num(0, 0.99));
  else if (key == "unicache.align_threshold") p.unicache.align_threshold = static_cast<float>(num(0, 1));
  else if (key == "unicache.align_discount") p.unicache.align_discount = static_cast<float>(num(0, 1));
  else if (key == "unicache.merge_threshold") p.unicache.merge_threshold = static_cast<float>(num(-1, 1));
  else {
    std::string valid;
    for (const auto& [k, _] : policy_parameters()) valid += (valid.empty() ? "" : ", ") + k;
    throw PolicyError(where + ": unknown parameter '" + key + "' (valid: " + valid + ")");
  }
  if (p.scorer != ScorerKind::kNone) p.compress_tokens = true;
}

}  // namespace

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
      if (k != "base") apply_parameter(p, k, v, path + ":" + std::to_string(ln));
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
  if (!p.compress_tokens) bad = "it does not evict tokens (decode mode needs a token scorer)";
  else if (p.adaptive) bad = "adaptive budgets";
  else if (p.head_merge) bad = "head merging";
  else if (p.executor != ExecutorKind::kEvict) bad = "a merging executor";
  else if (p.allocator != AllocatorKind::kUniform && p.allocator != AllocatorKind::kPyramid) bad = "its budget allocator";
  else if (p.scorer == ScorerKind::kVisionStride || p.scorer == ScorerKind::kUniCache ||
           p.scorer == ScorerKind::kOracleTopK)
    bad = "its scorer";
  if (!bad.empty()) {
    throw PolicyError(where + ": decode mode does not support " + bad +
                      "; it supports scorers none, recency, h2o, snapkv, tova, knorm, random with the uniform or "
                      "pyramid allocator, the evict executor and any quantizer (e.g. h2o~decode, snapkv+int8~decode)");
  }
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
