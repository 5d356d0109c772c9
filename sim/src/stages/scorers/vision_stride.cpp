// vision-stride: structured spatial priority of a vision token: log2 of the coarsest stride s whose
// grid (row % s == 0 and col % s == 0) contains it, so any top-k is evenly spread over the image.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

float stride_level(int row, int col) {
  if (row < 0 || col < 0) return 0.0f;
  int level = 0;
  for (int s = 2; s <= 1 << 12; s <<= 1) {
    if (row % s != 0 || col % s != 0) break;
    ++level;
  }
  return static_cast<float>(level);
}

class VisionStride final : public Scorer {
 public:
  using Scorer::Scorer;
  void score(const LayerView& v, std::vector<float>& out) const override {
    for (int h = 0; h < v.kv_heads; ++h)
      for (int t = 0; t < v.T; ++t)
        out[v.index(h, t)] = stride_level(v.tokens.grid_row[t], v.tokens.grid_col[t]);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_vision_stride() {
  return std::make_unique<VisionStride>(StageInfo{StageKind::kScorer,
                                                  "vision-stride",
                                                  "coarsest patch grid first (structured spatial drop)",
                                                  "structured vision token pruning baseline (spatial stride)",
                                                  false,
                                                  {}});
}

}  // namespace kvscope::sim::stages
