// Token merging: every evicted token is folded into the most similar kept token
// of its head (cosine similarity of keys, within a position window), and each
// kept slot becomes the importance-weighted average of its members with the
// norm restored to the members' weighted mean norm. See docs/kernels/merge.md.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// Shapes and options of one token-merge call (one layer).
struct MergeParams {
  int num_heads = 0;          // H: KV heads
  int num_tokens = 0;         // T: context tokens
  int head_dim = 0;           // D
  int num_kept = 0;           // K: kept tokens (slots) per head, 1 <= K <= T
  bool shared_kept = false;   // true: one kept list [K] for all heads; false: [H, K]
  int window = 8;             // w >= 0: an evicted token t may join kept token s only if |t - s| <= w
  float threshold = 0.8f;     // join only if cos(k_t, k_s) > threshold (cosine clamped to [-1, 1])
  DType dtype = DType::kF32;  // element type of K and V
};

namespace cpu {

// Merges evicted tokens into kept slots.
//   k, v          : [H, T, D] row-major, params.dtype
//   kept          : [H, K] (or [K] when shared_kept), strictly increasing token indices in [0, T)
//   importance    : [H, T] float merge weights; values <= 0 or NaN count as 0; nullptr = all 1.
//                   A slot whose member weights sum to 0 uses uniform weights.
//   k_out, v_out  : [H, K, D] float32 merged slot keys / values; must not overlap k or v
//   multiplicity  : [H, K] int32, 1 + number of evicted tokens merged into the slot
//   token_to_slot : [H, T] int32, slot index in [0, K) of every token (kept tokens map to their
//                   own slot), or -1 for a dropped token
Status merge_tokens(const MergeParams& params, const void* k, const void* v, const std::int32_t* kept,
                    const float* importance, float* k_out, float* v_out, std::int32_t* multiplicity,
                    std::int32_t* token_to_slot);

}  // namespace cpu
}  // namespace kvscope::kernels
