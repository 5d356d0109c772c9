// The snapkv scorer's snap_pool_span (sim/src/stages/scorers/snapkv.cpp): `split` pools the keys
// before the observation window and the window's own keys separately (zero padding at the window's
// edge, as kvpress 0.5.5's SnapKVPress pools only the keys before its window); `all` (the default)
// pools over every key. Checked against the window sums per query head (kernels::cpu::
// snapkv_window_sums) pooled here in double and summed over the GQA group, for avg and max pooling;
// the snapkv-kvpress preset sets split, snapkv keeps all.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/trace/reader.hpp"
#include "tiny_trace.hpp"

using namespace kvscope;
using namespace kvscope::sim;

namespace {

// T = 1 + 24 + 65 = 90 context tokens, 4 layers, 2 kv heads.
const std::string& span_trace() { return kvscope::testing::tiny_trace("snapkv-span", 64, 24, 6, 13); }

// Pools row [T] over [t - r, t + r], the taps limited to [0, edge) for t < edge and to [edge, T)
// otherwise (edge = 0: one span); avg divides by the kernel size, max skips missing taps.
std::vector<double> pooled(const std::vector<double>& row, int edge, int kernel, bool avg) {
  const int T = static_cast<int>(row.size()), r = kernel / 2;
  std::vector<double> out(row.size());
  for (int t = 0; t < T; ++t) {
    const int lo = t < edge ? 0 : edge, hi = t < edge ? edge - 1 : T - 1;
    double v = avg ? 0.0 : -1e300;
    for (int u = std::max(lo, t - r); u <= std::min(hi, t + r); ++u) v = avg ? v + row[u] : std::max(v, row[u]);
    out[t] = avg ? v / kernel : v;
  }
  return out;
}

struct Case {
  std::string pool;
  int window, kernel;
};

}  // namespace

TEST(SnapKVPoolSpan, DeclaredWithDefaultAllAndSetBySnapkvKvpress) {
  const PolicyRegistry reg;
  EXPECT_EQ(reg.get("snapkv").params.text("snap_pool_span"), "all");
  EXPECT_EQ(reg.get("snapkv-kvpress").params.text("snap_pool_span"), "split");
  PolicySpec p = reg.get("snapkv");
  EXPECT_THROW(p.set("snap_pool_span", "window"), PolicyError);
  p.set("snap_pool_span", "split");
  EXPECT_EQ(p.params.text("snap_pool_span"), "split");
}

TEST(SnapKVPoolSpan, SplitPoolsEachSideOfTheWindowEdgeOnItsOwn) {
  trace::TraceReader reader(span_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  const int T = ctx.T, H = ctx.geometry.num_kv_heads, Hq = ctx.geometry.num_q_heads, G = Hq / H;
  ASSERT_EQ(T, 90);
  for (const Case& c : {Case{"avg", 64, 5}, Case{"max", 32, 7}, Case{"avg", 16, 3}}) {
    PolicySpec split = PolicyRegistry().get("snapkv");
    split.set("snap_pool", c.pool);
    split.set("snap_window", std::to_string(c.window));
    split.set("snap_kernel", std::to_string(c.kernel));
    split.set("snap_pool_span", "split");
    PolicySpec all = split;
    all.set("snap_pool_span", "all");
    const int edge = T - c.window;
    bool edge_differs = false;  // somewhere in the trace
    for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
      LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
      std::vector<std::string> warnings;
      const LayerSelection s = select_on_layer(split, 0.5, L, ctx, warnings);
      const LayerSelection a = select_on_layer(all, 0.5, L, ctx, warnings);
      // The window sums per query head [Hq, T] (the causal prefill attention of the last `window` queries).
      kernels::AttentionProblem ap;
      ap.q = L.prefill().q.data.data();
      ap.k = L.prefill().k.data.data();
      ap.q_pos = ap.k_pos = ctx.position.data();
      ap.num_q_heads = Hq;
      ap.num_kv_heads = H;
      ap.q_len = ap.k_len = T;
      ap.head_dim = ctx.geometry.head_dim;
      ap.dtype = ctx.dtype;
      std::vector<float> sums(static_cast<std::size_t>(Hq) * T);
      ASSERT_TRUE(kernels::cpu::snapkv_window_sums(ap, c.window, sums.data()).ok());
      ASSERT_EQ(s.scores.size(), static_cast<std::size_t>(H) * T);
      for (int h = 0; h < H; ++h) {
        // Pooled per query head, then summed over the group.
        std::vector<double> want_split(T, 0.0), want_all(T, 0.0);
        for (int j = h * G; j < (h + 1) * G; ++j) {
          const std::vector<double> row(sums.begin() + j * T, sums.begin() + (j + 1) * T);
          const std::vector<double> ps = pooled(row, edge, c.kernel, c.pool == "avg");
          const std::vector<double> pa = pooled(row, 0, c.kernel, c.pool == "avg");
          for (int t = 0; t < T; ++t) {
            want_split[t] += ps[t];
            want_all[t] += pa[t];
          }
        }
        for (int t = 0; t < T; ++t) {
          const std::size_t i = static_cast<std::size_t>(h) * T + t;
          EXPECT_NEAR(s.scores[i], want_split[t], 1e-5 * (1 + std::abs(want_split[t])))
              << c.pool << " layer " << layer << " head " << h << " token " << t;
          EXPECT_NEAR(a.scores[i], want_all[t], 1e-5 * (1 + std::abs(want_all[t])))
              << c.pool << " layer " << layer << " head " << h << " token " << t;
          // Away from the edge both spans pool the same taps.
          if (std::abs(t - edge) > c.kernel / 2 && std::abs(t + 1 - edge) > c.kernel / 2)
            EXPECT_NEAR(s.scores[i], a.scores[i], 1e-5 * (1 + std::abs(want_all[t])));
          else
            edge_differs = edge_differs || std::abs(want_split[t] - want_all[t]) > 1e-6;
        }
      }
    }
    EXPECT_TRUE(edge_differs) << c.pool << ": the tokens at the window's edge pool differently";
  }
}
