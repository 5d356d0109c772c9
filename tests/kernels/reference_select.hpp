// Reference token selection written as a walk over the fully sorted order
// (a different formulation from the kernels' nth_element / rank scans), plus
// input generators with many ties.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvscope/kernels/select.hpp"

namespace kvscope::testing {

// Kept indices (sorted ascending) for one score row.
inline std::vector<std::int32_t> reference_select(const float* s, int T, const kernels::SelectParams& p) {
  auto score = [&](int t) { return std::isnan(s[t]) ? -INFINITY : static_cast<double>(s[t]); };
  std::vector<int> order(T);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score(a) > score(b); });
  auto cls = [&](int t) { return p.use_modality_budgets ? static_cast<int>(p.modality[t]) : 0; };
  auto forced = [&](int t) {
    return t < p.num_sinks || t >= T - p.recent_window || (p.protected_mask && p.protected_mask[t]);
  };
  std::vector<char> kept(T, 0), picked(T, 0);
  int n_forced = 0, forced_in[4] = {0, 0, 0, 0};
  for (int t = 0; t < T; ++t)
    if (forced(t)) kept[t] = 1, ++n_forced, ++forced_in[cls(t)];
  int taken[4] = {0, 0, 0, 0};
  for (int t : order) {
    if (kept[t]) continue;
    const int c = cls(t);
    const int quota = p.use_modality_budgets ? p.modality_budget[c] : p.k;
    if (taken[c] < quota - forced_in[c]) picked[t] = 1, ++taken[c];
  }
  int room = p.k - n_forced;
  for (int t : order) {
    if (picked[t] && room > 0) kept[t] = 1, --room;
  }
  if (p.redistribute_leftover) {
    for (int t : order) {
      if (!kept[t] && room > 0) kept[t] = 1, --room;
    }
  }
  std::vector<std::int32_t> out;
  for (int t = 0; t < T; ++t)
    if (kept[t]) out.push_back(t);
  return out;
}

// Scores with many exact ties: integers 0..levels-1 (as float), optional NaNs.
inline std::vector<float> tied_scores(std::size_t n, std::uint64_t seed, int levels, bool with_nan = false) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = static_cast<float>(rng() % levels);
    if (with_nan && rng() % 17 == 0) x = NAN;
    if (rng() % 13 == 0) x = -x;  // includes -0
  }
  return v;
}

}  // namespace kvscope::testing
