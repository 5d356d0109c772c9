// unicache: s = w_a a~ + w_c c~ - w_d clamp(d, 0, 1) + w_r r (seed 000 step 2): H2O attention and
// cross-modal attention received, normalised per (kv head, modality), key redundancy to the
// neighbours, linear recency. Shallow layers use w_d 0.3, deep layers w_a 0.5. Decode mode: the
// same score on the resident cache at each eviction (UniCacheDecode below).
#include "../../exec_util.hpp"
#include "../stage.hpp"
#include "kvscope/kernels/scores.hpp"

namespace kvscope::sim::stages {
namespace {

kernels::UniCacheParams layer_params(const LayerView& v) {
  const UniCacheConfig u = unicache_config(v.policy);
  kernels::UniCacheParams up;
  up.w_a = u.w_a;
  up.w_c = u.w_c;
  up.w_d = u.w_d;
  up.w_r = u.w_r;
  const int third = std::max(1, v.num_layers / 3);
  if (v.layer < third) up.w_d = u.shallow_w_d;
  if (v.layer >= v.num_layers - third) up.w_a = u.deep_w_a;
  return up;
}

// Decode mode, one kv head. At an eviction the score is the prefill formula over the K resident
// tokens (resident index i in place of t, so r = i / (K - 1), and the normalisation groups are the
// resident tokens of each modality):
//   a: accumulated attention, the prefill H2O score plus every decode query's attention (as h2o);
//   c: mean attention received from other-modality queries: the prefill mean, updated with every
//      decode query (text) for the non-text tokens it saw; text and decode tokens keep theirs / 0;
//   d: max key cosine to the resident neighbours (grid tokens: their prefill grid neighbours still
//      resident; other tokens, decode tokens included: resident tokens within +-seq_radius ids),
//      on the resident (merged, dequantized) keys.
// With the whole context resident and no decode query seen it equals the prefill score.
class UniCacheDecode final : public DecodeScoring {
 public:
  UniCacheDecode(const LayerView& v, int h)
      : params_(layer_params(v)),
        T_(v.T),
        seq_radius_(unicache_config(v.policy).seq_radius),
        modality_(v.ctx.modality_all.data()),
        grid_row_(v.tokens.grid_row),
        grid_col_(v.tokens.grid_col),
        neighbours_(&v.ctx.neighbour_lists(unicache_config(v.policy).seq_radius,
                                           unicache_config(v.policy).grid_radius)),
        acc_(static_cast<std::size_t>(v.T) + static_cast<std::size_t>(v.S), 0.0f),
        cross_(acc_.size(), 0.0f),
        added_(acc_.size(), 0.0),
        seen_(acc_.size(), 0),
        before_(acc_.size(), 0) {
    const std::vector<float>& h2o = v.data.h2o();             // [Hkv, T]
    const std::vector<float>& rec = v.data.cross_received();  // [Hkv, T]
    std::copy_n(h2o.begin() + static_cast<std::ptrdiff_t>(h) * v.T, v.T, acc_.begin());
    std::copy_n(rec.begin() + static_cast<std::ptrdiff_t>(h) * v.T, v.T, cross_.begin());
    // Other-modality prefill queries that saw token t (causal: i >= t), the mean's count.
    PerModalityCount after{};
    for (int t = v.T - 1; t >= 0; --t) {
      const int m = modality_[t];
      std::int64_t other = 0;
      for (int x = 0; x < kModalities; ++x) other += x == m ? 0 : after[static_cast<std::size_t>(x)];
      before_[static_cast<std::size_t>(t)] = other;
      ++after[static_cast<std::size_t>(m)];
    }
  }
  void observe(const DecodeStepView& s) override {
    const int K = static_cast<int>(s.tokens.size()), G = s.query.num_q_heads;
    stat_.resize(static_cast<std::size_t>(G) * static_cast<std::size_t>(K));
    detail::check(s.backend.accumulated_attention(s.query, kernels::QueryRange{0, -1}, stat_.data()),
                  "UniCache attention");
    constexpr std::uint8_t kText = static_cast<std::uint8_t>(kernels::Modality::kText);
    for (int i = 0; i < K; ++i) {
      float sum = 0;
      for (int j = 0; j < G; ++j) sum += stat_[static_cast<std::size_t>(j) * K + i];
      const auto t = static_cast<std::size_t>(s.tokens[static_cast<std::size_t>(i)]);
      acc_[t] += sum;
      if (modality_[t] != kText) {  // a decode query is text: cross-modal for this token
        added_[t] += sum;
        ++seen_[t];
      }
    }
  }
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    const int K = static_cast<int>(s.tokens.size());
    a_.resize(static_cast<std::size_t>(K));
    c_.resize(a_.size());
    mod_.resize(a_.size());
    for (int i = 0; i < K; ++i) {
      const auto t = static_cast<std::size_t>(s.tokens[static_cast<std::size_t>(i)]);
      a_[static_cast<std::size_t>(i)] = acc_[t];
      c_[static_cast<std::size_t>(i)] =
          seen_[t] == 0 ? cross_[t]
                        : static_cast<float>(
                              (static_cast<double>(cross_[t]) * static_cast<double>(before_[t]) + added_[t]) /
                              static_cast<double>(before_[t] + seen_[t]));
      mod_[static_cast<std::size_t>(i)] = modality_[t];
    }
    resident_redundancy(s);
    kernels::UniCacheInputs in;
    in.attention = a_.data();
    in.cross = c_.data();
    in.redundancy = d_.data();
    in.modality = mod_.data();
    in.num_heads = 1;
    in.num_tokens = K;
    out.resize(a_.size());
    detail::check(kernels::cpu::unicache_score(in, params_, out.data()), "UniCache score");
  }

 private:
  void resident_redundancy(const DecodeStepView& s) {
    const int K = static_cast<int>(s.tokens.size());
    const std::int32_t newest = s.tokens.empty() ? 0 : s.tokens.back();
    slot_.assign(static_cast<std::size_t>(newest) + 1, -1);
    for (int i = 0; i < K; ++i) slot_[static_cast<std::size_t>(s.tokens[static_cast<std::size_t>(i)])] = i;
    table_.offsets.assign(1, 0);
    table_.indices.clear();
    for (int i = 0; i < K; ++i) {
      const std::int32_t t = s.tokens[static_cast<std::size_t>(i)];
      if (t < T_ && grid_row_[t] >= 0 && grid_col_[t] >= 0) {
        for (std::int32_t e = neighbours_->offsets[static_cast<std::size_t>(t)];
             e < neighbours_->offsets[static_cast<std::size_t>(t) + 1]; ++e) {
          const std::int32_t j =
              slot_[static_cast<std::size_t>(neighbours_->indices[static_cast<std::size_t>(e)])];
          if (j >= 0) table_.indices.push_back(j);
        }
      } else {
        for (int j = i - 1; j >= 0 && t - s.tokens[static_cast<std::size_t>(j)] <= seq_radius_; --j)
          table_.indices.push_back(j);
        for (int j = i + 1; j < K && s.tokens[static_cast<std::size_t>(j)] - t <= seq_radius_; ++j)
          table_.indices.push_back(j);
      }
      table_.offsets.push_back(static_cast<std::int32_t>(table_.indices.size()));
    }
    d_.resize(static_cast<std::size_t>(K));
    const kernels::KeyTensor k{s.query.k, 1, K, s.query.head_dim, kernels::DType::kF32};
    detail::check(kernels::cpu::redundancy(k, table_.view(), d_.data()), "UniCache redundancy");
  }

  kernels::UniCacheParams params_;
  int T_ = 0, seq_radius_ = 4;
  const std::uint8_t* modality_;               // [T + S]
  const std::int32_t *grid_row_, *grid_col_;   // [T]
  const kernels::NeighbourTable* neighbours_;  // prefill neighbour lists of the context tokens
  std::vector<float> acc_, cross_;             // [T + S] by token id: a, prefill c
  std::vector<double> added_;                  // [T + S] decode attention from other-modality queries
  std::vector<std::int64_t> seen_, before_;    // [T + S] decode / prefill other-modality query counts
  std::vector<float> stat_, a_, c_, d_;        // [G, K], [K] x 3
  std::vector<std::uint8_t> mod_;              // [K]
  std::vector<std::int32_t> slot_;             // [newest id + 1] resident index of a token id, -1
  kernels::NeighbourTable table_;              // resident neighbour lists
};

class UniCache final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec& p, const TraceContext&) const override {
    const UniCacheConfig u = unicache_config(p);
    d.h2o();
    d.cross_received();
    d.redundancy(u.seq_radius, u.grid_radius);
    d.cross_given();  // alignment protection reads it
  }
  void score(const LayerView& v, std::vector<float>& out) const override {
    const UniCacheConfig u = unicache_config(v.policy);
    const kernels::UniCacheParams up = layer_params(v);
    kernels::UniCacheInputs in;
    in.attention = v.data.h2o().data();
    in.cross = v.data.cross_received().data();
    in.redundancy = v.data.redundancy(u.seq_radius, u.grid_radius).data();
    in.modality = v.tokens.modality;
    in.num_heads = v.kv_heads;
    in.num_tokens = v.T;
    detail::check(kernels::cpu::unicache_score(in, up, out.data()), "UniCache score");
  }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView& v, int h) const override {
    return std::make_unique<UniCacheDecode>(v, h);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_unicache() {
  const std::string src = "seed 000 (UniCache), step 2";
  return std::make_unique<UniCache>(StageInfo{
      StageKind::kScorer,
      "unicache",
      "modality-normalised attention + cross-modal - redundancy + recency",
      src,
      true,
      {float_param("unicache.w_a", "0.4", 0, 10, "attention weight (middle layers; deep layers 0.5)", src),
       float_param("unicache.w_c", "0.3", 0, 10, "cross-modal weight", src),
       float_param("unicache.w_d", "0.2", 0, 10, "redundancy weight (middle layers; shallow layers 0.3)",
                   src),
       float_param("unicache.w_r", "0.1", 0, 10, "recency weight", src)}});
}

}  // namespace kvscope::sim::stages
