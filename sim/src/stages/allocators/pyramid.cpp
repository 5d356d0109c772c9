// pyramid: more tokens in shallow layers, fewer in deep ones, same mean:
// keep_l = keep * (1 + spread * (1 - 2 l / (L - 1))).
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Pyramid final : public Allocator {
 public:
  using Allocator::Allocator;
  double layer_fraction(const LayerView& v, double keep) const override {
    if (v.num_layers <= 1) return keep;
    const float spread = v.policy.params.real("pyramid_spread");
    return keep * (1.0 + spread * (1.0 - 2.0 * v.layer / (v.num_layers - 1)));
  }
};

}  // namespace

std::unique_ptr<Stage> make_allocator_pyramid() {
  const std::string src = "Cai et al. 2024, PyramidKV (kvscope's linear parameterisation)";
  return std::make_unique<Pyramid>(StageInfo{
      StageKind::kAllocator,
      "pyramid",
      "shallow layers keep more, deep fewer, same total",
      src,
      true,
      {float_param("pyramid_spread", "0.5", 0, 1, "budget_l = b (1 + spread (1 - 2 l / (L - 1)))", src)}});
}

}  // namespace kvscope::sim::stages
