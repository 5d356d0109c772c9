// int8-head: int8 symmetric, one scale per kv head and layer (K and V).
#include "../stage.hpp"

namespace kvscope::sim::stages {

std::unique_ptr<Stage> make_quantizer_int8_head() {
  const kernels::QuantSpec spec{8, true, kernels::Granularity::kPerHead, 0, 0};
  return std::make_unique<FixedQuantizer>(
      StageInfo{StageKind::kQuantizer,
                "int8-head",
                "int8 symmetric, one scale per kv head and layer (K and V)",
                "seed 000 (UniCache), step 7",
                true,
                {}},
      spec, spec);
}

}  // namespace kvscope::sim::stages
