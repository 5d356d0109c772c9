// CPU backend of head merging (kvscope/kernels/head_merge.hpp); the math follows
// docs/kernels/head_merge.md and src/cuda/head_merge.cu.
#include "kvscope/kernels/head_merge.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cpu {
namespace {

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

Status validate_shape(const HeadMergeParams& p, const char* fn) {
  const std::string f = std::string(fn) + ": ";
  if (p.num_kv_heads <= 0)
    return Status::Invalid(f + "num_kv_heads " + std::to_string(p.num_kv_heads) + " must be > 0");
  if (p.num_tokens <= 0)
    return Status::Invalid(f + "num_tokens " + std::to_string(p.num_tokens) + " must be > 0");
  if (p.head_dim <= 0) return Status::Invalid(f + "head_dim " + std::to_string(p.head_dim) + " must be > 0");
  return Status::Ok();
}

// Upper triangle (a <= b) of the Gram matrix of the flattened heads of one tensor:
// float sums inside blocks of kHeadSimilarityBlock elements, double across blocks.
std::vector<double> gram(const HeadMergeParams& p, const void* x) {
  const int H = p.num_kv_heads;
  const std::size_t n = static_cast<std::size_t>(p.num_tokens) * p.head_dim;
  const std::size_t blocks = (n + kHeadSimilarityBlock - 1) / kHeadSimilarityBlock;
  std::vector<double> g(static_cast<std::size_t>(H) * H, 0.0);
#pragma omp parallel
  {
    std::vector<double> local(static_cast<std::size_t>(H) * H, 0.0);
    std::vector<float> buf(static_cast<std::size_t>(H) * kHeadSimilarityBlock);
#pragma omp for schedule(static)
    for (std::size_t blk = 0; blk < blocks; ++blk) {
      const std::size_t begin = blk * kHeadSimilarityBlock;
      const std::size_t len = std::min<std::size_t>(kHeadSimilarityBlock, n - begin);
      for (int a = 0; a < H; ++a)
        to_float(x, p.dtype, a * n + begin, len, buf.data() + a * kHeadSimilarityBlock);
      for (int a = 0; a < H; ++a) {
        const float* xa = buf.data() + a * kHeadSimilarityBlock;
        for (int b = a; b < H; ++b) {
          const float* xb = buf.data() + b * kHeadSimilarityBlock;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (std::size_t i = 0; i < len; ++i) s += xa[i] * xb[i];
          local[static_cast<std::size_t>(a) * H + b] += s;
        }
      }
    }
#pragma omp critical(kvscope_head_gram)
    for (std::size_t i = 0; i < g.size(); ++i) g[i] += local[i];
  }
  return g;
}

// cos = G[a,b] / sqrt(G[a,a] G[b,b]) in double, 0 for a zero head, clamped to [-1, 1].
float gram_cosine(const std::vector<double>& g, int H, int a, int b) {
  if (a > b) std::swap(a, b);
  const double den =
      std::sqrt(g[static_cast<std::size_t>(a) * H + a] * g[static_cast<std::size_t>(b) * H + b]);
  if (!(den > 0.0)) return 0.0f;
  return static_cast<float>(std::clamp(g[static_cast<std::size_t>(a) * H + b] / den, -1.0, 1.0));
}

}  // namespace

Status head_similarity(const HeadMergeParams& p, const void* k, const void* v, float* similarity) {
  KVSCOPE_NVTX_RANGE("cpu::head_similarity", kHeadMerge);
  KVSCOPE_RETURN_IF_ERROR(validate_shape(p, "head_similarity"));
  if (!k || !similarity) return Status::Invalid("head_similarity: k and similarity must not be null");
  const bool with_v = p.similarity == HeadSimilarity::kKeysValues;
  if (with_v && !v) return Status::Invalid("head_similarity: v must not be null for kKeysValues");
  const int H = p.num_kv_heads;
  const std::vector<double> gk = gram(p, k);
  std::vector<double> gv;
  if (with_v) gv = gram(p, v);
  for (int a = 0; a < H; ++a) {
    for (int b = 0; b < H; ++b) {
      float s = 1.0f;
      if (a != b)
        s = with_v ? 0.5f * (gram_cosine(gk, H, a, b) + gram_cosine(gv, H, a, b)) : gram_cosine(gk, H, a, b);
      similarity[static_cast<std::size_t>(a) * H + b] = s;
    }
  }
  return Status::Ok();
}

Status cluster_heads(int H, const float* similarity, float threshold, std::int32_t* cluster_id,
                     int* num_clusters) {
  if (H <= 0) return Status::Invalid("cluster_heads: num_kv_heads " + std::to_string(H) + " must be > 0");
  if (!similarity || !cluster_id || !num_clusters) {
    return Status::Invalid("cluster_heads: similarity, cluster_id and num_clusters must not be null");
  }
  if (std::isnan(threshold)) return Status::Invalid("cluster_heads: threshold is NaN");
  std::fill(cluster_id, cluster_id + H, -1);
  int c = 0;
  for (int a = 0; a < H; ++a) {
    if (cluster_id[a] >= 0) continue;
    cluster_id[a] = c;
    for (int b = a + 1; b < H; ++b) {
      if (cluster_id[b] < 0 && similarity[static_cast<std::size_t>(a) * H + b] > threshold) cluster_id[b] = c;
    }
    ++c;
  }
  *num_clusters = c;
  return Status::Ok();
}

Status apply_head_merge(const HeadMergeParams& p, const void* k, const void* v,
                        const std::int32_t* cluster_id, int num_clusters, const float* head_weights,
                        float* k_out, float* v_out) {
  KVSCOPE_NVTX_RANGE("cpu::apply_head_merge", kHeadMerge);
  KVSCOPE_RETURN_IF_ERROR(validate_shape(p, "apply_head_merge"));
  if (!k || !v || !cluster_id || !k_out || !v_out) {
    return Status::Invalid("apply_head_merge: k, v, cluster_id, k_out and v_out must not be null");
  }
  const int H = p.num_kv_heads;
  if (num_clusters <= 0 || num_clusters > H) {
    return Status::Invalid("apply_head_merge: num_clusters " + std::to_string(num_clusters) +
                           " must be in [1, " + std::to_string(H) + "]");
  }
  // Members of each cluster in head order, and their weights.
  std::vector<std::vector<int>> members(num_clusters);
  for (int a = 0; a < H; ++a) {
    if (cluster_id[a] < 0 || cluster_id[a] >= num_clusters) {
      return Status::Invalid("apply_head_merge: cluster_id[" + std::to_string(a) +
                             "] = " + std::to_string(cluster_id[a]) + " is out of [0, num_clusters)");
    }
    members[cluster_id[a]].push_back(a);
  }
  std::vector<std::vector<float>> weights(num_clusters);
  std::vector<float> weight_sum(num_clusters, 0.0f);
  for (int c = 0; c < num_clusters; ++c) {
    if (members[c].empty()) {
      return Status::Invalid("apply_head_merge: cluster " + std::to_string(c) + " has no member head");
    }
    for (int a : members[c]) {
      const float w = head_weights ? (head_weights[a] > 0.0f ? head_weights[a] : 0.0f) : 1.0f;
      weights[c].push_back(w);
      weight_sum[c] += w;
    }
    if (!(weight_sum[c] > 0.0f)) {  // all weights zero: uniform
      std::fill(weights[c].begin(), weights[c].end(), 1.0f);
      weight_sum[c] = static_cast<float>(members[c].size());
    }
  }
  const int T = p.num_tokens, D = p.head_dim;
  const std::size_t head_elems = static_cast<std::size_t>(T) * D;
  const long long rows = static_cast<long long>(num_clusters) * T;
#pragma omp parallel
  {
    std::vector<float> row(D);
#pragma omp for schedule(static)
    for (long long r = 0; r < rows; ++r) {
      const int c = static_cast<int>(r / T);
      const std::size_t t_off = static_cast<std::size_t>(r % T) * D;
      for (int which = 0; which < 2; ++which) {
        const void* src = which == 0 ? k : v;
        float* out = (which == 0 ? k_out : v_out) + static_cast<std::size_t>(c) * head_elems + t_off;
        if (members[c].size() == 1) {
          to_float(src, p.dtype, members[c][0] * head_elems + t_off, D, out);
          continue;
        }
        std::fill(out, out + D, 0.0f);
        for (std::size_t i = 0; i < members[c].size(); ++i) {
          to_float(src, p.dtype, members[c][i] * head_elems + t_off, D, row.data());
          const float w = weights[c][i];
          for (int d = 0; d < D; ++d) out[d] += w * row[d];
        }
        const float ws = weight_sum[c];
        for (int d = 0; d < D; ++d) out[d] = out[d] / ws;
      }
    }
  }
  return Status::Ok();
}

Status merge_heads(const HeadMergeParams& p, const void* k, const void* v, const float* head_weights,
                   float* similarity, std::int32_t* cluster_id, int* num_merged_heads, float* k_out,
                   float* v_out, std::int32_t* q_to_merged) {
  KVSCOPE_NVTX_RANGE("cpu::merge_heads", kHeadMerge);
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
  KVSCOPE_RETURN_IF_ERROR(head_similarity(p, k, v, similarity));
  KVSCOPE_RETURN_IF_ERROR(
      cluster_heads(p.num_kv_heads, similarity, p.threshold, cluster_id, num_merged_heads));
  KVSCOPE_RETURN_IF_ERROR(
      apply_head_merge(p, k, v, cluster_id, *num_merged_heads, head_weights, k_out, v_out));
  const int group = p.num_q_heads / p.num_kv_heads;
  for (int j = 0; j < p.num_q_heads; ++j) q_to_merged[j] = cluster_id[j / group];
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
