// recency: score = token id, so the newest tokens are kept (window, streamingllm).
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

// Newest first: the token id is the score.
class NewestFirst final : public DecodeScoring {
 public:
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    out.resize(s.tokens.size());
    for (std::size_t i = 0; i < s.tokens.size(); ++i) out[i] = static_cast<float>(s.tokens[i]);
  }
};

class Recency final : public Scorer {
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

std::unique_ptr<Stage> newest_first_scorer(StageInfo info) {
  return std::make_unique<Recency>(std::move(info));
}

std::unique_ptr<Stage> make_scorer_recency() {
  return newest_first_scorer(StageInfo{StageKind::kScorer,
                                       "recency",
                                       "score = token index: the newest tokens are kept",
                                       "Beltagy et al. 2020 (Longformer); Xiao et al. 2023 (StreamingLLM)",
                                       true,
                                       {}});
}

}  // namespace kvscope::sim::stages
