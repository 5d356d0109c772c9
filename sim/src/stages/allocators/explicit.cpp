// explicit: per-layer x per-modality keep fractions given in PolicySpec::layer_modality_keep (the
// sweep's allocation search); no leftover redistribution.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "../stage.hpp"

namespace kvscope::sim::stages {

// Per-modality budgets that all round to zero tokens would empty the cache, and the selection
// needs them to sum to k >= 1: the modality with the largest unrounded share (ties: the one with
// more tokens, then the lower code) then keeps one token. Returns the budgets' sum, k.
int budgets_keep_one_token(int* budget, const double* share, const PerModalityCount& tokens) {
  int k = 0;
  for (int m = 0; m < kModalities; ++m) k += budget[m];
  if (k > 0) return k;
  int best = 0;
  for (int m = 1; m < kModalities; ++m) {
    const auto i = static_cast<std::size_t>(m), b = static_cast<std::size_t>(best);
    if (share[m] > share[best] || (share[m] == share[best] && tokens[i] > tokens[b])) best = m;
  }
  budget[best] = 1;
  return 1;
}

namespace {

class Explicit final : public Allocator {
 public:
  using Allocator::Allocator;
  void allocate(const LayerView& v, const std::vector<float>&, int, int& k, kernels::SelectParams& sp,
                std::vector<std::uint8_t>&) const override {
    const auto& keep = v.policy.layer_modality_keep;  // [L][4]
    if (static_cast<int>(keep.size()) != v.num_layers)
      throw std::runtime_error("explicit allocation needs one entry per layer");
    const PerModalityCount& n = v.tokens.per_modality;
    sp.use_modality_budgets = true;
    sp.redistribute_leftover = false;
    double share[kModalities];
    for (int m = 0; m < kModalities; ++m) {
      const double f =
          std::clamp(keep[static_cast<std::size_t>(v.layer)][static_cast<std::size_t>(m)], 0.0, 1.0);
      share[m] = f * static_cast<double>(n[static_cast<std::size_t>(m)]);
      sp.modality_budget[m] = static_cast<int>(std::lround(share[m]));
    }
    k = budgets_keep_one_token(sp.modality_budget, share, n);
  }
};

}  // namespace

std::unique_ptr<Stage> make_allocator_explicit() {
  return std::make_unique<Explicit>(
      StageInfo{StageKind::kAllocator,
                "explicit",
                "per-layer x per-modality keep fractions (set by the sweep's allocation search)",
                "kvscope (sweep --oracle)",
                false,
                {}});
}

}  // namespace kvscope::sim::stages
