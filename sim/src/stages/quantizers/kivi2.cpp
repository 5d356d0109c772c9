// kivi2: KIVI 2-bit: keys per channel, values per token, groups of 32, last 128 tokens full precision.
#include "../stage.hpp"

namespace kvscope::sim::stages {

std::unique_ptr<Stage> make_quantizer_kivi2() {
  return std::make_unique<FixedQuantizer>(
      StageInfo{
          StageKind::kQuantizer,
          "kivi2",
          "KIVI 2-bit: keys per channel, values per token, groups of 32, last 128 tokens full precision",
          "Liu et al. 2024, KIVI, Sec. 3",
          true,
          {}},
      kernels::kivi_key_spec(2, 32, 128), kernels::kivi_value_spec(2, 32, 128));
}

}  // namespace kvscope::sim::stages
