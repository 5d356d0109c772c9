// random: a splitmix64 hash of (seed, layer, kv head, token id) -> uniform in [0, 1); decode token
// j has id T + j, so both modes score a token alike. random_layers = same hashes layer 0 for every layer
// (kvpress's RandomPress draws the same positions in every layer).
#include "../../exec_util.hpp"
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class Hashed final : public DecodeScoring {
 public:
  Hashed(std::uint64_t seed, int layer, int h) : seed_(seed), layer_(layer), head_(h) {}
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    out.resize(s.tokens.size());
    for (std::size_t i = 0; i < s.tokens.size(); ++i)
      out[i] = detail::random_token_score(seed_, layer_, head_, s.tokens[i]);
  }

 private:
  std::uint64_t seed_;
  int layer_, head_;
};

std::uint64_t seed_of(const PolicySpec& p) { return static_cast<std::uint64_t>(p.params.number("seed")); }
int layer_of(const PolicySpec& p, int layer) { return p.params.text("random_layers") == "same" ? 0 : layer; }

class Random final : public Scorer {
 public:
  using Scorer::Scorer;
  void score(const LayerView& v, std::vector<float>& out) const override {
    const std::uint64_t seed = seed_of(v.policy);
    for (int h = 0; h < v.kv_heads; ++h)
      for (int t = 0; t < v.T; ++t)
        out[v.index(h, t)] = detail::random_token_score(seed, layer_of(v.policy, v.layer), h, t);
  }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView& v, int h) const override {
    return std::make_unique<Hashed>(seed_of(v.policy), layer_of(v.policy, v.layer), h);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_random() {
  return std::make_unique<Random>(
      StageInfo{StageKind::kScorer,
                "random",
                "uniformly random tokens (seeded)",
                "baseline",
                true,
                {int_param("seed", "0", 0, 1.8e19, "seed of the random scorer", "kvscope"),
                 choice_param("random_layers", "own", {"own", "same"},
                              "own: every layer draws its own positions; same: every layer the same (kvpress "
                              "RandomPress)",
                              "kvpress 0.5.5 RandomPress")}});
}

}  // namespace kvscope::sim::stages
