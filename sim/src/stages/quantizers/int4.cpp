// int4: int4 asymmetric, one scale and zero per group of 32 channels of a token.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Q final : public Quantizer {
 public:
  using Quantizer::Quantizer;
  bool specs(kernels::QuantSpec* key, kernels::QuantSpec* value) const override {
    *key = *value = kernels::QuantSpec{4, false, kernels::Granularity::kPerToken, 32, 0};
    return true;
  }
};

}  // namespace

std::unique_ptr<Stage> make_quantizer_int4() {
  return std::make_unique<Q>(
      StageInfo{StageKind::kQuantizer,
                "int4",
                "int4 asymmetric, one scale and zero per group of 32 channels of a token",
                "group-wise int4 KV quantization (e.g. FlexGen, KIVI baseline)",
                true,
                {}});
}

}  // namespace kvscope::sim::stages
