// CUDA backend of the quantization family. Group statistics are exact minima and
// maxima (order-free), and all scalar math comes from quant_math, so scales, codes
// and dequantized values equal the CPU backend's bit for bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/nvtx.hpp"
#include "kvscope/kernels/quantize_cuda.hpp"

namespace kvscope::kernels::cuda {
namespace {

using quant_math::max_f;
using quant_math::min_f;

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// Everything the kernels need, passed by value.
struct DevPlan {
  std::int64_t heads, tokens, quant_tokens, head_dim;
  std::int64_t group_size, groups_per_row, row_bytes;
  int bits, lo, hi;
  bool symmetric;
  Granularity granularity;
  DType dtype;

  // Index of the scale of element (h, t, i) of the quantized part.
  __device__ std::int64_t group_of(std::int64_t h, std::int64_t t, std::int64_t i) const {
    switch (granularity) {
      case Granularity::kPerTensor:
        return 0;
      case Granularity::kPerHead:
        return h;
      case Granularity::kPerToken:
        return (h * quant_tokens + t) * groups_per_row + i / group_size;
      default:
        return (h * groups_per_row + t / group_size) * head_dim + i;
    }
  }
  __device__ std::int64_t element(std::int64_t h, std::int64_t t, std::int64_t i) const {
    return (h * tokens + t) * head_dim + i;
  }
};

DevPlan make_dev_plan(const QuantSpec& spec, const QuantShape& shape, const QuantLayout& l) {
  DevPlan p{};
  p.heads = shape.num_heads;
  p.tokens = shape.tokens;
  p.quant_tokens = l.quant_tokens;
  p.head_dim = shape.head_dim;
  p.group_size = l.group_size;
  p.groups_per_row = l.groups_per_row;
  p.row_bytes = l.row_bytes;
  p.bits = spec.bits;
  p.lo = quant_math::code_min(spec.bits, spec.symmetric);
  p.hi = quant_math::code_max(spec.bits, spec.symmetric);
  p.symmetric = spec.symmetric;
  p.granularity = spec.granularity;
  p.dtype = shape.dtype;
  return p;
}

unsigned blocks_for(std::int64_t n, int threads = kThreads) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::min<std::int64_t>(std::max<std::int64_t>(b, 1), 1 << 20));
}

__device__ void warp_minmax(float& mn, float& mx) {
  for (int o = 16; o > 0; o >>= 1) {
    mn = min_f(mn, __shfl_xor_sync(kFullMask, mn, o));
    mx = max_f(mx, __shfl_xor_sync(kFullMask, mx, o));
  }
}

// Block-wide min/max of kThreads threads; the result is valid in thread 0.
__device__ void block_minmax(float& mn, float& mx) {
  __shared__ float s_mn[kThreads / 32], s_mx[kThreads / 32];
  warp_minmax(mn, mx);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_mn[warp] = mn;
    s_mx[warp] = mx;
  }
  __syncthreads();
  if (warp == 0) {
    mn = lane < kThreads / 32 ? s_mn[lane] : INFINITY;
    mx = lane < kThreads / 32 ? s_mx[lane] : -INFINITY;
    warp_minmax(mn, mx);
  }
}

// Per-tensor / per-head, pass 1: partial min/max of a slice of head blockIdx.y's
// quantized part. partials: [heads, gridDim.x, 2].
__global__ void head_partial_minmax_kernel(const void* x, DevPlan p, float* partials) {
  const std::int64_t h = blockIdx.y, n = p.quant_tokens * p.head_dim;
  const std::int64_t base = h * p.tokens * p.head_dim;  // quantized tokens are the first Tq of the head
  float mn = INFINITY, mx = -INFINITY;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = load_element(x, p.dtype, static_cast<std::size_t>(base + e));
    mn = min_f(mn, v);
    mx = max_f(mx, v);
  }
  block_minmax(mn, mx);
  if (threadIdx.x == 0) {
    float* out = partials + (h * gridDim.x + blockIdx.x) * 2;
    out[0] = mn;
    out[1] = mx;
  }
}

// Per-tensor / per-head, pass 2: group blockIdx.x reduces `per_group` consecutive
// partials (0: the group is empty and gets scale 0, zero 0).
__global__ void head_params_kernel(const float* partials, std::int64_t per_group, DevPlan p, float* scales,
                                   float* zeros) {
  float mn = INFINITY, mx = -INFINITY;
  for (std::int64_t k = threadIdx.x; k < per_group; k += blockDim.x) {
    const float* q = partials + (blockIdx.x * per_group + k) * 2;
    mn = min_f(mn, q[0]);
    mx = max_f(mx, q[1]);
  }
  block_minmax(mn, mx);
  if (threadIdx.x == 0) {
    if (per_group == 0) mn = mx = 0.0f;
    float s, z;
    quant_math::group_params(mn, mx, p.bits, p.symmetric, &s, &z);
    scales[blockIdx.x] = s;
    if (zeros != nullptr) zeros[blockIdx.x] = z;
  }
}

// Per-token groups: one warp per (row, channel group).
__global__ void token_params_kernel(const void* x, DevPlan p, float* scales, float* zeros) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const std::int64_t n = p.heads * p.quant_tokens * p.groups_per_row;
  const int lane = threadIdx.x % 32;
  for (std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w < n;
       w += warps) {
    const std::int64_t row = w / p.groups_per_row, g = w % p.groups_per_row;
    const std::int64_t h = row / p.quant_tokens, t = row % p.quant_tokens;
    const std::int64_t i0 = g * p.group_size, i1 = min(p.head_dim, i0 + p.group_size);
    float mn = INFINITY, mx = -INFINITY;
    for (std::int64_t i = i0 + lane; i < i1; i += 32) {
      const float v = load_element(x, p.dtype, static_cast<std::size_t>(p.element(h, t, i)));
      mn = min_f(mn, v);
      mx = max_f(mx, v);
    }
    warp_minmax(mn, mx);
    if (lane == 0) {
      float s, z;
      quant_math::group_params(mn, mx, p.bits, p.symmetric, &s, &z);
      scales[w] = s;
      if (zeros != nullptr) zeros[w] = z;
    }
  }
}

// Per-channel groups: block (32 channels, 8 token lanes); grid (channel blocks, token groups
// (strided when more than gridDim.y), heads).
constexpr int kChannelLanes = 8;
__global__ void channel_params_kernel(const void* x, DevPlan p, float* scales, float* zeros) {
  __shared__ float s_mn[kChannelLanes][32], s_mx[kChannelLanes][32];
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const std::int64_t h = blockIdx.z;
  for (std::int64_t g = blockIdx.y; g < p.groups_per_row; g += gridDim.y) {  // uniform across the block
    const std::int64_t t0 = g * p.group_size, t1 = min(p.quant_tokens, t0 + p.group_size);
    float mn = INFINITY, mx = -INFINITY;
    if (i < p.head_dim) {
      for (std::int64_t t = t0 + threadIdx.y; t < t1; t += kChannelLanes) {
        const float v = load_element(x, p.dtype, static_cast<std::size_t>(p.element(h, t, i)));
        mn = min_f(mn, v);
        mx = max_f(mx, v);
      }
    }
    s_mn[threadIdx.y][threadIdx.x] = mn;
    s_mx[threadIdx.y][threadIdx.x] = mx;
    __syncthreads();
    if (threadIdx.y == 0 && i < p.head_dim) {
      for (int k = 1; k < kChannelLanes; ++k) {
        mn = min_f(mn, s_mn[k][threadIdx.x]);
        mx = max_f(mx, s_mx[k][threadIdx.x]);
      }
      float s, z;
      quant_math::group_params(mn, mx, p.bits, p.symmetric, &s, &z);
      const std::int64_t idx = (h * p.groups_per_row + g) * p.head_dim + i;
      scales[idx] = s;
      if (zeros != nullptr) zeros[idx] = z;
    }
    __syncthreads();  // s_mn/s_mx are rewritten by the next group
  }
}

// Writes scales (and zeros when non-null) for every group; may allocate stream-ordered scratch.
Status compute_params(const void* x, const DevPlan& p, const QuantLayout& l, float* scales, float* zeros,
                      cudaStream_t stream) {
  switch (p.granularity) {
    case Granularity::kPerTensor:
    case Granularity::kPerHead: {
      const std::int64_t per_head = p.quant_tokens * p.head_dim;
      const int slices = static_cast<int>(std::clamp<std::int64_t>(per_head / (kThreads * 16), 1, 256));
      const std::int64_t groups = p.granularity == Granularity::kPerTensor ? 1 : p.heads;
      const std::int64_t per_group = per_head == 0 ? 0 : p.heads * slices / groups;
      float* partials = nullptr;
      if (per_head > 0) {
        KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&partials),
                                         static_cast<std::size_t>(p.heads * slices * 2) * sizeof(float),
                                         stream));
        head_partial_minmax_kernel<<<dim3(slices, static_cast<unsigned>(p.heads)), kThreads, 0, stream>>>(
            x, p, partials);
        KVSCOPE_CUDA_CHECK_LAUNCH("head_partial_minmax_kernel");
      }
      head_params_kernel<<<static_cast<unsigned>(groups), kThreads, 0, stream>>>(partials, per_group, p,
                                                                                 scales, zeros);
      const cudaError_t launch = cudaPeekAtLastError();
      if (partials != nullptr) KVSCOPE_CUDA_TRY(cudaFreeAsync(partials, stream));
      KVSCOPE_CUDA_TRY(launch);
      break;
    }
    case Granularity::kPerToken: {
      if (l.num_groups == 0) break;
      token_params_kernel<<<blocks_for(l.num_groups * 32), kThreads, 0, stream>>>(x, p, scales, zeros);
      KVSCOPE_CUDA_CHECK_LAUNCH("token_params_kernel");
      break;
    }
    case Granularity::kPerChannel: {
      if (l.num_groups == 0) break;
      const dim3 grid(static_cast<unsigned>((p.head_dim + 31) / 32),
                      static_cast<unsigned>(std::min<std::int64_t>(p.groups_per_row, 65535)),
                      static_cast<unsigned>(p.heads));
      channel_params_kernel<<<grid, dim3(32, kChannelLanes), 0, stream>>>(x, p, scales, zeros);
      KVSCOPE_CUDA_CHECK_LAUNCH("channel_params_kernel");
      break;
    }
  }
  return Status::Ok();
}

__device__ int encode_element(const void* x, const DevPlan& p, const float* scales, const float* zeros,
                              std::int64_t h, std::int64_t t, std::int64_t i) {
  const float v = load_element(x, p.dtype, static_cast<std::size_t>(p.element(h, t, i)));
  const std::int64_t g = p.group_of(h, t, i);
  return quant_math::encode(v, scales[g], zeros != nullptr ? zeros[g] : 0.0f, p.lo, p.hi);
}

// One thread per packed code byte of [heads, Tq, row_bytes].
__global__ void encode_kernel(const void* x, DevPlan p, const float* scales, const float* zeros,
                              std::uint8_t* codes) {
  const std::int64_t n = p.heads * p.quant_tokens * p.row_bytes;
  const int per = 8 / p.bits;
  for (std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < n;
       b += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = b / p.row_bytes, j = b % p.row_bytes;
    const std::int64_t h = row / p.quant_tokens, t = row % p.quant_tokens;
    unsigned byte = 0;
    for (int k = 0; k < per; ++k) {
      const std::int64_t i = j * per + k;
      if (i < p.head_dim)
        byte |= quant_math::to_field(encode_element(x, p, scales, zeros, h, t, i), p.bits) << (k * p.bits);
    }
    codes[b] = static_cast<std::uint8_t>(byte);
  }
}

// One thread per element of the quantized part: out[h, t, i] = decode(code).
__global__ void decode_kernel(const std::uint8_t* codes, DevPlan p, const float* scales, const float* zeros,
                              float* out) {
  const std::int64_t n = p.heads * p.quant_tokens * p.head_dim;
  const int per = 8 / p.bits;
  const unsigned mask = (1u << p.bits) - 1u;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.head_dim, i = e % p.head_dim;
    const std::int64_t h = row / p.quant_tokens, t = row % p.quant_tokens;
    const unsigned field =
        (static_cast<unsigned>(codes[row * p.row_bytes + i / per]) >> ((i % per) * p.bits)) & mask;
    const std::int64_t g = p.group_of(h, t, i);
    out[p.element(h, t, i)] = quant_math::decode(quant_math::from_field(field, p.bits, p.symmetric),
                                                 scales[g], zeros != nullptr ? zeros[g] : 0.0f);
  }
}

// One thread per element of the quantized part: out = decode(encode(x)).
__global__ void fake_quant_kernel(const void* x, DevPlan p, const float* scales, const float* zeros,
                                  float* out) {
  const std::int64_t n = p.heads * p.quant_tokens * p.head_dim;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.head_dim, i = e % p.head_dim;
    const std::int64_t h = row / p.quant_tokens, t = row % p.quant_tokens;
    const std::int64_t g = p.group_of(h, t, i);
    const float z = zeros != nullptr ? zeros[g] : 0.0f;
    out[p.element(h, t, i)] = quant_math::decode(encode_element(x, p, scales, zeros, h, t, i), scales[g], z);
  }
}

// Residual tokens to float: out[h, Tq + t, i] = src[h, first + t, i] (src has src_tokens tokens per head).
__global__ void residual_to_float_kernel(const void* src, std::int64_t src_tokens, std::int64_t src_first,
                                         DevPlan p, float* out) {
  const std::int64_t r = p.tokens - p.quant_tokens, n = p.heads * r * p.head_dim;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.head_dim, i = e % p.head_dim;
    const std::int64_t h = row / r, t = row % r;
    const std::int64_t s = (h * src_tokens + src_first + t) * p.head_dim + i;
    out[p.element(h, p.quant_tokens + t, i)] = load_element(src, p.dtype, static_cast<std::size_t>(s));
  }
}

Status launch_residual_to_float(const void* src, std::int64_t src_tokens, std::int64_t src_first,
                                const DevPlan& p, float* out, cudaStream_t stream) {
  const std::int64_t n = p.heads * (p.tokens - p.quant_tokens) * p.head_dim;
  if (n == 0) return Status::Ok();
  residual_to_float_kernel<<<blocks_for(n), kThreads, 0, stream>>>(src, src_tokens, src_first, p, out);
  KVSCOPE_CUDA_CHECK_LAUNCH("residual_to_float_kernel");
  return Status::Ok();
}

Status layout_for(const char* fn, const QuantSpec& spec, const QuantShape& shape, QuantLayout* l) {
  const Status s = quant_layout(spec, shape, l);
  if (!s.ok()) return Status::Invalid(std::string("cuda::") + fn + ": " + s.message());
  if (shape.num_heads > 65535) {  // heads index a grid dimension
    return Status::Invalid(std::string("cuda::") + fn + ": num_heads " + std::to_string(shape.num_heads) +
                           " > 65535");
  }
  return Status::Ok();
}

}  // namespace

Status quantize(const QuantSpec& spec, const QuantShape& shape, const void* x, const QuantBuffers& out,
                cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::quantize", kQuantize);
  QuantLayout l;
  KVSCOPE_RETURN_IF_ERROR(layout_for("quantize", spec, shape, &l));
  if (x == nullptr) return Status::Invalid("cuda::quantize: x is null");
  if (out.codes == nullptr && l.code_bytes > 0) return Status::Invalid("cuda::quantize: out.codes is null");
  if (out.scales == nullptr && l.num_groups > 0) return Status::Invalid("cuda::quantize: out.scales is null");
  if (out.zeros == nullptr && l.zero_bytes > 0) {
    return Status::Invalid("cuda::quantize: out.zeros is null (asymmetric)");
  }
  if (out.residual == nullptr && l.residual_bytes > 0) {
    return Status::Invalid("cuda::quantize: out.residual is null (residual_tokens > 0)");
  }
  const DevPlan p = make_dev_plan(spec, shape, l);
  float* zeros = spec.symmetric ? nullptr : out.zeros;
  KVSCOPE_RETURN_IF_ERROR(compute_params(x, p, l, out.scales, zeros, stream));
  if (l.code_bytes > 0) {
    encode_kernel<<<blocks_for(l.code_bytes), kThreads, 0, stream>>>(x, p, out.scales, zeros, out.codes);
    KVSCOPE_CUDA_CHECK_LAUNCH("encode_kernel");
  }
  if (l.residual_bytes > 0) {
    const std::size_t esz = dtype_bytes(shape.dtype);
    const std::size_t width = static_cast<std::size_t>(l.residual_tokens * shape.head_dim) * esz;
    const std::size_t pitch = static_cast<std::size_t>(shape.tokens) * shape.head_dim * esz;
    const char* src =
        static_cast<const char*>(x) + static_cast<std::size_t>(l.quant_tokens * shape.head_dim) * esz;
    KVSCOPE_CUDA_TRY(cudaMemcpy2DAsync(out.residual, width, src, pitch, width,
                                       static_cast<std::size_t>(shape.num_heads), cudaMemcpyDeviceToDevice,
                                       stream));
  }
  return Status::Ok();
}

Status dequantize(const QuantSpec& spec, const QuantShape& shape, const QuantConstBuffers& in, float* out,
                  cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::dequantize", kQuantize);
  QuantLayout l;
  KVSCOPE_RETURN_IF_ERROR(layout_for("dequantize", spec, shape, &l));
  if (out == nullptr) return Status::Invalid("cuda::dequantize: out is null");
  if (in.codes == nullptr && l.code_bytes > 0) return Status::Invalid("cuda::dequantize: in.codes is null");
  if (in.scales == nullptr && l.num_groups > 0) return Status::Invalid("cuda::dequantize: in.scales is null");
  if (in.zeros == nullptr && l.zero_bytes > 0)
    return Status::Invalid("cuda::dequantize: in.zeros is null (asymmetric)");
  if (in.residual == nullptr && l.residual_bytes > 0)
    return Status::Invalid("cuda::dequantize: in.residual is null");
  const DevPlan p = make_dev_plan(spec, shape, l);
  const std::int64_t n = shape.num_heads * l.quant_tokens * shape.head_dim;
  if (n > 0) {
    decode_kernel<<<blocks_for(n), kThreads, 0, stream>>>(in.codes, p, in.scales,
                                                          spec.symmetric ? nullptr : in.zeros, out);
    KVSCOPE_CUDA_CHECK_LAUNCH("decode_kernel");
  }
  return launch_residual_to_float(in.residual, l.residual_tokens, 0, p, out, stream);
}

Status quantize_dequantize(const QuantSpec& spec, const QuantShape& shape, const void* x, float* out,
                           cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::quantize_dequantize", kQuantize);
  QuantLayout l;
  KVSCOPE_RETURN_IF_ERROR(layout_for("quantize_dequantize", spec, shape, &l));
  if (x == nullptr) return Status::Invalid("cuda::quantize_dequantize: x is null");
  if (out == nullptr) return Status::Invalid("cuda::quantize_dequantize: out is null");
  if (static_cast<const void*>(out) == x) return Status::Invalid("cuda::quantize_dequantize: out aliases x");
  const DevPlan p = make_dev_plan(spec, shape, l);
  // scales [num_groups] then zeros [num_groups] (asymmetric) in one scratch allocation.
  float* scratch = nullptr;
  const std::size_t count = static_cast<std::size_t>(l.num_groups) * (spec.symmetric ? 1 : 2);
  if (count > 0)
    KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&scratch), count * sizeof(float), stream));
  float* scales = scratch;
  float* zeros = spec.symmetric || scratch == nullptr ? nullptr : scratch + l.num_groups;
  const std::int64_t n = shape.num_heads * l.quant_tokens * shape.head_dim;
  const auto fake_quant = [&]() -> Status {
    KVSCOPE_RETURN_IF_ERROR(compute_params(x, p, l, scales, zeros, stream));
    if (n == 0) return Status::Ok();
    fake_quant_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, p, scales, zeros, out);
    KVSCOPE_CUDA_CHECK_LAUNCH("fake_quant_kernel");
    return Status::Ok();
  };
  const Status st = fake_quant();
  if (scratch != nullptr) KVSCOPE_CUDA_TRY(cudaFreeAsync(scratch, stream));
  KVSCOPE_RETURN_IF_ERROR(st);
  return launch_residual_to_float(x, shape.tokens, l.quant_tokens, p, out, stream);
}

}  // namespace kvscope::kernels::cuda
