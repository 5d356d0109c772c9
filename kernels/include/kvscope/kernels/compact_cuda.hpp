// CUDA backend of compaction: same structs and results as cpu::compact, device
// pointers (indices, offsets, inputs, outputs), `stream` last. See docs/kernels/compact.md.
#pragma once

#include <cuda_runtime_api.h>

#include "kvscope/kernels/compact.hpp"

namespace kvscope::kernels::cuda {

// Gathers the kept rows and reports out-of-range indices or malformed offsets as
// Invalid. Index checks happen on the device, so this call synchronizes `stream`.
Status compact(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
               const CompactOutputs& out, cudaStream_t stream);

// Asynchronous variant: a row with an out-of-range index is zero-filled (multiplicity
// and modality 0) and counted in errors[0]; malformed offsets are counted in errors[1].
// errors: device [2] int32 accumulated with atomicAdd (the caller zeroes it), or null.
Status compact_unchecked(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
                         const CompactOutputs& out, int* errors, cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
