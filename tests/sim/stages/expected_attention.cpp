// The expected-attention scorer (sim/src/stages/scorers/expected_attention.cpp) against a literal
// float64 transcription of kvpress 0.5.5 ExpectedAttentionPress.score / get_query_statistics /
// apply_avg_rope: per-position RoPE matrices R(p) = cos I + sin P averaged over the future
// positions, pre-RoPE queries R(p_t)^T q_t, softmax over the non-sink keys, group mean, value
// norm, sinks padded with max + 1. Also: the parameters change the ranking as declared.
#include <gtest/gtest.h>

#include <cmath>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string ea_trace() {
  return kvscope::testing::tiny_trace("expected_attention", 16, 30, 3, 21);
}

using Mat = std::vector<std::vector<double>>;

Mat rope(double pos, int D, double theta) {  // R(pos) = diag(cos) + diag(sin) P, rotate-half layout
  Mat R(D, std::vector<double>(D, 0.0));
  for (int i = 0; i < D; ++i) {
    const double a = pos * std::pow(theta, -2.0 * (i % (D / 2)) / D);
    R[i][i] = std::cos(a);
    if (i < D / 2)
      R[i][i + D / 2] = -std::sin(a);  // P[:D/2, D/2:] = -I
    else
      R[i][i - D / 2] = std::sin(a);  // P[D/2:, :D/2] = I
  }
  return R;
}

std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& kall,
                              const std::vector<float>& vall, const TraceContext& ctx, int n_future,
                              int n_sink) {
  const int Hq = ctx.geometry.num_q_heads, H = ctx.geometry.num_kv_heads, G = Hq / H,
            D = ctx.geometry.head_dim;
  const int T = ctx.T, S = ctx.S, N = T - n_sink;
  const double theta = ctx.geometry.rope_theta;
  Mat Rm(D, std::vector<double>(D, 0.0));
  for (int j = 0; j < n_future; ++j) {
    const Mat r = rope(T + j, D, theta);  // positions q_len .. q_len + n_future - 1
    for (int a = 0; a < D; ++a)
      for (int b = 0; b < D; ++b) Rm[a][b] += r[a][b] / n_future;
  }
  std::vector<double> out(static_cast<std::size_t>(H) * T, 0.0);
  for (int j = 0; j < Hq; ++j) {
    const int h = j / G;
    Mat pre(N, std::vector<double>(D));
    for (int n = 0; n < N; ++n) {
      const int t = n_sink + n;
      const Mat r = rope(ctx.position[t], D, theta);
      for (int a = 0; a < D; ++a) {
        double s = 0;
        for (int b = 0; b < D; ++b) s += r[b][a] * q[(static_cast<std::size_t>(j) * T + t) * D + b];  // R^T q
        pre[n][a] = s;
      }
    }
    std::vector<double> mu(D, 0.0);
    for (int n = 0; n < N; ++n)
      for (int a = 0; a < D; ++a) mu[a] += pre[n][a] / N;
    Mat cov(D, std::vector<double>(D, 0.0));
    for (int n = 0; n < N; ++n)
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b) cov[a][b] += (pre[n][a] - mu[a]) * (pre[n][b] - mu[b]) / N;
    std::vector<double> mu2(D, 0.0);  // mu @ R^T
    for (int a = 0; a < D; ++a)
      for (int b = 0; b < D; ++b) mu2[a] += mu[b] * Rm[a][b];
    Mat c2(D, std::vector<double>(D, 0.0));  // R @ (cov @ R^T)
    for (int a = 0; a < D; ++a)
      for (int b = 0; b < D; ++b)
        for (int c = 0; c < D; ++c)
          for (int e = 0; e < D; ++e) c2[a][b] += Rm[a][c] * cov[c][e] * Rm[b][e];
    std::vector<double> logit(T);
    double mx = -1e300;
    for (int t = n_sink; t < T; ++t) {
      const float* k = &kall[(static_cast<std::size_t>(h) * (T + S) + t) * D];
      double s = 0, quad = 0;
      for (int a = 0; a < D; ++a) s += mu2[a] * k[a];
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b) quad += k[a] * c2[a][b] * k[b];
      logit[t] = s / std::sqrt(D) + quad / D / 2;
      mx = std::max(mx, logit[t]);
    }
    double z = 0;
    for (int t = n_sink; t < T; ++t) z += std::exp(logit[t] - mx);
    for (int t = n_sink; t < T; ++t)
      out[static_cast<std::size_t>(h) * T + t] += std::exp(logit[t] - mx) / z / G;
  }
  double best = -1e300;
  for (int h = 0; h < H; ++h)
    for (int t = n_sink; t < T; ++t) {
      double n2 = 0;
      for (int d = 0; d < D; ++d) {
        const double v = vall[(static_cast<std::size_t>(h) * (T + S) + t) * D + d];
        n2 += v * v;
      }
      out[static_cast<std::size_t>(h) * T + t] *= std::sqrt(n2);
      best = std::max(best, out[static_cast<std::size_t>(h) * T + t]);
    }
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < n_sink; ++t) out[static_cast<std::size_t>(h) * T + t] = best + 1;
  return out;
}

}  // namespace

TEST(ExpectedAttention, MatchesKvpressFormulaOnEveryLayerAndHead) {
  trace::TraceReader reader(ea_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  PolicyRegistry reg;
  const PolicySpec p = reg.get("expected-attention");  // the scorer's own preset, kvpress defaults
  EXPECT_EQ(p.params.integer("ea_future_positions"), 512);
  EXPECT_EQ(p.params.integer("ea_sinks"), 4);
  const int T = ctx.T;
  for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
    const trace::LayerTensors prefill = reader.read_layer(layer);
    const std::vector<float> q = prefill.q.to_float();
    LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
    L.prepare(p);
    const std::vector<double> ref = reference(q, L.k_all(), L.v_all(), ctx, 512, 4);
    std::vector<std::string> warnings;
    const LayerResult r = run_policy_on_layer(p, 0.4, L, ctx, warnings, true);
    for (int h = 0; h < ctx.geometry.num_kv_heads; ++h) {
      const auto& score = r.token_maps[static_cast<std::size_t>(h)].score;
      for (int t = 0; t < T; ++t) {
        const double want = ref[static_cast<std::size_t>(h) * T + t];
        EXPECT_NEAR(score[t], want, 1e-4 * std::max(1e-3, std::fabs(want)))
            << "layer " << layer << " head " << h << " t " << t;
      }
      // The sinks are kept (padded with the maximum + 1).
      for (int t = 0; t < 4; ++t) EXPECT_EQ(r.token_maps[static_cast<std::size_t>(h)].state[t], 1);
    }
  }
}

TEST(ExpectedAttention, ParametersAreDeclaredAndChangeTheScores) {
  trace::TraceReader reader(ea_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  PolicySpec a = PolicyRegistry().get("expected-attention");
  PolicySpec b = a;
  b.set("ea_covariance", "false");
  b.set("ea_vnorm", "false");
  b.set("ea_future_positions", "1");
  EXPECT_THROW(b.set("ea_sinks", "-1"), PolicyError);
  EXPECT_THROW(b.set("ea_covariance", "maybe"), PolicyError);
  LayerData L(1, reader.read_layer(1), reader.read_decode_layer(1), ctx);
  L.prepare(a);
  L.prepare(b);
  std::vector<std::string> w;
  const auto ra = run_policy_on_layer(a, 0.4, L, ctx, w, true),
             rb = run_policy_on_layer(b, 0.4, L, ctx, w, true);
  EXPECT_NE(ra.token_maps[0].score, rb.token_maps[0].score);
  // Without the value norm the non-sink scores are the group-mean softmax: they sum to 1 per head.
  double sum = 0;
  for (int t = 4; t < ctx.T; ++t) sum += rb.token_maps[0].score[t];
  EXPECT_NEAR(sum, 1.0, 1e-5);
  // Not a decode-mode scorer.
  EXPECT_THROW(PolicyRegistry().get("expected-attention~decode"), PolicyError);
}
