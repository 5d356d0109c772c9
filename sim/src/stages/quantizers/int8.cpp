// int8: int8 symmetric, one scale per token (K and V).
#include "../stage.hpp"

namespace kvscope::sim::stages {

std::unique_ptr<Stage> make_quantizer_int8() {
  const kernels::QuantSpec spec{8, true, kernels::Granularity::kPerToken, 0, 0};
  return std::make_unique<FixedQuantizer>(StageInfo{StageKind::kQuantizer,
                                                    "int8",
                                                    "int8 symmetric, one scale per token (K and V)",
                                                    "standard per-token int8 KV quantization",
                                                    true,
                                                    {}},
                                          spec, spec);
}

}  // namespace kvscope::sim::stages
