// none: no scorer. A policy that does not compress tokens (full, quantization only) keeps every
// token; a token policy given `scorer = none` (INI) ranks like recency, newest first.
#include "../stage.hpp"

namespace kvscope::sim::stages {

std::unique_ptr<Stage> make_scorer_none() {
  return newest_first_scorer(
      StageInfo{StageKind::kScorer,
                "none",
                "no scorer: keeps every token, or ranks like recency in a token policy",
                "baseline",
                true,
                {}});
}

}  // namespace kvscope::sim::stages
