// CUDA backend of the quantization family: same parameter structs and results as
// kvscope::kernels::cpu (scales, zeros and codes bit-identical, dequantized values
// bit-identical), device pointers, `stream` last. See docs/kernels/quantize.md.
#pragma once

#include <cuda_runtime_api.h>

#include "kvscope/kernels/quantize.hpp"

namespace kvscope::kernels::cuda {

// x: device [num_heads, tokens, head_dim] shape.dtype; out: device buffers sized by quant_layout().
// Per-tensor and per-head scales use a temporary stream-ordered allocation (cudaMallocAsync).
Status quantize(const QuantSpec& spec, const QuantShape& shape, const void* x, const QuantBuffers& out,
                cudaStream_t stream);

// out: device [num_heads, tokens, head_dim] float32.
Status dequantize(const QuantSpec& spec, const QuantShape& shape, const QuantConstBuffers& in, float* out,
                  cudaStream_t stream);

// Fake quantization, equal to dequantize(quantize(x)); scales live in a temporary
// stream-ordered allocation. x: device [num_heads, tokens, head_dim] shape.dtype; out: float32.
Status quantize_dequantize(const QuantSpec& spec, const QuantShape& shape, const void* x, float* out,
                           cudaStream_t stream);

}  // namespace kvscope::kernels::cuda
