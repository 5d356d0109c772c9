#include "kvscope/sim/planner.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>

#include "kvscope/synth/synth.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::sim {

namespace {

constexpr std::int64_t kInt4GroupSize = 128;  // parameters per fp16 scale of int4 weights
constexpr double kMaxParams = 1e15;
constexpr std::int64_t kMaxTokens = std::int64_t{1} << 40;

std::string num(double v) {
  std::ostringstream o;
  o.precision(15);
  o << v;
  return o.str();
}

ModelSpec preset_from_synth(const char* name, double params, const char* source) {
  const synth::SynthPreset* p = synth::find_preset(name);
  ModelSpec m;
  m.name = name;
  m.layers = p->geometry.num_layers;
  m.q_heads = p->geometry.num_q_heads;
  m.kv_heads = p->geometry.num_kv_heads;
  m.head_dim = p->geometry.head_dim;
  m.params = params;
  m.source = source;
  return m;
}

void check_model(const ModelSpec& m) {
  auto positive = [](int v, const char* field) {
    if (v <= 0)
      throw PlanError(field, std::string("model ") + field + " must be > 0, got " + std::to_string(v));
  };
  positive(m.layers, "layers");
  positive(m.kv_heads, "kv-heads");
  positive(m.head_dim, "head-dim");
  auto at_most = [](int v, int limit, const char* field) {
    if (v > limit) {
      throw PlanError(field, std::string("model ") + field + " must be <= " + std::to_string(limit) +
                                 ", got " + std::to_string(v));
    }
  };
  at_most(m.layers, 4096, "layers");
  at_most(m.kv_heads, 4096, "kv-heads");
  at_most(m.head_dim, 65536, "head-dim");
  if (m.q_heads < 0 || (m.q_heads > 0 && m.q_heads % m.kv_heads != 0)) {
    throw PlanError("q-heads", "model q-heads must be a multiple of kv-heads (" + std::to_string(m.kv_heads) +
                                   "), got " + std::to_string(m.q_heads));
  }
  if (!(m.params > 0 && m.params <= kMaxParams)) {
    throw PlanError("params", "model params must be in (0, 1e15], got " + num(m.params) +
                                  (m.params == 0 ? " (unknown model size: give --params)" : ""));
  }
}

void check_ratio(double r, const std::string& what) {
  if (!(r > 0.0 && r <= 1.0)) {
    throw PlanError(what, what + " must be in (0, 1] (bytes kept / bytes full), got " + num(r));
  }
}

void check_request(const RequestShape& r) {
  auto count = [](std::int64_t v, const char* field) {
    if (v < 0 || v > kMaxTokens) {
      throw PlanError(field,
                      std::string("request ") + field + " must be in [0, 2^40], got " + std::to_string(v));
    }
  };
  count(r.images, "images");
  count(r.image_tokens, "image-tokens");
  count(r.text_tokens, "text");
  count(r.audio_tokens, "audio");
  count(r.special_tokens, "special");
  count(r.output_tokens, "max-new");
  if (r.images > 0 && r.image_tokens == 0) {
    throw PlanError("image-tokens",
                    "request has " + std::to_string(r.images) + " images but 0 tokens per image");
  }
  if (r.images > 0 && r.image_tokens > kMaxTokens / r.images) {
    throw PlanError("images", "request images x image-tokens exceeds 2^40 tokens");
  }
  if (r.total_tokens() == 0)
    throw PlanError("text", "request has no tokens: give --text, --images or --max-new");
}

// Bytes of `tokens` tokens at `bytes_per_token`, kept at `ratio`: exact when ratio == 1, else rounded up.
long double kept_bytes(std::int64_t tokens, std::int64_t bytes_per_token, double ratio) {
  const long double full = static_cast<long double>(tokens) * static_cast<long double>(bytes_per_token);
  return ratio == 1.0 ? full : std::ceil(full * static_cast<long double>(ratio));
}

// Largest n in [0, hi] with cost(n) <= budget, for a nondecreasing cost; 0 when none fits.
template <typename Cost>
std::int64_t max_fitting(const Cost& cost, long double budget, std::int64_t hi) {
  std::int64_t lo = 0;
  if (cost(0) > budget) return 0;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (cost(mid) <= budget)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

std::string human_bytes(long double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(b) >= 1024.0L && u < 5) {
    b /= 1024.0L;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0Lf %s" : "%.2Lf %s", b, units[u]);
  return buf;
}

// "7.063 B", "2.50 M" parameters.
std::string human_params(double p) {
  char buf[32];
  if (p >= 1e9)
    std::snprintf(buf, sizeof buf, "%.3f B", p / 1e9);
  else if (p >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2f M", p / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.0f", p);
  return buf;
}

}  // namespace

// ---------------------------------------------------------------- models and dtypes

const std::vector<ModelSpec>& model_presets() {
  static const std::vector<ModelSpec> presets = [] {
    std::vector<ModelSpec> v;
    // Vicuna-7B v1.5 (Llama-2-7B architecture) 6.738e9 + CLIP ViT-L/14-336 vision tower 0.304e9
    // + 2-layer MLP projector (1024x4096 + 4096x4096 + biases) 0.021e9 = 7.063e9.
    v.push_back(preset_from_synth("llava-1.5-7b", 7.063e9,
                                  "Vicuna-7B 6.738B + CLIP ViT-L/14-336 0.304B + MLP projector 0.021B"));
    v.push_back(preset_from_synth("qwen2-vl-7b", 8.29e9, "Qwen2-VL-7B model card: 8.29B incl. 675M ViT"));
    return v;
  }();
  return presets;
}

const ModelSpec& find_model_preset(const std::string& name) {
  std::string valid;
  for (const auto& m : model_presets()) {
    if (m.name == name) return m;
    valid += (valid.empty() ? "" : ", ") + m.name;
  }
  throw PlanError("model", "unknown model preset '" + name + "' (valid: " + valid +
                               "; or the generic form --layers --kv-heads --head-dim --params)");
}

ModelSpec generic_model(int layers, int kv_heads, int head_dim, double params, int q_heads) {
  ModelSpec m;
  m.name = "generic";
  m.layers = layers;
  m.q_heads = q_heads;
  m.kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.params = params;
  m.source = "given on the command line";
  check_model(m);
  return m;
}

const char* weights_dtype_name(WeightsDType t) {
  switch (t) {
    case WeightsDType::kF16:
      return "fp16";
    case WeightsDType::kBF16:
      return "bf16";
    case WeightsDType::kInt8:
      return "int8";
    case WeightsDType::kInt4:
      return "int4";
  }
  return "?";
}

const char* kv_dtype_name(KvDType t) {
  switch (t) {
    case KvDType::kF16:
      return "fp16";
    case KvDType::kBF16:
      return "bf16";
    case KvDType::kF32:
      return "fp32";
    case KvDType::kInt8:
      return "int8";
    case KvDType::kInt4:
      return "int4";
  }
  return "?";
}

WeightsDType parse_weights_dtype(const std::string& s, const std::string& parameter) {
  for (auto t : {WeightsDType::kF16, WeightsDType::kBF16, WeightsDType::kInt8, WeightsDType::kInt4}) {
    if (s == weights_dtype_name(t)) return t;
  }
  throw PlanError(parameter,
                  "--" + parameter + ": unknown weights dtype '" + s + "' (valid: fp16, bf16, int8, int4)");
}

KvDType parse_kv_dtype(const std::string& s, const std::string& parameter) {
  for (auto t : {KvDType::kF16, KvDType::kBF16, KvDType::kF32, KvDType::kInt8, KvDType::kInt4}) {
    if (s == kv_dtype_name(t)) return t;
  }
  throw PlanError(parameter,
                  "--" + parameter + ": unknown KV dtype '" + s + "' (valid: fp16, bf16, fp32, int8, int4)");
}

int kv_dtype_bits(KvDType t) {
  switch (t) {
    case KvDType::kF32:
      return 32;
    case KvDType::kInt8:
      return 8;
    case KvDType::kInt4:
      return 4;
    default:
      return 16;
  }
}

std::int64_t weights_bytes(double params, WeightsDType dtype) {
  if (!(params > 0 && params <= kMaxParams))
    throw PlanError("params", "params must be in (0, 1e15], got " + num(params));
  const auto p = static_cast<std::int64_t>(std::ceil(params));
  switch (dtype) {
    case WeightsDType::kF16:
    case WeightsDType::kBF16:
      return 2 * p;
    case WeightsDType::kInt8:
      return p;
    case WeightsDType::kInt4:
      return (p + 1) / 2 + 2 * ((p + kInt4GroupSize - 1) / kInt4GroupSize);
  }
  return 0;
}

std::int64_t kv_bytes_per_token_layer(const ModelSpec& m, KvDType dtype) {
  // 2 x kv_heads x head_dim elements of `bits` bits: always a whole number of bytes for 4, 8, 16, 32 bits.
  return 2 * static_cast<std::int64_t>(m.kv_heads) * m.head_dim * kv_dtype_bits(dtype) / 8;
}

std::int64_t kv_bytes_per_token(const ModelSpec& m, KvDType dtype) {
  return kv_bytes_per_token_layer(m, dtype) * m.layers;
}

// ---------------------------------------------------------------- byte sizes

std::int64_t parse_byte_size(const std::string& text, const std::string& parameter) {
  const std::string flag = "--" + parameter;
  const std::string hint = " (expected e.g. 24GiB, 80GB, 512MiB or a number of bytes)";
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i < text.size() && text[i] == '-')
    throw PlanError(parameter, flag + ": size must be positive, got '" + text + "'");
  const std::size_t num_begin = i;
  bool digits = false;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    digits |= std::isdigit(static_cast<unsigned char>(text[i])) != 0;
    ++i;
  }
  const std::string number = text.substr(num_begin, i - num_begin);
  if (!digits || std::count(number.begin(), number.end(), '.') > 1) {
    throw PlanError(parameter, flag + ": '" + text + "' is not a byte size" + hint);
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    if (std::isspace(static_cast<unsigned char>(text[i]))) break;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  static const std::map<std::string, long double> kUnits = {{"", 1.0L},
                                                            {"b", 1.0L},
                                                            {"kb", 1e3L},
                                                            {"mb", 1e6L},
                                                            {"gb", 1e9L},
                                                            {"tb", 1e12L},
                                                            {"kib", 1024.0L},
                                                            {"mib", 1048576.0L},
                                                            {"gib", 1073741824.0L},
                                                            {"tib", 1099511627776.0L}};
  const auto u = kUnits.find(unit);
  if (u == kUnits.end() || i != text.size()) {
    throw PlanError(parameter, flag + ": '" + text + "' has an unknown unit" + hint);
  }
  const long double bytes = std::stold(number) * u->second;
  if (bytes > static_cast<long double>(std::numeric_limits<std::int64_t>::max() / 2)) {
    throw PlanError(parameter, flag + ": '" + text + "' is too large");
  }
  if (bytes != std::floor(bytes)) {
    throw PlanError(parameter, flag + ": '" + text + "' is not a whole number of bytes");
  }
  if (bytes <= 0) throw PlanError(parameter, flag + ": size must be positive, got '" + text + "'");
  return static_cast<std::int64_t>(bytes);
}

// ---------------------------------------------------------------- requests and plan

PerModalityCount RequestShape::prompt_tokens() const {
  PerModalityCount t{};
  t[static_cast<std::size_t>(kernels::Modality::kText)] = text_tokens;
  t[static_cast<std::size_t>(kernels::Modality::kVision)] = images * image_tokens;
  t[static_cast<std::size_t>(kernels::Modality::kAudio)] = audio_tokens;
  t[static_cast<std::size_t>(kernels::Modality::kSpecial)] = special_tokens;
  return t;
}

std::int64_t RequestShape::total_tokens() const {
  std::int64_t n = output_tokens;
  for (auto t : prompt_tokens()) n += t;
  return n;
}

KeepRatios KeepRatios::uniform(double r) {
  KeepRatios k;
  k.prompt.fill(r);
  return k;
}

bool KeepRatios::is_identity() const {
  return output == 1.0 && std::all_of(prompt.begin(), prompt.end(), [](double r) { return r == 1.0; });
}

double PlanResult::request_gain() const {
  if (!compressed) return 1.0;
  return full.max_requests > 0
             ? static_cast<double>(compressed->max_requests) / static_cast<double>(full.max_requests)
             : 0.0;
}

Capacity request_bytes(const RequestShape& r, std::int64_t bytes_per_token, const KeepRatios* ratios) {
  Capacity c;
  const PerModalityCount tokens = r.prompt_tokens();
  for (std::size_t m = 0; m < tokens.size(); ++m) {
    const double ratio = ratios ? ratios->prompt[m] : 1.0;
    c.prompt_bytes[m] = static_cast<std::int64_t>(kept_bytes(tokens[m], bytes_per_token, ratio));
    c.request_bytes += c.prompt_bytes[m];
  }
  c.output_bytes =
      static_cast<std::int64_t>(kept_bytes(r.output_tokens, bytes_per_token, ratios ? ratios->output : 1.0));
  c.request_bytes += c.output_bytes;
  return c;
}

namespace {

Capacity capacity(const RequestShape& r, std::int64_t bpt, std::int64_t budget, const KeepRatios* ratios) {
  Capacity c = request_bytes(r, bpt, ratios);
  c.max_requests = budget / c.request_bytes;
  const long double b = static_cast<long double>(budget);
  // One request holding only text tokens (the longest context the budget allows).
  const double text_ratio = ratios ? ratios->prompt[static_cast<std::size_t>(kernels::Modality::kText)] : 1.0;
  const long double per_token = static_cast<long double>(bpt) * text_ratio;
  const auto context_hi =
      static_cast<std::int64_t>(std::min(b / per_token + 2.0L, static_cast<long double>(kMaxTokens)));
  c.max_context_tokens =
      max_fitting([&](std::int64_t n) { return kept_bytes(n, bpt, text_ratio); }, b, context_hi);
  // Images of this shape that one request can hold next to its text, audio and output tokens.
  if (r.image_tokens > 0) {
    // Each image costs at least image_tokens x bpt x vision ratio, which bounds the search.
    const double vision_ratio =
        ratios ? ratios->prompt[static_cast<std::size_t>(kernels::Modality::kVision)] : 1.0;
    const long double per_image =
        static_cast<long double>(r.image_tokens) * static_cast<long double>(bpt) * vision_ratio;
    const auto images_hi = static_cast<std::int64_t>(
        std::min(b / per_image + 2.0L, static_cast<long double>(kMaxTokens / r.image_tokens)));
    RequestShape probe = r;
    c.max_images = max_fitting(
        [&](std::int64_t k) {
          probe.images = k;
          return static_cast<long double>(request_bytes(probe, bpt, ratios).request_bytes);
        },
        b, images_hi);
  }
  return c;
}

}  // namespace

PlanResult plan(const PlanInput& in) {
  check_model(in.model);
  check_request(in.request);
  if (in.gpu_mem_bytes <= 0) {
    throw PlanError("gpu-mem",
                    "GPU memory must be positive, got " + std::to_string(in.gpu_mem_bytes) + " bytes");
  }
  if (!(in.reserve_fraction >= 0.0 && in.reserve_fraction < 1.0)) {
    throw PlanError("reserve", "reserve fraction must be in [0, 1), got " + num(in.reserve_fraction));
  }
  if (in.compression) {
    const char* names[] = {"text-ratio", "vision-ratio", "audio-ratio", "special-ratio"};
    for (std::size_t m = 0; m < in.compression->prompt.size(); ++m)
      check_ratio(in.compression->prompt[m], names[m]);
    check_ratio(in.compression->output, "output-ratio");
  }
  PlanResult r;
  r.input = in;
  r.kv_bytes_per_token_layer = kv_bytes_per_token_layer(in.model, in.kv_dtype);
  r.kv_bytes_per_token = kv_bytes_per_token(in.model, in.kv_dtype);
  r.weights_bytes = weights_bytes(in.model.params, in.weights);
  if (static_cast<long double>(in.request.total_tokens()) * static_cast<long double>(r.kv_bytes_per_token) >
      4e18L) {
    throw PlanError("text", "one request would need more than 4e18 bytes of KV cache");
  }
  if (r.weights_bytes >= in.gpu_mem_bytes) {
    throw PlanError("gpu-mem", "weights alone need " + human_bytes(r.weights_bytes) + " (" +
                                   human_params(in.model.params) + " parameters in " +
                                   weights_dtype_name(in.weights) + "), GPU has " +
                                   human_bytes(in.gpu_mem_bytes) +
                                   "; use more memory or --weights-dtype int4");
  }
  r.reserve_bytes = static_cast<std::int64_t>(
      std::llround(static_cast<long double>(in.gpu_mem_bytes) * in.reserve_fraction));
  r.kv_budget_bytes = in.gpu_mem_bytes - r.weights_bytes - r.reserve_bytes;
  if (r.kv_budget_bytes <= 0) {
    throw PlanError("reserve", "weights (" + human_bytes(r.weights_bytes) + ") plus the reserve (" +
                                   human_bytes(r.reserve_bytes) + ") leave no room for the KV cache on " +
                                   human_bytes(in.gpu_mem_bytes) +
                                   "; lower --reserve or quantize the weights");
  }
  r.full = capacity(in.request, r.kv_bytes_per_token, r.kv_budget_bytes, nullptr);
  if (in.compression)
    r.compressed = capacity(in.request, r.kv_bytes_per_token, r.kv_budget_bytes, &*in.compression);
  if (r.full.max_requests == 0) {
    r.notes.push_back("one uncompressed request (" + human_bytes(r.full.request_bytes) +
                      ") does not fit in the KV budget");
  }
  return r;
}

// ---------------------------------------------------------------- traces

TraceRequest request_from_trace(const std::string& path) {
  const trace::TraceReader reader(path);
  const trace::ModelGeometry& g = reader.geometry();
  TraceRequest t;
  t.model.name = g.model_name.empty() ? "trace" : g.model_name;
  t.model.layers = g.num_layers;
  t.model.q_heads = g.num_q_heads;
  t.model.kv_heads = g.num_kv_heads;
  t.model.head_dim = g.head_dim;
  t.model.source = "geometry from trace " + path;
  for (const auto& m : model_presets()) {
    if (m.name == g.model_name) {
      t.model.params = m.params;
      t.model.source += "; params from preset " + m.name;
    }
  }
  const trace::Tokens& tok = reader.tokens();
  PerModalityCount counts{};
  std::map<int, std::int64_t> vision_per_segment;  // image segment -> its vision tokens
  for (std::size_t i = 0; i < tok.size(); ++i) {
    ++counts[tok.modality[i]];
    if (tok.modality[i] == static_cast<std::uint8_t>(kernels::Modality::kVision))
      ++vision_per_segment[tok.segment[i]];
  }
  t.request.text_tokens = counts[static_cast<std::size_t>(kernels::Modality::kText)];
  t.request.audio_tokens = counts[static_cast<std::size_t>(kernels::Modality::kAudio)];
  t.request.special_tokens = counts[static_cast<std::size_t>(kernels::Modality::kSpecial)];
  const std::int64_t vision = counts[static_cast<std::size_t>(kernels::Modality::kVision)];
  t.request.images = static_cast<std::int64_t>(vision_per_segment.size());
  if (t.request.images > 0) {
    t.request.image_tokens = (vision + t.request.images - 1) / t.request.images;
    const bool uniform = std::all_of(vision_per_segment.begin(), vision_per_segment.end(),
                                     [&](const auto& s) { return s.second == t.request.image_tokens; });
    if (!uniform) {
      t.notes.push_back("images of the trace differ in size (" + std::to_string(vision) +
                        " vision tokens in " + std::to_string(t.request.images) + " images): planning with " +
                        std::to_string(t.request.image_tokens) + " tokens per image (rounded up)");
    }
  }
  t.notes.push_back("request shape from trace " + path + " (" + std::to_string(tok.size()) +
                    " context tokens)");
  return t;
}

// ---------------------------------------------------------------- reports

namespace {

const char* const kModalityNames[] = {"text", "vision", "audio", "special"};

std::string with_commas(std::int64_t v) {
  const std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out = v < 0 ? "-" : "";
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

std::string images_text(std::int64_t v) { return v < 0 ? std::string("-") : with_commas(v); }

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      o += '\\';
      o += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += ch;
    }
  }
  return o + "\"";
}

std::string json_capacity(const Capacity& c, const std::string& indent) {
  std::ostringstream o;
  o << "{\n" << indent << "  \"prompt_bytes\": {";
  for (std::size_t m = 0; m < c.prompt_bytes.size(); ++m) {
    o << (m ? ", " : "") << "\"" << kModalityNames[m] << "\": " << c.prompt_bytes[m];
  }
  o << "},\n"
    << indent << "  \"output_bytes\": " << c.output_bytes << ",\n"
    << indent << "  \"request_bytes\": " << c.request_bytes << ",\n"
    << indent << "  \"max_requests\": " << c.max_requests << ",\n"
    << indent << "  \"max_context_tokens\": " << c.max_context_tokens << ",\n"
    << indent << "  \"max_images\": " << c.max_images << "\n"
    << indent << "}";
  return o.str();
}

}  // namespace

std::string format_plan(const PlanResult& r) {
  const PlanInput& in = r.input;
  const ModelSpec& m = in.model;
  const RequestShape& q = in.request;
  std::ostringstream o;
  char line[256];
  o << "model        " << m.name << ": " << m.layers << " layers, " << m.kv_heads << " KV heads";
  if (m.q_heads > 0)
    o << (m.q_heads == m.kv_heads ? " (MHA)" : " (GQA, " + std::to_string(m.q_heads) + " query heads)");
  o << ", head_dim " << m.head_dim << ", " << human_params(m.params) << " parameters\n";
  o << "             (" << m.source << ")\n";
  o << "KV per token " << with_commas(r.kv_bytes_per_token_layer) << " B per layer, "
    << human_bytes(r.kv_bytes_per_token) << " (" << with_commas(r.kv_bytes_per_token) << " B) over "
    << m.layers << " layers, " << kv_dtype_name(in.kv_dtype) << " elements\n";
  o << "request      " << q.images << " image(s) x " << q.image_tokens << " tokens + " << q.text_tokens
    << " text";
  if (q.audio_tokens) o << " + " << q.audio_tokens << " audio";
  if (q.special_tokens) o << " + " << q.special_tokens << " special";
  o << " + " << q.output_tokens << " generated = " << with_commas(q.total_tokens()) << " tokens\n";
  std::snprintf(line, sizeof line,
                "memory       GPU %s (%s B) = weights %s (%s) + reserve %s (%.0f%%) + KV budget %s\n",
                human_bytes(in.gpu_mem_bytes).c_str(), with_commas(in.gpu_mem_bytes).c_str(),
                human_bytes(r.weights_bytes).c_str(), weights_dtype_name(in.weights),
                human_bytes(r.reserve_bytes).c_str(), 100.0 * in.reserve_fraction,
                human_bytes(r.kv_budget_bytes).c_str());
  o << line;
  if (r.compressed) {
    const KeepRatios& k = *in.compression;
    std::snprintf(
        line, sizeof line,
        "compression  bytes kept: text %.3g, vision %.3g, audio %.3g, special %.3g, generated %.3g\n",
        k.prompt[0], k.prompt[1], k.prompt[2], k.prompt[3], k.output);
    o << line;
  }
  o << "\n";
  const Capacity& f = r.full;
  const Capacity* c = r.compressed ? &*r.compressed : nullptr;
  auto row = [&](const std::string& label, const std::string& full, const std::string& comp,
                 const std::string& gain) {
    std::snprintf(line, sizeof line, "%-34s %20s %20s %8s", label.c_str(), full.c_str(), comp.c_str(),
                  gain.c_str());
    std::string text = line;
    text.erase(text.find_last_not_of(' ') + 1);
    o << text << "\n";
  };
  auto gain = [](long double a, long double b) {
    if (a <= 0) return std::string("-");
    char g[32];
    std::snprintf(g, sizeof g, "%.2fx", static_cast<double>(b / a));
    return std::string(g);
  };
  row("", "without compression", c ? "with compression" : "", c ? "gain" : "");
  row("KV bytes per request", human_bytes(f.request_bytes), c ? human_bytes(c->request_bytes) : "",
      c ? gain(c->request_bytes, f.request_bytes) : "");
  const PerModalityCount tokens = q.prompt_tokens();
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] == 0) continue;
    row("  " + std::string(kModalityNames[i]) + " (" + with_commas(tokens[i]) + " tokens)",
        human_bytes(f.prompt_bytes[i]), c ? human_bytes(c->prompt_bytes[i]) : "", "");
  }
  if (q.output_tokens) {
    row("  generated (" + with_commas(q.output_tokens) + " tokens)", human_bytes(f.output_bytes),
        c ? human_bytes(c->output_bytes) : "", "");
  }
  row("max concurrent requests", with_commas(f.max_requests), c ? with_commas(c->max_requests) : "",
      c ? gain(f.max_requests, c->max_requests) : "");
  row("max context, 1 text-only request", with_commas(f.max_context_tokens),
      c ? with_commas(c->max_context_tokens) : "",
      c ? gain(f.max_context_tokens, c->max_context_tokens) : "");
  row("max images in 1 request", images_text(f.max_images), c ? images_text(c->max_images) : "",
      c && f.max_images >= 0 ? gain(f.max_images, c->max_images) : "");
  for (const auto& n : r.notes) o << "note: " << n << "\n";
  return o.str();
}

std::string plan_csv(const PlanResult& r) {
  std::ostringstream o;
  o << "setting,model,layers,kv_heads,head_dim,params,weights_dtype,kv_dtype,gpu_mem_bytes,weights_bytes,"
       "reserve_bytes,kv_budget_bytes,kv_bytes_per_token_layer,kv_bytes_per_token,images,image_tokens,text_"
       "tokens,"
       "audio_tokens,special_tokens,output_tokens,ratio_text,ratio_vision,ratio_audio,ratio_special,ratio_"
       "output,"
       "bytes_text,bytes_vision,bytes_audio,bytes_special,bytes_output,request_bytes,max_requests,"
       "max_context_tokens,max_images\n";
  auto emit = [&](const char* setting, const Capacity& c, const KeepRatios& k) {
    const PlanInput& in = r.input;
    const ModelSpec& m = in.model;
    const RequestShape& q = in.request;
    std::string name = m.name;
    std::replace(name.begin(), name.end(), ',', ';');
    o << setting << "," << name << "," << m.layers << "," << m.kv_heads << "," << m.head_dim << ","
      << num(m.params) << "," << weights_dtype_name(in.weights) << "," << kv_dtype_name(in.kv_dtype) << ","
      << in.gpu_mem_bytes << "," << r.weights_bytes << "," << r.reserve_bytes << "," << r.kv_budget_bytes
      << "," << r.kv_bytes_per_token_layer << "," << r.kv_bytes_per_token << "," << q.images << ","
      << q.image_tokens << "," << q.text_tokens << "," << q.audio_tokens << "," << q.special_tokens << ","
      << q.output_tokens;
    for (double x : k.prompt) o << "," << num(x);
    o << "," << num(k.output);
    for (auto b : c.prompt_bytes) o << "," << b;
    o << "," << c.output_bytes << "," << c.request_bytes << "," << c.max_requests << ","
      << c.max_context_tokens << "," << c.max_images << "\n";
  };
  emit("full", r.full, KeepRatios{});
  if (r.compressed) emit("compressed", *r.compressed, *r.input.compression);
  return o.str();
}

std::string plan_json(const PlanResult& r) {
  const PlanInput& in = r.input;
  const ModelSpec& m = in.model;
  const RequestShape& q = in.request;
  std::ostringstream o;
  o << "{\n  \"model\": {\"name\": " << json_string(m.name) << ", \"layers\": " << m.layers
    << ", \"q_heads\": " << m.q_heads << ", \"kv_heads\": " << m.kv_heads << ", \"head_dim\": " << m.head_dim
    << ", \"params\": " << num(m.params) << ", \"source\": " << json_string(m.source) << "},\n"
    << "  \"gpu_mem_bytes\": " << in.gpu_mem_bytes << ",\n"
    << "  \"weights_dtype\": \"" << weights_dtype_name(in.weights) << "\",\n"
    << "  \"kv_dtype\": \"" << kv_dtype_name(in.kv_dtype) << "\",\n"
    << "  \"reserve_fraction\": " << num(in.reserve_fraction) << ",\n"
    << "  \"request\": {\"images\": " << q.images << ", \"image_tokens\": " << q.image_tokens
    << ", \"text_tokens\": " << q.text_tokens << ", \"audio_tokens\": " << q.audio_tokens
    << ", \"special_tokens\": " << q.special_tokens << ", \"output_tokens\": " << q.output_tokens << "},\n"
    << "  \"kv_bytes_per_token_layer\": " << r.kv_bytes_per_token_layer << ",\n"
    << "  \"kv_bytes_per_token\": " << r.kv_bytes_per_token << ",\n"
    << "  \"weights_bytes\": " << r.weights_bytes << ",\n"
    << "  \"reserve_bytes\": " << r.reserve_bytes << ",\n"
    << "  \"kv_budget_bytes\": " << r.kv_budget_bytes << ",\n"
    << "  \"full\": " << json_capacity(r.full, "  ") << ",\n";
  if (r.compressed) {
    const KeepRatios& k = *in.compression;
    o << "  \"ratios\": {";
    for (std::size_t i = 0; i < k.prompt.size(); ++i)
      o << (i ? ", " : "") << "\"" << kModalityNames[i] << "\": " << num(k.prompt[i]);
    o << ", \"output\": " << num(k.output) << "},\n"
      << "  \"compressed\": " << json_capacity(*r.compressed, "  ") << ",\n"
      << "  \"request_gain\": " << num(r.request_gain()) << ",\n";
  } else {
    o << "  \"ratios\": null,\n  \"compressed\": null,\n  \"request_gain\": 1,\n";
  }
  o << "  \"notes\": [";
  for (std::size_t i = 0; i < r.notes.size(); ++i) o << (i ? ", " : "") << json_string(r.notes[i]);
  o << "]\n}\n";
  return o.str();
}

}  // namespace kvscope::sim
