// evict: the kept tokens become the slots, everything else is dropped.
#include "../../exec_util.hpp"
#include "../stage.hpp"
#include "kvscope/kernels/compact.hpp"

namespace kvscope::sim::stages {
namespace {

class Evict final : public Executor {
 public:
  using Executor::Executor;
  bool merges() const override { return false; }
  void execute(const LayerView& v, int n, const float* keys, const float* values, const std::int32_t* kept,
               int K, const float*, SlotOutput out) const override {
    kernels::CompactShape cs{1, n, v.head_dim, kernels::DType::kF32};
    kernels::KeptIndices ki{kept, nullptr, K};
    kernels::CompactInputs ci;
    ci.keys = keys;
    ci.values = values;
    kernels::CompactOutputs co;
    co.keys = out.keys;
    co.values = out.values;
    detail::check(kernels::cpu::compact(cs, ki, ci, co), "compact");
    for (int s = 0; s < K; ++s) out.token_to_slot[kept[s]] = s;
  }
};

}  // namespace

std::unique_ptr<Stage> make_executor_evict() {
  return std::make_unique<Evict>(
      StageInfo{StageKind::kExecutor, "evict", "drop what is not selected", "baseline", true, {}});
}

}  // namespace kvscope::sim::stages
