// knorm: score = -||k_t||_2 per kv head (the trace's keys): the lowest-norm keys are kept.
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class NegNorm final : public DecodeScoring {
 public:
  NegNorm(const LayerView& v, int h)
      : norms_(v.data.key_norm_all()),
        base_(static_cast<std::size_t>(h) * (static_cast<std::size_t>(v.T) + static_cast<std::size_t>(v.S))) {
  }
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    out.resize(s.tokens.size());
    for (std::size_t i = 0; i < s.tokens.size(); ++i)
      out[i] = norms_[base_ + static_cast<std::size_t>(s.tokens[i])];
  }

 private:
  const std::vector<float>& norms_;  // [Hkv, T + S] -||k||
  std::size_t base_;
};

class KeyNorm final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec&, const TraceContext&) const override { d.key_norm(); }
  void prepare_float(LayerData& d, const PolicySpec& p, const TraceContext&) const override {
    if (p.mode == PolicyMode::kDecode) d.key_norm_all();
  }
  void score(const LayerView& v, std::vector<float>& out) const override {
    out = v.data.key_norm();
    for (auto& x : out) x = -x;
  }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView& v, int h) const override {
    return std::make_unique<NegNorm>(v, h);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_knorm() {
  return std::make_unique<KeyNorm>(
      StageInfo{StageKind::kScorer,
                "knorm",
                "lowest key L2 norm first",
                "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
                true,
                {}});
}

}  // namespace kvscope::sim::stages
