// int4: int4 asymmetric, one scale and zero per group of 32 channels of a token.
#include "../stage.hpp"

namespace kvscope::sim::stages {

std::unique_ptr<Stage> make_quantizer_int4() {
  const kernels::QuantSpec spec{4, false, kernels::Granularity::kPerToken, 32, 0};
  return std::make_unique<FixedQuantizer>(
      StageInfo{StageKind::kQuantizer,
                "int4",
                "int4 asymmetric, one scale and zero per group of 32 channels of a token",
                "group-wise int4 KV quantization (e.g. FlexGen, KIVI baseline)",
                true,
                {}},
      spec, spec);
}

}  // namespace kvscope::sim::stages
