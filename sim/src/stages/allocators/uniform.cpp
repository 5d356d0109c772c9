// uniform: every layer and kv head keeps lround(keep * T) tokens.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Uniform final : public Allocator {
 public:
  using Allocator::Allocator;
};

}  // namespace

std::unique_ptr<Stage> make_allocator_uniform() {
  return std::make_unique<Uniform>(StageInfo{StageKind::kAllocator,
                                             "uniform",
                                             "every layer keeps the budget fraction of every head",
                                             "baseline",
                                             true,
                                             {}});
}

}  // namespace kvscope::sim::stages
