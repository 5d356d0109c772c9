// CUDA backend of the attention statistics. One block per (query row, query
// head): the query row sits in shared memory, each warp takes every 8th key
// (lanes split head_dim, so K reads are coalesced). Pass 1 finds the row max
// and the softmax denominator online; pass 2 recomputes the logits and emits
// p into the requested statistics (atomics for per-key sums, a block
// reduction for per-row values). This is the simple, correct version: logits
// are computed twice and K is re-read from L2 for every query row.
#include <cuda_runtime.h>

#include <string>

#include "kvscope/kernels/attention_stats_cuda.hpp"
#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadDim = 8192;  // dynamic shared memory for the query row

// Where pass 2 sends the probabilities of a row; nullptr = not requested.
struct RowOutputs {
  float* colsum = nullptr;         // [num_q_heads, k_len] += p (atomic)
  float* entropy = nullptr;        // [num_q_heads, q_len]
  float* modality_mass = nullptr;  // [num_q_heads, q_len, 4]
  float* received = nullptr;       // [num_q_heads, k_len] += p for other-modality (query, key) pairs (atomic)
  float* given = nullptr;          // [num_q_heads, q_len]
  const std::uint8_t* k_modality = nullptr;  // [k_len]
  const std::uint8_t* q_modality = nullptr;  // [q_len]
};

// Frees a stream-ordered scratch allocation when the launcher returns.
class Scratch {
 public:
  explicit Scratch(cudaStream_t s) : stream_(s) {}
  ~Scratch() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  cudaError_t allocate(std::size_t bytes) { return cudaMallocAsync(&ptr_, bytes, stream_); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// q . k[h, t] (all lanes get the sum).
__device__ __forceinline__ float key_dot(const AttentionProblem& a, const float* qs, int h, int t, int lane) {
  const std::size_t base = (static_cast<std::size_t>(h) * a.k_len + t) * a.head_dim;
  float acc = 0.0f;
  for (int d = lane; d < a.head_dim; d += 32) acc += qs[d] * load_element(a.k, a.dtype, base + d);
  return warp_sum(acc);
}

__device__ __forceinline__ int modality_code(std::uint8_t m) {
  return m < kNumModalities ? m : kNumModalities - 1;
}

// Block (blockIdx.x, blockIdx.y) = (query row q_begin + x, query head y).
__global__ void attention_rows_kernel(AttentionProblem a, int q_begin, RowOutputs o) {
  extern __shared__ float qs[];  // [head_dim]
  __shared__ float red_m[kWarps], red_l[kWarps];
  __shared__ float red_acc[kWarps][6];
  const int i = q_begin + static_cast<int>(blockIdx.x), j = static_cast<int>(blockIdx.y);
  const int h = j / (a.num_q_heads / a.num_kv_heads);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::size_t qbase = (static_cast<std::size_t>(j) * a.q_len + i) * a.head_dim;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) qs[d] = load_element(a.q, a.dtype, qbase + d);
  __syncthreads();

  const std::int32_t qpos = detail::query_position(a, i);
  const int limit = detail::key_limit(a, qpos);
  const float scale = 1.0f / sqrtf(static_cast<float>(a.head_dim));

  // Pass 1: running max m and sum l = sum exp(s - m) per warp.
  float m = -INFINITY, l = 0.0f;
  for (int t = warp; t < limit; t += kWarps) {
    if (!detail::key_visible(a, qpos, t)) continue;
    const float s = key_dot(a, qs, h, t, lane) * scale;
    if (s > m) {
      l = l * expf(m - s) + 1.0f;
      m = s;
    } else {
      l += expf(s - m);
    }
  }
  if (lane == 0) red_m[warp] = m, red_l[warp] = l;
  __syncthreads();
  float M = -INFINITY, L = 0.0f;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w]);
  for (int w = 0; w < kWarps; ++w) L += red_m[w] == -INFINITY ? 0.0f : red_l[w] * expf(red_m[w] - M);

  // Pass 2: emit p = exp(s - M) / L.
  float ent = 0.0f, mass[kNumModalities] = {0.0f, 0.0f, 0.0f, 0.0f}, given = 0.0f;
  if (M != -INFINITY) {
    const std::uint8_t qm = o.q_modality != nullptr ? o.q_modality[i] : 0;
    const std::size_t krow = static_cast<std::size_t>(j) * a.k_len;
    for (int t = warp; t < limit; t += kWarps) {
      if (!detail::key_visible(a, qpos, t)) continue;
      const float p = expf(key_dot(a, qs, h, t, lane) * scale - M) / L;
      if (lane == 0) {
        if (o.colsum != nullptr) atomicAdd(o.colsum + krow + t, p);
        if (o.entropy != nullptr && p > 0.0f) ent -= p * logf(p);
        if (o.modality_mass != nullptr) mass[modality_code(o.k_modality[t])] += p;
        if ((o.received != nullptr || o.given != nullptr) && o.k_modality[t] != qm) {
          if (o.received != nullptr) atomicAdd(o.received + krow + t, p);
          given += p;
        }
      }
    }
  }
  if (lane == 0) {
    red_acc[warp][0] = ent, red_acc[warp][5] = given;
    for (int c = 0; c < kNumModalities; ++c) red_acc[warp][1 + c] = mass[c];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  float tot[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int w = 0; w < kWarps; ++w)
    for (int c = 0; c < 6; ++c) tot[c] += red_acc[w][c];
  const std::size_t row = static_cast<std::size_t>(j) * a.q_len + i;
  if (o.entropy != nullptr) o.entropy[row] = tot[0];
  if (o.modality_mass != nullptr)
    for (int c = 0; c < kNumModalities; ++c) o.modality_mass[row * kNumModalities + c] = tot[1 + c];
  if (o.given != nullptr) o.given[row] = tot[5];
}

Status launch_rows(const AttentionProblem& a, int q_begin, int q_end, const RowOutputs& o,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(q_end - q_begin), static_cast<unsigned>(a.num_q_heads));
  attention_rows_kernel<<<grid, kThreads, a.head_dim * sizeof(float), stream>>>(a, q_begin, o);
  KVSCOPE_CUDA_CHECK_LAUNCH("attention_rows_kernel");
  return Status::Ok();
}

Status validate(const AttentionProblem& a, const char* fn) {
  KVSCOPE_RETURN_IF_ERROR(cpu::validate_attention_problem(a, fn));
  if (a.num_q_heads > 65535) {
    return Status::Invalid(std::string(fn) + ": num_q_heads " + std::to_string(a.num_q_heads) +
                           " above 65535");
  }
  if (a.head_dim > kMaxHeadDim) {
    return Status::Invalid(std::string(fn) + ": head_dim " + std::to_string(a.head_dim) + " above " +
                           std::to_string(kMaxHeadDim));
  }
  return Status::Ok();
}

// Same order of operations as the CPU backend's pooling loop.
__global__ void pool_kernel(const float* sums, int rows, int len, int r, bool avg, float inv_k, float* out) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= static_cast<std::size_t>(rows) * len) return;
  const int t = static_cast<int>(e % len);
  const float* row = sums + (e - t);
  const int lo = max(0, t - r), hi = min(len - 1, t + r);
  float v = avg ? 0.0f : row[lo];
  for (int u = lo; u <= hi; ++u) v = avg ? v + row[u] : fmaxf(v, row[u]);
  out[e] = avg ? v * inv_k : v;
}

__global__ void reduce_to_kv_heads_kernel(const float* in, int num_kv_heads, int group, int len, float* out) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= static_cast<std::size_t>(num_kv_heads) * len) return;
  const std::size_t h = e / len, t = e % len;
  float s = 0.0f;
  for (int g = 0; g < group; ++g) s += in[(h * group + g) * len + t];
  out[e] = s;
}

// n_t = number of queries of another modality that can see key t.
__global__ void other_modality_count_kernel(AttentionProblem a, const std::uint8_t* mk,
                                            const std::uint8_t* mq, int* count) {
  const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= a.k_len) return;
  int n = 0;
  for (int i = 0; i < a.q_len; ++i) {
    n += (mq[i] != mk[t] && detail::key_visible(a, detail::query_position(a, i), t)) ? 1 : 0;
  }
  count[t] = n;
}

__global__ void divide_by_count_kernel(float* v, const int* count, int rows, int len) {
  const std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= static_cast<std::size_t>(rows) * len) return;
  const int n = count[e % len];
  v[e] = n > 0 ? v[e] / static_cast<float>(n) : 0.0f;
}

unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

Status accumulated_attention(const AttentionProblem& a, QueryRange range, float* out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::accumulated_attention", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate(a, "accumulated_attention"));
  if (out == nullptr) return Status::Invalid("accumulated_attention: out is null");
  const int end = range.end < 0 ? a.q_len : range.end;
  if (range.begin < 0 || range.begin >= end || end > a.q_len) {
    return Status::Invalid("accumulated_attention: query range [" + std::to_string(range.begin) + ", " +
                           std::to_string(range.end) + ") is empty or outside q_len " +
                           std::to_string(a.q_len));
  }
  KVSCOPE_CUDA_TRY(
      cudaMemsetAsync(out, 0, sizeof(float) * a.num_q_heads * static_cast<std::size_t>(a.k_len), stream));
  RowOutputs o;
  o.colsum = out;
  return launch_rows(a, range.begin, end, o, stream);
}

Status reduce_to_kv_heads(const float* in, int num_q_heads, int num_kv_heads, int len, float* out,
                          cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::reduce_to_kv_heads", kAttentionStats);
  if (in == nullptr || out == nullptr) return Status::Invalid("reduce_to_kv_heads: in or out is null");
  if (num_q_heads <= 0 || num_kv_heads <= 0 || len <= 0) {
    return Status::Invalid("reduce_to_kv_heads: num_q_heads, num_kv_heads and len must be positive");
  }
  if (num_q_heads % num_kv_heads != 0) {
    return Status::Invalid("reduce_to_kv_heads: num_q_heads " + std::to_string(num_q_heads) +
                           " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  }
  const std::size_t n = static_cast<std::size_t>(num_kv_heads) * len;
  reduce_to_kv_heads_kernel<<<blocks_for(n), kThreads, 0, stream>>>(in, num_kv_heads,
                                                                    num_q_heads / num_kv_heads, len, out);
  KVSCOPE_CUDA_CHECK_LAUNCH("reduce_to_kv_heads_kernel");
  return Status::Ok();
}

Status snapkv_scores(const AttentionProblem& a, const SnapKVParams& params, float* out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::snapkv_scores", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate(a, "snapkv_scores"));
  if (out == nullptr) return Status::Invalid("snapkv_scores: out is null");
  if (params.window <= 0 || params.window > a.q_len) {
    return Status::Invalid("snapkv_scores: window " + std::to_string(params.window) + " outside 1..q_len " +
                           std::to_string(a.q_len));
  }
  if (params.kernel_size <= 0 || params.kernel_size % 2 == 0) {
    return Status::Invalid("snapkv_scores: kernel_size " + std::to_string(params.kernel_size) +
                           " must be odd and positive");
  }
  const std::size_t n = static_cast<std::size_t>(a.num_q_heads) * a.k_len;
  Scratch sums(stream);
  KVSCOPE_CUDA_TRY(sums.allocate(n * sizeof(float)));
  KVSCOPE_CUDA_TRY(cudaMemsetAsync(sums.as<float>(), 0, n * sizeof(float), stream));
  RowOutputs o;
  o.colsum = sums.as<float>();
  KVSCOPE_RETURN_IF_ERROR(launch_rows(a, a.q_len - params.window, a.q_len, o, stream));
  pool_kernel<<<blocks_for(n), kThreads, 0, stream>>>(sums.as<float>(), a.num_q_heads, a.k_len,
                                                      params.kernel_size / 2, params.pool == PoolKind::kAvg,
                                                      1.0f / static_cast<float>(params.kernel_size), out);
  KVSCOPE_CUDA_CHECK_LAUNCH("pool_kernel");
  return Status::Ok();
}

Status tova_scores(const AttentionProblem& a, float* out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::tova_scores", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate(a, "tova_scores"));
  return accumulated_attention(a, QueryRange{a.q_len - 1, a.q_len}, out, stream);
}

Status attention_row_stats(const AttentionProblem& a, const std::uint8_t* k_modality, float* entropy,
                           float* modality_mass, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::attention_row_stats", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate(a, "attention_row_stats"));
  if (entropy == nullptr && modality_mass == nullptr) {
    return Status::Invalid("attention_row_stats: entropy and modality_mass are both null");
  }
  if (modality_mass != nullptr && k_modality == nullptr) {
    return Status::Invalid("attention_row_stats: k_modality is null");
  }
  RowOutputs o;
  o.entropy = entropy;
  o.modality_mass = modality_mass;
  o.k_modality = k_modality;
  return launch_rows(a, 0, a.q_len, o, stream);
}

Status cross_modal_interaction(const AttentionProblem& a, const std::uint8_t* k_modality,
                               const std::uint8_t* q_modality, float* received, float* given,
                               cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::cross_modal_interaction", kAttentionStats);
  const char* fn = "cross_modal_interaction";
  KVSCOPE_RETURN_IF_ERROR(validate(a, fn));
  if (a.q_len != a.k_len) {
    return Status::Invalid(std::string(fn) + ": needs a prefill with q_len == k_len (got " +
                           std::to_string(a.q_len) + " and " + std::to_string(a.k_len) + ")");
  }
  if (received == nullptr && given == nullptr) {
    return Status::Invalid(std::string(fn) + ": received and given are both null");
  }
  if (k_modality == nullptr) return Status::Invalid(std::string(fn) + ": k_modality is null");
  RowOutputs o;
  o.received = received;
  o.given = given;
  o.k_modality = k_modality;
  o.q_modality = q_modality != nullptr ? q_modality : k_modality;
  const std::size_t n = static_cast<std::size_t>(a.num_q_heads) * a.k_len;
  if (received != nullptr) KVSCOPE_CUDA_TRY(cudaMemsetAsync(received, 0, n * sizeof(float), stream));
  KVSCOPE_RETURN_IF_ERROR(launch_rows(a, 0, a.q_len, o, stream));
  if (received != nullptr) {
    Scratch count(stream);
    KVSCOPE_CUDA_TRY(count.allocate(sizeof(int) * static_cast<std::size_t>(a.k_len)));
    other_modality_count_kernel<<<blocks_for(a.k_len), kThreads, 0, stream>>>(a, o.k_modality, o.q_modality,
                                                                              count.as<int>());
    KVSCOPE_CUDA_CHECK_LAUNCH("other_modality_count_kernel");
    divide_by_count_kernel<<<blocks_for(n), kThreads, 0, stream>>>(received, count.as<int>(), a.num_q_heads,
                                                                   a.k_len);
    KVSCOPE_CUDA_CHECK_LAUNCH("divide_by_count_kernel");
  }
  return Status::Ok();
}

}  // namespace kvscope::kernels::cuda
