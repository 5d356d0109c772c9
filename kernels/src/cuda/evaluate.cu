// CUDA backend of compressed-cache evaluation (kvscope/kernels/evaluate.hpp).
// Pipeline per layer (rows r = j * Nq + i; the rows of kv head h are contiguous):
//   1. logits_kernel   Z = Q K^T * scale (+ log n) per kv head, 64x64 smem tiles
//   2. full/compressed_stats_kernel: one block per row: max, e = exp(z - max) in place,
//      row sums (Z, entropy term, per-modality masses, surviving masses, slot masses)
//   3. pv_kernel        O += E V, 64x64 tiles, split over tokens with atomicAdd
//   4. finalize_kernel  one block per row: output error, recall, KL, entropy, shares.
// Same formulas as src/cpu/evaluate.cpp (docs/kernels/evaluate.md); sums are float
// tree reductions here, so results agree with the CPU within float rounding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/evaluate_cuda.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kTile = 64;   // output tile (rows x columns) of the two GEMM kernels
constexpr int kTileK = 16;  // reduction step of the GEMM kernels
constexpr int kGemmThreads = 256;
constexpr int kPvSplit = 512;  // tokens per split of the P.V reduction
constexpr int kRowThreads = 256;
// A row whose metrics are NaN or infinite (inputs outside float32's range) sets the flag to 3 and
// the call fails with the CPU backend's message.
constexpr const char* kNotFinite =
    "a metric is not finite in float32 (attention logits, norms or sums overflow: inputs outside the range "
    "this kernel computes in; outputs undefined)";
constexpr int kStats = 20;  // per-row statistics, layout below
// [0] Z  [1] sum e*(z-m)  [2..5] mass per modality  [6..9] surviving mass per modality
// [10] Z~  [11] sum e~*(z~-m~)  [12..15] compressed mass per modality  [16] m~

// Where the B operand (keys / values) of kv head h lives.
struct Source {
  const void* data;  // full: [Hkv, T, D] dtype; compressed: [S_total, D] float
  DType dtype;
  const std::int32_t* offsets;  // compressed: [Hkv + 1] slot offsets; nullptr for the full cache
  int num_tokens;               // full cache T
  __device__ long long row0(int h) const {
    return offsets ? offsets[h] : static_cast<long long>(h) * num_tokens;
  }
  __device__ int rows(int h) const { return offsets ? offsets[h + 1] - offsets[h] : num_tokens; }
};

struct Multiplicity {
  const float* f32;
  const std::int32_t* i32;
  bool proportional;
  __device__ float log_n(long long s) const {
    if (!proportional) return 0.0f;
    if (f32) return logf(f32[s]);
    if (i32) return logf(static_cast<float>(i32[s]));
    return 0.0f;
  }
};

// Z[(h*M + m) * ldz + n] = scale * (q_m . b_n) + log n_n, for the M query rows and the
// N_h key rows of kv head h = blockIdx.z.
__global__ void __launch_bounds__(kGemmThreads)
    logits_kernel(const void* q, DType q_dtype, int M, int D, Source b, Multiplicity mult, float scale,
                  float* z, long long ldz) {
  __shared__ float As[kTileK][kTile + 4];
  __shared__ float Bs[kTileK][kTile + 4];
  const int h = blockIdx.z;
  const int N = b.rows(h);
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  if (n0 >= N) return;
  const long long q_row0 = static_cast<long long>(h) * M, b_row0 = b.row0(h);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < D; k0 += kTileK) {
    for (int i = threadIdx.x; i < kTile * kTileK; i += kGemmThreads) {
      const int r = i / kTileK, kk = i % kTileK, k = k0 + kk;
      As[kk][r] = (m0 + r < M && k < D) ? load_element(q, q_dtype, (q_row0 + m0 + r) * D + k) : 0.0f;
      Bs[kk][r] = (n0 + r < N && k < D) ? load_element(b.data, b.dtype, (b_row0 + n0 + r) * D + k) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], bb[4];
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
      for (int j = 0; j < 4; ++j) bb[j] = Bs[kk][tx * 4 + j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * bb[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty * 4 + i;
    if (m >= M) continue;
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx * 4 + j;
      if (n < N) z[(q_row0 + m) * ldz + n] = acc[i][j] * scale + mult.log_n(b_row0 + n);
    }
  }
}

// O[(h*M + m) * D + d] += sum over this block's token split of E[m][t] * b_t[d].
__global__ void __launch_bounds__(kGemmThreads)
    pv_kernel(const float* e, long long lde, int M, int D, Source b, int splits, int split_len, float* o) {
  __shared__ float As[kTileK][kTile + 4];
  __shared__ float Bs[kTileK][kTile + 4];
  const int h = blockIdx.z / splits, split = blockIdx.z % splits;
  const int N = b.rows(h);
  const int t_begin = split * split_len, t_end = min(N, t_begin + split_len);
  if (t_begin >= t_end) return;
  const int m0 = blockIdx.y * kTile, d0 = blockIdx.x * kTile;
  const long long row0 = static_cast<long long>(h) * M, b_row0 = b.row0(h);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int t0 = t_begin; t0 < t_end; t0 += kTileK) {
    for (int i = threadIdx.x; i < kTile * kTileK; i += kGemmThreads) {
      const int r = i / kTileK, kk = i % kTileK, t = t0 + kk;  // A: row r, token kk
      As[kk][r] = (m0 + r < M && t < t_end) ? e[(row0 + m0 + r) * lde + t] : 0.0f;
      const int tk = i / kTile, c = i % kTile, tb = t0 + tk;  // B: token tk, column c
      Bs[tk][c] =
          (tb < t_end && d0 + c < D) ? load_element(b.data, b.dtype, (b_row0 + tb) * D + d0 + c) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < kTileK; ++kk) {
      float a[4], bb[4];
      for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
      for (int j = 0; j < 4; ++j) bb[j] = Bs[kk][tx * 4 + j];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * bb[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty * 4 + i;
    if (m >= M) continue;
    for (int j = 0; j < 4; ++j) {
      const int d = d0 + tx * 4 + j;
      if (d < D) atomicAdd(o + (row0 + m) * D + d, acc[i][j]);
    }
  }
}

__device__ float warp_sum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
__device__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// Block-wide reductions of NV values (every thread gets the results).
template <int NV>
__device__ void block_sum(float (&v)[NV], float* red /* [NV * 32] */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int i = 0; i < NV; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();
  if (lane == 0)
    for (int i = 0; i < NV; ++i) red[i * 32 + warp] = v[i];
  __syncthreads();
  for (int i = 0; i < NV; ++i) {
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += red[i * 32 + w];
    v[i] = s;
  }
}
__device__ float block_max(float x, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float m = red[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, red[w]);
  return m;
}

// One block per row: e = exp(z - max) in place and the full-attention row sums;
// scatters e of surviving tokens onto their slots. Flags bad modality / slot codes.
__global__ void __launch_bounds__(kRowThreads)
    full_stats_kernel(float* z, int T, int M, const std::uint8_t* modality, const std::int32_t* token_to_slot,
                      const std::int32_t* offsets, float* slot_mass, long long ld_slots, float* stats,
                      int* bad) {
  __shared__ float red[10 * 32];
  const long long r = blockIdx.x;
  const int h = static_cast<int>(r / M);
  const int S = offsets[h + 1] - offsets[h];
  float* zr = z + r * T;
  const std::int32_t* map = token_to_slot + static_cast<long long>(h) * T;
  float m = -INFINITY;
  for (int t = threadIdx.x; t < T; t += kRowThreads) m = fmaxf(m, zr[t]);
  m = block_max(m, red);
  float acc[10] = {};
  for (int t = threadIdx.x; t < T; t += kRowThreads) {
    const float x = zr[t] - m;
    const float e = expf(x);
    zr[t] = e;
    acc[0] += e;
    acc[1] += e * x;
    const int mod = modality[t];
    const int s = map[t];
    if (mod >= kNumModalities || s < -1 || s >= S) {
      atomicExch(bad, 1);
      continue;
    }
    acc[2 + mod] += e;
    if (s >= 0) {
      acc[6 + mod] += e;
      atomicAdd(slot_mass + r * ld_slots + s, e);
    }
  }
  block_sum(acc, red);
  if (threadIdx.x < 10) stats[r * kStats + threadIdx.x] = acc[threadIdx.x];
}

// One block per row: e~ = exp(z~ - max) and the compressed-attention row sums.
__global__ void __launch_bounds__(kRowThreads)
    compressed_stats_kernel(const float* zc, float* ec, long long ld_slots, int M,
                            const std::int32_t* offsets, const std::uint8_t* slot_modality, float* stats) {
  __shared__ float red[6 * 32];
  const long long r = blockIdx.x;
  const int h = static_cast<int>(r / M);
  const int base = offsets[h], S = offsets[h + 1] - base;
  float* st = stats + r * kStats;
  if (S == 0) {
    if (threadIdx.x < 7) st[10 + threadIdx.x] = 0.0f;
    return;
  }
  const float* zr = zc + r * ld_slots;
  float* er = ec + r * ld_slots;
  float m = -INFINITY;
  for (int s = threadIdx.x; s < S; s += kRowThreads) m = fmaxf(m, zr[s]);
  m = block_max(m, red);
  float acc[6] = {};
  for (int s = threadIdx.x; s < S; s += kRowThreads) {
    const float x = zr[s] - m;
    const float e = expf(x);
    er[s] = e;
    acc[0] += e;
    acc[1] += e * x;
    const int mod = slot_modality[base + s];
    if (mod < kNumModalities) acc[2 + mod] += e;
  }
  block_sum(acc, red);
  if (threadIdx.x < 6) st[10 + threadIdx.x] = acc[threadIdx.x];
  if (threadIdx.x == 0) st[16] = m;
}

// full_attention, one block per row: p = exp(z - max) / Z in place, H(p) and the
// per-modality masses (modality may be nullptr when modality_mass is).
__global__ void __launch_bounds__(kRowThreads)
    full_softmax_kernel(float* z, int T, const std::uint8_t* modality, float* entropy, float* modality_mass,
                        int* bad) {
  __shared__ float red[6 * 32];
  const long long r = blockIdx.x;
  float* zr = z + r * T;
  float m = -INFINITY;
  for (int t = threadIdx.x; t < T; t += kRowThreads) m = fmaxf(m, zr[t]);
  m = block_max(m, red);
  float acc[6] = {};  // Z, sum e*(z-m), mass per modality
  for (int t = threadIdx.x; t < T; t += kRowThreads) {
    const float x = zr[t] - m;
    const float e = expf(x);
    zr[t] = e;
    acc[0] += e;
    acc[1] += e * x;
    if (modality_mass) {
      const int mod = modality[t];
      if (mod >= kNumModalities) {
        atomicExch(bad, 1);
        continue;
      }
      acc[2 + mod] += e;
    }
  }
  block_sum(acc, red);
  const float inv = 1.0f / acc[0];
  for (int t = threadIdx.x; t < T; t += kRowThreads) zr[t] *= inv;  // each thread rescales its own e
  if (threadIdx.x != 0) return;
  entropy[r] = logf(acc[0]) - acc[1] / acc[0];
  if (!isfinite(entropy[r])) atomicExch(bad, 3);
  if (modality_mass)
    for (int mm = 0; mm < kNumModalities; ++mm) modality_mass[r * kNumModalities + mm] = acc[2 + mm] * inv;
}

// evaluate_attention(FullAttention), one block per row: sums of the full
// probabilities (total, per modality, over surviving tokens), scattered onto slots.
__global__ void __launch_bounds__(kRowThreads)
    probs_stats_kernel(const float* probs, int T, int M, const std::uint8_t* modality,
                       const std::int32_t* token_to_slot, const std::int32_t* offsets, float* slot_mass,
                       long long ld_slots, float* stats, int* bad) {
  __shared__ float red[10 * 32];
  const long long r = blockIdx.x;
  const int h = static_cast<int>(r / M);
  const int S = offsets[h + 1] - offsets[h];
  const float* pr = probs + r * T;
  const std::int32_t* map = token_to_slot + static_cast<long long>(h) * T;
  float acc[10] = {};  // layout of stats[0..9]; [1] unused (entropy comes from FullAttention)
  for (int t = threadIdx.x; t < T; t += kRowThreads) {
    const float e = pr[t];
    const int mod = modality[t];
    const int s = map[t];
    if (mod >= kNumModalities || s < -1 || s >= S) {
      atomicExch(bad, 1);
      continue;
    }
    acc[0] += e;
    acc[2 + mod] += e;
    if (s >= 0) {
      acc[6 + mod] += e;
      atomicAdd(slot_mass + r * ld_slots + s, e);
    }
  }
  block_sum(acc, red);
  if (threadIdx.x < 10) stats[r * kStats + threadIdx.x] = acc[threadIdx.x];
}

// Flags slot modality codes >= 4 and multiplicities that are not > 0 (finite) / >= 1.
__global__ void validate_slots_kernel(int total, const std::uint8_t* slot_modality, const float* mult_f32,
                                      const std::int32_t* mult_i32, int* bad) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= total) return;
  bool ok = slot_modality[s] < kNumModalities;
  if (mult_f32) ok = ok && mult_f32[s] > 0.0f && isfinite(mult_f32[s]);
  if (mult_i32) ok = ok && mult_i32[s] >= 1;
  if (!ok) atomicExch(bad, 2);
}

// One block per row: the metrics. full_entropy == nullptr: o is unnormalised and
// stats hold sums of e; else (FullAttention) o is normalised, stats hold sums of p
// and H(p) = full_entropy[r].
__global__ void __launch_bounds__(kRowThreads)
    finalize_kernel(int M, int D, const std::int32_t* offsets, const float* o, const float* oc,
                    const float* zc, const float* slot_mass, long long ld_slots, const float* stats,
                    const float* full_entropy, EvaluateOutputs out, int* bad) {
  __shared__ float red[3 * 32];
  const long long r = blockIdx.x;
  const int h = static_cast<int>(r / M);
  const int S = offsets[h + 1] - offsets[h];
  const float* st = stats + r * kStats;
  const float Z = st[0], Zc = st[10];
  const float survived = st[6] + st[7] + st[8] + st[9];
  float acc[3] = {};  // |o~ - o|^2, |o|^2, KL
  for (int d = threadIdx.x; d < D; d += kRowThreads) {
    const float od = full_entropy ? o[r * D + d] : o[r * D + d] / Z;  // FullAttention: o normalised
    const float ocd = S > 0 ? oc[r * D + d] / Zc : 0.0f;
    acc[0] += (ocd - od) * (ocd - od);
    acc[1] += od * od;
  }
  if (survived > 0.0f && S > 0) {
    const float log_surv = logf(survived), log_zc = logf(Zc), mc = st[16];
    const float* am = slot_mass + r * ld_slots;
    const float* zr = zc + r * ld_slots;
    for (int s = threadIdx.x; s < S; s += kRowThreads) {
      if (!(am[s] > 0.0f)) continue;
      const float log_p = logf(am[s]) - log_surv;
      const float log_pc = (zr[s] - mc) - log_zc;
      acc[2] += expf(log_p) * (log_p - log_pc);
    }
  }
  block_sum(acc, red);
  if (threadIdx.x != 0) return;
  const float norm = sqrtf(acc[1]), diff = sqrtf(acc[0]);
  if (out.output_error) out.output_error[r] = norm > 0.0f ? diff / norm : diff;
  if (out.recall) out.recall[r] = survived / Z;
  if (out.kl) out.kl[r] = acc[2];
  const float h_full = full_entropy ? full_entropy[r] : logf(Z) - st[1] / Z;
  const float h_comp = S > 0 ? logf(Zc) - st[11] / Zc : 0.0f;
  if (out.entropy_change) out.entropy_change[r] = h_comp - h_full;
  // Every output of the row in one sum: NaN or infinite if any of them is (the CPU backend's check).
  double check = static_cast<double>(norm > 0.0f ? diff / norm : diff) + survived / Z + acc[2] + (h_comp - h_full);
  for (int m = 0; m < kNumModalities; ++m) {
    const float full_m = st[2 + m];
    const float rm = full_m > 0.0f ? st[6 + m] / full_m : 1.0f, mf = full_m / Z;
    const float mc = S > 0 ? st[12 + m] / Zc : 0.0f;
    check += static_cast<double>(rm) + mf + mc;
    if (out.recall_modality) out.recall_modality[r * 4 + m] = rm;
    if (out.mass_full) out.mass_full[r * 4 + m] = mf;
    if (out.mass_compressed) out.mass_compressed[r * 4 + m] = mc;
  }
  if (!isfinite(check)) atomicExch(bad, 3);
}

Status validate_sizes(const EvaluateParams& p, const std::string& f) {
  if (p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.num_queries <= 0 || p.num_tokens <= 0 ||
      p.head_dim <= 0) {
    return Status::Invalid(f + "num_q_heads, num_kv_heads, num_queries, num_tokens and head_dim must be > 0");
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return Status::Invalid(f + "num_q_heads " + std::to_string(p.num_q_heads) +
                           " is not a multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return Status::Invalid(f + "unknown dtype");
  }
  return Status::Ok();
}

Status validate(const EvaluateParams& p, const void* q, const void* k, const void* v,
                const std::uint8_t* modality, const CompressedCache& c, const EvaluateOutputs& out) {
  const std::string f = "evaluate_attention: ";
  KVSCOPE_RETURN_IF_ERROR(validate_sizes(p, f));
  if (!q || !k || !v || !modality) return Status::Invalid(f + "q, k, v and modality must not be null");
  if (!c.slot_offsets || !c.token_to_slot) {
    return Status::Invalid(f + "cache.slot_offsets and cache.token_to_slot must not be null");
  }
  if (c.multiplicity_f32 && c.multiplicity_i32) {
    return Status::Invalid(f + "set at most one of cache.multiplicity_f32 and cache.multiplicity_i32");
  }
  if (!out.output_error && !out.recall && !out.kl && !out.entropy_change && !out.recall_modality &&
      !out.mass_full && !out.mass_compressed) {
    return Status::Invalid(f + "every output pointer is null");
  }
  return Status::Ok();
}

unsigned cdiv(long long a, long long b) { return static_cast<unsigned>((a + b - 1) / b); }

// Token splits of the P.V reduction: about kPvSplit tokens each (a multiple of kTileK),
// with at most 65535 blocks in grid.z.
void pv_splits(int n, int Hkv, int* splits, int* split_len) {
  *splits = std::max(1, std::min(static_cast<int>(cdiv(n, kPvSplit)), 65535 / Hkv));
  *split_len = static_cast<int>(cdiv(cdiv(n, *splits), kTileK)) * kTileK;
}

}  // namespace

Status evaluate_attention(const EvaluateParams& p, const void* q, const void* k, const void* v,
                          const std::uint8_t* modality, const CompressedCache& c, const EvaluateOutputs& out,
                          cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::evaluate_attention", kEvaluate);
  KVSCOPE_RETURN_IF_ERROR(validate(p, q, k, v, modality, c, out));
  const std::string f = "evaluate_attention: ";
  const int Hkv = p.num_kv_heads, T = p.num_tokens, D = p.head_dim;
  const int M = (p.num_q_heads / Hkv) * p.num_queries;
  const long long R = static_cast<long long>(p.num_q_heads) * p.num_queries;

  std::vector<std::int32_t> offsets(Hkv + 1);
  KVSCOPE_CUDA_TRY(cudaMemcpyAsync(offsets.data(), c.slot_offsets, sizeof(std::int32_t) * (Hkv + 1),
                                   cudaMemcpyDeviceToHost, stream));
  KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
  if (offsets[0] != 0) return Status::Invalid(f + "cache.slot_offsets[0] must be 0");
  int max_slots = 0;
  for (int h = 0; h < Hkv; ++h) {
    if (offsets[h + 1] < offsets[h])
      return Status::Invalid(f + "cache.slot_offsets decreases at head " + std::to_string(h));
    max_slots = std::max(max_slots, offsets[h + 1] - offsets[h]);
  }
  const int total = offsets[Hkv];
  if (total > 0 && (!c.k || !c.v || !c.slot_modality)) {
    return Status::Invalid(f + "cache.k, cache.v and cache.slot_modality must not be null");
  }
  const long long ld_slots = std::max(max_slots, 1);

  // Workspace (floats): Zf [R, T] | Zc, Ec, A [R, ld_slots] each | O, Oc [R, D] | stats [R, kStats] | flag.
  const long long n_zf = R * T, n_slot = R * ld_slots, n_o = R * D, n_st = R * kStats;
  const std::size_t ws_floats = n_zf + 3 * n_slot + 2 * n_o + n_st + 1;
  float* ws = nullptr;
  KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&ws), ws_floats * sizeof(float), stream));
  float* zf = ws;
  float* zc = zf + n_zf;
  float* ec = zc + n_slot;
  float* am = ec + n_slot;
  float* o = am + n_slot;
  float* oc = o + n_o;
  float* stats = oc + n_o;
  int* bad = reinterpret_cast<int*>(stats + n_st);

  auto run = [&]() -> Status {
    KVSCOPE_CUDA_TRY(cudaMemsetAsync(am, 0, sizeof(float) * (n_slot + 2 * n_o + n_st + 1), stream));
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const Source full{k, p.dtype, nullptr, T};
    const Source full_v{v, p.dtype, nullptr, T};
    const Source comp{c.k, DType::kF32, c.slot_offsets, T};
    const Source comp_v{c.v, DType::kF32, c.slot_offsets, T};
    const Multiplicity no_mult{nullptr, nullptr, false};
    const Multiplicity mult{c.multiplicity_f32, c.multiplicity_i32, p.proportional_attention};
    if (total > 0) {
      validate_slots_kernel<<<cdiv(total, 256), 256, 0, stream>>>(total, c.slot_modality, c.multiplicity_f32,
                                                                  c.multiplicity_i32, bad);
      KVSCOPE_CUDA_CHECK_LAUNCH("validate_slots_kernel");
    }
    // Full attention.
    logits_kernel<<<dim3(cdiv(T, kTile), cdiv(M, kTile), Hkv), kGemmThreads, 0, stream>>>(
        q, p.dtype, M, D, full, no_mult, scale, zf, T);
    KVSCOPE_CUDA_CHECK_LAUNCH("logits_kernel(full)");
    full_stats_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(
        zf, T, M, modality, c.token_to_slot, c.slot_offsets, am, ld_slots, stats, bad);
    KVSCOPE_CUDA_CHECK_LAUNCH("full_stats_kernel");
    int splits = 0, split_len = 0;
    pv_splits(T, Hkv, &splits, &split_len);
    pv_kernel<<<dim3(cdiv(D, kTile), cdiv(M, kTile), Hkv * splits), kGemmThreads, 0, stream>>>(
        zf, T, M, D, full_v, splits, split_len, o);
    KVSCOPE_CUDA_CHECK_LAUNCH("pv_kernel(full)");
    // Compressed attention.
    if (max_slots > 0) {
      logits_kernel<<<dim3(cdiv(max_slots, kTile), cdiv(M, kTile), Hkv), kGemmThreads, 0, stream>>>(
          q, p.dtype, M, D, comp, mult, scale, zc, ld_slots);
      KVSCOPE_CUDA_CHECK_LAUNCH("logits_kernel(compressed)");
    }
    compressed_stats_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(
        zc, ec, ld_slots, M, c.slot_offsets, c.slot_modality, stats);
    KVSCOPE_CUDA_CHECK_LAUNCH("compressed_stats_kernel");
    if (max_slots > 0) {
      pv_splits(max_slots, Hkv, &splits, &split_len);
      pv_kernel<<<dim3(cdiv(D, kTile), cdiv(M, kTile), Hkv * splits), kGemmThreads, 0, stream>>>(
          ec, ld_slots, M, D, comp_v, splits, split_len, oc);
      KVSCOPE_CUDA_CHECK_LAUNCH("pv_kernel(compressed)");
    }
    finalize_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(M, D, c.slot_offsets, o, oc, zc, am,
                                                                          ld_slots, stats, nullptr, out, bad);
    KVSCOPE_CUDA_CHECK_LAUNCH("finalize_kernel");
    int host_bad = 0;
    KVSCOPE_CUDA_TRY(cudaMemcpyAsync(&host_bad, bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
    KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
    if (host_bad == 1) {
      return Status::Invalid(
          f + "modality code >= 4 or cache.token_to_slot out of [-1, S_h) (outputs undefined)");
    }
    if (host_bad == 3) return Status::Invalid(f + kNotFinite);
    if (host_bad == 2) {
      return Status::Invalid(f + "cache.slot_modality >= 4 or a multiplicity not > 0 (outputs undefined)");
    }
    return Status::Ok();
  };
  const Status st = run();
  const cudaError_t free_err = cudaFreeAsync(ws, stream);
  if (!st.ok()) return st;
  return cuda_status(free_err, "cudaFreeAsync(evaluate workspace)");
}

Status full_attention(const EvaluateParams& p, const void* q, const void* k, const void* v,
                      const std::uint8_t* modality, const FullAttention& full, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::full_attention", kEvaluate);
  const std::string f = "full_attention: ";
  KVSCOPE_RETURN_IF_ERROR(validate_sizes(p, f));
  if (!q || !k || !v) return Status::Invalid(f + "q, k and v must not be null");
  if (!full.probs || !full.output || !full.entropy) {
    return Status::Invalid(f + "full.probs, full.output and full.entropy must not be null");
  }
  if (full.modality_mass && !modality) return Status::Invalid(f + "modality must not be null");
  const int Hkv = p.num_kv_heads, T = p.num_tokens, D = p.head_dim;
  const int M = (p.num_q_heads / Hkv) * p.num_queries;
  const long long R = static_cast<long long>(p.num_q_heads) * p.num_queries;
  int* bad = nullptr;
  KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&bad), sizeof(int), stream));
  auto run = [&]() -> Status {
    KVSCOPE_CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof(int), stream));
    KVSCOPE_CUDA_TRY(
        cudaMemsetAsync(full.output, 0, sizeof(float) * R * D, stream));  // pv_kernel accumulates
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    logits_kernel<<<dim3(cdiv(T, kTile), cdiv(M, kTile), Hkv), kGemmThreads, 0, stream>>>(
        q, p.dtype, M, D, Source{k, p.dtype, nullptr, T}, Multiplicity{nullptr, nullptr, false}, scale,
        full.probs, T);
    KVSCOPE_CUDA_CHECK_LAUNCH("logits_kernel(full_attention)");
    full_softmax_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(
        full.probs, T, full.modality_mass ? modality : nullptr, full.entropy, full.modality_mass, bad);
    KVSCOPE_CUDA_CHECK_LAUNCH("full_softmax_kernel");
    int splits = 0, split_len = 0;
    pv_splits(T, Hkv, &splits, &split_len);
    pv_kernel<<<dim3(cdiv(D, kTile), cdiv(M, kTile), Hkv * splits), kGemmThreads, 0, stream>>>(
        full.probs, T, M, D, Source{v, p.dtype, nullptr, T}, splits, split_len, full.output);
    KVSCOPE_CUDA_CHECK_LAUNCH("pv_kernel(full_attention)");
    int host_bad = 0;
    KVSCOPE_CUDA_TRY(cudaMemcpyAsync(&host_bad, bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
    KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
    if (host_bad == 3) return Status::Invalid(f + kNotFinite);
    if (host_bad != 0) return Status::Invalid(f + "modality code >= 4 (modality_mass undefined)");
    return Status::Ok();
  };
  const Status st = run();
  const cudaError_t free_err = cudaFreeAsync(bad, stream);
  if (!st.ok()) return st;
  return cuda_status(free_err, "cudaFreeAsync(full_attention flag)");
}

Status evaluate_attention(const EvaluateParams& p, const void* q, const std::uint8_t* modality,
                          const FullAttention& full, const CompressedCache& c, const EvaluateOutputs& out,
                          cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::evaluate_attention(full)", kEvaluate);
  const std::string f = "evaluate_attention: ";
  if (!full.probs || !full.output || !full.entropy) {
    return Status::Invalid(f + "full.probs, full.output and full.entropy must not be null");
  }
  // full.probs / full.output stand in for k / v in the shared null checks.
  KVSCOPE_RETURN_IF_ERROR(validate(p, q, full.probs, full.output, modality, c, out));
  const int Hkv = p.num_kv_heads, T = p.num_tokens, D = p.head_dim;
  const int M = (p.num_q_heads / Hkv) * p.num_queries;
  const long long R = static_cast<long long>(p.num_q_heads) * p.num_queries;

  std::vector<std::int32_t> offsets(Hkv + 1);
  KVSCOPE_CUDA_TRY(cudaMemcpyAsync(offsets.data(), c.slot_offsets, sizeof(std::int32_t) * (Hkv + 1),
                                   cudaMemcpyDeviceToHost, stream));
  KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
  if (offsets[0] != 0) return Status::Invalid(f + "cache.slot_offsets[0] must be 0");
  int max_slots = 0;
  for (int h = 0; h < Hkv; ++h) {
    if (offsets[h + 1] < offsets[h])
      return Status::Invalid(f + "cache.slot_offsets decreases at head " + std::to_string(h));
    max_slots = std::max(max_slots, offsets[h + 1] - offsets[h]);
  }
  const int total = offsets[Hkv];
  if (total > 0 && (!c.k || !c.v || !c.slot_modality)) {
    return Status::Invalid(f + "cache.k, cache.v and cache.slot_modality must not be null");
  }
  const long long ld_slots = std::max(max_slots, 1);

  // Workspace (floats): Zc, Ec, A [R, ld_slots] each | Oc [R, D] | stats [R, kStats] | flag.
  const long long n_slot = R * ld_slots, n_o = R * D, n_st = R * kStats;
  const std::size_t ws_floats = 3 * n_slot + n_o + n_st + 1;
  float* ws = nullptr;
  KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&ws), ws_floats * sizeof(float), stream));
  float* zc = ws;
  float* ec = zc + n_slot;
  float* am = ec + n_slot;
  float* oc = am + n_slot;
  float* stats = oc + n_o;
  int* bad = reinterpret_cast<int*>(stats + n_st);

  auto run = [&]() -> Status {
    KVSCOPE_CUDA_TRY(cudaMemsetAsync(am, 0, sizeof(float) * (n_slot + n_o + n_st + 1), stream));
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    if (total > 0) {
      validate_slots_kernel<<<cdiv(total, 256), 256, 0, stream>>>(total, c.slot_modality, c.multiplicity_f32,
                                                                  c.multiplicity_i32, bad);
      KVSCOPE_CUDA_CHECK_LAUNCH("validate_slots_kernel");
    }
    probs_stats_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(
        full.probs, T, M, modality, c.token_to_slot, c.slot_offsets, am, ld_slots, stats, bad);
    KVSCOPE_CUDA_CHECK_LAUNCH("probs_stats_kernel");
    if (max_slots > 0) {
      logits_kernel<<<dim3(cdiv(max_slots, kTile), cdiv(M, kTile), Hkv), kGemmThreads, 0, stream>>>(
          q, p.dtype, M, D, Source{c.k, DType::kF32, c.slot_offsets, T},
          Multiplicity{c.multiplicity_f32, c.multiplicity_i32, p.proportional_attention}, scale, zc,
          ld_slots);
      KVSCOPE_CUDA_CHECK_LAUNCH("logits_kernel(compressed)");
    }
    compressed_stats_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(
        zc, ec, ld_slots, M, c.slot_offsets, c.slot_modality, stats);
    KVSCOPE_CUDA_CHECK_LAUNCH("compressed_stats_kernel");
    if (max_slots > 0) {
      int splits = 0, split_len = 0;
      pv_splits(max_slots, Hkv, &splits, &split_len);
      pv_kernel<<<dim3(cdiv(D, kTile), cdiv(M, kTile), Hkv * splits), kGemmThreads, 0, stream>>>(
          ec, ld_slots, M, D, Source{c.v, DType::kF32, c.slot_offsets, T}, splits, split_len, oc);
      KVSCOPE_CUDA_CHECK_LAUNCH("pv_kernel(compressed)");
    }
    finalize_kernel<<<static_cast<unsigned>(R), kRowThreads, 0, stream>>>(
        M, D, c.slot_offsets, full.output, oc, zc, am, ld_slots, stats, full.entropy, out, bad);
    KVSCOPE_CUDA_CHECK_LAUNCH("finalize_kernel");
    int host_bad = 0;
    KVSCOPE_CUDA_TRY(cudaMemcpyAsync(&host_bad, bad, sizeof(int), cudaMemcpyDeviceToHost, stream));
    KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
    if (host_bad == 1) {
      return Status::Invalid(
          f + "modality code >= 4 or cache.token_to_slot out of [-1, S_h) (outputs undefined)");
    }
    if (host_bad == 3) return Status::Invalid(f + kNotFinite);
    if (host_bad == 2) {
      return Status::Invalid(f + "cache.slot_modality >= 4 or a multiplicity not > 0 (outputs undefined)");
    }
    return Status::Ok();
  };
  const Status st = run();
  const cudaError_t free_err = cudaFreeAsync(ws, stream);
  if (!st.ok()) return st;
  return cuda_status(free_err, "cudaFreeAsync(evaluate workspace)");
}

}  // namespace kvscope::kernels::cuda
