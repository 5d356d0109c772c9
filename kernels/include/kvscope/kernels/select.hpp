// Token selection: top-k per head or shared across heads, with per-modality
// budgets, forced-keep sets (attention sinks, recent window, protected mask)
// and deterministic ties (equal score -> lower index wins).
// Exact rules: docs/kernels/select.md.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// What to keep out of num_tokens tokens. Pointers are host pointers for the
// CPU backend and device pointers for the CUDA backend.
struct SelectParams {
  int k = 0;  // total budget per head, 1..num_tokens
  // Per-modality budgets k_m (sum must equal k); used only if use_modality_budgets.
  bool use_modality_budgets = false;
  int modality_budget[kNumModalities] = {0, 0, 0, 0};
  // When a modality has fewer tokens than its budget, give the unused slots to
  // the best remaining tokens of any modality (else the head keeps fewer than k).
  bool redistribute_leftover = true;
  const std::uint8_t* modality = nullptr;  // [num_tokens] codes 0..3; required with modality budgets
  int num_sinks = 0;                       // tokens [0, num_sinks) are always kept
  int recent_window = 0;                   // tokens [num_tokens - recent_window, num_tokens) are always kept
  const std::uint8_t* protected_mask = nullptr;  // [num_tokens] non-zero = always kept; may be nullptr
};

namespace detail {

// Total order used by every backend: higher score first, then lower index.
// NaN ranks as -inf, and -0 equals +0. Returns an unsigned key that grows
// with the score (ascending key = ascending score).
KVSCOPE_HD std::uint32_t score_order_key(float s) {
  if (s != s) s = -INFINITY;  // NaN
  if (s == 0.0f) s = 0.0f;    // -0 -> +0
  const std::uint32_t u = float_to_bits(s);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// 64-bit sort key: ascending order = score descending, then index ascending.
KVSCOPE_HD std::uint64_t select_rank_key(float s, std::int32_t index) {
  return (static_cast<std::uint64_t>(~score_order_key(s)) << 32) | static_cast<std::uint32_t>(index);
}

// Forced-keep rule shared by the backends.
KVSCOPE_HD bool select_forced(const SelectParams& p, int num_tokens, int t) {
  return t < p.num_sinks || t >= num_tokens - p.recent_window ||
         (p.protected_mask != nullptr && p.protected_mask[t] != 0);
}

}  // namespace detail
}  // namespace kvscope::kernels

namespace kvscope::kernels::cpu {

// Per head: out_indices[h, 0 .. count_h) = kept token indices, sorted ascending
// and unique; slots after count_h are -1. count_h == k unless a modality
// budget cannot be filled and redistribute_leftover is false.
// scores: [num_heads, num_tokens] float; out_indices: [num_heads, k] int32;
// out_counts: [num_heads] int32 or nullptr.
Status select_topk(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                   std::int32_t* out_indices, std::int32_t* out_counts);

// One list shared by all heads: selection on the head mean
//   m[t] = (sum_{h = 0 .. H-1} scores[h, t]) * (1 / H)   (fp32, summed in head order).
// scores: [num_heads, num_tokens]; out_indices: [k] int32; out_count: int32 or nullptr.
Status select_topk_shared(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                          std::int32_t* out_indices, std::int32_t* out_count);

// Checks sizes and budgets; with host arrays also the modality codes and that
// the forced set fits in k (both backends call it; CUDA on host copies).
Status validate_select(const SelectParams& params, int num_heads, int num_tokens, bool arrays_on_host,
                       const char* fn);

}  // namespace kvscope::kernels::cpu
