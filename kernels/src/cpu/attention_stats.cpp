// CPU backend of the attention statistics. Work item: one query head x a block of
// up to kQueryBlock query rows. The block's logits [Bq, Tk'] come from one
// single-threaded cblas_sgemm on fp32 copies of Q and K (K converted once per kv
// head, Tk' = the last key any row of the block can see), then each row is masked
// and soft-maxed in place (fp32, max subtracted, vectorised exp). OpenMP runs the
// blocks in parallel; OpenBLAS is kept at one thread (pin_blas_to_one_thread) so
// its own pool never competes with the OpenMP team. Per-block accumulators are
// reduced in block order, so results do not depend on the number of threads.
#include "kvscope/kernels/attention_stats.hpp"

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/nvtx.hpp"
#include "row_math.hpp"
#include "simd.hpp"

namespace kvscope::kernels::cpu {
namespace {

using rowmath::exp_vec;
using rowmath::to_float;

using detail::key_limit;
using detail::key_visible;
using detail::query_position;

// Below this many elementary operations a loop runs on the calling thread:
// waking the OpenMP team costs more than the work.
constexpr double kMinParallelWork = 32768.0;
// Query rows per work item: the [kQueryBlock, Tk] logits block stays in L2 for
// llava-sized T and the sgemm is tall enough to run near peak.
constexpr int kQueryBlock = 64;

// K of one kv head as float, cached per thread: points into the input for fp32,
// else converted when the head changes.
class FloatKeys {
 public:
  const float* head(const AttentionProblem& a, int h) {
    const std::size_t n = static_cast<std::size_t>(a.k_len) * a.head_dim;
    const std::size_t base = static_cast<std::size_t>(h) * n;
    if (a.dtype == DType::kF32) return static_cast<const float*>(a.k) + base;
    if (h != cached_) {
      buf_.resize(n);
      to_float(a.k, a.dtype, base, n, buf_.data());
      cached_ = h;
    }
    return buf_.data();
  }

 private:
  std::vector<float> buf_;
  int cached_ = -1;
};

// max of x[0, n) (-inf for n = 0) with 16 independent lanes, so that it vectorises.
inline float row_max(const float* x, int n) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = -std::numeric_limits<float>::infinity();
  int t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = lane[l] > x[t + l] ? lane[l] : x[t + l];
  for (; t < n; ++t) lane[0] = lane[0] > x[t] ? lane[0] : x[t];
  float m = lane[0];
  for (int l = 1; l < kLanes; ++l) m = m > lane[l] ? m : lane[l];
  return m;
}

// Thread-local buffers of one work item.
struct BlockScratch {
  std::vector<float> q;    // [kQueryBlock, head_dim]
  std::vector<float> p;    // [kQueryBlock, ld] logits, then probabilities
  std::vector<int> limit;  // [kQueryBlock] keys >= limit[r] are invisible to row r
  int ld = 0;              // row stride of p
};

// Attention rows (j, i) for i in [i0, i1) into s.p: row r = i - i0 holds p(i, t)
// for t < s.limit[r] (masked keys inside the limit are 0; a row with no visible
// key gets limit 0).
void attention_block(const AttentionProblem& a, const float* keys, int j, int i0, int i1, BlockScratch& s) {
  const int D = a.head_dim, nr = i1 - i0;
  int block_limit = 0;
  for (int r = 0; r < nr; ++r) {
    s.limit[r] = key_limit(a, query_position(a, i0 + r));
    block_limit = std::max(block_limit, s.limit[r]);
  }
  if (block_limit == 0) return;
  to_float(a.q, a.dtype, (static_cast<std::size_t>(j) * a.q_len + i0) * D, static_cast<std::size_t>(nr) * D,
           s.q.data());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  s.ld = block_limit;
  // logits[r, t] = scale * q_r . k_t for t < block_limit.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, block_limit, D, scale, s.q.data(), D, keys, D,
              0.0f, s.p.data(), s.ld);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool masked = a.causal && a.k_pos != nullptr;  // else visibility is exactly t < limit
  for (int r = 0; r < nr; ++r) {
    float* p = s.p.data() + static_cast<std::size_t>(r) * s.ld;
    const int limit = s.limit[r];
    if (masked) {  // explicit key positions: visible iff k_pos[t] <= qpos
      const std::int32_t qpos = query_position(a, i0 + r);
      const std::int32_t* kp = a.k_pos;
      for (int t = 0; t < limit; ++t) p[t] = kp[t] <= qpos ? p[t] : neg_inf;
    }
    const float m = row_max(p, limit);
    if (m == neg_inf) {
      s.limit[r] = 0;
      continue;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < limit; ++t) {
      const float e = exp_vec(p[t] - m);  // masked keys: exp(-inf) = 0
      p[t] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
    for (int t = 0; t < limit; ++t) p[t] *= inv;
  }
}

// Runs attention_block over every (query head, block of rows in [q_begin, q_end))
// and calls use_block(task, j, i0, i1, s) after each, task = (h - h0) * G * nblocks
// + g * nblocks + block for kv heads of the current wave [h0, h1), so callers can
// keep one accumulator per task; after_wave(h0, h1) then runs on the calling thread.
// Waves bound such accumulators to about kWaveFloats and keep the number of OpenMP
// barriers small (one wave for llava-sized layers).
constexpr double kWaveFloats = 16.0 * 1024 * 1024;
int wave_heads(const AttentionProblem& a, int q_begin, int q_end, int accumulators = 1) {
  const int G = a.num_q_heads / a.num_kv_heads;
  const double per_head =
      static_cast<double>(G) * ((q_end - q_begin + kQueryBlock - 1) / kQueryBlock) * a.k_len * accumulators;
  return static_cast<int>(std::clamp(kWaveFloats / per_head, 1.0, static_cast<double>(a.num_kv_heads)));
}

template <typename UseBlock, typename AfterWave>
void for_each_block(const AttentionProblem& a, int q_begin, int q_end, UseBlock use_block,
                    AfterWave after_wave, int accumulators = 1) {
  pin_blas_to_one_thread();  // sgemm inside OpenMP regions, and results independent of the BLAS kernel
  const int G = a.num_q_heads / a.num_kv_heads;
  const int nblocks = (q_end - q_begin + kQueryBlock - 1) / kQueryBlock;
  const int wave = wave_heads(a, q_begin, q_end, accumulators);
  for (int h0 = 0; h0 < a.num_kv_heads; h0 += wave) {
    const int h1 = std::min(a.num_kv_heads, h0 + wave);
    const int tasks = (h1 - h0) * G * nblocks;
    const double work = static_cast<double>(h1 - h0) * G * (q_end - q_begin) * a.k_len * a.head_dim;
#pragma omp parallel if (work >= kMinParallelWork)
    {
      FloatKeys fk;
      BlockScratch s;
      s.q.resize(static_cast<std::size_t>(kQueryBlock) * a.head_dim);
      s.p.resize(static_cast<std::size_t>(kQueryBlock) * a.k_len);
      s.limit.resize(kQueryBlock);
#pragma omp for schedule(dynamic, 1)
      for (int task = 0; task < tasks; ++task) {
        const int h = h0 + task / (G * nblocks), g = task / nblocks % G, b = task % nblocks;
        const int i0 = q_begin + b * kQueryBlock, i1 = std::min(q_end, i0 + kQueryBlock);
        attention_block(a, fk.head(a, h), h * G + g, i0, i1, s);
        use_block(task, h * G + g, i0, i1, s);
      }
    }
    after_wave(h0, h1);
  }
}

// Sums rows [q_begin, q_end) into N outputs out[n][j, t] through
// `add_row(j, i, p, limit, acc)`, which adds one row into the block's N accumulators acc[n][k_len].
// Blocks are reduced in index order.
template <int N, typename AddRow>
void accumulate_rows_n(const AttentionProblem& a, int q_begin, int q_end, float* const (&out)[N],
                       AddRow add_row) {
  const int Tk = a.k_len;
  const int G = a.num_q_heads / a.num_kv_heads;
  const int nblocks = (q_end - q_begin + kQueryBlock - 1) / kQueryBlock;
  const std::size_t per =
      static_cast<std::size_t>(wave_heads(a, q_begin, q_end, N)) * G * nblocks * static_cast<std::size_t>(Tk);
  std::vector<float> partial(per * N);
  for_each_block(
      a, q_begin, q_end,
      [&](int task, int j, int i0, int i1, const BlockScratch& s) {
        float* acc[N];
        for (int n = 0; n < N; ++n) {
          acc[n] = partial.data() + static_cast<std::size_t>(n) * per + static_cast<std::size_t>(task) * Tk;
          std::fill(acc[n], acc[n] + Tk, 0.0f);
        }
        for (int i = i0; i < i1; ++i) {
          add_row(j, i, s.p.data() + static_cast<std::size_t>(i - i0) * s.ld, s.limit[i - i0], acc);
        }
      },
      [&](int h0, int h1) {
        const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(h1 - h0) * G * Tk;  // rows (j, t) of the wave
#pragma omp parallel for schedule(static) if (static_cast <double>(n) * nblocks * N >= kMinParallelWork)
        for (std::ptrdiff_t e = 0; e < n; ++e) {
          const std::ptrdiff_t jw = e / Tk, t = e % Tk;  // query head within the wave
          for (int o = 0; o < N; ++o) {
            const float* part = partial.data() + static_cast<std::size_t>(o) * per;
            float sum = 0.0f;
            for (int b = 0; b < nblocks; ++b)
              sum += part[(static_cast<std::size_t>(jw) * nblocks + b) * Tk + t];
            out[o][static_cast<std::size_t>(h0) * G * Tk + e] = sum;
          }
        }
      },
      N);
}

// accumulate_rows_n with one output.
template <typename AddRow>
void accumulate_rows(const AttentionProblem& a, int q_begin, int q_end, float* out, AddRow add_row) {
  float* const outs[1] = {out};
  accumulate_rows_n<1>(
      a, q_begin, q_end, outs,
      [&](int j, int i, const float* p, int limit, float* const* acc) { add_row(j, i, p, limit, acc[0]); });
}

// n_t of cross_modal_interaction: the queries of another modality than key t that can see it,
// then received[j, t] /= n_t (0 where n_t = 0).
void divide_by_other_modality_queries(const AttentionProblem& a, const std::uint8_t* mq,
                                      const std::uint8_t* mk, float* received) {
  const int T = a.k_len;
  std::vector<int> count(T);
#pragma omp parallel for schedule(static) if (static_cast <double>(T) * a.q_len >= kMinParallelWork)
  for (int t = 0; t < T; ++t) {
    int n = 0;
    for (int i = 0; i < a.q_len; ++i) {
      n += (mq[i] != mk[t] && key_visible(a, query_position(a, i), t)) ? 1 : 0;
    }
    count[t] = n;
  }
#pragma omp parallel for schedule(static) if (static_cast <double>(a.num_q_heads) * T >= kMinParallelWork)
  for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(a.num_q_heads) * T; ++e) {
    const int n = count[e % T];
    received[e] = n > 0 ? received[e] / static_cast<float>(n) : 0.0f;
  }
}

// Calls `use_row(j, i, p, limit)` for every row of the problem, in parallel.
template <typename UseRow>
void for_each_row(const AttentionProblem& a, UseRow use_row) {
  for_each_block(
      a, 0, a.q_len,
      [&](int, int j, int i0, int i1, const BlockScratch& s) {
        for (int i = i0; i < i1; ++i) {
          use_row(j, i, s.p.data() + static_cast<std::size_t>(i - i0) * s.ld, s.limit[i - i0]);
        }
      },
      [](int, int) {});
}

Status check_modality(const std::uint8_t* m, int n, const char* fn, const char* name) {
  if (m == nullptr) return Status::Invalid(std::string(fn) + ": " + name + " is null");
  for (int t = 0; t < n; ++t) {
    if (m[t] >= kNumModalities) {
      return Status::Invalid(std::string(fn) + ": " + name + "[" + std::to_string(t) +
                             "] = " + std::to_string(m[t]) + " is not a modality code 0..3");
    }
  }
  return Status::Ok();
}

}  // namespace

Status validate_attention_problem(const AttentionProblem& a, const char* fn) {
  const std::string f(fn);
  if (a.q == nullptr) return Status::Invalid(f + ": q is null");
  if (a.k == nullptr) return Status::Invalid(f + ": k is null");
  if (a.num_q_heads <= 0 || a.num_kv_heads <= 0 || a.q_len <= 0 || a.k_len <= 0 || a.head_dim <= 0) {
    return Status::Invalid(f + ": sizes must be positive (num_q_heads " + std::to_string(a.num_q_heads) +
                           ", num_kv_heads " + std::to_string(a.num_kv_heads) + ", q_len " +
                           std::to_string(a.q_len) + ", k_len " + std::to_string(a.k_len) + ", head_dim " +
                           std::to_string(a.head_dim) + ")");
  }
  if (a.num_q_heads % a.num_kv_heads != 0) {
    return Status::Invalid(f + ": num_q_heads " + std::to_string(a.num_q_heads) +
                           " is not a multiple of num_kv_heads " + std::to_string(a.num_kv_heads));
  }
  if (a.dtype != DType::kF32 && a.dtype != DType::kF16 && a.dtype != DType::kBF16) {
    return Status::Invalid(f + ": unknown dtype");
  }
  return Status::Ok();
}

Status accumulated_attention(const AttentionProblem& a, QueryRange range, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::accumulated_attention", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, "accumulated_attention"));
  if (out == nullptr) return Status::Invalid("accumulated_attention: out is null");
  const int end = range.end < 0 ? a.q_len : range.end;
  if (range.begin < 0 || range.begin >= end || end > a.q_len) {
    return Status::Invalid("accumulated_attention: query range [" + std::to_string(range.begin) + ", " +
                           std::to_string(range.end) + ") is empty or outside q_len " +
                           std::to_string(a.q_len));
  }
  accumulate_rows(a, range.begin, end, out, [](int, int, const float* p, int limit, float* acc) {
    for (int t = 0; t < limit; ++t) acc[t] += p[t];
  });
  return Status::Ok();
}

Status reduce_to_kv_heads(const float* in, int num_q_heads, int num_kv_heads, int len, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::reduce_to_kv_heads", kAttentionStats);
  if (in == nullptr || out == nullptr) return Status::Invalid("reduce_to_kv_heads: in or out is null");
  if (num_q_heads <= 0 || num_kv_heads <= 0 || len <= 0) {
    return Status::Invalid("reduce_to_kv_heads: num_q_heads, num_kv_heads and len must be positive");
  }
  if (num_q_heads % num_kv_heads != 0) {
    return Status::Invalid("reduce_to_kv_heads: num_q_heads " + std::to_string(num_q_heads) +
                           " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  }
  const int G = num_q_heads / num_kv_heads;
#pragma omp parallel for schedule(static) if (static_cast <double>(num_q_heads) * len >= kMinParallelWork)
  for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(num_kv_heads) * len; ++e) {
    const std::ptrdiff_t h = e / len, t = e % len;
    float s = 0.0f;
    for (int g = 0; g < G; ++g) s += in[(h * G + g) * len + t];
    out[e] = s;
  }
  return Status::Ok();
}

Status snapkv_scores(const AttentionProblem& a, const SnapKVParams& params, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::snapkv_scores", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, "snapkv_scores"));
  if (out == nullptr) return Status::Invalid("snapkv_scores: out is null");
  if (params.window <= 0 || params.window > a.q_len) {
    return Status::Invalid("snapkv_scores: window " + std::to_string(params.window) + " outside 1..q_len " +
                           std::to_string(a.q_len));
  }
  if (params.kernel_size <= 0 || params.kernel_size % 2 == 0) {
    return Status::Invalid("snapkv_scores: kernel_size " + std::to_string(params.kernel_size) +
                           " must be odd and positive");
  }
  std::vector<float> sums(static_cast<std::size_t>(a.num_q_heads) * a.k_len);
  KVSCOPE_RETURN_IF_ERROR(snapkv_window_sums(a, params.window, sums.data()));
  return snapkv_pool(sums.data(), a.num_q_heads, a.k_len, params, out);
}

Status snapkv_window_sums(const AttentionProblem& a, int window, float* sums) {
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, "snapkv_window_sums"));
  if (sums == nullptr) return Status::Invalid("snapkv_window_sums: sums is null");
  if (window <= 0 || window > a.q_len) {
    return Status::Invalid("snapkv_window_sums: window " + std::to_string(window) + " outside 1..q_len " +
                           std::to_string(a.q_len));
  }
  accumulate_rows(a, a.q_len - window, a.q_len, sums, [](int, int, const float* p, int limit, float* acc) {
    for (int t = 0; t < limit; ++t) acc[t] += p[t];
  });
  return Status::Ok();
}

Status snapkv_pool(const float* sums, int heads, int len, const SnapKVParams& params, float* out) {
  return snapkv_pool_split(sums, heads, len, len, params, out);
}

Status snapkv_pool_split(const float* sums, int heads, int len, int edge, const SnapKVParams& params, float* out) {
  if (sums == nullptr || out == nullptr) return Status::Invalid("snapkv_pool: sums or out is null");
  if (heads <= 0 || len <= 0) return Status::Invalid("snapkv_pool: heads and len must be positive");
  if (params.kernel_size <= 0 || params.kernel_size % 2 == 0) {
    return Status::Invalid("snapkv_pool: kernel_size " + std::to_string(params.kernel_size) +
                           " must be odd and positive");
  }
  if (edge < 0 || edge > len) {
    return Status::Invalid("snapkv_pool_split: edge " + std::to_string(edge) + " outside 0.." + std::to_string(len));
  }
  const int Tk = len;
  const int r = params.kernel_size / 2;
  const bool avg = params.pool == PoolKind::kAvg;
  const float inv_k = 1.0f / static_cast<float>(params.kernel_size);
#pragma omp parallel for schedule(static) if (static_cast <double>(heads) * Tk * params.kernel_size >= \
                                              kMinParallelWork)
  for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(heads) * Tk; ++e) {
    const int t = static_cast<int>(e % Tk);
    const float* row = sums + (e - t);
    const int lo = std::max(t < edge ? 0 : edge, t - r), hi = std::min((t < edge ? edge : Tk) - 1, t + r);
    float v = avg ? 0.0f : row[lo];
    for (int u = lo; u <= hi; ++u) v = avg ? v + row[u] : std::max(v, row[u]);
    out[e] = avg ? v * inv_k : v;
  }
  return Status::Ok();
}

Status tova_scores(const AttentionProblem& a, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::tova_scores", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, "tova_scores"));
  if (out == nullptr) return Status::Invalid("tova_scores: out is null");
  return accumulated_attention(a, QueryRange{a.q_len - 1, a.q_len}, out);
}

Status attention_row_stats(const AttentionProblem& a, const std::uint8_t* k_modality, float* entropy,
                           float* modality_mass) {
  KVSCOPE_NVTX_RANGE("cpu::attention_row_stats", kAttentionStats);
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, "attention_row_stats"));
  if (entropy == nullptr && modality_mass == nullptr) {
    return Status::Invalid("attention_row_stats: entropy and modality_mass are both null");
  }
  if (modality_mass != nullptr) {
    KVSCOPE_RETURN_IF_ERROR(check_modality(k_modality, a.k_len, "attention_row_stats", "k_modality"));
  }
  const int Tq = a.q_len;
  for_each_row(a, [&](int j, int i, const float* p, int limit) {
    const std::size_t row = static_cast<std::size_t>(j) * Tq + i;
    if (entropy != nullptr) {
      float h = 0.0f;
      for (int t = 0; t < limit; ++t) h -= p[t] > 0.0f ? p[t] * std::log(p[t]) : 0.0f;
      entropy[row] = h;
    }
    if (modality_mass != nullptr) {
      float mass[kNumModalities] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int t = 0; t < limit; ++t) mass[k_modality[t]] += p[t];
      for (int m = 0; m < kNumModalities; ++m) modality_mass[row * kNumModalities + m] = mass[m];
    }
  });
  return Status::Ok();
}

Status cross_modal_interaction(const AttentionProblem& a, const std::uint8_t* k_modality,
                               const std::uint8_t* q_modality, float* received, float* given) {
  KVSCOPE_NVTX_RANGE("cpu::cross_modal_interaction", kAttentionStats);
  const char* fn = "cross_modal_interaction";
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, fn));
  if (a.q_len != a.k_len) {
    return Status::Invalid(std::string(fn) + ": needs a prefill with q_len == k_len (got " +
                           std::to_string(a.q_len) + " and " + std::to_string(a.k_len) + ")");
  }
  if (received == nullptr && given == nullptr) {
    return Status::Invalid(std::string(fn) + ": received and given are both null");
  }
  KVSCOPE_RETURN_IF_ERROR(check_modality(k_modality, a.k_len, fn, "k_modality"));
  const std::uint8_t* mq = q_modality != nullptr ? q_modality : k_modality;
  if (q_modality != nullptr) KVSCOPE_RETURN_IF_ERROR(check_modality(q_modality, a.q_len, fn, "q_modality"));
  const std::uint8_t* mk = k_modality;
  const int T = a.k_len;

  // One pass over the attention rows produces both outputs.
  const auto given_row = [&](int j, int i, const float* p, int limit) {
    float s = 0.0f;
    for (int t = 0; t < limit; ++t) s += mk[t] != mq[i] ? p[t] : 0.0f;
    given[static_cast<std::size_t>(j) * T + i] = s;
  };
  if (received == nullptr) {
    for_each_row(a, given_row);
    return Status::Ok();
  }
  accumulate_rows(a, 0, a.q_len, received, [&](int j, int i, const float* p, int limit, float* acc) {
    const std::uint8_t qm = mq[i];
    for (int t = 0; t < limit; ++t) acc[t] += mk[t] != qm ? p[t] : 0.0f;
    if (given != nullptr) given_row(j, i, p, limit);
  });
  divide_by_other_modality_queries(a, mq, mk, received);
  return Status::Ok();
}

Status prefill_attention_sums(const AttentionProblem& a, const std::uint8_t* k_modality, float* h2o,
                              float* received, float* given) {
  KVSCOPE_NVTX_RANGE("cpu::prefill_attention_sums", kAttentionStats);
  const char* fn = "prefill_attention_sums";
  KVSCOPE_RETURN_IF_ERROR(validate_attention_problem(a, fn));
  if (a.q_len != a.k_len) {
    return Status::Invalid(std::string(fn) + ": needs a prefill with q_len == k_len (got " +
                           std::to_string(a.q_len) + " and " + std::to_string(a.k_len) + ")");
  }
  if (h2o == nullptr || received == nullptr || given == nullptr) {
    return Status::Invalid(std::string(fn) + ": h2o, received and given must not be null");
  }
  KVSCOPE_RETURN_IF_ERROR(check_modality(k_modality, a.k_len, fn, "k_modality"));
  const std::uint8_t* mk = k_modality;
  const int T = a.k_len;
  float* const outs[2] = {h2o, received};
  // Each row adds exactly what accumulated_attention and cross_modal_interaction add.
  accumulate_rows_n<2>(a, 0, a.q_len, outs, [&](int j, int i, const float* p, int limit, float* const* acc) {
    const std::uint8_t qm = mk[i];
    float* col = acc[0];
    float* rec = acc[1];
    float s = 0.0f;
    for (int t = 0; t < limit; ++t) {
      col[t] += p[t];
      rec[t] += mk[t] != qm ? p[t] : 0.0f;
    }
    for (int t = 0; t < limit; ++t) s += mk[t] != qm ? p[t] : 0.0f;  // in t order, as cross_modal_interaction
    given[static_cast<std::size_t>(j) * T + i] = s;
  });
  divide_by_other_modality_queries(a, mk, mk, received);
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
