// Attention statistics over a (Q, K) pair: H2O accumulated attention, SnapKV
// observation-window scores, TOVA last-query scores, per-query entropy and
// modality mass, and cross-modal interaction per token.
//
// Every statistic is built from the same attention row:
//   logit(i, t) = (q_i . k_t) / sqrt(D)              for visible keys t
//   p(i, t)     = exp(logit - max) / sum(exp(logit - max))   (fp32, max subtracted)
// GQA: query head j reads kv head j / (num_q_heads / num_kv_heads).
// Causal mask by absolute positions: key t is visible to query i iff
// k_pos[t] <= q_pos[i]. A row with no visible key has p = 0 everywhere.
// Exact formulas and edge cases: docs/kernels/attention_stats.md.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// One attention problem. All pointers are host pointers for the CPU backend
// and device pointers for the CUDA backend.
struct AttentionProblem {
  const void* q = nullptr;              // [num_q_heads, q_len, head_dim] row-major, `dtype`
  const void* k = nullptr;              // [num_kv_heads, k_len, head_dim] row-major, `dtype`
  const std::int32_t* q_pos = nullptr;  // [q_len] absolute positions; nullptr: k_len - q_len + i
  const std::int32_t* k_pos = nullptr;  // [k_len] absolute positions; nullptr: t
  int num_q_heads = 0;                  // multiple of num_kv_heads
  int num_kv_heads = 0;
  int q_len = 0;  // Tq
  int k_len = 0;  // Tk
  int head_dim = 0;
  DType dtype = DType::kF32;
  bool causal = true;  // false: every key is visible to every query
};

// Half-open range of query rows [begin, end); end = -1 means q_len.
struct QueryRange {
  int begin = 0;
  int end = -1;
};

enum class PoolKind : std::uint8_t { kAvg = 0, kMax = 1 };

// SnapKV: rows of the last `window` queries summed, then pooled along keys.
struct SnapKVParams {
  int window = 32;      // observation window W (last W rows of Q), 1..q_len
  int kernel_size = 7;  // odd pooling width; 1 = no pooling
  PoolKind pool = PoolKind::kAvg;
};

namespace detail {

// Absolute position of query row i and key t, and the causal visibility rule,
// shared by both backends so that they mask identically.
KVSCOPE_HD std::int32_t query_position(const AttentionProblem& a, int i) {
  return a.q_pos != nullptr ? a.q_pos[i] : static_cast<std::int32_t>(a.k_len - a.q_len + i);
}
KVSCOPE_HD std::int32_t key_position(const AttentionProblem& a, int t) {
  return a.k_pos != nullptr ? a.k_pos[t] : static_cast<std::int32_t>(t);
}
KVSCOPE_HD bool key_visible(const AttentionProblem& a, std::int32_t qpos, int t) {
  return !a.causal || key_position(a, t) <= qpos;
}
// Keys at index >= key_limit are invisible to a query at qpos (only known
// without k_pos: then visibility is a prefix).
KVSCOPE_HD int key_limit(const AttentionProblem& a, std::int32_t qpos) {
  if (!a.causal || a.k_pos != nullptr) return a.k_len;
  const long long lim = static_cast<long long>(qpos) + 1;
  return lim < 0 ? 0 : (lim > a.k_len ? a.k_len : static_cast<int>(lim));
}

}  // namespace detail
}  // namespace kvscope::kernels

namespace kvscope::kernels::cpu {

// Checks shapes, pointers and the GQA ratio; `fn` names the caller in messages.
Status validate_attention_problem(const AttentionProblem& a, const char* fn);

// H2O accumulated attention over query rows `range`:
//   out[j, t] = sum_{i in range} p_j(i, t)
// out: [num_q_heads, k_len] float.
Status accumulated_attention(const AttentionProblem& a, QueryRange range, float* out);

// Sums per-query-head statistics over each GQA group:
//   out[h, t] = sum_{j : j / (num_q_heads / num_kv_heads) == h} in[j, t]
// in: [num_q_heads, len] float; out: [num_kv_heads, len] float.
Status reduce_to_kv_heads(const float* in, int num_q_heads, int num_kv_heads, int len, float* out);

// SnapKV scores: s[j, t] = sum over the last W query rows of p_j(i, t), then
// 1-D pooling along t with "same" output length (window [t - k/2, t + k/2],
// out-of-range taps count as 0 for avg -- divisor is always kernel_size -- and
// are skipped for max). out: [num_q_heads, k_len] float.
Status snapkv_scores(const AttentionProblem& a, const SnapKVParams& params, float* out);

// The two halves of snapkv_scores, for callers that store the window sums (trace format 1.2
// /aggregates, docs/trace-format.md): sums[j, t] = sum over the last `window` query rows of
// p_j(i, t) ([num_q_heads, k_len]; the same sums snapkv_scores pools), and the pooling of such sums
// ([heads, len] -> [heads, len]) exactly as snapkv_scores pools them (params.window is not read).
Status snapkv_window_sums(const AttentionProblem& a, int window, float* sums);
Status snapkv_pool(const float* sums, int heads, int len, const SnapKVParams& params, float* out);
// snapkv_pool on each side of `edge` separately (0 <= edge <= len): keys t < edge pool only keys < edge,
// keys t >= edge only keys >= edge, the taps beyond a segment's end treated as beyond the row's (kvpress
// 0.5.5 SnapKVPress pools the keys before its observation window on their own, the window's keys are
// forced). edge = 0 or len is snapkv_pool.
Status snapkv_pool_split(const float* sums, int heads, int len, int edge, const SnapKVParams& params, float* out);

// TOVA: attention row of the last query, out[j, t] = p_j(q_len - 1, t).
// out: [num_q_heads, k_len] float.
Status tova_scores(const AttentionProblem& a, float* out);

// Per-query statistics of each attention row (either output may be nullptr):
//   entropy[j, i]          = -sum_t p log p   (natural log, 0 log 0 = 0)
//   modality_mass[j, i, m] = sum_{t : k_modality[t] == m} p_j(i, t)
// k_modality: [k_len] uint8 codes 0..3; entropy: [num_q_heads, q_len];
// modality_mass: [num_q_heads, q_len, 4].
Status attention_row_stats(const AttentionProblem& a, const std::uint8_t* k_modality, float* entropy,
                           float* modality_mass);

// Cross-modal interaction for a prefill (q_len == k_len, query i is token i):
//   received[j, t] = (1 / n_t) * sum_{i : mq[i] != mk[t], t visible to i} p_j(i, t)
//                    n_t = number of such queries i (0 -> received = 0)
//   given[j, i]    = sum_{t : mk[t] != mq[i]} p_j(i, t)
// k_modality: [k_len] uint8; q_modality: [q_len] uint8 or nullptr (= k_modality).
// received, given: [num_q_heads, k_len] float (either may be nullptr).
Status cross_modal_interaction(const AttentionProblem& a, const std::uint8_t* k_modality,
                               const std::uint8_t* q_modality, float* received, float* given);

// H2O and cross-modal interaction of a prefill from one pass over the attention rows: the same
// values as accumulated_attention(a, {0, -1}, h2o) and cross_modal_interaction(a, k_modality,
// nullptr, received, given) (the same row blocks, sums and block order), for half the work of the
// two calls. h2o, received, given: [num_q_heads, k_len] float, none may be nullptr; q_len == k_len.
Status prefill_attention_sums(const AttentionProblem& a, const std::uint8_t* k_modality, float* h2o,
                              float* received, float* given);

}  // namespace kvscope::kernels::cpu
