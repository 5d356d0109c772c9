// unicache: cosine layer schedule (rescaled to the budget's mean), density-driven cross-modal
// split with caps, alignment protection (seed 000 steps 3-5). Decode mode: the schedule scales the
// cap per layer, and the split and protection run on the resident tokens at each eviction.
#include <algorithm>
#include <cmath>

#include "../stage.hpp"

namespace kvscope::sim {

UniCacheConfig unicache_config(const PolicySpec& p) {
  UniCacheConfig u;
  const StageParams& s = p.params;
  u.w_a = s.real("unicache.w_a");
  u.w_c = s.real("unicache.w_c");
  u.w_d = s.real("unicache.w_d");
  u.w_r = s.real("unicache.w_r");
  u.rate_shallow = s.real("unicache.rate_shallow");
  u.rate_deep = s.real("unicache.rate_deep");
  u.vision_cap = s.real("unicache.vision_cap");
  u.text_cap = s.real("unicache.text_cap");
  u.align_threshold = s.real("unicache.align_threshold");
  u.align_discount = s.real("unicache.align_discount");
  u.merge_threshold = s.real("unicache.merge_threshold");
  u.rate_offset = s.real("unicache.rate_offset");
  return u;
}

double unicache_rate(const UniCacheConfig& u, int layer, int num_layers) {
  const double x = num_layers > 1 ? static_cast<double>(layer) / (num_layers - 1) : 0.0;
  return u.rate_deep + (u.rate_shallow - u.rate_deep) * 0.5 * (1.0 + std::cos(M_PI * x)) + u.rate_offset;
}

namespace stages {
namespace {

constexpr int kVision = static_cast<int>(kernels::Modality::kVision);
constexpr int kText = static_cast<int>(kernels::Modality::kText);

class UniCacheAllocator final : public Allocator {
 public:
  using Allocator::Allocator;
  void prepare_prefill(LayerData& d, const PolicySpec&, const TraceContext&) const override {
    d.cross_given();
  }
  void prepare_float(LayerData& d, const PolicySpec&, const TraceContext&) const override {
    d.modality_similarity();
  }

  bool own_schedule() const override { return true; }
  double default_keep(const PolicySpec& p, const TraceContext& ctx) const override {
    const UniCacheConfig u = unicache_config(p);
    const int L = ctx.geometry.num_layers;
    double mean = 0;
    for (int l = 0; l < L; ++l) mean += 1.0 - unicache_rate(u, l, L);
    return std::clamp(mean / L, 0.0, 1.0);
  }

  double layer_fraction(const LayerView& v, double keep) const override {
    // Cosine schedule, rescaled so its mean keep fraction equals `keep`; rate_offset is applied
    // after the rescaling, so scene offsets survive a budget.
    const UniCacheConfig u = unicache_config(v.policy);
    UniCacheConfig shape = u;
    shape.rate_offset = 0.0f;
    double mean = 0;
    for (int l = 0; l < v.num_layers; ++l) mean += 1.0 - unicache_rate(shape, l, v.num_layers);
    mean /= v.num_layers;
    return (1.0 - unicache_rate(shape, v.layer, v.num_layers)) * keep / mean - u.rate_offset;
  }

  void allocate(const LayerView& v, const std::vector<float>& scores, int Hw, int& k,
                kernels::SelectParams& sp, std::vector<std::uint8_t>& protect) const override {
    split_and_protect(v, v.tokens.per_modality, v.T, k, sp, protect, [&](int t) {
      float score = 0;
      for (int w = 0; w < Hw; ++w) score += scores[v.index(w, t)];
      return Token{v.tokens.modality_of(t), t, score};
    });
  }
  // Decode mode: the same split of the cap over the K resident tokens (rate 1 - k / K; decode
  // tokens are text), alignment tokens being the resident context tokens whose prefill given share
  // exceeds the threshold (a decode token is never one), ranked by the resident scores.
  void allocate_resident(const LayerView& v, const TokenView& resident, const std::vector<float>& scores,
                         int& k, kernels::SelectParams& sp,
                         std::vector<std::uint8_t>& protect) const override {
    split_and_protect(v, resident.per_modality, resident.count, k, sp, protect, [&](int i) {
      const std::int32_t id = resident.id[i];
      return Token{resident.modality_of(i), id < v.T ? id : -1, scores[static_cast<std::size_t>(i)]};
    });
  }

 private:
  struct Token {
    int modality;
    int context_id;  // context token id (reads the prefill given share), -1: not a context token
    float score;     // summed over the working heads
  };
  // n: tokens of each modality among the N candidates; token(i), i < N: candidate i.
  template <class TokenAt>
  void split_and_protect(const LayerView& v, const PerModalityCount& n, int N, int& k,
                         kernels::SelectParams& sp, std::vector<std::uint8_t>& protect, TokenAt token) const {
    const UniCacheConfig u = unicache_config(v.policy);
    const int H = v.kv_heads;
    PerModality mod_rate{};                                // compression rate per modality
    const double rate = 1.0 - static_cast<double>(k) / N;  // this layer's overall compression rate
    // Density: the more similar a modality's keys are to each other, the more it is compressed.
    const PerModality& sim = v.data.modality_similarity();
    double wsum = 0, nsum = 0;
    for (int m : {kText, kVision, 2}) {
      wsum += n[static_cast<std::size_t>(m)] * std::max(0.05, sim[static_cast<std::size_t>(m)]);
      nsum += static_cast<double>(n[static_cast<std::size_t>(m)]);
    }
    const double mean_sim = nsum > 0 ? wsum / nsum : 1.0;
    double removed_target = rate * N, removed = 0;
    for (int m : {kText, kVision, 2}) {
      const double cap = m == kText ? u.text_cap : u.vision_cap;
      const double r = rate * std::max(0.05, sim[static_cast<std::size_t>(m)]) / mean_sim;
      mod_rate[static_cast<std::size_t>(m)] = std::clamp(r, 0.0, cap);
      removed += mod_rate[static_cast<std::size_t>(m)] * n[static_cast<std::size_t>(m)];
    }
    // Overflow: what a capped modality could not remove moves to the others (up to their caps).
    for (int pass = 0; pass < 2 && removed + 0.5 < removed_target; ++pass) {
      for (int m : {kVision, 2, kText}) {
        const double cap = m == kText ? u.text_cap : u.vision_cap;
        const double nm = static_cast<double>(n[static_cast<std::size_t>(m)]);
        if (nm <= 0) continue;
        const double room = (cap - mod_rate[static_cast<std::size_t>(m)]) * nm;
        const double take = std::min(room, removed_target - removed);
        if (take > 0) {
          mod_rate[static_cast<std::size_t>(m)] += take / nm;
          removed += take;
        }
      }
    }
    sp.use_modality_budgets = true;
    double share[kModalities];
    for (int m = 0; m < kModalities; ++m) {
      share[m] =
          static_cast<double>(n[static_cast<std::size_t>(m)]) * (1.0 - mod_rate[static_cast<std::size_t>(m)]);
      sp.modality_budget[m] = static_cast<int>(std::lround(share[m]));
    }
    k = budgets_keep_one_token(sp.modality_budget, share, n);
    // Alignment protection: tokens whose cross-modal attention share exceeds the threshold
    // get a discounted rate: the best (1 - discount * rate) of them are always kept.
    const auto& given = v.data.cross_given();  // [Hkv, T]
    for (int m = 0; m < kModalities; ++m) {
      std::vector<std::pair<float, int>> align;
      for (int i = 0; i < N; ++i) {
        const Token t = token(i);
        if (t.modality != m || t.context_id < 0) continue;
        float gshare = 0;
        for (int h = 0; h < H; ++h) gshare += given[v.index(h, t.context_id)];
        if (gshare / H > u.align_threshold) align.emplace_back(-t.score, i);
      }
      std::sort(align.begin(), align.end());
      const double keep_align = 1.0 - u.align_discount * mod_rate[static_cast<std::size_t>(m)];
      const std::size_t nkeep =
          static_cast<std::size_t>(std::ceil(keep_align * static_cast<double>(align.size())));
      for (std::size_t i = 0; i < std::min(nkeep, align.size()); ++i)
        protect[static_cast<std::size_t>(align[i].second)] = 1;
    }
  }
};

}  // namespace

std::unique_ptr<Stage> make_allocator_unicache() {
  const std::string src = "seed 000 (UniCache), steps 3-5";
  return std::make_unique<UniCacheAllocator>(StageInfo{
      StageKind::kAllocator,
      "unicache",
      "cosine layer schedule + density-driven cross-modal split with caps",
      src,
      true,
      {float_param("unicache.rate_shallow", "0.75", 0, 0.99, "compression rate of the first layer", src),
       float_param("unicache.rate_deep", "0.45", 0, 0.99, "compression rate of the last layer", src),
       float_param("unicache.rate_offset", "0", -0.99, 0.99,
                   "added to every layer rate (realtime-chat: -0.05)", src),
       float_param("unicache.vision_cap", "0.80", 0, 0.99, "maximum vision (and audio) compression rate",
                   src),
       float_param("unicache.text_cap", "0.40", 0, 0.99, "maximum text compression rate", src),
       float_param("unicache.align_threshold", "0.3", 0, 1, "cross-modal share that makes an alignment token",
                   src),
       float_param("unicache.align_discount", "0.5", 0, 1, "fraction of the rate applied to alignment tokens",
                   src)}});
}

}  // namespace stages
}  // namespace kvscope::sim
