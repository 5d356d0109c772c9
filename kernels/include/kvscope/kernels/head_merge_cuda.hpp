// CUDA backend of head merging (kvscope/kernels/head_merge.hpp): same parameters,
// device pointers for all tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvscope/kernels/head_merge.hpp"

namespace kvscope::kernels::cuda {

// Device version of cpu::head_similarity. similarity: [H, H] float, device.
Status head_similarity(const HeadMergeParams& params, const void* k, const void* v, float* similarity,
                       cudaStream_t stream);

// Device version of cpu::apply_head_merge (cluster_id and head_weights on the device).
Status apply_head_merge(const HeadMergeParams& params, const void* k, const void* v,
                        const std::int32_t* cluster_id, int num_clusters, const float* head_weights,
                        float* k_out, float* v_out, cudaStream_t stream);

// Device version of cpu::merge_heads. All tensors are device pointers except
// num_merged_heads (host int). The [H, H] similarity matrix is copied to the host and
// clustered with cpu::cluster_heads (the stream is synchronised once), so both backends
// cluster identically given the same similarities.
Status merge_heads(const HeadMergeParams& params, const void* k, const void* v, const float* head_weights,
                   float* similarity, std::int32_t* cluster_id, int* num_merged_heads, float* k_out,
                   float* v_out, std::int32_t* q_to_merged, cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
