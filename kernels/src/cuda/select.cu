// CUDA backend of token selection. Every token gets the 64-bit rank key of
// select.hpp (score descending, index ascending); CUB's segmented radix sort
// orders each head; then one block per head walks the sorted order in chunks
// of 256 with block-wide prefix counts to apply the same three steps as the
// CPU backend (per-class quotas, forced overflow, leftover redistribution),
// and compacts the kept flags into sorted indices.
#include <cuda_runtime.h>

#include <cub/device/device_segmented_radix_sort.cuh>
#include <string>
#include <vector>

#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/nvtx.hpp"
#include "kvscope/kernels/select_cuda.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Kept-flag values in the per-head scratch row.
constexpr std::uint8_t kNotKept = 0, kForced = 1, kPicked = 2, kFilled = 3;

// Stream-ordered device allocations released when the launcher returns.
class ScratchSet {
 public:
  explicit ScratchSet(cudaStream_t s) : stream_(s) {}
  ~ScratchSet() {
    for (void* p : ptrs_) (void)cudaFreeAsync(p, stream_);
  }
  ScratchSet(const ScratchSet&) = delete;
  ScratchSet& operator=(const ScratchSet&) = delete;
  template <typename T>
  cudaError_t allocate(T** out, std::size_t count) {
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, count * sizeof(T) + 1, stream_);
    if (e == cudaSuccess) ptrs_.push_back(p);
    *out = static_cast<T*>(p);
    return e;
  }

 private:
  std::vector<void*> ptrs_;
  cudaStream_t stream_;
};

__global__ void rank_keys_kernel(const float* scores, int num_heads, int num_tokens, std::uint64_t* keys,
                                 int* offsets) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e <= static_cast<std::size_t>(num_heads)) {
    offsets[e] = static_cast<int>(e * num_tokens);
  }
  if (e >= static_cast<std::size_t>(num_heads) * num_tokens) return;
  keys[e] = detail::select_rank_key(scores[e], static_cast<std::int32_t>(e % num_tokens));
}

// Head mean in head order, times 1/H, exactly as the CPU backend.
__global__ void head_mean_kernel(const float* scores, int num_heads, int num_tokens, float inv, float* mean) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= num_tokens) return;
  float s = 0.0f;
  for (int h = 0; h < num_heads; ++h) s += scores[static_cast<std::size_t>(h) * num_tokens + t];
  mean[t] = s * inv;
}

// Block-wide exclusive prefix sum of one int per thread (blockDim.x == kThreads).
// `*total` gets the block sum. smem: [kWarps + 1].
__device__ int block_exclusive_sum(int v, int* total, int* smem) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  int x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) smem[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int s = smem[w];
      smem[w] = run;
      run += s;
    }
    smem[kWarps] = run;
  }
  __syncthreads();
  const int excl = smem[warp] + x - v;
  *total = smem[kWarps];
  __syncthreads();
  return excl;
}

// One block per head. sorted: [num_heads, T] rank keys in ascending order;
// flags: [num_heads, T] scratch (zeroed); out: [num_heads, k]; counts: [num_heads] or nullptr.
__global__ void select_from_sorted_kernel(const std::uint64_t* sorted, int T, SelectParams p,
                                          std::uint8_t* flags, std::int32_t* out, std::int32_t* counts) {
  __shared__ int smem[kWarps + 1];
  __shared__ int forced_in[kNumModalities];
  const int h = static_cast<int>(blockIdx.x);
  const std::uint64_t* order = sorted + static_cast<std::size_t>(h) * T;
  std::uint8_t* flag = flags + static_cast<std::size_t>(h) * T;
  const int nclass = p.use_modality_budgets ? kNumModalities : 1;
  auto class_of = [&](int t) {
    if (!p.use_modality_budgets) return 0;
    const int m = p.modality[t];
    return m < kNumModalities ? m : kNumModalities - 1;
  };
  if (threadIdx.x < kNumModalities) forced_in[threadIdx.x] = 0;
  __syncthreads();
  for (int t = threadIdx.x; t < T; t += kThreads) {
    if (detail::select_forced(p, T, t)) {
      flag[t] = kForced;
      atomicAdd(&forced_in[class_of(t)], 1);
    }
  }
  __syncthreads();
  int forced = 0;
  for (int c = 0; c < nclass; ++c) forced += forced_in[c];

  // 1) per class: the first (quota - forced_in) non-forced tokens in rank order.
  int picks = 0;
  for (int c = 0; c < nclass; ++c) {
    const int quota = max(0, (p.use_modality_budgets ? p.modality_budget[c] : p.k) - forced_in[c]);
    int carry = 0;
    for (int base = 0; base < T; base += kThreads) {
      const int idx = base + static_cast<int>(threadIdx.x);
      const int t = idx < T ? static_cast<int>(static_cast<std::uint32_t>(order[idx])) : -1;
      const int cand = (t >= 0 && flag[t] == kNotKept && class_of(t) == c) ? 1 : 0;
      int total = 0;
      const int before = block_exclusive_sum(cand, &total, smem);
      if (cand && carry + before < quota) flag[t] = kPicked;
      carry += total;
    }
    picks += min(quota, carry);
    __syncthreads();
  }
  // 2) forced tokens beyond their class budget: keep only the best k - forced picks.
  if (forced + picks > p.k) {
    int carry = 0;
    for (int base = 0; base < T; base += kThreads) {
      const int idx = base + static_cast<int>(threadIdx.x);
      const int t = idx < T ? static_cast<int>(static_cast<std::uint32_t>(order[idx])) : -1;
      const int picked = (t >= 0 && flag[t] == kPicked) ? 1 : 0;
      int total = 0;
      const int before = block_exclusive_sum(picked, &total, smem);
      if (picked && carry + before >= p.k - forced) flag[t] = kNotKept;
      carry += total;
    }
    picks = p.k - forced;
    __syncthreads();
  }
  // 3) leftover budget to the best remaining tokens of any class.
  const int count = forced + picks;
  if (count < p.k && p.redistribute_leftover) {
    int carry = 0;
    for (int base = 0; base < T; base += kThreads) {
      const int idx = base + static_cast<int>(threadIdx.x);
      const int t = idx < T ? static_cast<int>(static_cast<std::uint32_t>(order[idx])) : -1;
      const int free_slot = (t >= 0 && flag[t] == kNotKept) ? 1 : 0;
      int total = 0;
      const int before = block_exclusive_sum(free_slot, &total, smem);
      if (free_slot && carry + before < p.k - count) flag[t] = kFilled;
      carry += total;
    }
    __syncthreads();
  }
  // Compact kept flags in index order.
  std::int32_t* row = out + static_cast<std::size_t>(h) * p.k;
  int kept = 0;
  for (int base = 0; base < T; base += kThreads) {
    const int t = base + static_cast<int>(threadIdx.x);
    const int keep = (t < T && flag[t] != kNotKept) ? 1 : 0;
    int total = 0;
    const int before = block_exclusive_sum(keep, &total, smem);
    if (keep) row[kept + before] = t;
    kept += total;
  }
  for (int i = kept + static_cast<int>(threadIdx.x); i < p.k; i += kThreads) row[i] = -1;
  if (threadIdx.x == 0 && counts != nullptr) counts[h] = kept;
}

unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// Copies the device arrays the validation reads to the host and validates.
Status validate_on_host(const SelectParams& p, int num_heads, int num_tokens, const char* fn,
                        cudaStream_t stream) {
  KVSCOPE_RETURN_IF_ERROR(cpu::validate_select(p, num_heads, num_tokens, false, fn));
  std::vector<std::uint8_t> mod, prot;
  SelectParams host = p;
  if (p.use_modality_budgets) {
    mod.resize(num_tokens);
    KVSCOPE_CUDA_TRY(cudaMemcpyAsync(mod.data(), p.modality, num_tokens, cudaMemcpyDeviceToHost, stream));
    host.modality = mod.data();
  }
  if (p.protected_mask != nullptr) {
    prot.resize(num_tokens);
    KVSCOPE_CUDA_TRY(
        cudaMemcpyAsync(prot.data(), p.protected_mask, num_tokens, cudaMemcpyDeviceToHost, stream));
    host.protected_mask = prot.data();
  }
  if (p.use_modality_budgets || p.protected_mask != nullptr) KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
  return cpu::validate_select(host, num_heads, num_tokens, true, fn);
}

// Selection on validated inputs: scores [num_heads, T] -> out [num_heads, k].
Status select_rows(const float* scores, int num_heads, int T, const SelectParams& p, std::int32_t* out,
                   std::int32_t* counts, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(num_heads) * T;
  ScratchSet scratch(stream);
  std::uint64_t *keys = nullptr, *sorted = nullptr;
  int* offsets = nullptr;
  std::uint8_t* flags = nullptr;
  KVSCOPE_CUDA_TRY(scratch.allocate(&keys, n));
  KVSCOPE_CUDA_TRY(scratch.allocate(&sorted, n));
  KVSCOPE_CUDA_TRY(scratch.allocate(&offsets, static_cast<std::size_t>(num_heads) + 1));
  KVSCOPE_CUDA_TRY(scratch.allocate(&flags, n));
  KVSCOPE_CUDA_TRY(cudaMemsetAsync(flags, 0, n, stream));
  rank_keys_kernel<<<blocks_for(n + 1), kThreads, 0, stream>>>(scores, num_heads, T, keys, offsets);
  KVSCOPE_CUDA_CHECK_LAUNCH("rank_keys_kernel");
  std::size_t temp_bytes = 0;
  KVSCOPE_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeys(nullptr, temp_bytes, keys, sorted,
                                                           static_cast<int>(n), num_heads, offsets,
                                                           offsets + 1, 0, 64, stream));
  unsigned char* temp = nullptr;
  KVSCOPE_CUDA_TRY(scratch.allocate(&temp, temp_bytes));
  KVSCOPE_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeys(
      temp, temp_bytes, keys, sorted, static_cast<int>(n), num_heads, offsets, offsets + 1, 0, 64, stream));
  select_from_sorted_kernel<<<static_cast<unsigned>(num_heads), kThreads, 0, stream>>>(sorted, T, p, flags,
                                                                                       out, counts);
  KVSCOPE_CUDA_CHECK_LAUNCH("select_from_sorted_kernel");
  return Status::Ok();
}

}  // namespace

Status select_topk(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                   std::int32_t* out_indices, std::int32_t* out_counts, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::select_topk", kSelect);
  if (scores == nullptr || out_indices == nullptr)
    return Status::Invalid("select_topk: scores or out_indices is null");
  KVSCOPE_RETURN_IF_ERROR(validate_on_host(params, num_heads, num_tokens, "select_topk", stream));
  if (static_cast<long long>(num_heads) * num_tokens > 0x7fffffffLL) {
    return Status::Invalid("select_topk: num_heads * num_tokens above 2^31 - 1");
  }
  return select_rows(scores, num_heads, num_tokens, params, out_indices, out_counts, stream);
}

Status select_topk_shared(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                          std::int32_t* out_indices, std::int32_t* out_count, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::select_topk_shared", kSelect);
  if (scores == nullptr || out_indices == nullptr) {
    return Status::Invalid("select_topk_shared: scores or out_indices is null");
  }
  KVSCOPE_RETURN_IF_ERROR(validate_on_host(params, num_heads, num_tokens, "select_topk_shared", stream));
  ScratchSet scratch(stream);
  float* mean = nullptr;
  KVSCOPE_CUDA_TRY(scratch.allocate(&mean, static_cast<std::size_t>(num_tokens)));
  head_mean_kernel<<<blocks_for(num_tokens), kThreads, 0, stream>>>(
      scores, num_heads, num_tokens, 1.0f / static_cast<float>(num_heads), mean);
  KVSCOPE_CUDA_CHECK_LAUNCH("head_mean_kernel");
  return select_rows(mean, 1, num_tokens, params, out_indices, out_count, stream);
}

}  // namespace kvscope::kernels::cuda
