// CUDA backend of token selection: same SelectParams and rules as select.hpp,
// device pointers, `stream` last. Produces exactly the CPU backend's index
// sets (ties included): both order tokens by the same 64-bit rank key.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvscope/kernels/select.hpp"

namespace kvscope::kernels::cuda {

// scores: [num_heads, num_tokens]; out_indices: [num_heads, k] (-1 padded);
// out_counts: [num_heads] or nullptr. All device pointers, including
// params.modality and params.protected_mask. To validate modality codes and
// the forced-set size (and report them as Status::Invalid), the launcher copies
// those two arrays to the host and synchronises `stream` once.
Status select_topk(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                   std::int32_t* out_indices, std::int32_t* out_counts, cudaStream_t stream);

// Shared list on the head mean. out_indices: [k]; out_count: int32 or nullptr (device).
Status select_topk_shared(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                          std::int32_t* out_indices, std::int32_t* out_count, cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
