// CPU backend of the attention statistics: OpenMP over (query head, query
// chunk), one attention row at a time (never a [Tq, Tk] matrix), per-chunk
// accumulators reduced in a fixed order so results do not depend on the
// number of threads.
#include "kvscope/kernels/attention_stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cpu {
namespace {

using detail::key_limit;
using detail::key_visible;
using detail::query_position;

// Below this many elementary operations a loop runs on the calling thread:
// waking the OpenMP team costs more than the work.
constexpr double kMinParallelWork = 32768.0;

// K of one kv head as float: points into the input for fp32, else converted.
class FloatKeys {
 public:
  const float* head(const AttentionProblem& a, int h) {
    const std::size_t n = static_cast<std::size_t>(a.k_len) * a.head_dim;
    const std::size_t base = static_cast<std::size_t>(h) * n;
    if (a.dtype == DType::kF32) return static_cast<const float*>(a.k) + base;
    buf_.resize(n);
    float* dst = buf_.data();
    const void* src = a.k;
    const DType dt = a.dtype;
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
    for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(n); ++e) {
      dst[e] = load_element(src, dt, base + static_cast<std::size_t>(e));
    }
    return dst;
  }

 private:
  std::vector<float> buf_;
};

// Dot product with 8 independent fp32 partial sums (vectorisable in a fixed
// order, so results do not depend on the compiler's choices).
inline float dot8(const float* a, const float* b, int n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[d + l] * b[d + l];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Computes attention row (j, i) into p[0, limit); keys >= limit are invisible
// (p = 0, not written). Returns limit, or 0 when no key is visible.
// qrow: scratch [head_dim].
int attention_row(const AttentionProblem& a, const float* keys, int j, int i, float* qrow, float* p) {
  const int D = a.head_dim;
  const std::size_t qbase = (static_cast<std::size_t>(j) * a.q_len + i) * D;
  for (int d = 0; d < D; ++d) qrow[d] = load_element(a.q, a.dtype, qbase + d);
  const std::int32_t qpos = query_position(a, i);
  const int limit = key_limit(a, qpos);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m = neg_inf;
  for (int t = 0; t < limit; ++t) {
    if (!key_visible(a, qpos, t)) {
      p[t] = neg_inf;
      continue;
    }
    const float s = dot8(qrow, keys + static_cast<std::size_t>(t) * D, D) * scale;
    p[t] = s;
    m = std::max(m, s);
  }
  if (m == neg_inf) {
    std::fill(p, p + limit, 0.0f);
    return 0;
  }
  float sum = 0.0f;
  for (int t = 0; t < limit; ++t) {
    const float e = std::exp(p[t] - m);  // exp(-inf) = 0 for masked keys
    p[t] = e;
    sum += e;
  }
  for (int t = 0; t < limit; ++t) p[t] = p[t] / sum;
  return limit;
}

// Sums rows [q_begin, q_end) into out[j, t] through `add_row(j, i, p, limit,
// acc)`, which adds one row into a chunk accumulator acc[k_len]. Chunks are
// reduced in index order.
template <typename AddRow>
void accumulate_rows(const AttentionProblem& a, int q_begin, int q_end, float* out, AddRow add_row) {
  const int Tk = a.k_len;
  const int G = a.num_q_heads / a.num_kv_heads;
  const int rows = q_end - q_begin;
  const int nchunks = std::max(1, std::min(rows, 64 / G));
  std::vector<float> partial(static_cast<std::size_t>(G) * nchunks * Tk);
  const double work = static_cast<double>(G) * rows * Tk * a.head_dim;  // per kv head
  FloatKeys fk;
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const float* keys = fk.head(a, h);
    std::fill(partial.begin(), partial.end(), 0.0f);
#pragma omp parallel if (work >= kMinParallelWork)
    {
      std::vector<float> qrow(a.head_dim), p(Tk);
#pragma omp for schedule(dynamic, 1)
      for (int task = 0; task < G * nchunks; ++task) {
        const int g = task / nchunks, c = task % nchunks;
        const int j = h * G + g;
        const int i0 = q_begin + static_cast<int>(static_cast<long long>(rows) * c / nchunks);
        const int i1 = q_begin + static_cast<int>(static_cast<long long>(rows) * (c + 1) / nchunks);
        float* acc = partial.data() + static_cast<std::size_t>(task) * Tk;
        for (int i = i0; i < i1; ++i) {
          const int limit = attention_row(a, keys, j, i, qrow.data(), p.data());
          add_row(j, i, p.data(), limit, acc);
        }
      }
    }
#pragma omp parallel for schedule(static) if (static_cast <double>(G) * Tk * nchunks >= kMinParallelWork)
    for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(G) * Tk; ++e) {
      const int g = static_cast<int>(e / Tk), t = static_cast<int>(e % Tk);
      float s = 0.0f;
      for (int c = 0; c < nchunks; ++c) s += partial[(static_cast<std::size_t>(g) * nchunks + c) * Tk + t];
      out[static_cast<std::size_t>(h * G + g) * Tk + t] = s;
    }
  }
}

// Calls `use_row(j, i, p, limit)` for every row of the problem, in parallel.
template <typename UseRow>
void for_each_row(const AttentionProblem& a, UseRow use_row) {
  const int G = a.num_q_heads / a.num_kv_heads;
  const double work = static_cast<double>(G) * a.q_len * a.k_len * a.head_dim;  // per kv head
  FloatKeys fk;
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const float* keys = fk.head(a, h);
#pragma omp parallel if (work >= kMinParallelWork)
    {
      std::vector<float> qrow(a.head_dim), p(a.k_len);
#pragma omp for schedule(dynamic, 4)
      for (std::ptrdiff_t task = 0; task < static_cast<std::ptrdiff_t>(G) * a.q_len; ++task) {
        const int j = h * G + static_cast<int>(task / a.q_len), i = static_cast<int>(task % a.q_len);
        const int limit = attention_row(a, keys, j, i, qrow.data(), p.data());
        use_row(j, i, p.data(), limit);
      }
    }
  }
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
  const int Tk = a.k_len;
  std::vector<float> sums(static_cast<std::size_t>(a.num_q_heads) * Tk);
  accumulate_rows(a, a.q_len - params.window, a.q_len, sums.data(),
                  [](int, int, const float* p, int limit, float* acc) {
                    for (int t = 0; t < limit; ++t) acc[t] += p[t];
                  });
  const int r = params.kernel_size / 2;
  const bool avg = params.pool == PoolKind::kAvg;
  const float inv_k = 1.0f / static_cast<float>(params.kernel_size);
#pragma omp parallel for schedule( \
    static) if (static_cast <double>(a.num_q_heads) * Tk * params.kernel_size >= kMinParallelWork)
  for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(a.num_q_heads) * Tk; ++e) {
    const int t = static_cast<int>(e % Tk);
    const float* row = sums.data() + (e - t);
    const int lo = std::max(0, t - r), hi = std::min(Tk - 1, t + r);
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

  if (given != nullptr) {
    for_each_row(a, [&](int j, int i, const float* p, int limit) {
      float s = 0.0f;
      for (int t = 0; t < limit; ++t) s += mk[t] != mq[i] ? p[t] : 0.0f;
      given[static_cast<std::size_t>(j) * T + i] = s;
    });
  }
  if (received != nullptr) {
    accumulate_rows(a, 0, a.q_len, received, [&](int, int i, const float* p, int limit, float* acc) {
      const std::uint8_t qm = mq[i];
      for (int t = 0; t < limit; ++t) acc[t] += mk[t] != qm ? p[t] : 0.0f;
    });
    // n_t: other-modality queries that can see key t (head independent).
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
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
