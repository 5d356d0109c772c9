// CPU backend of token selection: nth_element per head on 64-bit rank keys
// (score descending, index ascending), so ties and NaN are ordered exactly
// as in the CUDA backend's radix sort.
#include "kvscope/kernels/select.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cpu {
namespace {

// Below this many elementary operations a loop runs on the calling thread.
constexpr double kMinParallelWork = 32768.0;

using detail::select_forced;
using detail::select_rank_key;

// Keeps the `n` smallest rank keys of `keys` (all of them if n >= size).
void keep_best(std::vector<std::uint64_t>& keys, std::size_t n) {
  if (n >= keys.size()) return;
  std::nth_element(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(n), keys.end());
  keys.resize(n);
}

// Selection for one score row. kept: scratch [T]. Returns the kept count.
int select_row(const float* s, int T, const SelectParams& p, std::int32_t* out,
               std::vector<std::uint8_t>& kept) {
  const int nclass = p.use_modality_budgets ? kNumModalities : 1;
  auto class_of = [&](int t) { return p.use_modality_budgets ? static_cast<int>(p.modality[t]) : 0; };
  kept.assign(T, 0);
  int forced = 0, forced_in[kNumModalities] = {0, 0, 0, 0};
  std::vector<std::uint64_t> cand[kNumModalities];
  for (int t = 0; t < T; ++t) {
    if (select_forced(p, T, t)) {
      kept[t] = 1;
      ++forced;
      ++forced_in[class_of(t)];
    } else {
      cand[class_of(t)].push_back(select_rank_key(s[t], t));
    }
  }
  // 1) each class fills what its budget has left after its forced tokens.
  std::vector<std::uint64_t> picks;
  for (int c = 0; c < nclass; ++c) {
    const int quota = p.use_modality_budgets ? p.modality_budget[c] : p.k;
    keep_best(cand[c], static_cast<std::size_t>(std::max(0, quota - forced_in[c])));
    picks.insert(picks.end(), cand[c].begin(), cand[c].end());
  }
  // 2) forced tokens over their class budget push out the worst picks overall.
  keep_best(picks, static_cast<std::size_t>(p.k - forced));
  for (std::uint64_t key : picks) kept[static_cast<std::uint32_t>(key)] = 1;
  int count = forced + static_cast<int>(picks.size());
  // 3) unfilled budget (a modality with too few tokens) goes to the best rest.
  if (count < p.k && p.redistribute_leftover) {
    std::vector<std::uint64_t> rest;
    for (int t = 0; t < T; ++t) {
      if (!kept[t]) rest.push_back(select_rank_key(s[t], t));
    }
    keep_best(rest, static_cast<std::size_t>(p.k - count));
    for (std::uint64_t key : rest) kept[static_cast<std::uint32_t>(key)] = 1;
    count += static_cast<int>(rest.size());
  }
  int n = 0;
  for (int t = 0; t < T; ++t) {
    if (kept[t]) out[n++] = t;
  }
  std::fill(out + n, out + p.k, -1);
  return n;
}

}  // namespace

Status validate_select(const SelectParams& p, int num_heads, int num_tokens, bool arrays_on_host,
                       const char* fn) {
  const std::string f(fn);
  if (num_heads <= 0 || num_tokens <= 0) {
    return Status::Invalid(f + ": num_heads " + std::to_string(num_heads) + " and num_tokens " +
                           std::to_string(num_tokens) + " must be positive");
  }
  if (p.k < 1 || p.k > num_tokens) {
    return Status::Invalid(f + ": k " + std::to_string(p.k) + " outside 1..num_tokens " +
                           std::to_string(num_tokens));
  }
  if (p.num_sinks < 0 || p.recent_window < 0) {
    return Status::Invalid(f + ": num_sinks " + std::to_string(p.num_sinks) + " and recent_window " +
                           std::to_string(p.recent_window) + " must be >= 0");
  }
  if (p.use_modality_budgets) {
    if (p.modality == nullptr) return Status::Invalid(f + ": modality budgets need the modality array");
    long long sum = 0;
    for (int m = 0; m < kNumModalities; ++m) {
      if (p.modality_budget[m] < 0) {
        return Status::Invalid(f + ": modality_budget[" + std::to_string(m) +
                               "] = " + std::to_string(p.modality_budget[m]) + " is negative");
      }
      sum += p.modality_budget[m];
    }
    if (sum != p.k) {
      return Status::Invalid(f + ": modality budgets sum to " + std::to_string(sum) + ", k is " +
                             std::to_string(p.k));
    }
  }
  if (!arrays_on_host) return Status::Ok();
  if (p.use_modality_budgets) {
    for (int t = 0; t < num_tokens; ++t) {
      if (p.modality[t] >= kNumModalities) {
        return Status::Invalid(f + ": modality[" + std::to_string(t) +
                               "] = " + std::to_string(p.modality[t]) + " is not a modality code 0..3");
      }
    }
  }
  int forced = 0, is_protected = 0;
  for (int t = 0; t < num_tokens; ++t) {
    forced += detail::select_forced(p, num_tokens, t) ? 1 : 0;
    is_protected += (p.protected_mask != nullptr && p.protected_mask[t] != 0) ? 1 : 0;
  }
  if (forced > p.k) {
    return Status::Invalid(f + ": " + std::to_string(forced) + " forced tokens (num_sinks " +
                           std::to_string(p.num_sinks) + ", recent_window " +
                           std::to_string(p.recent_window) + ", protected " + std::to_string(is_protected) +
                           ") exceed the budget k = " + std::to_string(p.k));
  }
  return Status::Ok();
}

Status select_topk(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                   std::int32_t* out_indices, std::int32_t* out_counts) {
  KVSCOPE_NVTX_RANGE("cpu::select_topk", kSelect);
  if (scores == nullptr || out_indices == nullptr)
    return Status::Invalid("select_topk: scores or out_indices is null");
  KVSCOPE_RETURN_IF_ERROR(validate_select(params, num_heads, num_tokens, true, "select_topk"));
#pragma omp parallel if (static_cast <double>(num_heads) * num_tokens >= kMinParallelWork)
  {
    std::vector<std::uint8_t> kept;
#pragma omp for schedule(dynamic, 1)
    for (int h = 0; h < num_heads; ++h) {
      const int n = select_row(scores + static_cast<std::size_t>(h) * num_tokens, num_tokens, params,
                               out_indices + static_cast<std::size_t>(h) * params.k, kept);
      if (out_counts != nullptr) out_counts[h] = n;
    }
  }
  return Status::Ok();
}

Status select_topk_shared(const float* scores, int num_heads, int num_tokens, const SelectParams& params,
                          std::int32_t* out_indices, std::int32_t* out_count) {
  KVSCOPE_NVTX_RANGE("cpu::select_topk_shared", kSelect);
  if (scores == nullptr || out_indices == nullptr) {
    return Status::Invalid("select_topk_shared: scores or out_indices is null");
  }
  KVSCOPE_RETURN_IF_ERROR(validate_select(params, num_heads, num_tokens, true, "select_topk_shared"));
  std::vector<float> mean(num_tokens);
  const float inv = 1.0f / static_cast<float>(num_heads);
#pragma omp parallel for schedule(static) if (static_cast <double>(num_heads) * num_tokens >= \
                                              kMinParallelWork)
  for (int t = 0; t < num_tokens; ++t) {
    float s = 0.0f;
    for (int h = 0; h < num_heads; ++h) s += scores[static_cast<std::size_t>(h) * num_tokens + t];
    mean[t] = s * inv;
  }
  std::vector<std::uint8_t> kept;
  const int n = select_row(mean.data(), num_tokens, params, out_indices, kept);
  if (out_count != nullptr) *out_count = n;
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
