// merge-evicted (LOOK-M): each evicted token folds into the kept token within +-merge_window
// positions whose key is most similar, if that cosine is > merge_threshold; else it is dropped.
// Decode mode: the same kernel on the resident cache at each eviction (the window counts resident
// slots; merge weights times the slots' multiplicities; sim/src/decode_exec.cpp).
#include "../../exec_util.hpp"
#include "../stage.hpp"
#include "kvscope/kernels/merge.hpp"

namespace kvscope::sim::stages {

// The merge kernel on one working head (shared with the unicache executor).
void merge_into_kept(const LayerView& v, int n, const float* keys, const float* values,
                     const std::int32_t* kept, int K, const float* importance, int window, float threshold,
                     SlotOutput out) {
  kernels::MergeParams mp;
  mp.num_heads = 1;
  mp.num_tokens = n;
  mp.head_dim = v.head_dim;
  mp.num_kept = K;
  mp.window = window;
  mp.threshold = threshold;
  mp.dtype = kernels::DType::kF32;
  detail::check(kernels::cpu::merge_tokens(mp, keys, values, kept, importance, out.keys, out.values,
                                           out.multiplicity, out.token_to_slot),
                "merge");
}

namespace {

class MergeEvicted final : public Executor {
 public:
  using Executor::Executor;
  bool merges() const override { return true; }
  void execute(const LayerView& v, int n, const float* keys, const float* values, const std::int32_t* kept,
               int K, const float* importance, SlotOutput out) const override {
    merge_into_kept(v, n, keys, values, kept, K, importance, v.policy.params.integer("merge_window"),
                    v.policy.params.real("merge_threshold"), out);
  }
};

}  // namespace

std::unique_ptr<Stage> make_executor_merge_evicted() {
  const std::string src = "Wan et al. 2024, LOOK-M, Sec. 3.2";
  return std::make_unique<MergeEvicted>(
      StageInfo{StageKind::kExecutor,
                "merge-evicted",
                "fold evicted tokens into the most similar kept one (LOOK-M)",
                src,
                true,
                {float_param("merge_threshold", "0.8", -1, 1, "merge if the key cosine is > this", src),
                 int_param("merge_window", "8", 0, 1e6, "positions within which tokens may merge", src)}});
}

}  // namespace kvscope::sim::stages
