// vision-only: layers before fastv_layer keep everything; from there on every non-vision token is
// protected and the rest of the budget goes to vision (FastV, vision-stride, LOOK-M). Decode mode:
// every non-vision resident token (decode tokens are text) is protected; only vision is evicted.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class VisionOnly final : public Allocator {
 public:
  using Allocator::Allocator;
  bool keeps_layer(const LayerView& v) const override {
    return v.layer < v.policy.params.integer("fastv_layer");
  }
  void allocate(const LayerView& v, const std::vector<float>&, int, int&, kernels::SelectParams&,
                std::vector<std::uint8_t>& protect) const override {
    for (int t = 0; t < v.T; ++t) protect[static_cast<std::size_t>(t)] = !v.tokens.is_vision(t);
  }
  void allocate_resident(const LayerView&, const TokenView& resident, const std::vector<float>&, int&,
                         kernels::SelectParams&, std::vector<std::uint8_t>& protect) const override {
    for (int i = 0; i < resident.count; ++i) protect[static_cast<std::size_t>(i)] = !resident.is_vision(i);
  }
};

}  // namespace

std::unique_ptr<Stage> make_allocator_vision_only() {
  const std::string src = "Chen et al. 2024, FastV, Sec. 4";
  return std::make_unique<VisionOnly>(
      StageInfo{StageKind::kAllocator,
                "vision-only",
                "text, audio and special tokens kept, the budget spent on vision",
                src,
                true,
                {int_param("fastv_layer", "2", 0, 1e6, "layers before this keep everything", src)}});
}

}  // namespace kvscope::sim::stages
