// unicache: s = w_a a~ + w_c c~ - w_d clamp(d, 0, 1) + w_r r (seed 000 step 2): H2O attention and
// cross-modal attention received, normalised per (kv head, modality), key redundancy to the
// neighbours, linear recency. Shallow layers use w_d 0.3, deep layers w_a 0.5.
#include "../../exec_util.hpp"
#include "../stage.hpp"
#include "kvscope/kernels/scores.hpp"

namespace kvscope::sim::stages {
namespace {

class UniCache final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec& p, const TraceContext&) const override {
    const UniCacheConfig u = unicache_config(p);
    d.h2o();
    d.cross_received();
    d.redundancy(u.seq_radius, u.grid_radius);
    d.cross_given();  // alignment protection reads it
  }
  void score(const LayerView& v, std::vector<float>& out) const override {
    const UniCacheConfig u = unicache_config(v.policy);
    kernels::UniCacheParams up;
    up.w_a = u.w_a;
    up.w_c = u.w_c;
    up.w_d = u.w_d;
    up.w_r = u.w_r;
    const int third = std::max(1, v.num_layers / 3);
    if (v.layer < third) up.w_d = u.shallow_w_d;
    if (v.layer >= v.num_layers - third) up.w_a = u.deep_w_a;
    kernels::UniCacheInputs in;
    in.attention = v.data.h2o().data();
    in.cross = v.data.cross_received().data();
    in.redundancy = v.data.redundancy(u.seq_radius, u.grid_radius).data();
    in.modality = v.tokens.modality;
    in.num_heads = v.kv_heads;
    in.num_tokens = v.T;
    detail::check(kernels::cpu::unicache_score(in, up, out.data()), "UniCache score");
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_unicache() {
  const std::string src = "seed 000 (UniCache), step 2";
  return std::make_unique<UniCache>(StageInfo{
      StageKind::kScorer,
      "unicache",
      "modality-normalised attention + cross-modal - redundancy + recency",
      src,
      false,
      {float_param("unicache.w_a", "0.4", 0, 10, "attention weight (middle layers; deep layers 0.5)", src),
       float_param("unicache.w_c", "0.3", 0, 10, "cross-modal weight", src),
       float_param("unicache.w_d", "0.2", 0, 10, "redundancy weight (middle layers; shallow layers 0.3)",
                   src),
       float_param("unicache.w_r", "0.1", 0, 10, "recency weight", src)}});
}

}  // namespace kvscope::sim::stages
