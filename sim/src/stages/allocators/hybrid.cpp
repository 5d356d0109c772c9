// hybrid: text dense, vision sparse: text gets min(n_text, lround(alpha * k)), the rest of k is
// split over the other modalities by token count (floor; the remainder goes to vision). Decode
// mode: the same split of the cap over the resident tokens' modalities (decode tokens are text).
#include <cmath>

#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

constexpr int kVision = static_cast<int>(kernels::Modality::kVision);
constexpr int kText = static_cast<int>(kernels::Modality::kText);

void split(const PerModalityCount& n, float share, int k, kernels::SelectParams& sp) {
  sp.use_modality_budgets = true;
  const int k_text = static_cast<int>(std::min<std::int64_t>(n[kText], std::lround(share * k)));
  const int rest = k - k_text;
  std::int64_t others = 0;
  for (int m = 0; m < kModalities; ++m) others += m == kText ? 0 : n[static_cast<std::size_t>(m)];
  sp.modality_budget[kText] = k_text;
  int given = 0;
  for (int m = 0; m < kModalities; ++m) {
    if (m == kText) continue;
    const int km = others ? static_cast<int>(std::floor(static_cast<double>(rest) *
                                                        n[static_cast<std::size_t>(m)] / others))
                          : 0;
    sp.modality_budget[m] = km;
    given += km;
  }
  sp.modality_budget[kVision] += rest - given;
}

class Hybrid final : public Allocator {
 public:
  using Allocator::Allocator;
  void allocate(const LayerView& v, const std::vector<float>&, int, int& k, kernels::SelectParams& sp,
                std::vector<std::uint8_t>&) const override {
    split(v.tokens.per_modality, v.policy.params.real("hybrid_text_share"), k, sp);
  }
  void allocate_resident(const LayerView& v, const TokenView& resident, const std::vector<float>&, int& k,
                         kernels::SelectParams& sp, std::vector<std::uint8_t>&) const override {
    split(resident.per_modality, v.policy.params.real("hybrid_text_share"), k, sp);
  }
};

}  // namespace

std::unique_ptr<Stage> make_allocator_hybrid() {
  const std::string src = "HybridKV-style modality split (design.md)";
  return std::make_unique<Hybrid>(StageInfo{
      StageKind::kAllocator,
      "hybrid",
      "text dense (a share alpha of the budget), vision sparse",
      src,
      true,
      {float_param("hybrid_text_share", "0.5", 0, 1, "alpha: share of the budget reserved for text", src)}});
}

}  // namespace kvscope::sim::stages
