// kivi2: KIVI 2-bit: keys per channel, values per token, groups of 32, last 128 tokens full precision.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Q final : public Quantizer {
 public:
  using Quantizer::Quantizer;
  bool specs(kernels::QuantSpec* key, kernels::QuantSpec* value) const override {
    *key = kernels::kivi_key_spec(2, 32, 128);
    *value = kernels::kivi_value_spec(2, 32, 128);
    return true;
  }
};

}  // namespace

std::unique_ptr<Stage> make_quantizer_kivi2() {
  return std::make_unique<Q>(StageInfo{
      StageKind::kQuantizer,
      "kivi2",
      "KIVI 2-bit: keys per channel, values per token, groups of 32, last 128 tokens full precision",
      "Liu et al. 2024, KIVI, Sec. 3",
      true,
      {}});
}

}  // namespace kvscope::sim::stages
