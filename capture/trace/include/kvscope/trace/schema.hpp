// Trace format v1: names, codes and in-memory records shared by the writer,
// the reader and the validator. docs/trace-format.md is the normative text.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/kernels/common.hpp"

namespace kvscope::trace {

using kernels::DType;
using kernels::Modality;

inline constexpr const char* kFormatName = "kvscope-trace";
inline constexpr int kVersionMajor = 1;
inline constexpr int kVersionMinor = 0;
// The minor version a writer writes when the trace has 1.1 content (token roles); traces without it
// stay 1.0, byte for byte what a 1.0 writer wrote.
inline constexpr int kVersionMinorRoles = 1;

// Role of a token in the prompt (trace format 1.1, /tokens/role and /decode/tokens/role;
// docs/trace-format.md section 2a). Traces without roles read as: every context token kContext,
// every decode step kAnswer.
enum class Role : std::uint8_t {
  kContext = 0,   // the material the question is about (document, haystack, images)
  kQuestion = 1,  // the question (or instruction) the answer responds to
  kAnswer = 2,    // the model's answer: a pre-filled answer prefix and the generated tokens
  kTemplate = 3,  // chat-template markup and system prompt: none of the above
};
inline constexpr int kNumRoles = 4;
// "context", "question", "answer", "template"; "?" for another code.
const char* role_name(int role);

// The minor version of a trace with stored attention aggregates (/aggregates, section 3a of
// docs/trace-format.md).
inline constexpr int kVersionMinorAggregates = 2;

// Parses a `version` attribute of a kvscope file (traces and results): exactly MAJOR.MINOR, one to
// six digits each side of one dot, nothing else (no spaces, signs, suffixes or third component).
bool parse_version(const std::string& text, int& major, int& minor);

// "/layers/007" for layer 7 (three digits, more if num_layers > 1000).
std::string layer_group_name(int layer);
std::string decode_layer_group_name(int layer);

struct ModelGeometry {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  double rope_theta = 10000.0;
  std::string model_name;
  int group_size() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }
};

// Root attributes of a trace.
struct TraceHeader {
  ModelGeometry geometry;
  DType dtype = DType::kF16;   // element type of every q/k/v tensor
  bool synthetic = false;
  std::string creator;         // program and version that wrote the file
  std::string created;         // ISO-8601 UTC time; filled by the writer if empty
  std::string device;          // "cpu", "NVIDIA H200", "synthetic", ...
  int version_major = kVersionMajor;
  int version_minor = kVersionMinor;
  bool complete = false;       // set by the writer's close(); false means the run crashed
};

// /tokens: one entry per context (prefill) token.
struct Tokens {
  std::vector<std::uint8_t> modality;  // [T] Modality code 0..3
  std::vector<std::int32_t> position;  // [T] absolute position id
  std::vector<std::int32_t> token_id;  // [T] vocabulary id, -1 where none (e.g. image patches)
  std::vector<std::int32_t> segment;   // [T] which turn / image / audio clip
  std::vector<std::int32_t> grid_row;  // [T] patch row for vision tokens, -1 otherwise
  std::vector<std::int32_t> grid_col;  // [T] patch column for vision tokens, -1 otherwise
  std::vector<std::string> text;       // [T] optional decoded text (empty vector = absent)
  std::vector<std::uint8_t> role;      // [T] optional Role codes (empty = absent: all kContext)
  std::size_t size() const { return modality.size(); }
};

// A dense tensor in the trace's element type: raw little-endian bytes.
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<std::size_t> shape;   // e.g. [heads, tokens, head_dim]
  std::vector<std::byte> data;      // product(shape) * dtype_bytes(dtype)
  std::size_t numel() const {
    std::size_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  float at(std::size_t i) const { return kernels::load_element(data.data(), dtype, i); }
  std::vector<float> to_float() const;
};

// Non-owning view of a tensor to write (host memory).
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::array<std::size_t, 3> shape{};  // [heads, tokens, head_dim]
};

// One prefill layer: q [Hq, T, D], k and v [Hkv, T, D]; keys after RoPE as cached.
struct LayerTensors {
  Tensor q, k, v;
};

// Optional precomputed aggregates of a prefill layer.
struct LayerAggregates {
  std::vector<float> attn_colsum;  // [Hq, T] sum over causal prefill queries of attention to each key
  std::vector<float> attn_window;  // [Hq, W, T] attention rows of the last W prefill queries
  int window = 0;                  // W
};

// Trace format 1.2: attention statistics of the prefill stored once (/aggregates; docs/trace-format.md
// section 3a), with the definition they were computed under, so that a reader uses them only where its
// own definition is the same. Every statistic is over the causal prefill attention of one layer:
//   p_j(i, t) = softmax_t(softmax_scale * q_j,i . k_h,t) over the keys t with position[t] <= position[i]
// (query head j reads kv head h = j / gqa_group; /tokens/position), accumulated in float32.
inline constexpr const char* kAggregatesGroup = "/aggregates";
// The formulas below, versioned: a reader uses stored aggregates only with this exact name.
inline constexpr const char* kAggregateDefinitionName = "kvscope-attention-aggregates-1";
std::string aggregate_layer_group_name(int layer);  // "/aggregates/007"

struct AggregateDefinition {
  std::string definition = kAggregateDefinitionName;
  int num_layers = 0, num_tokens = 0;  // L, T (the context the statistics are over)
  int num_q_heads = 0, num_kv_heads = 0, gqa_group = 1;
  double softmax_scale = 0;             // float32(1 / sqrt(head_dim)), the factor of q.k in the logits
  bool causal = true;                   // key t visible to query i iff position[t] <= position[i]
  int window = 0;                       // W of window_sum: the last W prefill queries (1 <= W <= T)
  int seq_radius = 4, grid_radius = 1;  // neighbourhood of redundancy
  std::string input_dtype;              // the trace's tensor dtype, converted exactly to float32
  std::string accumulate_dtype = "float32";
  std::string creator;  // program that computed them (informational)
};
// The aggregates of one layer, float32. [Hq, T] unless noted; query head j, key (token) t:
struct LayerAttentionAggregates {
  std::vector<float> h2o;             // sum over every prefill query i of p_j(i, t)
  std::vector<float> window_sum;      // sum over the last W queries i >= T - W of p_j(i, t)
  std::vector<float> last_query;      // p_j(T - 1, t)
  std::vector<float> cross_received;  // mean over the queries i of another modality that see t of p_j(i, t)
  std::vector<float> cross_given;     // sum over the keys u of another modality than token t of p_j(t, u)
  std::vector<float> redundancy;  // [Hkv, T] max key cosine of t to its neighbours (kernels::cpu::redundancy)
};
// State of a trace's /aggregates group.
enum class AggregateState {
  kAbsent,      // no /aggregates
  kIncomplete,  // /aggregates@complete is not 1: a writer stopped (or is still writing); never use
  kPresent,     // complete: every layer's datasets were written
};

// /profile records (CUPTI kernels / memcpys, NVTX or steady-clock ranges).
struct KernelRecord {
  std::string name;
  std::int64_t start_ns = 0, end_ns = 0;
  std::int64_t stream = 0;
  std::int32_t device = 0;
  std::array<std::int32_t, 3> grid{0, 0, 0}, block{0, 0, 0};
  std::int64_t bytes = 0;  // bytes moved (memcpy records), 0 for kernels
  std::string kind;        // "kernel", "memcpy_htod", "memcpy_dtoh", ...
};
struct RangeRecord {
  std::string name;
  std::int64_t start_ns = 0, end_ns = 0;
  std::int32_t depth = 0;   // nesting depth, 0 = outermost
  std::int64_t thread = 0;  // thread or stream id
};
struct Profile {
  std::vector<KernelRecord> kernels;
  std::vector<RangeRecord> ranges;
};

// Bytes of K plus V for `tokens` tokens in one layer: 2 * kv_heads * tokens * head_dim * element bytes.
inline std::uint64_t kv_bytes_per_layer(const ModelGeometry& g, DType dtype, std::uint64_t tokens) {
  return 2ull * static_cast<std::uint64_t>(g.num_kv_heads) * tokens * static_cast<std::uint64_t>(g.head_dim) *
         kernels::dtype_bytes(dtype);
}

}  // namespace kvscope::trace
