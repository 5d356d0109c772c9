// CUDA backend of the token scores: same parameter structs and formulas as
// scores.hpp, device pointers, `stream` last. Neighbour lists are built on
// the host once per trace (cpu::build_neighbour_lists) and uploaded by the caller.
#pragma once

#include <cuda_runtime_api.h>

#include "kvscope/kernels/scores.hpp"

namespace kvscope::kernels::cuda {

// out: [num_heads, num_tokens] float (device).
Status key_norms(const KeyTensor& k, float* out, cudaStream_t stream);

// neighbours: device CSR arrays (offsets [num_tokens + 1], indices); they are
// trusted (validate them with the CPU backend when they are built).
// out: [num_heads, num_tokens] float (device).
Status redundancy(const KeyTensor& k, const NeighbourLists& neighbours, float* out, cudaStream_t stream);

// UniCache score; all arrays on the device. Modality codes >= 4 count as 3.
// The score is formed with explicitly rounded products and sums (no FMA), so it
// matches the CPU backend bit for bit with linear recency (exponential recency:
// expf may differ from the host's by one ulp).
Status unicache_score(const UniCacheInputs& in, const UniCacheParams& params, float* out,
                      cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
