// none: no scorer. A policy that does not compress tokens (full, quantization only) keeps every
// token; a token policy given `scorer = none` (INI) ranks like recency, newest first.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class NewestFirst final : public DecodeScoring {
 public:
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    out.resize(s.tokens.size());
    for (std::size_t i = 0; i < s.tokens.size(); ++i) out[i] = static_cast<float>(s.tokens[i]);
  }
};

class NoScorer final : public Scorer {
 public:
  using Scorer::Scorer;
  void score(const LayerView& v, std::vector<float>& out) const override {
    for (int h = 0; h < v.kv_heads; ++h)
      for (int t = 0; t < v.T; ++t) out[v.index(h, t)] = static_cast<float>(t);
  }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView&, int) const override {
    return std::make_unique<NewestFirst>();
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_none() {
  return std::make_unique<NoScorer>(
      StageInfo{StageKind::kScorer,
                "none",
                "no scorer: keeps every token, or ranks like recency in a token policy",
                "baseline",
                true,
                {}});
}

}  // namespace kvscope::sim::stages
