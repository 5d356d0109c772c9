// Run-time allocators (kvscope/sim/custom_stages.hpp): a callback gives a layer's keep fraction or its
// per-modality keep fractions (then budgeted as the explicit allocator does, no leftover redistribution).
#include "../custom.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvscope::sim::stages {
namespace {

class Callback final : public Allocator {
 public:
  Callback(StageInfo info, CustomAllocateFn fn) : Allocator(std::move(info)), fn_(std::move(fn)) {}
  double layer_fraction(const LayerView& v, double keep) const override {
    const CustomAllocation a = decide(v, keep);
    if (!a.per_modality) return a.layer_keep;
    double kept = 0;
    for (int m = 0; m < kModalities; ++m)
      kept += a.modality_keep[static_cast<std::size_t>(m)] * static_cast<double>(v.tokens.per_modality[m]);
    return v.T > 0 ? kept / v.T : 1.0;
  }
  void allocate(const LayerView& v, const std::vector<float>&, int, int& k, kernels::SelectParams& sp,
                std::vector<std::uint8_t>&) const override {
    const CustomAllocation a = decide(v, last_keep(v));
    if (!a.per_modality) return;
    sp.use_modality_budgets = true;
    sp.redistribute_leftover = false;
    double share[kModalities];
    for (int m = 0; m < kModalities; ++m) {
      share[m] = a.modality_keep[static_cast<std::size_t>(m)] * static_cast<double>(v.tokens.per_modality[m]);
      sp.modality_budget[m] = static_cast<int>(std::lround(share[m]));
    }
    k = budgets_keep_one_token(sp.modality_budget, share, v.tokens.per_modality);
  }

 private:
  CustomAllocation decide(const LayerView& v, double keep) const {
    CustomAllocation a = fn_(custom_layer(v.data, v.ctx), keep);
    auto bad = [](double f) { return !(f >= 0.0 && f <= 1.0); };
    bool wrong = !a.per_modality && bad(a.layer_keep);
    for (double f : a.modality_keep) wrong = wrong || (a.per_modality && bad(f));
    if (wrong) {
      throw std::runtime_error("custom allocator '" + info().name +
                               "' gave a keep fraction outside [0, 1] for layer " + std::to_string(v.layer));
    }
    // allocate() asks again with the same mean keep (the caller does not pass it there).
    keep_.at(v) = keep;
    return a;
  }
  // The mean keep fraction layer_fraction() was last called with for this layer, in this thread.
  struct KeepMemo {
    const void* data = nullptr;
    const void* policy = nullptr;
    double keep = 1.0;
    double& at(const LayerView& v) {
      data = &v.data;
      policy = &v.policy;
      return keep;
    }
  };
  static double last_keep(const LayerView& v) {
    if (keep_.data != &v.data || keep_.policy != &v.policy)
      throw std::logic_error("custom allocator: allocate() before layer_fraction()");
    return keep_.keep;
  }
  static thread_local KeepMemo keep_;
  CustomAllocateFn fn_;
};

thread_local Callback::KeepMemo Callback::keep_;

}  // namespace

}  // namespace kvscope::sim::stages

namespace kvscope::sim {

void register_custom_allocator(const std::string& name, const std::string& meaning,
                               CustomAllocateFn allocate) {
  StageInfo info{StageKind::kAllocator, name,  meaning.empty() ? "custom allocator" : meaning,
                 "custom (run time)",   false, {}};
  stages::put_custom_stage(std::make_unique<stages::Callback>(std::move(info), std::move(allocate)));
}

}  // namespace kvscope::sim
