// CUDA backend of the attention statistics: same parameter structs and
// formulas as attention_stats.hpp, device pointers, `stream` last.
// Per-key sums use float atomics, so their summation order (and the last bits)
// differ from the CPU backend; results agree within float reduction tolerance.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvscope/kernels/attention_stats.hpp"

namespace kvscope::kernels::cuda {

// H2O accumulated attention. out: [num_q_heads, k_len] float (device).
Status accumulated_attention(const AttentionProblem& a, QueryRange range, float* out, cudaStream_t stream);

// Sum over each GQA group. in: [num_q_heads, len]; out: [num_kv_heads, len] (device).
Status reduce_to_kv_heads(const float* in, int num_q_heads, int num_kv_heads, int len, float* out,
                          cudaStream_t stream);

// SnapKV window sum + pooling. out: [num_q_heads, k_len] float (device).
Status snapkv_scores(const AttentionProblem& a, const SnapKVParams& params, float* out, cudaStream_t stream);

// TOVA: attention row of the last query. out: [num_q_heads, k_len] float (device).
Status tova_scores(const AttentionProblem& a, float* out, cudaStream_t stream);

// Entropy [num_q_heads, q_len] and modality mass [num_q_heads, q_len, 4] (either may be nullptr).
// k_modality: [k_len] uint8 (device); codes >= 4 are counted as 3 (not validated on the device).
Status attention_row_stats(const AttentionProblem& a, const std::uint8_t* k_modality, float* entropy,
                           float* modality_mass, cudaStream_t stream);

// Cross-modal received / given, [num_q_heads, k_len] each (device, either may be nullptr).
Status cross_modal_interaction(const AttentionProblem& a, const std::uint8_t* k_modality,
                               const std::uint8_t* q_modality, float* received, float* given,
                               cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
