// keydiff: score = -cos(k_t, a) with anchor a = the mean of the head's L2-normalised keys, so the
// keys least similar to the head's average key are kept (Park et al. 2025, KeyDiff: Key
// Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
// Environments, arXiv 2504.15364, Sec. 3; as kvpress's KeyDiffPress, without its BlockPress
// iteration). Decode mode: the same score over the resident keys at each eviction.
#include <cmath>

#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

// -cos(k_i, mean_j k_j / ||k_j||) of n keys [n, D] into out [n]; float64 sums. A zero key has
// cosine 0 (kvpress's F.normalize / cosine_similarity use eps 1e-12 / 1e-8 and give 0 too).
void keydiff_scores(const float* k, int n, int D, float* out) {
  std::vector<double> anchor(static_cast<std::size_t>(D), 0.0);
  std::vector<double> norm(static_cast<std::size_t>(n), 0.0);
  for (int i = 0; i < n; ++i) {
    const float* x = k + static_cast<std::size_t>(i) * static_cast<std::size_t>(D);
    double s = 0;
    for (int d = 0; d < D; ++d) s += static_cast<double>(x[d]) * x[d];
    norm[static_cast<std::size_t>(i)] = std::sqrt(s);
    if (s > 0)
      for (int d = 0; d < D; ++d)
        anchor[static_cast<std::size_t>(d)] += x[d] / norm[static_cast<std::size_t>(i)];
  }
  double an = 0;
  for (int d = 0; d < D; ++d) {
    anchor[static_cast<std::size_t>(d)] /= std::max(1, n);
    an += anchor[static_cast<std::size_t>(d)] * anchor[static_cast<std::size_t>(d)];
  }
  an = std::sqrt(an);
  for (int i = 0; i < n; ++i) {
    const float* x = k + static_cast<std::size_t>(i) * static_cast<std::size_t>(D);
    double dot = 0;
    for (int d = 0; d < D; ++d) dot += x[d] * anchor[static_cast<std::size_t>(d)];
    const double den = norm[static_cast<std::size_t>(i)] * an;
    out[i] = den > 0 ? static_cast<float>(-dot / den) : 0.0f;
  }
}

class Resident final : public DecodeScoring {
 public:
  explicit Resident(int D) : D_(D) {}
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    out.resize(s.tokens.size());
    keydiff_scores(static_cast<const float*>(s.query.k), static_cast<int>(s.tokens.size()), D_, out.data());
  }

 private:
  int D_;
};

// [Hkv, T] of the layer's context keys (float32 copy), computed once per layer and shared by
// every point.
const std::vector<float>& keydiff_statistic(LayerData& d, const TraceContext& ctx) {
  return d.stage_statistic("keydiff", false, [&ctx](LayerData& l) {
    const int H = ctx.geometry.num_kv_heads, D = ctx.geometry.head_dim, T = ctx.T;
    const std::size_t stride =
        (static_cast<std::size_t>(T) + static_cast<std::size_t>(ctx.S)) * static_cast<std::size_t>(D);
    std::vector<float> s(static_cast<std::size_t>(H) * static_cast<std::size_t>(T));
    for (int h = 0; h < H; ++h)
      keydiff_scores(l.k_all().data() + static_cast<std::size_t>(h) * stride, T, D,
                     &s[static_cast<std::size_t>(h) * T]);
    return s;
  });
}

class KeyDiff final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_float(LayerData& d, const PolicySpec&, const TraceContext& ctx) const override {
    keydiff_statistic(d, ctx);
  }
  void score(const LayerView& v, std::vector<float>& out) const override {
    out = keydiff_statistic(v.data, v.ctx);
  }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView& v, int) const override {
    return std::make_unique<Resident>(v.head_dim);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_keydiff() {
  StageInfo info{StageKind::kScorer,
                 "keydiff",
                 "keys least similar (cosine) to the head's mean normalised key first",
                 "Park et al. 2025, KeyDiff, arXiv 2504.15364, Sec. 3; kvpress KeyDiffPress",
                 true,
                 {}};
  info.preset = true;
  return std::make_unique<KeyDiff>(std::move(info));
}

}  // namespace kvscope::sim::stages
