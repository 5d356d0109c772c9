// expected-attention: the attention that future queries are expected to pay to each key, from the
// statistics of the prefill queries (kvpress 0.5.5 ExpectedAttentionPress, Devoto et al. 2025,
// "Expected Attention: KV cache compression by estimating attention from future queries
// distribution"). Per query head: the mean mu and covariance Sigma (divided by N) of the pre-RoPE
// prefill queries after the first ea_sinks (the trace's queries are stored after RoPE, so each is
// rotated back by its position with rope_theta, rotate-half layout), both moved to the future by
// the mean RoPE matrix R of positions P .. P + ea_future_positions - 1 (P = last position + 1):
// mu' = R mu, Sigma' = R Sigma R^T. Then s_t = softmax_t(k_t . mu' / sqrt(D) + k_t^T Sigma' k_t / (2 D))
// over the non-sink keys, averaged over the GQA group, times ||v_t|| (+ ea_epsilon first); the first
// ea_sinks tokens get the layer's largest score + 1, as kvpress pads them.
#include <cmath>
#include <sstream>

#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

struct Params {
  int future = 512, sinks = 4;
  bool covariance = true, vnorm = true;
  double epsilon = 0;
  explicit Params(const PolicySpec& p)
      : future(p.params.integer("ea_future_positions")),
        sinks(p.params.integer("ea_sinks")),
        covariance(p.params.flag("ea_covariance")),
        vnorm(p.params.flag("ea_vnorm")),
        epsilon(p.params.number("ea_epsilon")) {}
  std::string key() const {
    std::ostringstream o;
    o << "expected-attention:" << future << ":" << sinks << ":" << covariance << ":" << vnorm << ":"
      << epsilon;
    return o.str();
  }
};

// [Hkv, T] scores of one layer; reads the prefill queries (trace tensor [Hq, T, D]).
std::vector<float> compute(LayerData& L, const TraceContext& ctx, const Params& prm) {
  const int Hq = ctx.geometry.num_q_heads, H = ctx.geometry.num_kv_heads, G = ctx.geometry.group_size();
  const int D = ctx.geometry.head_dim, T = ctx.T, S = ctx.S, half = D / 2;
  const int n_sink = std::min(prm.sinks, T), N = T - n_sink;
  std::vector<float> out(static_cast<std::size_t>(H) * static_cast<std::size_t>(T), 0.0f);
  if (N <= 0) return out;                                 // every token is a sink
  const std::vector<float> q = L.prefill().q.to_float();  // [Hq, T, D] after RoPE
  const std::vector<float>& kall = L.k_all();             // [Hkv, T + S, D]
  const std::vector<float>& vall = L.v_all();
  const std::size_t stride =
      (static_cast<std::size_t>(T) + static_cast<std::size_t>(S)) * static_cast<std::size_t>(D);
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i)
    inv_freq[static_cast<std::size_t>(i)] = std::pow(ctx.geometry.rope_theta, -2.0 * i / D);
  // Mean RoPE rotation over the future positions: per frequency i, mean cos C_i and mean sin S_i.
  int last = 0;
  for (int t = 0; t < T; ++t) last = std::max(last, ctx.position[static_cast<std::size_t>(t)]);
  std::vector<double> C(static_cast<std::size_t>(half), 0.0), Sn(static_cast<std::size_t>(half), 0.0);
  for (int j = 0; j < prm.future; ++j)
    for (int i = 0; i < half; ++i) {
      const double a = (static_cast<double>(last) + 1 + j) * inv_freq[static_cast<std::size_t>(i)];
      C[static_cast<std::size_t>(i)] += std::cos(a) / prm.future;
      Sn[static_cast<std::size_t>(i)] += std::sin(a) / prm.future;
    }
  // R as a dense [D, D] matrix (rotate-half layout): R = diag(C) + diag(S) P.
  std::vector<double> R(static_cast<std::size_t>(D) * D, 0.0);
  for (int i = 0; i < half; ++i) {
    const auto u = static_cast<std::size_t>(i), w = static_cast<std::size_t>(i + half);
    R[u * D + u] = C[u];
    R[w * D + w] = C[u];
    R[u * D + w] = -Sn[u];
    R[w * D + u] = Sn[u];
  }
  std::vector<double> kv_scores(static_cast<std::size_t>(H) * static_cast<std::size_t>(T), 0.0);
  std::vector<double> pre(static_cast<std::size_t>(N) * D), mu(static_cast<std::size_t>(D)),
      cov(static_cast<std::size_t>(D) * D), tmp(static_cast<std::size_t>(D) * D),
      mu2(static_cast<std::size_t>(D)), cov2(static_cast<std::size_t>(D) * D),
      logit(static_cast<std::size_t>(T));
  for (int j = 0; j < Hq; ++j) {
    const int h = j / G;
    // Pre-RoPE queries: rotate query t back by its position.
    for (int n = 0; n < N; ++n) {
      const int t = n_sink + n;
      const float* x = &q[(static_cast<std::size_t>(j) * T + t) * D];
      for (int i = 0; i < half; ++i) {
        const double a = ctx.position[static_cast<std::size_t>(t)] * inv_freq[static_cast<std::size_t>(i)];
        const double c = std::cos(a), s = std::sin(a);
        pre[static_cast<std::size_t>(n) * D + i] = c * x[i] + s * x[i + half];
        pre[static_cast<std::size_t>(n) * D + i + half] = c * x[i + half] - s * x[i];
      }
    }
    std::fill(mu.begin(), mu.end(), 0.0);
    for (int n = 0; n < N; ++n)
      for (int d = 0; d < D; ++d)
        mu[static_cast<std::size_t>(d)] += pre[static_cast<std::size_t>(n) * D + d] / N;
    for (int a = 0; a < D; ++a) {
      double m = 0;
      for (int b = 0; b < D; ++b)
        m += R[static_cast<std::size_t>(a) * D + b] * mu[static_cast<std::size_t>(b)];
      mu2[static_cast<std::size_t>(a)] = m;
    }
    if (prm.covariance) {
      std::fill(cov.begin(), cov.end(), 0.0);
      for (int n = 0; n < N; ++n) {
        const double* x = &pre[static_cast<std::size_t>(n) * D];
        for (int a = 0; a < D; ++a) {
          const double xa = x[a] - mu[static_cast<std::size_t>(a)];
          for (int b = 0; b < D; ++b)
            cov[static_cast<std::size_t>(a) * D + b] += xa * (x[b] - mu[static_cast<std::size_t>(b)]);
        }
      }
      for (auto& c : cov) c /= N;
      // cov2 = R cov R^T
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b) {
          double m = 0;
          for (int c = 0; c < D; ++c)
            m += cov[static_cast<std::size_t>(a) * D + c] * R[static_cast<std::size_t>(b) * D + c];
          tmp[static_cast<std::size_t>(a) * D + b] = m;
        }
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b) {
          double m = 0;
          for (int c = 0; c < D; ++c)
            m += R[static_cast<std::size_t>(a) * D + c] * tmp[static_cast<std::size_t>(c) * D + b];
          cov2[static_cast<std::size_t>(a) * D + b] = m;
        }
    }
    const float* k = &kall[static_cast<std::size_t>(h) * stride];
    double mx = -INFINITY;
    for (int t = n_sink; t < T; ++t) {
      const float* x = k + static_cast<std::size_t>(t) * D;
      double s = 0;
      for (int d = 0; d < D; ++d) s += x[d] * mu2[static_cast<std::size_t>(d)];
      s /= std::sqrt(static_cast<double>(D));
      if (prm.covariance) {
        double quad = 0;
        for (int a = 0; a < D; ++a) {
          double r = 0;
          for (int b = 0; b < D; ++b) r += cov2[static_cast<std::size_t>(a) * D + b] * x[b];
          quad += x[a] * r;
        }
        s += quad / D / 2;
      }
      logit[static_cast<std::size_t>(t)] = s;
      mx = std::max(mx, s);
    }
    double z = 0;
    for (int t = n_sink; t < T; ++t) z += std::exp(logit[static_cast<std::size_t>(t)] - mx);
    for (int t = n_sink; t < T; ++t)
      kv_scores[static_cast<std::size_t>(h) * T + t] +=
          std::exp(logit[static_cast<std::size_t>(t)] - mx) / z / G;
  }
  double best = -INFINITY;
  for (int h = 0; h < H; ++h) {
    const float* v = &vall[static_cast<std::size_t>(h) * stride];
    for (int t = n_sink; t < T; ++t) {
      double& s = kv_scores[static_cast<std::size_t>(h) * T + t];
      if (prm.vnorm) {
        double n2 = 0;
        for (int d = 0; d < D; ++d)
          n2 += static_cast<double>(v[static_cast<std::size_t>(t) * D + d]) *
                v[static_cast<std::size_t>(t) * D + d];
        s = (s + prm.epsilon) * std::sqrt(n2);
      }
      best = std::max(best, s);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t)
      out[static_cast<std::size_t>(h) * T + t] =
          static_cast<float>(t < n_sink ? best + 1 : kv_scores[static_cast<std::size_t>(h) * T + t]);
  return out;
}

class ExpectedAttention final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_prefill(LayerData& d, const PolicySpec& p, const TraceContext& ctx) const override {
    const Params prm(p);
    d.stage_statistic(prm.key(), true, [&](LayerData& l) { return compute(l, ctx, prm); });
  }
  void score(const LayerView& v, std::vector<float>& out) const override {
    const Params prm(v.policy);
    out = v.data.stage_statistic(prm.key(), true, [&](LayerData& l) { return compute(l, v.ctx, prm); });
  }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_expected_attention() {
  const std::string src = "kvpress ExpectedAttentionPress (0.5.5); Devoto et al. 2025, Expected Attention";
  StageInfo info{
      StageKind::kScorer,
      "expected-attention",
      "attention expected from the mean and covariance of future (RoPE-shifted) queries, times ||v||",
      src,
      false,
      {int_param("ea_future_positions", "512", 1, 1e6, "future positions whose RoPE is averaged", src),
       int_param("ea_sinks", "4", 0, 1e6, "first tokens: excluded from the statistics, kept first", src),
       bool_param("ea_covariance", "true", "include the query covariance term", src),
       bool_param("ea_vnorm", "true", "multiply by the value norm", src),
       float_param("ea_epsilon", "0", 0, 1, "added to the expected attention before the value norm", src)}};
  info.preset = true;
  return std::make_unique<ExpectedAttention>(std::move(info));
}

}  // namespace kvscope::sim::stages
