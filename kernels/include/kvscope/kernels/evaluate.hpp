// Attention on a compressed cache: for each evaluation query, full attention over
// the original K/V versus attention over the compressed slots, and the quality
// metrics of design.md "Quality" (output error, recall, KL, entropy change,
// modality shares). See docs/kernels/evaluate.md for the exact math.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

struct EvaluateParams {
  int num_q_heads = 0;        // Hq, a multiple of Hkv (q head j reads kv head j / (Hq / Hkv))
  int num_kv_heads = 0;       // Hkv
  int num_queries = 0;        // Nq evaluation (decode) queries per q head
  int num_tokens = 0;         // T context tokens; every query attends to all of them (no causal mask)
  int head_dim = 0;           // D
  DType dtype = DType::kF32;  // element type of q and the full k, v
  bool proportional_attention = true;  // add log n_s to the compressed logits
};

// The compressed cache of one layer, ragged per kv head: head h owns slot rows
// [slot_offsets[h], slot_offsets[h + 1]) of k / v / multiplicity / slot_modality.
struct CompressedCache {
  const float* k = nullptr;                        // [S_total, D] float32 slot keys (dequantized)
  const float* v = nullptr;                        // [S_total, D] float32 slot values
  const std::int32_t* slot_offsets = nullptr;      // [Hkv + 1], offsets[0] = 0, non-decreasing
  const float* multiplicity_f32 = nullptr;         // [S_total] n_s > 0, or nullptr
  const std::int32_t* multiplicity_i32 = nullptr;  // [S_total] n_s >= 1, or nullptr
                                                   // (at most one of the two; none: n_s = 1)
  const std::uint8_t* slot_modality = nullptr;     // [S_total] modality code of the slot's representative
  const std::int32_t* token_to_slot = nullptr;     // [Hkv, T] slot of token t in [0, S_h) (local to the
                                                   // head), or -1 when the token was evicted
};

// Per-query results, row r = j * Nq + i for q head j, query i. Any pointer may be
// nullptr (that metric is not written); at least one must be set.
struct EvaluateOutputs {
  float* output_error = nullptr;     // [Hq, Nq] ||o~ - o|| / ||o|| (||o~ - o|| when ||o|| = 0)
  float* recall = nullptr;           // [Hq, Nq] R = sum of p(t) over surviving tokens
  float* kl = nullptr;               // [Hq, Nq] KL(P || p~), natural log; 0 when R = 0
  float* entropy_change = nullptr;   // [Hq, Nq] H(p~) - H(p), natural log
  float* recall_modality = nullptr;  // [Hq, Nq, 4] R_m; 1 where the modality's full mass is 0
  float* mass_full = nullptr;        // [Hq, Nq, 4] sum_{t in m} p(t)   (modality share before)
  float* mass_compressed = nullptr;  // [Hq, Nq, 4] sum_{s in m} p~(s)  (modality share after)
};

// Full attention of the evaluation queries over the original cache, computed once
// per layer (cpu::full_attention) and reused for every compressed cache of that
// layer (the evaluate_attention overload below). Row r = j * Nq + i as above.
struct FullAttention {
  float* probs = nullptr;          // [Hq, Nq, T] p(t) = softmax_t(q . k_t / sqrt(D)), normalised
  float* output = nullptr;         // [Hq, Nq, D] o = sum_t p(t) v_t
  float* entropy = nullptr;        // [Hq, Nq] H(p) = -sum_t p log p, natural log
  float* modality_mass = nullptr;  // [Hq, Nq, 4] sum_{t in m} p(t); optional (may be nullptr)
};

// Every function below (and its CUDA counterpart) returns Status::Invalid ("... a metric is not
// finite in float32 ...") instead of writing a NaN or infinite metric, e.g. for inputs whose
// logits q . k / sqrt(D) overflow float32 (docs/kernels/evaluate.md, "Range").
namespace cpu {

// Fills `full` (probs, output and entropy required; modality_mass optional).
//   q        : [Hq, Nq, D] params.dtype
//   k, v     : [Hkv, T, D] params.dtype, the full cache
//   modality : [T] uint8 modality code (< 4); may be nullptr when full.modality_mass is nullptr
// params.proportional_attention is not used.
Status full_attention(const EvaluateParams& params, const void* q, const void* k, const void* v,
                      const std::uint8_t* modality, const FullAttention& full);

// Same metrics as the overload below, with the full-cache side read from `full`
// (as written by full_attention for the same params, q, modality; probs, output and
// entropy are read). Results equal the k/v overload bit for bit.
//   q        : [Hq, Nq, D] params.dtype
//   modality : [T] uint8 modality code (< 4) of every context token
Status evaluate_attention(const EvaluateParams& params, const void* q, const std::uint8_t* modality,
                          const FullAttention& full, const CompressedCache& cache,
                          const EvaluateOutputs& out);

// Evaluates every (q head, query) pair (full_attention into temporary buffers, then
// the FullAttention overload).
//   q        : [Hq, Nq, D] params.dtype
//   k, v     : [Hkv, T, D] params.dtype, the full cache
//   modality : [T] uint8 modality code (< 4) of every context token
Status evaluate_attention(const EvaluateParams& params, const void* q, const void* k, const void* v,
                          const std::uint8_t* modality, const CompressedCache& cache,
                          const EvaluateOutputs& out);

}  // namespace cpu
}  // namespace kvscope::kernels
