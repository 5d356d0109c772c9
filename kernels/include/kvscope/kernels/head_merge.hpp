// Head merging for one layer: cosine similarity between KV heads, greedy
// clustering at a threshold, weighted average of the member heads and the
// query-head -> merged-head map. See docs/kernels/head_merge.md.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// What the head similarity compares.
enum class HeadSimilarity : std::uint8_t {
  kKeys = 0,        // cos(vec(K_a), vec(K_b)): cosine of the flattened [T, D] key matrices
  kKeysValues = 1,  // (cos(vec(K_a), vec(K_b)) + cos(vec(V_a), vec(V_b))) / 2
};

struct HeadMergeParams {
  int num_kv_heads = 0;     // H
  int num_q_heads = 0;      // Hq, a multiple of H (GQA: q head j uses kv head j / (Hq / H))
  int num_tokens = 0;       // T
  int head_dim = 0;         // D
  float threshold = 0.88f;  // heads join a cluster if similarity to its first head > threshold
  HeadSimilarity similarity = HeadSimilarity::kKeys;
  DType dtype = DType::kF32;  // element type of K and V
};

// Elements per block of the similarity reduction: products are summed in float
// inside a block, block sums in double (both backends).
constexpr int kHeadSimilarityBlock = 4096;

namespace cpu {

// Head similarity matrix.
//   k, v       : [H, T, D] row-major, params.dtype (v may be nullptr for kKeys)
//   similarity : [H, H] float, symmetric, diagonal 1, in [-1, 1]; 0 where a head is all zeros
Status head_similarity(const HeadMergeParams& params, const void* k, const void* v, float* similarity);

// Greedy clustering (host only, also used by the CUDA backend): heads in order; an
// unassigned head opens cluster c (numbered 0, 1, ... in opening order) and pulls in every
// unassigned later head b with similarity[first, b] > threshold.
//   similarity  : [H, H] float (host)
//   cluster_id  : [H] int32 out, cluster of each kv head
//   num_clusters: out, H' = number of clusters
Status cluster_heads(int num_kv_heads, const float* similarity, float threshold, std::int32_t* cluster_id,
                     int* num_clusters);

// Merged heads for a given clustering.
//   k, v         : [H, T, D] params.dtype
//   cluster_id   : [H] int32, values in [0, num_clusters), every cluster non-empty
//   head_weights : [H] float weights (<= 0 or NaN count as 0), nullptr = uniform; a cluster
//                  whose weights sum to 0 uses uniform weights; one-member clusters are copied
//   k_out, v_out : [num_clusters, T, D] float32
Status apply_head_merge(const HeadMergeParams& params, const void* k, const void* v,
                        const std::int32_t* cluster_id, int num_clusters, const float* head_weights,
                        float* k_out, float* v_out);

// Whole pipeline: similarity -> cluster_heads(params.threshold) -> apply_head_merge -> q map.
//   similarity       : [H, H] float out
//   cluster_id       : [H] int32 out
//   num_merged_heads : host int out, H'
//   k_out, v_out     : [H, T, D] float32 capacity; the first H' heads are written
//   q_to_merged      : [Hq] int32 out, merged head of each query head
Status merge_heads(const HeadMergeParams& params, const void* k, const void* v, const float* head_weights,
                   float* similarity, std::int32_t* cluster_id, int* num_merged_heads, float* k_out,
                   float* v_out, std::int32_t* q_to_merged);

}  // namespace cpu
}  // namespace kvscope::kernels
