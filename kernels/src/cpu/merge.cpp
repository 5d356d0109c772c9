// CPU backend of token merging (kvscope/kernels/merge.hpp). One OpenMP task per
// head; the math follows docs/kernels/merge.md and src/cuda/merge.cu exactly.
#include "kvscope/kernels/merge.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cpu {
namespace {

// Converts n elements starting at element `offset` of a `t` tensor to float.
void to_float(const void* src, DType t, std::size_t offset, std::size_t n, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
    return;
  }
  const std::uint16_t* p = static_cast<const std::uint16_t*>(src) + offset;
  if (t == DType::kF16) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = half_to_float(p[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(p[i]);
  }
}

float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Merge weight of one token: non-positive and NaN weights count as 0.
inline float clamp_weight(float w) { return w > 0.0f ? w : 0.0f; }

// Weighted average of the member rows with the norm restored to the members'
// weighted mean norm (zero-norm guard: the plain average is written).
void merge_rows(const std::int32_t* members, int count, const float* weights, float weight_sum,
                const float* rows, const float* norms, int dim, float* acc, float* out) {
  std::fill(acc, acc + dim, 0.0f);
  float norm_sum = 0.0f;
  for (int i = 0; i < count; ++i) {
    const float w = weights[i];
    const float* x = rows + static_cast<std::size_t>(members[i]) * dim;
    for (int d = 0; d < dim; ++d) acc[d] += w * x[d];
    norm_sum += w * norms[members[i]];
  }
  for (int d = 0; d < dim; ++d) acc[d] = acc[d] / weight_sum;
  const float target = norm_sum / weight_sum;
  const float avg_norm = std::sqrt(dot(acc, acc, dim));
  const float scale = avg_norm > 0.0f ? target / avg_norm : 1.0f;
  for (int d = 0; d < dim; ++d) out[d] = acc[d] * scale;
}

Status validate(const MergeParams& p, const void* k, const void* v, const std::int32_t* kept, float* k_out,
                float* v_out, std::int32_t* multiplicity, std::int32_t* token_to_slot) {
  const std::string f = "merge_tokens: ";
  if (p.num_heads <= 0)
    return Status::Invalid(f + "num_heads " + std::to_string(p.num_heads) + " must be > 0");
  if (p.num_tokens <= 0)
    return Status::Invalid(f + "num_tokens " + std::to_string(p.num_tokens) + " must be > 0");
  if (p.head_dim <= 0) return Status::Invalid(f + "head_dim " + std::to_string(p.head_dim) + " must be > 0");
  if (p.num_kept <= 0 || p.num_kept > p.num_tokens) {
    return Status::Invalid(f + "num_kept " + std::to_string(p.num_kept) +
                           " must be in [1, num_tokens=" + std::to_string(p.num_tokens) + "]");
  }
  if (p.window < 0) return Status::Invalid(f + "window " + std::to_string(p.window) + " must be >= 0");
  if (std::isnan(p.threshold)) return Status::Invalid(f + "threshold is NaN");
  if (!k || !v || !kept) return Status::Invalid(f + "k, v and kept must not be null");
  if (!k_out || !v_out || !multiplicity || !token_to_slot) {
    return Status::Invalid(f + "k_out, v_out, multiplicity and token_to_slot must not be null");
  }
  return Status::Ok();
}

}  // namespace

Status merge_tokens(const MergeParams& p, const void* k, const void* v, const std::int32_t* kept,
                    const float* importance, float* k_out, float* v_out, std::int32_t* multiplicity,
                    std::int32_t* token_to_slot) {
  KVSCOPE_NVTX_RANGE("cpu::merge_tokens", kMerge);
  KVSCOPE_RETURN_IF_ERROR(validate(p, k, v, kept, k_out, v_out, multiplicity, token_to_slot));
  const int H = p.num_heads, T = p.num_tokens, D = p.head_dim, K = p.num_kept;
  const int kept_lists = p.shared_kept ? 1 : H;
  for (int h = 0; h < kept_lists; ++h) {
    const std::int32_t* kh = kept + static_cast<std::size_t>(h) * K;
    for (int s = 0; s < K; ++s) {
      if (kh[s] < 0 || kh[s] >= T || (s > 0 && kh[s] <= kh[s - 1])) {
        return Status::Invalid("merge_tokens: kept[" + std::to_string(h) + ", " + std::to_string(s) + "] = " +
                               std::to_string(kh[s]) + " is out of [0, T) or not strictly increasing");
      }
    }
  }

#pragma omp parallel for schedule(dynamic, 1)
  for (int h = 0; h < H; ++h) {
    const std::int32_t* kh = kept + (p.shared_kept ? 0 : static_cast<std::size_t>(h) * K);
    const std::size_t head_off = static_cast<std::size_t>(h) * T * D;
    // float32 rows are read in place; other dtypes are converted once per head. (A copy of a float32
    // head was two [T, D] buffers allocated, zeroed and copied per call: for the simulator, which merges
    // float32 rows per head and point, most of a long-trace sweep's page faults, docs/perf.md.)
    std::vector<float> key_buf, val_buf;
    const float* keys = nullptr;
    const float* vals = nullptr;
    if (p.dtype == DType::kF32) {
      keys = static_cast<const float*>(k) + head_off;
      vals = static_cast<const float*>(v) + head_off;
    } else {
      const std::size_t n = static_cast<std::size_t>(T) * D;
      key_buf.resize(n);
      val_buf.resize(n);
      to_float(k, p.dtype, head_off, n, key_buf.data());
      to_float(v, p.dtype, head_off, n, val_buf.data());
      keys = key_buf.data();
      vals = val_buf.data();
    }
    std::vector<float> key_norm(T), val_norm(T);
    for (int t = 0; t < T; ++t) {
      const float* kr = keys + static_cast<std::size_t>(t) * D;
      const float* vr = vals + static_cast<std::size_t>(t) * D;
      key_norm[t] = std::sqrt(dot(kr, kr, D));
      val_norm[t] = std::sqrt(dot(vr, vr, D));
    }

    // 1. Assignment: kept tokens map to their slot; an evicted token joins the most
    //    similar kept token within the window if the cosine exceeds the threshold.
    std::int32_t* map = token_to_slot + static_cast<std::size_t>(h) * T;
    std::fill(map, map + T, -1);
    for (int s = 0; s < K; ++s) map[kh[s]] = s;
    std::vector<char> is_kept(T, 0);
    for (int s = 0; s < K; ++s) is_kept[kh[s]] = 1;
    for (int t = 0; t < T; ++t) {
      if (is_kept[t]) continue;
      const long long lo_pos = static_cast<long long>(t) - p.window,
                      hi_pos = static_cast<long long>(t) + p.window;
      const int lo = static_cast<int>(
          std::lower_bound(kh, kh + K, lo_pos, [](std::int32_t a, long long b) { return a < b; }) - kh);
      int best_slot = -1;
      float best = 0.0f;
      const float* kt = keys + static_cast<std::size_t>(t) * D;
      for (int s = lo; s < K && kh[s] <= hi_pos; ++s) {
        const int u = kh[s];
        const float denom = key_norm[t] * key_norm[u];
        float sim = denom > 0.0f ? dot(kt, keys + static_cast<std::size_t>(u) * D, D) / denom : 0.0f;
        sim = std::min(1.0f, std::max(-1.0f, sim));
        if (best_slot < 0 || sim > best) {  // strict: ties keep the lower slot
          best = sim;
          best_slot = s;
        }
      }
      if (best_slot >= 0 && best > p.threshold) map[t] = best_slot;
    }

    // 2. Members of every slot in increasing token order (counting sort).
    std::vector<std::int32_t> start(K + 1, 0), members(T);
    for (int t = 0; t < T; ++t)
      if (map[t] >= 0) ++start[map[t] + 1];
    for (int s = 0; s < K; ++s) start[s + 1] += start[s];
    {
      std::vector<std::int32_t> fill(start.begin(), start.end() - 1);
      for (int t = 0; t < T; ++t)
        if (map[t] >= 0) members[fill[map[t]]++] = t;
    }

    // 3. Weighted average with norm restoration; singletons are copied exactly.
    std::vector<float> weights(T), acc(D);
    const float* imp = importance ? importance + static_cast<std::size_t>(h) * T : nullptr;
    for (int s = 0; s < K; ++s) {
      const std::int32_t* mem = members.data() + start[s];
      const int count = start[s + 1] - start[s];
      const std::size_t out_off = (static_cast<std::size_t>(h) * K + s) * D;
      multiplicity[static_cast<std::size_t>(h) * K + s] = count;
      if (count == 1) {
        std::memcpy(k_out + out_off, keys + static_cast<std::size_t>(mem[0]) * D, D * sizeof(float));
        std::memcpy(v_out + out_off, vals + static_cast<std::size_t>(mem[0]) * D, D * sizeof(float));
        continue;
      }
      float weight_sum = 0.0f;
      for (int i = 0; i < count; ++i) {
        weights[i] = imp ? clamp_weight(imp[mem[i]]) : 1.0f;
        weight_sum += weights[i];
      }
      if (!(weight_sum > 0.0f)) {  // all weights zero: uniform
        std::fill(weights.begin(), weights.begin() + count, 1.0f);
        weight_sum = static_cast<float>(count);
      }
      merge_rows(mem, count, weights.data(), weight_sum, keys, key_norm.data(), D, acc.data(),
                 k_out + out_off);
      merge_rows(mem, count, weights.data(), weight_sum, vals, val_norm.data(), D, acc.data(),
                 v_out + out_off);
    }
  }
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
