// int8-head: int8 symmetric, one scale per kv head and layer (K and V).
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Q final : public Quantizer {
 public:
  using Quantizer::Quantizer;
  bool specs(kernels::QuantSpec* key, kernels::QuantSpec* value) const override {
    *key = *value = kernels::QuantSpec{8, true, kernels::Granularity::kPerHead, 0, 0};
    return true;
  }
};

}  // namespace

std::unique_ptr<Stage> make_quantizer_int8_head() {
  return std::make_unique<Q>(StageInfo{StageKind::kQuantizer,
                                       "int8-head",
                                       "int8 symmetric, one scale per kv head and layer (K and V)",
                                       "seed 000 (UniCache), step 7",
                                       true,
                                       {}});
}

}  // namespace kvscope::sim::stages
