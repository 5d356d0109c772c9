// unicache executor (seed 000 step 6): a dropped token merges into the most similar kept token
// within +-merge_window positions if the cosine is > unicache.merge_threshold, else it is evicted.
// Decode mode: the same rule on the resident cache at each eviction, as merge-evicted's (the window
// counts resident slots, multiplicities carried; sim/src/decode_exec.cpp).
#include "../stage.hpp"

namespace kvscope::sim::stages {

namespace {

class UniCacheExecutor final : public Executor {
 public:
  using Executor::Executor;
  bool merges() const override { return true; }
  void execute(const LayerView& v, int n, const float* keys, const float* values, const std::int32_t* kept,
               int K, const float* importance, SlotOutput out) const override {
    merge_into_kept(v, n, keys, values, kept, K, importance, v.policy.params.integer("merge_window"),
                    v.policy.params.real("unicache.merge_threshold"), out);
  }
};

}  // namespace

std::unique_ptr<Stage> make_executor_unicache() {
  const std::string src = "seed 000 (UniCache), step 6";
  return std::make_unique<UniCacheExecutor>(StageInfo{
      StageKind::kExecutor,
      "unicache",
      "redundant dropped tokens merge, the rest are evicted",
      src,
      true,
      {float_param("unicache.merge_threshold", "0.8", -1, 1, "merge if the key cosine is > this", src),
       int_param("merge_window", "8", 0, 1e6, "positions within which tokens may merge", src)}});
}

}  // namespace kvscope::sim::stages
