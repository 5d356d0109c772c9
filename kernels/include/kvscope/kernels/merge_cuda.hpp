// CUDA backend of token merging (kvscope/kernels/merge.hpp): same parameters and
// results as cpu::merge_tokens, all tensor pointers are device pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvscope/kernels/merge.hpp"

namespace kvscope::kernels::cuda {

// Device-pointer version of cpu::merge_tokens (same shapes). The kept lists are
// validated on the device; the launcher synchronises `stream` once to read the
// validation flag, so an invalid list returns Status::Invalid like the CPU backend.
Status merge_tokens(const MergeParams& params, const void* k, const void* v, const std::int32_t* kept,
                    const float* importance, float* k_out, float* v_out, std::int32_t* multiplicity,
                    std::int32_t* token_to_slot, cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
