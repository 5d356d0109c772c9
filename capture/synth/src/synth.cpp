#include "kvscope/synth/synth.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "kvscope/trace/writer.hpp"
#include "rng.hpp"

namespace kvscope::synth {

using trace::DType;
using trace::Modality;

namespace {
SynthPreset make_preset(const char* name, int layers, int q_heads, int kv_heads, int head_dim, double rope_theta,
                        int image_tokens, int text, int decode, const char* description) {
  SynthPreset p;
  p.name = name;
  p.geometry.num_layers = layers;
  p.geometry.num_q_heads = q_heads;
  p.geometry.num_kv_heads = kv_heads;
  p.geometry.head_dim = head_dim;
  p.geometry.rope_theta = rope_theta;
  p.geometry.model_name = name;
  p.images = 1;
  p.image_tokens = image_tokens;
  p.text = text;
  p.decode = decode;
  p.description = description;
  return p;
}
}  // namespace

const std::vector<SynthPreset>& synth_presets() {
  static const std::vector<SynthPreset> presets = [] {
    std::vector<SynthPreset> v;
    v.push_back(make_preset("llava-1.5-7b", 32, 32, 32, 128, 10000.0, 576, 64, 16,
                            "32 layers, 32 heads (MHA), head_dim 128, 576 tokens per image (24x24)"));
    v.push_back(make_preset("qwen2-vl-7b", 28, 28, 4, 128, 1000000.0, 256, 64, 16,
                            "28 layers, 28 query / 4 KV heads, head_dim 128, 256 tokens per 448px image (16x16)"));
    v.push_back(make_preset("tiny", 4, 4, 2, 32, 10000.0, 64, 24, 4,
                            "4 layers, 4 query / 2 KV heads, head_dim 32, 64 tokens per image (8x8)"));
    return v;
  }();
  return presets;
}

const SynthPreset* find_preset(const std::string& name) {
  for (const auto& p : synth_presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

const char* head_role_name(HeadRole r) {
  return r == HeadRole::kVision ? "vision" : r == HeadRole::kText ? "text" : "mixed";
}

namespace {
constexpr std::uint64_t kStreamKeys = 1, kStreamValues = 2, kStreamQueries = 3, kStreamBasis = 4,
                        kStreamDecode = 5, kStreamLayout = 6;

std::uint64_t seed_of(std::uint64_t seed, std::uint64_t stream, int layer, int head, int extra = 0) {
  std::uint64_t s = mix_seed(seed, stream);
  s = mix_seed(s, static_cast<std::uint64_t>(layer) + 1);
  s = mix_seed(s, static_cast<std::uint64_t>(head) + 1);
  return mix_seed(s, static_cast<std::uint64_t>(extra) + 1);
}

void fill_normal(Rng& rng, float* out, int n, float scale = 1.0f) {
  for (int i = 0; i < n; ++i) out[i] = scale * rng.normal();
}

float norm(const float* x, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return static_cast<float>(std::sqrt(s));
}

// Random unit vectors, orthonormalised against each other (Gram-Schmidt).
std::vector<std::vector<float>> orthonormal(Rng& rng, int count, int D) {
  std::vector<std::vector<float>> u(static_cast<std::size_t>(count), std::vector<float>(static_cast<std::size_t>(D)));
  for (int a = 0; a < count; ++a) {
    auto& v = u[static_cast<std::size_t>(a)];
    fill_normal(rng, v.data(), D);
    for (int b = 0; b < a && b < D; ++b) {
      const auto& w = u[static_cast<std::size_t>(b)];
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += static_cast<double>(v[d]) * w[d];
      for (int d = 0; d < D; ++d) v[d] -= static_cast<float>(dot) * w[d];
    }
    const float n = norm(v.data(), D);
    for (auto& x : v) x /= (n > 0 ? n : 1.0f);
  }
  return u;
}
}  // namespace

// Per (layer, kv head) directions and strengths. Logit contributions are
// q·k/sqrt(D); a key carries sqrt(D)·(weight)·u along each structural direction
// u, so a query coefficient x along u adds x·weight to the logit.
struct SynthGenerator::HeadBasis {
  int D = 0;
  HeadRole role = HeadRole::kMixed;
  std::vector<float> u_sink, u_mod[4], u_r1, u_r2;
  float depth = 0;             // layer / (L - 1)
  float sink_bonus = 0;        // logit bonus of sink tokens
  float modality_bonus = 0;    // logit bonus of the head's preferred modality
  float recency = 0;           // logit amplitude of the recency rotation
  float alignment = 0;         // logit bonus of an alignment query's target patch
  float local = 0;             // logit bonus of a token's own content (local attention)
  float query_noise = 0;       // std of random query components (logit units)
  float vision_noise = 0;      // patch-independent noise relative to the smooth field
  float text_rho = 0;          // AR(1) correlation of consecutive text keys
};

SynthGenerator::HeadBasis SynthGenerator::basis(int layer, int kv_head) const {
  const auto& g = header_.geometry;
  HeadBasis b;
  b.D = g.head_dim;
  Rng rng(seed_of(options_.seed, kStreamBasis, layer, kv_head));
  auto u = orthonormal(rng, 8, b.D);
  b.u_sink = u[0];
  for (int m = 0; m < 4; ++m) b.u_mod[m] = u[static_cast<std::size_t>(1 + m)];
  b.u_r1 = u[5];
  b.u_r2 = u[6];
  b.depth = g.num_layers > 1 ? static_cast<float>(layer) / static_cast<float>(g.num_layers - 1) : 0.0f;
  b.role = static_cast<HeadRole>((kv_head + layer) % 3);
  b.sink_bonus = 2.5f + 3.0f * std::sqrt(b.depth);
  b.modality_bonus = 2.0f;
  b.recency = 1.5f;
  b.alignment = 8.0f * (0.7f + 0.3f * std::sin(static_cast<float>(M_PI) * b.depth));
  b.local = 2.5f;
  b.query_noise = 1.0f;
  b.vision_noise = 0.15f + 0.85f * b.depth;
  b.text_rho = 0.8f - 0.5f * b.depth;
  return b;
}

HeadRole SynthGenerator::head_role(int layer, int kv_head) const {
  return static_cast<HeadRole>((kv_head + layer) % 3);
}

SynthGenerator::SynthGenerator(SynthOptions o) : options_(std::move(o)) {
  const SynthPreset* p = find_preset(options_.preset);
  if (!p) {
    std::string names;
    for (const auto& q : synth_presets()) names += (names.empty() ? "" : ", ") + q.name;
    throw std::invalid_argument("unknown preset '" + options_.preset + "' (valid: " + names + ")");
  }
  // -1 means "the preset's value"; any other negative number is rejected below.
  if (options_.images == -1) options_.images = p->images;
  if (options_.image_tokens == -1) options_.image_tokens = p->image_tokens;
  if (options_.text == -1) options_.text = p->text;
  if (options_.decode == -1) options_.decode = p->decode;
  auto check = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  check(options_.images >= 0 && options_.images <= 64, "--images must be in 0..64");
  check(options_.images == 0 || (options_.image_tokens >= 1 && options_.image_tokens <= 65536),
        "--image-tokens must be in 1..65536");
  check(options_.text >= 1 && options_.text <= 1'000'000, "--text must be in 1..1000000");
  check(options_.audio >= 0 && options_.audio <= 1'000'000, "--audio must be in 0..1000000");
  check(options_.decode >= 1 && options_.decode <= 4096, "--decode must be in 1..4096");
  check(options_.deflate >= 0 && options_.deflate <= 9, "--deflate must be in 0..9");
  check(options_.layers == -1 || (options_.layers >= 1 && options_.layers <= 1024),
        "--layers must be in 1..1024");

  header_.geometry = p->geometry;
  if (options_.layers != -1) header_.geometry.num_layers = options_.layers;
  header_.dtype = options_.dtype;
  header_.synthetic = true;
  header_.creator = "kvcap synth (kvscope 0.1.0), preset " + p->name + ", seed " + std::to_string(options_.seed);
  header_.device = "synthetic";

  // Layout: BOS, system text, image(s) each followed by a separator, audio clip, question text.
  Rng rng(seed_of(options_.seed, kStreamLayout, 0, 0));
  static const char* kWords[] = {"the", "red", "blue", "green", "circle", "square", "triangle", "left", "right",
                                 "above", "below", "how", "many", "what", "color", "is", "shape", "in", "image",
                                 "of", "and", "a", "to", "which", "larger", "count", "top", "bottom"};
  constexpr int kNumWords = sizeof(kWords) / sizeof(kWords[0]);
  auto& t = tokens_;
  int segment = 0;
  auto push = [&](Modality m, int token_id, int row, int col, std::string text) {
    t.modality.push_back(static_cast<std::uint8_t>(m));
    t.position.push_back(static_cast<std::int32_t>(t.modality.size() - 1));
    t.token_id.push_back(token_id);
    t.segment.push_back(segment);
    t.grid_row.push_back(row);
    t.grid_col.push_back(col);
    t.text.push_back(std::move(text));
  };
  auto push_text = [&](int n) {
    for (int i = 0; i < n; ++i) {
      const int w = rng.uniform_int(0, kNumWords - 1);
      push(Modality::kText, 100 + w, -1, -1, kWords[w]);
    }
  };
  push(Modality::kSpecial, 1, -1, -1, "<s>");
  const int prefix = options_.images > 0 || options_.audio > 0 ? std::max(1, options_.text / 4) : options_.text;
  push_text(prefix);
  grid_rows_ = options_.images > 0 ? std::max(1, static_cast<int>(std::floor(std::sqrt(options_.image_tokens)))) : 0;
  grid_cols_ = options_.images > 0 ? (options_.image_tokens + grid_rows_ - 1) / grid_rows_ : 0;
  for (int im = 0; im < options_.images; ++im) {
    ++segment;
    image_first_token_.push_back(static_cast<int>(t.size()));
    for (int i = 0; i < options_.image_tokens; ++i) push(Modality::kVision, -1, i / grid_cols_, i % grid_cols_, "");
    push(Modality::kSpecial, 2, -1, -1, "\n");
  }
  if (options_.audio > 0) {
    ++segment;
    for (int i = 0; i < options_.audio; ++i) push(Modality::kAudio, -1, -1, -1, "");
    push(Modality::kSpecial, 2, -1, -1, "\n");
  }
  ++segment;
  const int question_start = static_cast<int>(t.size());
  push_text(options_.text - prefix);
  num_sinks_ = std::min<int>(4, static_cast<int>(t.size()));

  // Alignment tokens: question words that refer to one patch of one image.
  if (options_.images > 0) {
    for (int i = question_start; i < static_cast<int>(t.size()); ++i) {
      if (rng.uniform() < 0.15) align_tokens_.push_back(i);
    }
    if (align_tokens_.empty() && question_start < static_cast<int>(t.size())) align_tokens_.push_back(question_start);
    for (std::size_t a = 0; a < align_tokens_.size(); ++a) {
      const int im = rng.uniform_int(0, options_.images - 1);
      align_targets_.push_back(image_first_token_[static_cast<std::size_t>(im)] +
                               rng.uniform_int(0, options_.image_tokens - 1));
    }
  }
  const int T = static_cast<int>(t.size());
  for (int s = 0; s < options_.decode; ++s) {
    const int w = rng.uniform_int(0, kNumWords - 1);
    decode_tokens_.token_id.push_back(100 + w);
    decode_tokens_.position.push_back(T + s);
    decode_tokens_.text.push_back(kWords[w]);
    int target = -1;
    if (options_.images > 0 && rng.uniform() < 0.6) {
      const int im = rng.uniform_int(0, options_.images - 1);
      target = image_first_token_[static_cast<std::size_t>(im)] + rng.uniform_int(0, options_.image_tokens - 1);
    }
    decode_targets_.push_back(target);
  }
}

// Content part of every context key (or value) of one kv head, [T, D], unit variance per element:
// vision tokens follow a smooth random field over their patch grid plus noise that grows with depth;
// text and audio follow AR(1) chains; special tokens are independent.
void SynthGenerator::key_content(int layer, int kv_head, const HeadBasis& b, std::vector<float>& c) const {
  const int D = b.D;
  const int T = static_cast<int>(tokens_.size());
  c.assign(static_cast<std::size_t>(T) * static_cast<std::size_t>(D), 0.0f);
  Rng rng(seed_of(options_.seed, kStreamKeys, layer, kv_head));
  constexpr int kModes = 8;
  std::vector<float> modes(static_cast<std::size_t>(kModes * D));
  float freq_r[kModes], freq_c[kModes], phase[kModes];
  int field_segment = -1000;
  std::vector<float> prev(static_cast<std::size_t>(D), 0.0f);
  int prev_modality = -1;
  const float vis_scale = 1.0f / std::sqrt(1.0f + b.vision_noise * b.vision_noise);
  for (int t = 0; t < T; ++t) {
    float* out = &c[static_cast<std::size_t>(t) * static_cast<std::size_t>(D)];
    const int m = tokens_.modality[static_cast<std::size_t>(t)];
    if (m == static_cast<int>(Modality::kVision)) {
      if (tokens_.segment[static_cast<std::size_t>(t)] != field_segment) {
        field_segment = tokens_.segment[static_cast<std::size_t>(t)];
        Rng frng(seed_of(options_.seed, kStreamKeys, layer, kv_head, 1000 + field_segment));
        fill_normal(frng, modes.data(), kModes * D);
        for (int k = 0; k < kModes; ++k) {
          freq_r[k] = static_cast<float>(frng.uniform() * 0.12 - 0.06);  // cycles per patch
          freq_c[k] = static_cast<float>(frng.uniform() * 0.12 - 0.06);
          phase[k] = static_cast<float>(frng.uniform() * 2.0 * M_PI);
        }
      }
      const float r = static_cast<float>(tokens_.grid_row[static_cast<std::size_t>(t)]);
      const float col = static_cast<float>(tokens_.grid_col[static_cast<std::size_t>(t)]);
      const float amp = std::sqrt(2.0f / kModes);
      for (int k = 0; k < kModes; ++k) {
        const float w = amp * std::cos(2.0f * static_cast<float>(M_PI) * (freq_r[k] * r + freq_c[k] * col) + phase[k]);
        const float* mode = &modes[static_cast<std::size_t>(k * D)];
        for (int d = 0; d < D; ++d) out[d] += w * mode[d];
      }
      for (int d = 0; d < D; ++d) out[d] = vis_scale * (out[d] + b.vision_noise * rng.normal());
    } else if (m == static_cast<int>(Modality::kText) || m == static_cast<int>(Modality::kAudio)) {
      const float rho = m == static_cast<int>(Modality::kAudio) ? 0.95f - 0.4f * b.depth : b.text_rho;
      const bool chain = prev_modality == m;
      const float innov = chain ? std::sqrt(1.0f - rho * rho) : 1.0f;
      for (int d = 0; d < D; ++d) out[d] = (chain ? rho * prev[d] : 0.0f) + innov * rng.normal();
    } else {
      fill_normal(rng, out, D);
    }
    std::copy(out, out + D, prev.begin());
    prev_modality = m;
  }
}

SynthGenerator::Layer SynthGenerator::prefill_layer(int layer) const {
  const auto& g = header_.geometry;
  if (layer < 0 || layer >= g.num_layers) throw std::out_of_range("synth: layer out of range");
  const int D = g.head_dim, Hq = g.num_q_heads, Hkv = g.num_kv_heads, G = Hq / Hkv;
  const int T = static_cast<int>(tokens_.size());
  const std::size_t row = static_cast<std::size_t>(D), plane = static_cast<std::size_t>(T) * row;
  Layer out;
  out.q.assign(static_cast<std::size_t>(Hq) * plane, 0.0f);
  out.k.assign(static_cast<std::size_t>(Hkv) * plane, 0.0f);
  out.v.assign(static_cast<std::size_t>(Hkv) * plane, 0.0f);
  const float sqrtD = std::sqrt(static_cast<float>(D));
  const double omega = M_PI / static_cast<double>(T + static_cast<int>(num_decode_steps()));
  std::vector<int> align_target_of(static_cast<std::size_t>(T), -1);
  for (std::size_t a = 0; a < align_tokens_.size(); ++a) {
    align_target_of[static_cast<std::size_t>(align_tokens_[a])] = align_targets_[a];
  }

#pragma omp parallel for schedule(dynamic)
  for (int h = 0; h < Hkv; ++h) {
    const HeadBasis b = basis(layer, h);
    std::vector<float> c;
    key_content(layer, h, b, c);
    std::vector<float> unit(c.size());  // content directions for query terms
    for (int t = 0; t < T; ++t) {
      const float* ct = &c[static_cast<std::size_t>(t) * row];
      const float n = norm(ct, D);
      for (int d = 0; d < D; ++d) unit[static_cast<std::size_t>(t) * row + static_cast<std::size_t>(d)] = n > 0 ? ct[d] / n : 0.0f;
    }
    // Keys: content + structural directions.
    float* K = &out.k[static_cast<std::size_t>(h) * plane];
    for (int t = 0; t < T; ++t) {
      const int m = tokens_.modality[static_cast<std::size_t>(t)];
      const float sink = t < num_sinks_ ? 1.0f : 0.0f;
      const float cr = static_cast<float>(std::cos(omega * t)), sr = static_cast<float>(std::sin(omega * t));
      float* kt = &K[static_cast<std::size_t>(t) * row];
      const float* ct = &c[static_cast<std::size_t>(t) * row];
      for (int d = 0; d < D; ++d) {
        kt[d] = ct[d] + sqrtD * (sink * b.u_sink[d] + 0.5f * b.u_mod[m][d] + 0.5f * (cr * b.u_r1[d] + sr * b.u_r2[d]));
      }
    }
    // Values: an independent content field with the same smoothness; sinks carry small values.
    {
      std::vector<float> vc;
      key_content(layer, h + 7919 * (Hkv + 1), b, vc);
      float* V = &out.v[static_cast<std::size_t>(h) * plane];
      for (int t = 0; t < T; ++t) {
        const float s = t < num_sinks_ ? 0.1f : 1.0f;
        for (int d = 0; d < D; ++d) V[static_cast<std::size_t>(t) * row + static_cast<std::size_t>(d)] = s * vc[static_cast<std::size_t>(t) * row + static_cast<std::size_t>(d)];
      }
    }
    // Queries of the GQA group.
    for (int j = h * G; j < (h + 1) * G; ++j) {
      Rng rng(seed_of(options_.seed, kStreamQueries, layer, j));
      float* Q = &out.q[static_cast<std::size_t>(j) * plane];
      const float pref_v = b.role == HeadRole::kVision ? 2.0f * b.modality_bonus : 0.0f;
      const float pref_t = b.role == HeadRole::kText ? 2.0f * b.modality_bonus : 0.0f;
      const float align_w = b.role == HeadRole::kText ? 0.3f : 1.0f;
      for (int t = 0; t < T; ++t) {
        float* qt = &Q[static_cast<std::size_t>(t) * row];
        const float* ut = &unit[static_cast<std::size_t>(t) * row];
        const float cr = static_cast<float>(std::cos(omega * t)), sr = static_cast<float>(std::sin(omega * t));
        const int target = align_target_of[static_cast<std::size_t>(t)];
        const float* ua = target >= 0 ? &unit[static_cast<std::size_t>(target) * row] : nullptr;
        for (int d = 0; d < D; ++d) {
          float x = b.sink_bonus * b.u_sink[d] + pref_v * b.u_mod[1][d] + pref_t * b.u_mod[0][d] +
                    2.0f * b.recency * (cr * b.u_r1[d] + sr * b.u_r2[d]) + b.local * ut[d] +
                    b.query_noise * rng.normal();
          if (ua) x += align_w * b.alignment * ua[d];
          qt[d] = x;
        }
      }
    }
  }
  return out;
}

SynthGenerator::Layer SynthGenerator::decode_layer(int layer) const {
  const auto& g = header_.geometry;
  if (layer < 0 || layer >= g.num_layers) throw std::out_of_range("synth: layer out of range");
  const int D = g.head_dim, Hq = g.num_q_heads, Hkv = g.num_kv_heads, G = Hq / Hkv;
  const int T = static_cast<int>(tokens_.size()), S = static_cast<int>(num_decode_steps());
  const std::size_t row = static_cast<std::size_t>(D), plane = static_cast<std::size_t>(S) * row;
  Layer out;
  out.q.assign(static_cast<std::size_t>(Hq) * plane, 0.0f);
  out.k.assign(static_cast<std::size_t>(Hkv) * plane, 0.0f);
  out.v.assign(static_cast<std::size_t>(Hkv) * plane, 0.0f);
  const float sqrtD = std::sqrt(static_cast<float>(D));
  const double omega = M_PI / static_cast<double>(T + S);

#pragma omp parallel for schedule(dynamic)
  for (int h = 0; h < Hkv; ++h) {
    const HeadBasis b = basis(layer, h);
    std::vector<float> c;
    key_content(layer, h, b, c);
    Rng krng(seed_of(options_.seed, kStreamDecode, layer, h));
    // Appended keys/values: generated text continuing the AR(1) chain of the last context token.
    std::vector<float> prev(c.end() - static_cast<std::ptrdiff_t>(row), c.end());
    const float rho = b.text_rho, innov = std::sqrt(1.0f - rho * rho);
    for (int s = 0; s < S; ++s) {
      const double pos = T + s;
      const float cr = static_cast<float>(std::cos(omega * pos)), sr = static_cast<float>(std::sin(omega * pos));
      float* kt = &out.k[static_cast<std::size_t>(h) * plane + static_cast<std::size_t>(s) * row];
      float* vt = &out.v[static_cast<std::size_t>(h) * plane + static_cast<std::size_t>(s) * row];
      for (int d = 0; d < D; ++d) {
        prev[static_cast<std::size_t>(d)] = rho * prev[static_cast<std::size_t>(d)] + innov * krng.normal();
        kt[d] = prev[static_cast<std::size_t>(d)] + sqrtD * (0.5f * b.u_mod[0][d] + 0.5f * (cr * b.u_r1[d] + sr * b.u_r2[d]));
        vt[d] = krng.normal();
      }
    }
    for (int j = h * G; j < (h + 1) * G; ++j) {
      Rng rng(seed_of(options_.seed, kStreamDecode, layer, 10000 + j));
      const float pref_v = b.role == HeadRole::kVision ? 2.0f * b.modality_bonus : 0.0f;
      const float pref_t = b.role == HeadRole::kText ? 2.0f * b.modality_bonus : 0.0f;
      const float align_w = b.role == HeadRole::kText ? 0.3f : 1.0f;
      for (int s = 0; s < S; ++s) {
        const double pos = T + s;
        const float cr = static_cast<float>(std::cos(omega * pos)), sr = static_cast<float>(std::sin(omega * pos));
        const int target = decode_targets_[static_cast<std::size_t>(s)];
        float tn = 1.0f;
        const float* ct = nullptr;
        if (target >= 0) {
          ct = &c[static_cast<std::size_t>(target) * row];
          tn = norm(ct, D);
          if (tn <= 0) tn = 1.0f;
        }
        float* qt = &out.q[static_cast<std::size_t>(j) * plane + static_cast<std::size_t>(s) * row];
        for (int d = 0; d < D; ++d) {
          float x = b.sink_bonus * b.u_sink[d] + pref_v * b.u_mod[1][d] + pref_t * b.u_mod[0][d] +
                    2.0f * b.recency * (cr * b.u_r1[d] + sr * b.u_r2[d]) + b.query_noise * rng.normal();
          if (ct) x += align_w * b.alignment * ct[d] / tn;
          qt[d] = x;
        }
      }
    }
  }
  return out;
}

namespace {
// Converts float32 data to the trace dtype (round to nearest even).
std::vector<std::byte> convert(const std::vector<float>& x, DType t) {
  std::vector<std::byte> out(x.size() * kernels::dtype_bytes(t));
  for (std::size_t i = 0; i < x.size(); ++i) kernels::store_element(out.data(), t, i, x[i]);
  return out;
}
}  // namespace

void write_synthetic_trace(const SynthOptions& options, const std::string& path,
                           const std::function<void(int, int)>& progress) {
  SynthGenerator gen(options);
  const auto& g = gen.header().geometry;
  trace::WriterOptions wo;
  wo.deflate_level = options.deflate;
  trace::TraceWriter w(path, gen.header(), gen.num_tokens(), gen.num_decode_steps(), wo);
  w.write_tokens(gen.tokens());
  w.write_decode_tokens(gen.decode_tokens().token_id, gen.decode_tokens().position, gen.decode_tokens().text);
  trace::Profile profile;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto ns = [&](clock::time_point t) {
    return static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(t - t0).count());
  };
  const std::size_t D = static_cast<std::size_t>(g.head_dim);
  const DType dt = options.dtype;
  for (int l = 0; l < g.num_layers; ++l) {
    const auto start = clock::now();
    const auto pre = gen.prefill_layer(l);
    const auto q = convert(pre.q, dt), k = convert(pre.k, dt), v = convert(pre.v, dt);
    const std::size_t T = gen.num_tokens();
    w.write_layer(l, {q.data(), dt, {static_cast<std::size_t>(g.num_q_heads), T, D}},
                  {k.data(), dt, {static_cast<std::size_t>(g.num_kv_heads), T, D}},
                  {v.data(), dt, {static_cast<std::size_t>(g.num_kv_heads), T, D}});
    const auto dec = gen.decode_layer(l);
    const auto dq = convert(dec.q, dt), dk = convert(dec.k, dt), dv = convert(dec.v, dt);
    const std::size_t S = gen.num_decode_steps();
    w.write_decode_layer(l, {dq.data(), dt, {static_cast<std::size_t>(g.num_q_heads), S, D}},
                         {dk.data(), dt, {static_cast<std::size_t>(g.num_kv_heads), S, D}},
                         {dv.data(), dt, {static_cast<std::size_t>(g.num_kv_heads), S, D}});
    char name[48];
    std::snprintf(name, sizeof name, "synth layer %03d", l);
    profile.ranges.push_back({name, ns(start), ns(clock::now()), 0, 0});
    if (progress) progress(l + 1, g.num_layers);
  }
  w.write_profile(profile);
  w.close();
}

}  // namespace kvscope::synth
