// none: the kept slots stay in the trace's dtype.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class NoQuant final : public Quantizer {
 public:
  using Quantizer::Quantizer;
  bool specs(kernels::QuantSpec*, kernels::QuantSpec*) const override { return false; }
};

}  // namespace

std::unique_ptr<Stage> make_quantizer_none() {
  return std::make_unique<NoQuant>(
      StageInfo{StageKind::kQuantizer, "none", "no quantization", "baseline", true, {}});
}

}  // namespace kvscope::sim::stages
