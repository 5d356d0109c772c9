// CUDA backend of head merging (kvscope/kernels/head_merge.hpp). Same math as
// src/cpu/head_merge.cpp: Gram matrix of the flattened heads (float sums inside
// blocks of kHeadSimilarityBlock elements, double across blocks), cosine, then the
// host greedy clustering and a weighted average of member heads in head order.
#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/head_merge_cuda.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kGramThreads = 256;
constexpr int kPairsPerThread = 8;
constexpr int kGramTile = 32;  // elements per shared-memory tile

// Block (element block blockIdx.x, pair group blockIdx.y): float partial dot products
// of its pairs (a <= b; pair p = a * H + b) over kHeadSimilarityBlock elements, added
// to gram[a * H + b] in double.
__global__ void __launch_bounds__(kGramThreads)
    gram_kernel(const void* x, DType dt, int H, long long n, double* gram) {
  extern __shared__ float tile[];  // [H][kGramTile + 1]
  const long long begin = static_cast<long long>(blockIdx.x) * kHeadSimilarityBlock;
  const long long end = min(begin + kHeadSimilarityBlock, n);
  const int pair0 = blockIdx.y * kGramThreads * kPairsPerThread;
  float acc[kPairsPerThread];
  for (int i = 0; i < kPairsPerThread; ++i) acc[i] = 0.0f;
  for (long long e0 = begin; e0 < end; e0 += kGramTile) {
    const int len = static_cast<int>(min(static_cast<long long>(kGramTile), end - e0));
    __syncthreads();
    for (int i = threadIdx.x; i < H * kGramTile; i += kGramThreads) {
      const int a = i / kGramTile, e = i % kGramTile;
      tile[a * (kGramTile + 1) + e] = e < len ? load_element(x, dt, a * n + e0 + e) : 0.0f;
    }
    __syncthreads();
    for (int i = 0; i < kPairsPerThread; ++i) {
      const int pair = pair0 + i * kGramThreads + threadIdx.x;
      const int a = pair / H, b = pair % H;
      if (pair >= H * H || a > b) continue;
      const float* xa = tile + a * (kGramTile + 1);
      const float* xb = tile + b * (kGramTile + 1);
      float s = 0.0f;
      for (int e = 0; e < kGramTile; ++e) s += xa[e] * xb[e];
      acc[i] += s;
    }
  }
  for (int i = 0; i < kPairsPerThread; ++i) {
    const int pair = pair0 + i * kGramThreads + threadIdx.x;
    if (pair < H * H && pair / H <= pair % H) atomicAdd(gram + pair, static_cast<double>(acc[i]));
  }
}

__device__ float gram_cosine(const double* g, int H, int a, int b) {
  if (a > b) {
    const int t = a;
    a = b;
    b = t;
  }
  const double den = sqrt(g[a * H + a] * g[b * H + b]);
  if (!(den > 0.0)) return 0.0f;
  return static_cast<float>(fmin(1.0, fmax(-1.0, g[a * H + b] / den)));
}

__global__ void similarity_kernel(const double* gk, const double* gv, int H, float* similarity) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= H * H) return;
  const int a = i / H, b = i % H;
  float s = 1.0f;
  if (a != b)
    s = gv ? 0.5f * (gram_cosine(gk, H, a, b) + gram_cosine(gv, H, a, b)) : gram_cosine(gk, H, a, b);
  similarity[i] = s;
}

// One thread per (cluster, element): weighted average over member heads in head order,
// uniform when the member weights sum to 0, exact copy for one-member clusters.
__global__ void merge_heads_kernel(const void* k, const void* v, DType dt, int H, long long n,
                                   const std::int32_t* cluster_id, const float* head_weights, float* k_out,
                                   float* v_out) {
  const long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  const int c = blockIdx.y;
  if (e >= n) return;
  float wsum = 0.0f, ak = 0.0f, av = 0.0f, uk = 0.0f, uv = 0.0f;
  int count = 0, only = 0;
  for (int a = 0; a < H; ++a) {
    if (cluster_id[a] != c) continue;
    const float hw = head_weights ? head_weights[a] : 1.0f;
    const float w = hw > 0.0f ? hw : 0.0f;
    const float xk = load_element(k, dt, a * n + e), xv = load_element(v, dt, a * n + e);
    wsum += w;
    ak += w * xk;
    av += w * xv;
    uk += 1.0f * xk;
    uv += 1.0f * xv;
    ++count;
    only = a;
  }
  const long long o = static_cast<long long>(c) * n + e;
  if (count == 1) {
    k_out[o] = load_element(k, dt, only * n + e);
    v_out[o] = load_element(v, dt, only * n + e);
  } else if (wsum > 0.0f) {
    k_out[o] = ak / wsum;
    v_out[o] = av / wsum;
  } else {
    k_out[o] = uk / static_cast<float>(count);
    v_out[o] = uv / static_cast<float>(count);
  }
}

Status validate_shape(const HeadMergeParams& p, const char* fn) {
  const std::string f = std::string(fn) + ": ";
  if (p.num_kv_heads <= 0 || p.num_tokens <= 0 || p.head_dim <= 0) {
    return Status::Invalid(f + "num_kv_heads, num_tokens and head_dim must be > 0");
  }
  if (static_cast<std::size_t>(p.num_kv_heads) * (kGramTile + 1) * sizeof(float) > 48 * 1024) {
    return Status::Unsupported(f + "num_kv_heads " + std::to_string(p.num_kv_heads) +
                               " > 372 on the CUDA backend");
  }
  return Status::Ok();
}

Status launch_gram(const HeadMergeParams& p, const void* x, double* gram, cudaStream_t stream) {
  const int H = p.num_kv_heads;
  const long long n = static_cast<long long>(p.num_tokens) * p.head_dim;
  KVSCOPE_CUDA_TRY(cudaMemsetAsync(gram, 0, sizeof(double) * H * H, stream));
  const dim3 grid(
      static_cast<unsigned>((n + kHeadSimilarityBlock - 1) / kHeadSimilarityBlock),
      static_cast<unsigned>((H * H + kGramThreads * kPairsPerThread - 1) / (kGramThreads * kPairsPerThread)));
  const std::size_t smem = static_cast<std::size_t>(H) * (kGramTile + 1) * sizeof(float);
  gram_kernel<<<grid, kGramThreads, smem, stream>>>(x, p.dtype, H, n, gram);
  KVSCOPE_CUDA_CHECK_LAUNCH("gram_kernel");
  return Status::Ok();
}

}  // namespace

Status head_similarity(const HeadMergeParams& p, const void* k, const void* v, float* similarity,
                       cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::head_similarity", kHeadMerge);
  KVSCOPE_RETURN_IF_ERROR(validate_shape(p, "head_similarity"));
  if (!k || !similarity) return Status::Invalid("head_similarity: k and similarity must not be null");
  const bool with_v = p.similarity == HeadSimilarity::kKeysValues;
  if (with_v && !v) return Status::Invalid("head_similarity: v must not be null for kKeysValues");
  const int H = p.num_kv_heads;
  double* gram = nullptr;
  KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&gram), sizeof(double) * 2 * H * H, stream));
  auto run = [&]() -> Status {
    KVSCOPE_RETURN_IF_ERROR(launch_gram(p, k, gram, stream));
    if (with_v) KVSCOPE_RETURN_IF_ERROR(launch_gram(p, v, gram + H * H, stream));
    similarity_kernel<<<(H * H + 255) / 256, 256, 0, stream>>>(gram, with_v ? gram + H * H : nullptr, H,
                                                               similarity);
    KVSCOPE_CUDA_CHECK_LAUNCH("similarity_kernel");
    return Status::Ok();
  };
  const Status st = run();
  const cudaError_t free_err = cudaFreeAsync(gram, stream);
  if (!st.ok()) return st;
  return cuda_status(free_err, "cudaFreeAsync(head gram)");
}

Status apply_head_merge(const HeadMergeParams& p, const void* k, const void* v,
                        const std::int32_t* cluster_id, int num_clusters, const float* head_weights,
                        float* k_out, float* v_out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::apply_head_merge", kHeadMerge);
  KVSCOPE_RETURN_IF_ERROR(validate_shape(p, "apply_head_merge"));
  if (!k || !v || !cluster_id || !k_out || !v_out) {
    return Status::Invalid("apply_head_merge: k, v, cluster_id, k_out and v_out must not be null");
  }
  const int H = p.num_kv_heads;
  if (num_clusters <= 0 || num_clusters > H) {
    return Status::Invalid("apply_head_merge: num_clusters " + std::to_string(num_clusters) +
                           " must be in [1, " + std::to_string(H) + "]");
  }
  // The [H] cluster ids are tiny: check them on the host like the CPU backend.
  std::vector<std::int32_t> ids(H);
  KVSCOPE_CUDA_TRY(
      cudaMemcpyAsync(ids.data(), cluster_id, sizeof(std::int32_t) * H, cudaMemcpyDeviceToHost, stream));
  KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<int> members(num_clusters, 0);
  for (int a = 0; a < H; ++a) {
    if (ids[a] < 0 || ids[a] >= num_clusters) {
      return Status::Invalid("apply_head_merge: cluster_id[" + std::to_string(a) +
                             "] = " + std::to_string(ids[a]) + " is out of [0, num_clusters)");
    }
    ++members[ids[a]];
  }
  for (int c = 0; c < num_clusters; ++c) {
    if (members[c] == 0)
      return Status::Invalid("apply_head_merge: cluster " + std::to_string(c) + " has no member head");
  }
  const long long n = static_cast<long long>(p.num_tokens) * p.head_dim;
  const dim3 grid(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(num_clusters));
  merge_heads_kernel<<<grid, 256, 0, stream>>>(k, v, p.dtype, H, n, cluster_id, head_weights, k_out, v_out);
  KVSCOPE_CUDA_CHECK_LAUNCH("merge_heads_kernel");
  return Status::Ok();
}

Status merge_heads(const HeadMergeParams& p, const void* k, const void* v, const float* head_weights,
                   float* similarity, std::int32_t* cluster_id, int* num_merged_heads, float* k_out,
                   float* v_out, std::int32_t* q_to_merged, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::merge_heads", kHeadMerge);
  KVSCOPE_RETURN_IF_ERROR(validate_shape(p, "merge_heads"));
  if (p.num_q_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) {
    return Status::Invalid("merge_heads: num_q_heads " + std::to_string(p.num_q_heads) +
                           " must be a positive multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (!k || !v || !similarity || !cluster_id || !num_merged_heads || !k_out || !v_out || !q_to_merged) {
    return Status::Invalid(
        "merge_heads: k, v, similarity, cluster_id, num_merged_heads, k_out, v_out and "
        "q_to_merged must not be null");
  }
  const int H = p.num_kv_heads, Hq = p.num_q_heads;
  KVSCOPE_RETURN_IF_ERROR(head_similarity(p, k, v, similarity, stream));
  std::vector<float> sim(static_cast<std::size_t>(H) * H);
  KVSCOPE_CUDA_TRY(
      cudaMemcpyAsync(sim.data(), similarity, sizeof(float) * H * H, cudaMemcpyDeviceToHost, stream));
  KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<std::int32_t> ids(H), qmap(Hq);
  int clusters = 0;
  KVSCOPE_RETURN_IF_ERROR(cpu::cluster_heads(H, sim.data(), p.threshold, ids.data(), &clusters));
  const int group = Hq / H;
  for (int j = 0; j < Hq; ++j) qmap[j] = ids[j / group];
  KVSCOPE_CUDA_TRY(
      cudaMemcpyAsync(cluster_id, ids.data(), sizeof(std::int32_t) * H, cudaMemcpyHostToDevice, stream));
  KVSCOPE_CUDA_TRY(
      cudaMemcpyAsync(q_to_merged, qmap.data(), sizeof(std::int32_t) * Hq, cudaMemcpyHostToDevice, stream));
  KVSCOPE_RETURN_IF_ERROR(
      apply_head_merge(p, k, v, cluster_id, clusters, head_weights, k_out, v_out, stream));
  KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));  // the host vectors above must outlive the copies
  *num_merged_heads = clusters;
  return Status::Ok();
}

}  // namespace kvscope::kernels::cuda
