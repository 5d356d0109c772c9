// h2o: accumulated attention each token received from all prefill queries (causal), summed over
// the query heads of its kv head's GQA group. Decode mode: the prefill score plus the attention of
// every decode query over the cache it saw.
#include "../../exec_util.hpp"
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Accumulated final : public DecodeScoring {
 public:
  Accumulated(const LayerView& v, int h)
      : acc_(static_cast<std::size_t>(v.T) + static_cast<std::size_t>(v.S), 0.0f) {
    const std::vector<float>& prefill = v.data.h2o();  // [Hkv, T]
    std::copy_n(prefill.begin() + static_cast<std::ptrdiff_t>(h) * v.T, v.T, acc_.begin());
  }
  void observe(const DecodeStepView& s) override {
    const int K = static_cast<int>(s.tokens.size()), G = s.query.num_q_heads;
    stat_.resize(static_cast<std::size_t>(G) * static_cast<std::size_t>(K));
    detail::check(s.backend.accumulated_attention(s.query, kernels::QueryRange{0, -1}, stat_.data()),
                  "H2O attention");
    sum_.assign(static_cast<std::size_t>(K), 0.0f);
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < K; ++i)
        sum_[static_cast<std::size_t>(i)] += stat_[static_cast<std::size_t>(j) * K + i];
    for (int i = 0; i < K; ++i)
      acc_[static_cast<std::size_t>(s.tokens[static_cast<std::size_t>(i)])] +=
          sum_[static_cast<std::size_t>(i)];
  }
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    out.resize(s.tokens.size());
    for (std::size_t i = 0; i < s.tokens.size(); ++i) out[i] = acc_[static_cast<std::size_t>(s.tokens[i])];
  }

 private:
  std::vector<float> acc_;         // [T + S] accumulated attention by token id
  std::vector<float> stat_, sum_;  // [G, K], [K]
};

class H2O final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec&, const TraceContext&) const override { d.h2o(); }
  void score(const LayerView& v, std::vector<float>& out) const override { out = v.data.h2o(); }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView& v, int h) const override {
    return std::make_unique<Accumulated>(v, h);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_h2o() {
  return std::make_unique<H2O>(StageInfo{StageKind::kScorer,
                                         "h2o",
                                         "accumulated attention from all prefill queries (heavy hitters)",
                                         "Zhang et al. 2023, H2O: Heavy-Hitter Oracle, Sec. 3",
                                         true,
                                         {}});
}

}  // namespace kvscope::sim::stages
