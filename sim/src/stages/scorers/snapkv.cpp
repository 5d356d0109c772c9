// snapkv: attention from the last snap_window prefill queries (the observation window), summed,
// pooled over snap_kernel neighbouring tokens, summed over the GQA group. Decode mode: the last
// min(snap_window, s + 1) decode queries on the resident keys. snap_pool_span = split pools the
// keys before the window and the window's own keys separately (pooling does not cross the window's
// edge), as kvpress 0.5.5's SnapKVPress pools only the keys before its window.
#include "../../exec_util.hpp"
#include "../stage.hpp"
#include "kvscope/kernels/attention_stats.hpp"

namespace kvscope::sim::stages {
namespace {

kernels::SnapKVParams snap_params(const PolicySpec& p) {
  kernels::SnapKVParams s;
  s.window = p.params.integer("snap_window");
  s.kernel_size = p.params.integer("snap_kernel");
  s.pool = p.params.text("snap_pool") == "max" ? kernels::PoolKind::kMax : kernels::PoolKind::kAvg;
  return s;
}

bool split_span(const PolicySpec& p) { return p.params.text("snap_pool_span") == "split"; }

// The window sums without pooling (kernel 1: each tap times 1).
kernels::SnapKVParams unpooled(kernels::SnapKVParams p) {
  p.kernel_size = 1;
  return p;
}

class Window final : public DecodeScoring {
 public:
  Window(const LayerView& v, int h)
      : params_(snap_params(v.policy)), split_(split_span(v.policy)), q_heads_(v.q_heads), head_(h),
        D_(v.head_dim), T_(v.T) {}
  void score(const DecodeStepView& s, std::vector<float>& out) override {
    const int K = static_cast<int>(s.tokens.size()), G = s.query.num_q_heads;
    const int wlen = std::min(params_.window, s.step + 1);
    // The window's queries [G, wlen, D] from q_steps [S, Hq, D].
    qwin_.resize(static_cast<std::size_t>(G) * static_cast<std::size_t>(wlen) * static_cast<std::size_t>(D_));
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < wlen; ++i)
        std::copy_n(&s.q_steps[(static_cast<std::size_t>(s.step - wlen + 1 + i) * q_heads_ +
                                static_cast<std::size_t>(head_) * G + j) *
                               D_],
                    D_, &qwin_[(static_cast<std::size_t>(j) * wlen + i) * D_]);
    kernels::AttentionProblem aw = s.query;
    aw.q = qwin_.data();
    aw.q_len = wlen;
    kernels::SnapKVParams sp = split_ ? unpooled(params_) : params_;
    sp.window = wlen;
    stat_.resize(static_cast<std::size_t>(G) * static_cast<std::size_t>(K));
    detail::check(s.backend.snapkv_scores(aw, sp, stat_.data()), "SnapKV scores");
    if (split_) {
      // Per query head, pooled on each side of the window's keys: the resident decode tokens of its
      // steps (ids T + s - wlen + 1 .. T + s).
      const std::int32_t first = T_ + s.step - wlen + 1;
      const int edge = static_cast<int>(std::lower_bound(s.tokens.begin(), s.tokens.end(), first) - s.tokens.begin());
      sums_.resize(stat_.size());
      detail::check(kernels::cpu::snapkv_pool_split(stat_.data(), G, K, edge, params_, sums_.data()),
                    "SnapKV pooling");
      stat_.swap(sums_);
    }
    out.assign(static_cast<std::size_t>(K), 0.0f);
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < K; ++i)
        out[static_cast<std::size_t>(i)] += stat_[static_cast<std::size_t>(j) * K + i];
  }

 private:
  kernels::SnapKVParams params_;
  bool split_;
  int q_heads_, head_, D_, T_;
  std::vector<float> qwin_, stat_, sums_;  // [G, wlen, D], [G, K], [G, K]
};

class SnapKV final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec& p, const TraceContext&) const override {
    d.snapkv(snap_params(p), split_span(p));
  }
  void score(const LayerView& v, std::vector<float>& out) const override {
    out = v.data.snapkv(snap_params(v.policy), split_span(v.policy));
  }
  std::unique_ptr<DecodeScoring> decode_scoring(const LayerView& v, int h) const override {
    return std::make_unique<Window>(v, h);
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_snapkv() {
  const std::string src = "Li et al. 2024, SnapKV, Sec. 4";
  return std::make_unique<SnapKV>(
      StageInfo{StageKind::kScorer,
                "snapkv",
                "observation-window attention of the last prefill queries, pooled",
                src,
                true,
                {int_param("snap_window", "32", 1, 1e6, "observation window (queries), capped at T", src),
                 [&] {
                   auto d = int_param("snap_kernel", "7", 1, 1001, "pooling width, odd (1 = none)", src);
                   d.odd = true;
                   return d;
                 }(),
                 choice_param("snap_pool", "avg", {"avg", "max"},
                              "pooling; avg divides by the kernel size (zero padding)", src),
                 choice_param("snap_pool_span", "all", {"all", "split"},
                              "all: one pooling over every key; split: the keys before the observation window "
                              "and the window's keys pooled separately (zero padding at the window's edge)",
                              "kvpress 0.5.5 SnapKVPress.score (pools the keys before its window only)")}});
}

}  // namespace kvscope::sim::stages
