// none: every kv head is its own working head.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class NoMerge final : public HeadMerge {
 public:
  using HeadMerge::HeadMerge;
  WorkingHeads merge(const LayerView& v) const override {
    WorkingHeads w;
    w.count = v.kv_heads;
    for (int h = 0; h < v.kv_heads; ++h) {
      w.cluster.push_back(h);
      w.keys.push_back(v.context_keys(h).data);
      w.values.push_back(v.context_values(h).data);
    }
    return w;
  }
};

}  // namespace

std::unique_ptr<Stage> make_head_merge_none() {
  return std::make_unique<NoMerge>(
      StageInfo{StageKind::kHeadMerge, "none", "no head merging", "baseline", true, {}});
}

}  // namespace kvscope::sim::stages
