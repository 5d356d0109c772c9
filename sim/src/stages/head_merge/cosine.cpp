// cosine (head_merge = true): kv heads whose flattened key matrices have cosine > the threshold
// with a cluster's first head join it (greedy, head order); K and V of a cluster are averaged.
// The merged heads are computed once per layer and threshold (LayerData::merged_heads). Prefill
// only: decode mode runs the kv heads unmerged (docs/policies.md "Decode-time mode", step 8).
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class CosineMerge final : public HeadMerge {
 public:
  using HeadMerge::HeadMerge;
  void prepare_prefill(LayerData& d, const PolicySpec& p, const TraceContext& ctx) const override {
    if (p.compress_tokens && ctx.geometry.num_kv_heads > 1)
      d.merged_heads(p.params.real("head_merge_threshold"));
  }
  WorkingHeads merge(const LayerView& v) const override {
    const LayerData::MergedHeads& mh = v.data.merged_heads(v.policy.params.real("head_merge_threshold"));
    WorkingHeads w;
    w.merged = true;
    w.count = mh.num_heads;
    w.cluster = mh.cluster;
    const std::size_t TD = static_cast<std::size_t>(v.T) * static_cast<std::size_t>(v.head_dim);
    for (int c = 0; c < mh.num_heads; ++c) {
      const int row = mh.row[static_cast<std::size_t>(c)];
      if (row < 0) {  // one member: the kv head itself
        const int src = mh.source_head[static_cast<std::size_t>(c)];
        w.keys.push_back(v.context_keys(src).data);
        w.values.push_back(v.context_values(src).data);
      } else {
        w.keys.push_back(mh.k.data() + static_cast<std::size_t>(row) * TD);
        w.values.push_back(mh.v.data() + static_cast<std::size_t>(row) * TD);
      }
    }
    return w;
  }
};

}  // namespace

std::unique_ptr<Stage> make_head_merge_cosine() {
  const std::string src = "seed 000 (UniCache), step 1";
  return std::make_unique<CosineMerge>(
      StageInfo{StageKind::kHeadMerge,
                "cosine",
                "merge kv heads whose key cosine exceeds the threshold (prefill; decode mode runs unmerged)",
                src,
                false,
                {float_param("head_merge_threshold", "0.88", -1, 1,
                             "cosine threshold of head merging (0.85 - 0.92)", src)}});
}

}  // namespace kvscope::sim::stages
