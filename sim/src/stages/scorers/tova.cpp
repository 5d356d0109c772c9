// tova: attention of the last prefill query, summed over the GQA group. Decode mode: attention
// of the current decode query over the resident cache.
#include "../../exec_util.hpp"
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class CurrentQuery final : public DecodeScoring {
 public:
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    const int K = static_cast<int>(s.tokens.size()), G = s.query.num_q_heads;
    stat_.resize(static_cast<std::size_t>(G) * static_cast<std::size_t>(K));
    detail::check(s.backend.tova_scores(s.query, stat_.data()), "TOVA scores");
    out.assign(static_cast<std::size_t>(K), 0.0f);
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < K; ++i)
        out[static_cast<std::size_t>(i)] += stat_[static_cast<std::size_t>(j) * K + i];
  }

 private:
  std::vector<float> stat_;  // [G, K]
};

class TOVA final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec&, const TraceContext&) const override { d.tova(); }
  void score(const LayerView& v, std::vector<float>& out) const override { out = v.data.tova(); }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView&, int) const override {
    return std::make_unique<CurrentQuery>();
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_tova() {
  return std::make_unique<TOVA>(
      StageInfo{StageKind::kScorer,
                "tova",
                "attention of the last prefill query",
                "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA), Sec. 3",
                true,
                {}});
}

}  // namespace kvscope::sim::stages
