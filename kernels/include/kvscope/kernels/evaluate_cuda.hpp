// CUDA backend of compressed-cache evaluation (kvscope/kernels/evaluate.hpp): same
// parameter structs, every pointer (including those inside CompressedCache and
// EvaluateOutputs) is a device pointer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvscope/kernels/evaluate.hpp"

namespace kvscope::kernels::cuda {

// Device version of cpu::evaluate_attention. Reads slot_offsets back to size its
// workspace (stream-ordered allocation) and synchronises `stream` at the end to
// report invalid device data (modality codes, slot indices, multiplicities) as
// Status::Invalid, so the call is synchronous.
Status evaluate_attention(const EvaluateParams& params, const void* q, const void* k, const void* v,
                          const std::uint8_t* modality, const CompressedCache& cache,
                          const EvaluateOutputs& out, cudaStream_t stream);

// Device version of cpu::full_attention (every pointer in `full` is a device
// pointer). Synchronises `stream` to report modality codes >= 4 as Status::Invalid.
Status full_attention(const EvaluateParams& params, const void* q, const void* k, const void* v,
                      const std::uint8_t* modality, const FullAttention& full, cudaStream_t stream);

// Device version of the cpu::evaluate_attention FullAttention overload (full as
// written by cuda::full_attention). Synchronous like the k/v overload.
Status evaluate_attention(const EvaluateParams& params, const void* q, const std::uint8_t* modality,
                          const FullAttention& full, const CompressedCache& cache, const EvaluateOutputs& out,
                          cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
