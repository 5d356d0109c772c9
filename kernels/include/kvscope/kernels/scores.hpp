// Token scores: key norms, key redundancy (max cosine similarity to sequence
// or 2-D grid neighbours) and the UniCache weighted importance score
//   s = w_a * a~ + w_c * c~ - w_d * d + w_r * r.
// Exact formulas and edge cases: docs/kernels/scores.md.
#pragma once

#include <cstdint>
#include <vector>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// Keys of one layer (host pointer for the CPU backend, device pointer for CUDA).
struct KeyTensor {
  const void* k = nullptr;  // [num_heads, num_tokens, head_dim] row-major, `dtype`
  int num_heads = 0;
  int num_tokens = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;
};

// Token layout of a trace (always host pointers: it is turned into neighbour
// lists once per trace, then reused for every layer and head).
struct TokenGrid {
  const std::int32_t* row = nullptr;      // [num_tokens] grid row, -1 for non-grid tokens; nullptr: no grid
  const std::int32_t* col = nullptr;      // [num_tokens] grid column, -1 for non-grid tokens
  const std::int32_t* segment = nullptr;  // [num_tokens] image / clip id; nullptr: one segment
  int num_tokens = 0;
};

struct RedundancyParams {
  int seq_radius = 4;   // k: sequence neighbours within +-k (non-grid tokens)
  int grid_radius = 1;  // r: grid neighbours within Chebyshev distance r, same segment
};

// Neighbour lists in CSR form: neighbours of token t are
// indices[offsets[t] .. offsets[t + 1]). Host or device pointers per backend.
struct NeighbourLists {
  const std::int32_t* offsets = nullptr;  // [num_tokens + 1], offsets[0] = 0, non-decreasing
  const std::int32_t* indices = nullptr;  // [offsets[num_tokens]] token indices in [0, num_tokens)
  int num_tokens = 0;
};

// Owning host copy of neighbour lists (built by cpu::build_neighbour_lists).
struct NeighbourTable {
  std::vector<std::int32_t> offsets;  // [num_tokens + 1]
  std::vector<std::int32_t> indices;  // [offsets.back()]
  NeighbourLists view() const {
    return NeighbourLists{offsets.data(), indices.data(), static_cast<int>(offsets.size()) - 1};
  }
};

// How a~ and c~ are normalised within each (head, modality) group.
enum class NormalizeKind : std::uint8_t {
  kMax = 0,     // x / max (0 where max <= 0)
  kMinMax = 1,  // (x - min) / (max - min); constant group -> 1 if max > 0 else 0
};
enum class RecencyKind : std::uint8_t {
  kLinear = 0,       // r = t / (T - 1)  (T = 1 -> r = 1)
  kExponential = 1,  // r = exp(-(T - 1 - t) / tau)
};

struct UniCacheParams {
  float w_a = 0.4f;  // attention weight
  float w_c = 0.3f;  // cross-modal interaction weight
  float w_d = 0.2f;  // redundancy penalty weight
  float w_r = 0.1f;  // recency weight
  NormalizeKind normalize = NormalizeKind::kMax;
  RecencyKind recency = RecencyKind::kLinear;
  float recency_tau = 256.0f;  // tokens; only for kExponential, > 0
};

// Inputs of the UniCache score; every [H, T] array uses the same head axis
// (kv heads or query heads, as the caller chooses).
struct UniCacheInputs {
  const float* attention = nullptr;        // [num_heads, num_tokens] a (e.g. H2O / SnapKV scores)
  const float* cross = nullptr;            // [num_heads, num_tokens] c, or nullptr: c = 0
  const float* redundancy = nullptr;       // [num_heads, num_tokens] d, or nullptr: d = 0
  const std::uint8_t* modality = nullptr;  // [num_tokens] codes 0..3
  int num_heads = 0;
  int num_tokens = 0;
};

namespace detail {

// Cosine similarity from a dot product and two norms; 0 if either norm is 0.
KVSCOPE_HD float cosine_from(float dot, float norm_a, float norm_b) {
  const float den = norm_a * norm_b;
  return den > 0.0f ? dot / den : 0.0f;
}

// Normalisation of x within a group with extremes [lo, hi].
KVSCOPE_HD float normalize_in_group(float x, float lo, float hi, NormalizeKind kind) {
  if (kind == NormalizeKind::kMax) return hi > 0.0f ? x / hi : 0.0f;
  const float range = hi - lo;
  if (range > 0.0f) return (x - lo) / range;
  return hi > 0.0f ? 1.0f : 0.0f;
}

}  // namespace detail
}  // namespace kvscope::kernels

namespace kvscope::kernels::cpu {

// L2 norm of every key: out[h, t] = ||k[h, t, :]||, accumulated in fp32.
// out: [num_heads, num_tokens] float.
Status key_norms(const KeyTensor& k, float* out);

// Builds the neighbour lists used by `redundancy` (host only, once per trace):
// - grid token (row >= 0 and col >= 0): every other grid token of the same
//   segment with max(|drow|, |dcol|) <= grid_radius, found through a dense
//   per-segment (row, col) -> token table; two tokens on one cell is an error;
// - any other token: every other token u with |u - t| <= seq_radius.
Status build_neighbour_lists(const TokenGrid& grid, const RedundancyParams& params, NeighbourTable* out);

// Redundancy: out[h, t] = max over neighbours u of cos(k[h, t], k[h, u]),
// with cos = dot / (||a|| ||b||) (0 if a norm is 0); 0 for a token without
// neighbours. out: [num_heads, num_tokens] float, values in [-1, 1].
Status redundancy(const KeyTensor& k, const NeighbourLists& neighbours, float* out);

// Convenience: build_neighbour_lists + redundancy.
Status redundancy(const KeyTensor& k, const TokenGrid& grid, const RedundancyParams& params, float* out);

// UniCache importance, per head h and token t of modality m:
//   a~ = normalize(a[h, t]) within {u : modality[u] == m} of head h (same for c~)
//   d' = clamp(d[h, t], 0, 1)
//   s  = ((w_a * a~ + w_c * c~) - w_d * d') + w_r * r(t)
// out: [num_heads, num_tokens] float.
Status unicache_score(const UniCacheInputs& in, const UniCacheParams& params, float* out);

}  // namespace kvscope::kernels::cpu
