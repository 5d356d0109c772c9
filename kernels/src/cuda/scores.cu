// CUDA backend of the token scores: a warp per (head, token) for norms and
// redundancy (lanes split head_dim), a block per head for the UniCache score.
#include <cuda_runtime.h>

#include <string>

#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/nvtx.hpp"
#include "kvscope/kernels/scores_cuda.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

Status validate_keys(const KeyTensor& k, const char* fn) {
  const std::string f(fn);
  if (k.k == nullptr) return Status::Invalid(f + ": k is null");
  if (k.num_heads <= 0 || k.num_tokens <= 0 || k.head_dim <= 0) {
    return Status::Invalid(f + ": sizes must be positive (num_heads " + std::to_string(k.num_heads) +
                           ", num_tokens " + std::to_string(k.num_tokens) + ", head_dim " +
                           std::to_string(k.head_dim) + ")");
  }
  if (k.dtype != DType::kF32 && k.dtype != DType::kF16 && k.dtype != DType::kBF16) {
    return Status::Invalid(f + ": unknown dtype");
  }
  return Status::Ok();
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// k[h, a] . k[h, b] (all lanes get the sum).
__device__ __forceinline__ float key_dot(const KeyTensor& k, int h, int a, int b, int lane) {
  const std::size_t ba = (static_cast<std::size_t>(h) * k.num_tokens + a) * k.head_dim;
  const std::size_t bb = (static_cast<std::size_t>(h) * k.num_tokens + b) * k.head_dim;
  float acc = 0.0f;
  for (int d = lane; d < k.head_dim; d += 32) {
    acc += load_element(k.k, k.dtype, ba + d) * load_element(k.k, k.dtype, bb + d);
  }
  return warp_sum(acc);
}

unsigned warp_blocks(std::size_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

// Warp w of the grid handles row (h, t) = w.
__global__ void key_norms_kernel(KeyTensor k, float* out) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(k.num_heads) * k.num_tokens) return;
  const int h = static_cast<int>(row / k.num_tokens), t = static_cast<int>(row % k.num_tokens);
  const float ss = key_dot(k, h, t, t, static_cast<int>(threadIdx.x % 32));
  if (threadIdx.x % 32 == 0) out[row] = sqrtf(ss);
}

__global__ void redundancy_kernel(KeyTensor k, NeighbourLists nb, const float* norms, float* out) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= static_cast<std::size_t>(k.num_heads) * k.num_tokens) return;
  const int h = static_cast<int>(row / k.num_tokens), t = static_cast<int>(row % k.num_tokens);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const float* hn = norms + static_cast<std::size_t>(h) * k.num_tokens;
  float best = 0.0f;
  bool any = false;
  for (std::int32_t n = nb.offsets[t]; n < nb.offsets[t + 1]; ++n) {
    const int u = nb.indices[n];
    const float c = detail::cosine_from(key_dot(k, h, t, u, lane), hn[t], hn[u]);
    best = any ? fmaxf(best, c) : c;
    any = true;
  }
  if (lane == 0) out[row] = best;
}

__device__ __forceinline__ int modality_code(std::uint8_t m) {
  return m < kNumModalities ? m : kNumModalities - 1;
}

// One block per head: per-modality extremes of a and c, then the score.
__global__ void unicache_score_kernel(UniCacheInputs in, UniCacheParams p, float* out) {
  __shared__ float ext[kThreads][4][kNumModalities];  // a_lo, a_hi, c_lo, c_hi per thread
  const int h = static_cast<int>(blockIdx.x), T = in.num_tokens;
  const std::size_t base = static_cast<std::size_t>(h) * T;
  const float* a = in.attention + base;
  const float* c = in.cross != nullptr ? in.cross + base : nullptr;
  const float* d = in.redundancy != nullptr ? in.redundancy + base : nullptr;
  float lo_a[kNumModalities], hi_a[kNumModalities], lo_c[kNumModalities], hi_c[kNumModalities];
  for (int m = 0; m < kNumModalities; ++m) lo_a[m] = lo_c[m] = INFINITY, hi_a[m] = hi_c[m] = -INFINITY;
  for (int t = threadIdx.x; t < T; t += kThreads) {
    const int m = modality_code(in.modality[t]);
    lo_a[m] = fminf(lo_a[m], a[t]);
    hi_a[m] = fmaxf(hi_a[m], a[t]);
    if (c != nullptr) lo_c[m] = fminf(lo_c[m], c[t]), hi_c[m] = fmaxf(hi_c[m], c[t]);
  }
  for (int m = 0; m < kNumModalities; ++m) {
    ext[threadIdx.x][0][m] = lo_a[m], ext[threadIdx.x][1][m] = hi_a[m];
    ext[threadIdx.x][2][m] = lo_c[m], ext[threadIdx.x][3][m] = hi_c[m];
  }
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) {
      for (int m = 0; m < kNumModalities; ++m) {
        float(*me)[kNumModalities] = ext[threadIdx.x];
        float(*other)[kNumModalities] = ext[threadIdx.x + stride];
        me[0][m] = fminf(me[0][m], other[0][m]), me[1][m] = fmaxf(me[1][m], other[1][m]);
        me[2][m] = fminf(me[2][m], other[2][m]), me[3][m] = fmaxf(me[3][m], other[3][m]);
      }
    }
    __syncthreads();
  }
  for (int t = threadIdx.x; t < T; t += kThreads) {
    const int m = modality_code(in.modality[t]);
    const float an = detail::normalize_in_group(a[t], ext[0][0][m], ext[0][1][m], p.normalize);
    const float cn =
        c != nullptr ? detail::normalize_in_group(c[t], ext[0][2][m], ext[0][3][m], p.normalize) : 0.0f;
    const float dn = d != nullptr ? fminf(fmaxf(d[t], 0.0f), 1.0f) : 0.0f;
    float r;
    if (p.recency == RecencyKind::kLinear) {
      r = T > 1 ? static_cast<float>(t) / static_cast<float>(T - 1) : 1.0f;
    } else {
      r = expf(-static_cast<float>(T - 1 - t) / p.recency_tau);
    }
    // Explicit rounding: no fused multiply-add, as on the CPU.
    const float wa = __fmul_rn(p.w_a, an), wc = __fmul_rn(p.w_c, cn), wd = __fmul_rn(p.w_d, dn),
                wr = __fmul_rn(p.w_r, r);
    out[base + t] = __fadd_rn(__fsub_rn(__fadd_rn(wa, wc), wd), wr);
  }
}

}  // namespace

Status key_norms(const KeyTensor& k, float* out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::key_norms", kScores);
  KVSCOPE_RETURN_IF_ERROR(validate_keys(k, "key_norms"));
  if (out == nullptr) return Status::Invalid("key_norms: out is null");
  key_norms_kernel<<<warp_blocks(static_cast<std::size_t>(k.num_heads) * k.num_tokens), kThreads, 0,
                     stream>>>(k, out);
  KVSCOPE_CUDA_CHECK_LAUNCH("key_norms_kernel");
  return Status::Ok();
}

Status redundancy(const KeyTensor& k, const NeighbourLists& neighbours, float* out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::redundancy", kScores);
  KVSCOPE_RETURN_IF_ERROR(validate_keys(k, "redundancy"));
  if (out == nullptr) return Status::Invalid("redundancy: out is null");
  if (neighbours.offsets == nullptr || neighbours.indices == nullptr ||
      neighbours.num_tokens != k.num_tokens) {
    return Status::Invalid("redundancy: neighbour lists missing or built for " +
                           std::to_string(neighbours.num_tokens) + " tokens, keys have " +
                           std::to_string(k.num_tokens));
  }
  const std::size_t rows = static_cast<std::size_t>(k.num_heads) * k.num_tokens;
  float* norms = nullptr;
  KVSCOPE_CUDA_TRY(cudaMallocAsync(&norms, rows * sizeof(float), stream));
  const Status norms_status = key_norms(k, norms, stream);
  cudaError_t redundancy_kernel_launch = cudaSuccess;
  if (norms_status.ok()) {
    redundancy_kernel<<<warp_blocks(rows), kThreads, 0, stream>>>(k, neighbours, norms, out);
    redundancy_kernel_launch = cudaPeekAtLastError();
  }
  const cudaError_t free_norms = cudaFreeAsync(norms, stream);
  KVSCOPE_RETURN_IF_ERROR(norms_status);
  KVSCOPE_CUDA_TRY(redundancy_kernel_launch);
  KVSCOPE_CUDA_TRY(free_norms);
  return Status::Ok();
}

Status unicache_score(const UniCacheInputs& in, const UniCacheParams& params, float* out,
                      cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::unicache_score", kScores);
  if (in.attention == nullptr || in.modality == nullptr || out == nullptr) {
    return Status::Invalid("unicache_score: attention, modality and out must not be null");
  }
  if (in.num_heads <= 0 || in.num_tokens <= 0) {
    return Status::Invalid("unicache_score: num_heads " + std::to_string(in.num_heads) + " and num_tokens " +
                           std::to_string(in.num_tokens) + " must be positive");
  }
  if (params.recency == RecencyKind::kExponential && !(params.recency_tau > 0.0f)) {
    return Status::Invalid("unicache_score: recency_tau " + std::to_string(params.recency_tau) +
                           " must be > 0");
  }
  unicache_score_kernel<<<static_cast<unsigned>(in.num_heads), kThreads, 0, stream>>>(in, params, out);
  KVSCOPE_CUDA_CHECK_LAUNCH("unicache_score_kernel");
  return Status::Ok();
}

}  // namespace kvscope::kernels::cuda
