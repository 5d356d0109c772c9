// int8: int8 symmetric, one scale per token (K and V).
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Q final : public Quantizer {
 public:
  using Quantizer::Quantizer;
  bool specs(kernels::QuantSpec* key, kernels::QuantSpec* value) const override {
    *key = *value = kernels::QuantSpec{8, true, kernels::Granularity::kPerToken, 0, 0};
    return true;
  }
};

}  // namespace

std::unique_ptr<Stage> make_quantizer_int8() {
  return std::make_unique<Q>(StageInfo{StageKind::kQuantizer,
                                       "int8",
                                       "int8 symmetric, one scale per token (K and V)",
                                       "standard per-token int8 KV quantization",
                                       true,
                                       {}});
}

}  // namespace kvscope::sim::stages
