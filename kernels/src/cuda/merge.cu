// CUDA backend of token merging (kvscope/kernels/merge.hpp). Same math as
// src/cpu/merge.cpp: per-token norms, windowed best-cosine assignment (ties to the
// lower slot), then one block per slot that averages its members in increasing
// token order and restores the weighted mean norm.
#include <cstdint>
#include <string>

#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/merge_cuda.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kSlotThreads = 128;

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Flags a kept list that is out of [0, T) or not strictly increasing.
__global__ void validate_kept_kernel(const std::int32_t* kept, int lists, int K, int T, int* bad) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(lists) * K) return;
  const int s = static_cast<int>(i % K);
  const std::int32_t x = kept[i];
  if (x < 0 || x >= T || (s > 0 && x <= kept[i - 1])) atomicExch(bad, 1);
}

// One warp per (head, token): L2 norms of the key and value rows.
__global__ void row_norms_kernel(const void* k, const void* v, DType dt, long long rows, int D,
                                 float* key_norm, float* val_norm) {
  const long long row = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= rows) return;
  float sk = 0.0f, sv = 0.0f;
  for (int d = lane; d < D; d += kWarp) {
    const float a = load_element(k, dt, row * D + d), b = load_element(v, dt, row * D + d);
    sk += a * a;
    sv += b * b;
  }
  sk = warp_sum(sk);
  sv = warp_sum(sv);
  if (lane == 0) {
    key_norm[row] = sqrtf(sk);
    val_norm[row] = sqrtf(sv);
  }
}

// token_to_slot = -2 (not kept, to be assigned), then kept tokens get their slot.
__global__ void init_map_kernel(std::int32_t* map, long long n) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) map[i] = -2;
}
__global__ void scatter_kept_kernel(const std::int32_t* kept, bool shared, int H, int K, int T,
                                    std::int32_t* map) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(H) * K) return;
  const int h = static_cast<int>(i / K), s = static_cast<int>(i % K);
  map[static_cast<long long>(h) * T + kept[shared ? s : i]] = s;
}

// One warp per (head, evicted token): best cosine among kept tokens within the window.
__global__ void assign_kernel(MergeParams p, const void* k, const std::int32_t* kept, const float* key_norm,
                              std::int32_t* map) {
  const long long row = (blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int T = p.num_tokens, D = p.head_dim, K = p.num_kept;
  if (row >= static_cast<long long>(p.num_heads) * T) return;
  if (map[row] != -2) return;
  const int h = static_cast<int>(row / T), t = static_cast<int>(row % T);
  const std::int32_t* kh = kept + (p.shared_kept ? 0 : static_cast<long long>(h) * K);
  const long long lo_pos = static_cast<long long>(t) - p.window,
                  hi_pos = static_cast<long long>(t) + p.window;
  int lo = 0, hi = K;  // first s with kh[s] >= lo_pos
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (kh[mid] < lo_pos)
      lo = mid + 1;
    else
      hi = mid;
  }
  const long long head_row0 = static_cast<long long>(h) * T;
  int best_slot = -1;
  float best = 0.0f;
  for (int s = lo; s < K && kh[s] <= hi_pos; ++s) {
    const int u = kh[s];
    float dot = 0.0f;
    for (int d = lane; d < D; d += kWarp) {
      dot += load_element(k, p.dtype, row * D + d) * load_element(k, p.dtype, (head_row0 + u) * D + d);
    }
    dot = warp_sum(dot);
    const float denom = key_norm[row] * key_norm[head_row0 + u];
    float sim = denom > 0.0f ? dot / denom : 0.0f;
    sim = fminf(1.0f, fmaxf(-1.0f, sim));
    if (best_slot < 0 || sim > best) {
      best = sim;
      best_slot = s;
    }
  }
  if (lane == 0) map[row] = (best_slot >= 0 && best > p.threshold) ? best_slot : -1;
}

__device__ float block_sum(float x, float* red) {
  x = warp_sum(x);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) total += red[w];
  return total;
}

// One block per (head, slot). Members are the tokens t in [kept - w, kept + w] with
// map[t] == slot, visited in increasing t in chunks of kSlotThreads tokens (compacted
// with warp ballots so every thread sees them in the same order). Each thread owns
// dims d = threadIdx.x + i * kSlotThreads and keeps weighted and unweighted sums, so
// the zero-weight uniform fallback needs no second pass.
__global__ void __launch_bounds__(kSlotThreads)
    merge_slots_kernel(MergeParams p, const void* k, const void* v, const std::int32_t* kept,
                       const float* importance, const float* key_norm, const float* val_norm,
                       const std::int32_t* map, float* k_out, float* v_out, std::int32_t* multiplicity,
                       float* acc /* [H*K, 4, D] scratch */) {
  __shared__ std::int32_t members[kSlotThreads];
  __shared__ int warp_counts[kSlotThreads / kWarp];
  __shared__ float red[kSlotThreads / kWarp];
  const int T = p.num_tokens, D = p.head_dim, K = p.num_kept;
  const int h = blockIdx.x / K, s = blockIdx.x % K;
  const std::int32_t* kh = kept + (p.shared_kept ? 0 : static_cast<long long>(h) * K);
  const long long head_row0 = static_cast<long long>(h) * T;
  const int center = kh[s];
  const int first = max(0, static_cast<int>(max(static_cast<long long>(center) - p.window, 0LL)));
  const int last =
      static_cast<int>(min(static_cast<long long>(center) + p.window, static_cast<long long>(T - 1)));
  float* ak = acc + static_cast<long long>(blockIdx.x) * 4 * D;  // weighted k, v; unweighted k, v
  for (int d = threadIdx.x; d < D; d += kSlotThreads) {
    ak[d] = 0.0f;
    ak[D + d] = 0.0f;
    ak[2 * D + d] = 0.0f;
    ak[3 * D + d] = 0.0f;
  }
  float wsum = 0.0f, knorm_w = 0.0f, vnorm_w = 0.0f, knorm_1 = 0.0f, vnorm_1 = 0.0f;
  int count = 0;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int c0 = first; c0 <= last; c0 += kSlotThreads) {
    const int t = c0 + threadIdx.x;
    const bool mine = t <= last && map[head_row0 + t] == s;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    __syncthreads();
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, n = 0;
    for (int w = 0; w < kSlotThreads / kWarp; ++w) {
      if (w < warp) offset += warp_counts[w];
      n += warp_counts[w];
    }
    if (mine) members[offset + __popc(ballot & ((1u << lane) - 1u))] = t;
    __syncthreads();
    for (int i = 0; i < n; ++i) {  // every thread walks the members in the same order
      const long long row = head_row0 + members[i];
      const float imp = importance ? importance[row] : 1.0f;
      const float w = imp > 0.0f ? imp : 0.0f;
      wsum += w;
      knorm_w += w * key_norm[row];
      vnorm_w += w * val_norm[row];
      knorm_1 += key_norm[row];
      vnorm_1 += val_norm[row];
      for (int d = threadIdx.x; d < D; d += kSlotThreads) {
        const float xk = load_element(k, p.dtype, row * D + d), xv = load_element(v, p.dtype, row * D + d);
        ak[d] += w * xk;
        ak[D + d] += w * xv;
        ak[2 * D + d] += xk;
        ak[3 * D + d] += xv;
      }
    }
    count += n;
  }
  const long long out_row = static_cast<long long>(h) * K + s;
  if (threadIdx.x == 0) multiplicity[out_row] = count;
  if (count == 1) {  // singleton: exact copy of the kept token
    for (int d = threadIdx.x; d < D; d += kSlotThreads) {
      k_out[out_row * D + d] = load_element(k, p.dtype, (head_row0 + center) * D + d);
      v_out[out_row * D + d] = load_element(v, p.dtype, (head_row0 + center) * D + d);
    }
    return;
  }
  const bool uniform = !(wsum > 0.0f);
  const float W = uniform ? static_cast<float>(count) : wsum;
  const float* src_k = uniform ? ak + 2 * D : ak;
  const float* src_v = uniform ? ak + 3 * D : ak + D;
  const float target_k = (uniform ? knorm_1 : knorm_w) / W, target_v = (uniform ? vnorm_1 : vnorm_w) / W;
  float sq_k = 0.0f, sq_v = 0.0f;
  for (int d = threadIdx.x; d < D; d += kSlotThreads) {
    const float a = src_k[d] / W, b = src_v[d] / W;
    sq_k += a * a;
    sq_v += b * b;
  }
  const float nk = sqrtf(block_sum(sq_k, red));
  const float nv = sqrtf(block_sum(sq_v, red));
  const float scale_k = nk > 0.0f ? target_k / nk : 1.0f, scale_v = nv > 0.0f ? target_v / nv : 1.0f;
  for (int d = threadIdx.x; d < D; d += kSlotThreads) {
    k_out[out_row * D + d] = (src_k[d] / W) * scale_k;
    v_out[out_row * D + d] = (src_v[d] / W) * scale_v;
  }
}

unsigned grid_for(long long n, int block) { return static_cast<unsigned>((n + block - 1) / block); }

}  // namespace

Status merge_tokens(const MergeParams& p, const void* k, const void* v, const std::int32_t* kept,
                    const float* importance, float* k_out, float* v_out, std::int32_t* multiplicity,
                    std::int32_t* token_to_slot, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::merge_tokens", kMerge);
  const std::string f = "merge_tokens: ";
  if (p.num_heads <= 0 || p.num_tokens <= 0 || p.head_dim <= 0) {
    return Status::Invalid(f + "num_heads, num_tokens and head_dim must be > 0");
  }
  if (p.num_kept <= 0 || p.num_kept > p.num_tokens) {
    return Status::Invalid(f + "num_kept " + std::to_string(p.num_kept) + " must be in [1, num_tokens]");
  }
  if (p.window < 0) return Status::Invalid(f + "window " + std::to_string(p.window) + " must be >= 0");
  if (p.threshold != p.threshold) return Status::Invalid(f + "threshold is NaN");
  if (!k || !v || !kept || !k_out || !v_out || !multiplicity || !token_to_slot) {
    return Status::Invalid(f + "k, v, kept, k_out, v_out, multiplicity and token_to_slot must not be null");
  }
  const int H = p.num_heads, T = p.num_tokens, D = p.head_dim, K = p.num_kept;
  const long long rows = static_cast<long long>(H) * T;
  const int lists = p.shared_kept ? 1 : H;

  void* ws = nullptr;
  // Workspace: [flag, padded to 256 B] [key norms: rows] [value norms: rows] [slot sums: H*K*4*D].
  const std::size_t ws_bytes = 256 + (2 * rows + 4ll * H * K * D) * sizeof(float);
  KVSCOPE_CUDA_TRY(cudaMallocAsync(&ws, ws_bytes, stream));
  int* bad = static_cast<int*>(ws);
  auto run = [&]() -> Status {
    float* base = reinterpret_cast<float*>(static_cast<char*>(ws) + 256);
    float* kn = base;
    float* vn = base + rows;
    float* acc = base + 2 * rows;
    KVSCOPE_CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof(int), stream));
    validate_kept_kernel<<<grid_for(static_cast<long long>(lists) * K, 256), 256, 0, stream>>>(kept, lists, K,
                                                                                               T, bad);
    KVSCOPE_CUDA_CHECK_LAUNCH("validate_kept_kernel");
    int host_bad = 0;
    KVSCOPE_CUDA_TRY(cudaMemcpyAsync(&host_bad, bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
    KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
    if (host_bad) return Status::Invalid(f + "kept indices out of [0, T) or not strictly increasing");
    row_norms_kernel<<<grid_for(rows * kWarp, 256), 256, 0, stream>>>(k, v, p.dtype, rows, D, kn, vn);
    KVSCOPE_CUDA_CHECK_LAUNCH("row_norms_kernel");
    init_map_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(token_to_slot, rows);
    KVSCOPE_CUDA_CHECK_LAUNCH("init_map_kernel");
    scatter_kept_kernel<<<grid_for(static_cast<long long>(H) * K, 256), 256, 0, stream>>>(
        kept, p.shared_kept, H, K, T, token_to_slot);
    KVSCOPE_CUDA_CHECK_LAUNCH("scatter_kept_kernel");
    assign_kernel<<<grid_for(rows * kWarp, 256), 256, 0, stream>>>(p, k, kept, kn, token_to_slot);
    KVSCOPE_CUDA_CHECK_LAUNCH("assign_kernel");
    merge_slots_kernel<<<static_cast<unsigned>(H * K), kSlotThreads, 0, stream>>>(
        p, k, v, kept, importance, kn, vn, token_to_slot, k_out, v_out, multiplicity, acc);
    KVSCOPE_CUDA_CHECK_LAUNCH("merge_slots_kernel");
    return Status::Ok();
  };
  const Status st = run();
  const cudaError_t free_err = cudaFreeAsync(ws, stream);
  if (!st.ok()) return st;
  return cuda_status(free_err, "cudaFreeAsync(merge workspace)");
}

}  // namespace kvscope::kernels::cuda
