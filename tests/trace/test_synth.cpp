// Synthetic traces carry the structure compression policies react to. Each
// test measures one property on the generated tensors (docs/synthetic-traces.md).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "kvscope/synth/synth.hpp"

using namespace kvscope;
using synth::HeadRole;
using synth::SynthGenerator;

namespace {

SynthGenerator make(std::uint64_t seed = 3) {
  synth::SynthOptions o;
  o.preset = "tiny";
  o.images = 1;
  o.image_tokens = 144;  // 12 x 12
  o.text = 40;
  o.decode = 6;
  o.seed = seed;
  return SynthGenerator(o);
}

double cosine(const float* a, const float* b, int D) {
  double ab = 0, aa = 0, bb = 0;
  for (int d = 0; d < D; ++d) {
    ab += static_cast<double>(a[d]) * b[d];
    aa += static_cast<double>(a[d]) * a[d];
    bb += static_cast<double>(b[d]) * b[d];
  }
  return ab / std::sqrt(aa * bb);
}

// Causal attention row of prefill query i of query head j (float64 softmax).
std::vector<double> attention_row(const SynthGenerator& g, const SynthGenerator::Layer& L, int j, int i) {
  const auto& geo = g.header().geometry;
  const int D = geo.head_dim, T = static_cast<int>(g.num_tokens()), h = j / geo.group_size();
  const float* q = &L.q[(static_cast<std::size_t>(j) * T + i) * D];
  std::vector<double> p(static_cast<std::size_t>(i) + 1);
  double mx = -1e300;
  for (int t = 0; t <= i; ++t) {
    const float* k = &L.k[(static_cast<std::size_t>(h) * T + t) * D];
    double s = 0;
    for (int d = 0; d < D; ++d) s += static_cast<double>(q[d]) * k[d];
    p[static_cast<std::size_t>(t)] = s / std::sqrt(static_cast<double>(D));
    mx = std::max(mx, p[static_cast<std::size_t>(t)]);
  }
  double z = 0;
  for (auto& x : p) z += (x = std::exp(x - mx));
  for (auto& x : p) x /= z;
  return p;
}

struct VisionPairs {
  double neighbour = 0, distant = 0;
};

// Mean key cosine of horizontally adjacent patches vs patches >= 6 apart (same row), over kv heads.
VisionPairs patch_similarity(const SynthGenerator& g, const SynthGenerator::Layer& L) {
  const auto& geo = g.header().geometry;
  const auto& tk = g.tokens();
  const int D = geo.head_dim, T = static_cast<int>(g.num_tokens());
  double sn = 0, sd = 0;
  int nn = 0, nd = 0;
  for (int h = 0; h < geo.num_kv_heads; ++h) {
    for (int a = 0; a < T; ++a) {
      if (tk.modality[a] != 1) continue;
      for (int b = a + 1; b < T; ++b) {
        if (tk.modality[b] != 1 || tk.grid_row[b] != tk.grid_row[a]) continue;
        const int dist = tk.grid_col[b] - tk.grid_col[a];
        const double c = cosine(&L.k[(static_cast<std::size_t>(h) * T + a) * D], &L.k[(static_cast<std::size_t>(h) * T + b) * D], D);
        if (dist == 1) {
          sn += c;
          ++nn;
        } else if (dist >= 6) {
          sd += c;
          ++nd;
        }
      }
    }
  }
  return {sn / nn, sd / nd};
}

TEST(Synth, DeterministicForASeed) {
  const auto a = make(11).prefill_layer(2), b = make(11).prefill_layer(2), c = make(12).prefill_layer(2);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(make(11).decode_layer(1).q, make(11).decode_layer(1).q);
  EXPECT_NE(a.k, c.k);
}

TEST(Synth, PresetsHaveRealGeometry) {
  synth::SynthOptions o;
  o.preset = "llava-1.5-7b";
  SynthGenerator llava(o);
  EXPECT_EQ(llava.header().geometry.num_layers, 32);
  EXPECT_EQ(llava.header().geometry.num_q_heads, 32);
  EXPECT_EQ(llava.header().geometry.num_kv_heads, 32);
  EXPECT_EQ(llava.header().geometry.head_dim, 128);
  EXPECT_TRUE(llava.header().synthetic);
  int vision = 0, max_row = 0, max_col = 0;
  for (std::size_t i = 0; i < llava.num_tokens(); ++i) {
    if (llava.tokens().modality[i] == 1) {
      ++vision;
      max_row = std::max(max_row, llava.tokens().grid_row[i]);
      max_col = std::max(max_col, llava.tokens().grid_col[i]);
    }
  }
  EXPECT_EQ(vision, 576);
  EXPECT_EQ(max_row, 23);
  EXPECT_EQ(max_col, 23);
  o.preset = "qwen2-vl-7b";
  SynthGenerator qwen(o);
  EXPECT_EQ(qwen.header().geometry.num_layers, 28);
  EXPECT_EQ(qwen.header().geometry.num_q_heads, 28);
  EXPECT_EQ(qwen.header().geometry.num_kv_heads, 4);
  o.preset = "gpt-9";
  EXPECT_THROW(SynthGenerator{o}, std::invalid_argument);
}

TEST(Synth, NeighbouringPatchesAreMoreSimilarThanDistantOnes) {
  const auto g = make();
  const VisionPairs s = patch_similarity(g, g.prefill_layer(0));
  EXPECT_GT(s.neighbour, 0.7);
  EXPECT_GT(s.neighbour, s.distant + 0.3) << "neighbour " << s.neighbour << " distant " << s.distant;
}

TEST(Synth, ShallowLayersAreMoreRedundantThanDeepOnes) {
  const auto g = make();
  const int last = g.header().geometry.num_layers - 1;
  const double shallow = patch_similarity(g, g.prefill_layer(0)).neighbour;
  const double deep = patch_similarity(g, g.prefill_layer(last)).neighbour;
  EXPECT_GT(shallow, deep + 0.15) << "layer 0 " << shallow << ", layer " << last << " " << deep;
}

TEST(Synth, SinkTokensReceiveMoreAttentionThanAverage) {
  const auto g = make();
  const auto& geo = g.header().geometry;
  const int T = static_cast<int>(g.num_tokens());
  for (int l : {1, geo.num_layers - 1}) {
    const auto L = g.prefill_layer(l);
    double sink = 0, all = 0;
    int rows = 0;
    for (int j = 0; j < geo.num_q_heads; ++j) {
      for (int i = 16; i < T; i += 3) {
        const auto p = attention_row(g, L, j, i);
        for (int t = 0; t < g.num_sinks(); ++t) sink += p[static_cast<std::size_t>(t)];
        all += 1.0 / (i + 1);  // average attention per token is 1/(i+1)
        ++rows;
      }
    }
    const double per_sink = sink / (rows * g.num_sinks()), per_token = all / rows;
    EXPECT_GT(per_sink, 5 * per_token) << "layer " << l << ": sink " << per_sink << " vs mean " << per_token;
  }
}

TEST(Synth, RecentTokensReceiveMoreAttentionThanDistantOnes) {
  const auto g = make();
  const auto& geo = g.header().geometry;
  const int T = static_cast<int>(g.num_tokens());
  double recent = 0, distant = 0;
  int nr = 0, nd = 0;
  for (int l = 0; l < geo.num_layers; ++l) {
   const auto L = g.prefill_layer(l);
   for (int j = 0; j < geo.num_q_heads; ++j) {
    for (int i = T - 20; i < T; ++i) {
      const auto p = attention_row(g, L, j, i);
      for (int t = g.num_sinks(); t <= i; ++t) {
        if (g.tokens().modality[t] != 0) continue;  // text keys only: isolates position
        if (i - t <= 8) {
          recent += p[static_cast<std::size_t>(t)];
          ++nr;
        } else if (i - t >= T / 2) {
          distant += p[static_cast<std::size_t>(t)];
          ++nd;
        }
      }
    }
   }
  }
  ASSERT_GT(nr, 0);
  ASSERT_GT(nd, 0);
  EXPECT_GT(recent / nr, 3 * distant / nd) << "recent " << recent / nr << " distant " << distant / nd;
}

TEST(Synth, AlignmentQueriesAttendStronglyToTheirPatch) {
  const auto g = make();
  const auto& geo = g.header().geometry;
  ASSERT_FALSE(g.alignment_tokens().empty());
  const auto L = g.prefill_layer(1);
  double vision_share = 0, target = 0, per_patch = 0;
  int rows = 0;
  for (std::size_t a = 0; a < g.alignment_tokens().size(); ++a) {
    const int i = g.alignment_tokens()[a], tgt = g.alignment_targets()[a];
    for (int j = 0; j < geo.num_q_heads; ++j) {
      if (g.head_role(1, j / geo.group_size()) == HeadRole::kText) continue;
      const auto p = attention_row(g, L, j, i);
      double v = 0;
      int nv = 0;
      for (int t = 0; t <= i; ++t) {
        if (g.tokens().modality[t] == 1) {
          v += p[static_cast<std::size_t>(t)];
          ++nv;
        }
      }
      vision_share += v;
      target += p[static_cast<std::size_t>(tgt)];
      per_patch += v / nv;
      ++rows;
    }
  }
  EXPECT_GT(vision_share / rows, 0.3) << "cross-modal share of alignment queries";
  EXPECT_GT(target / rows, 5 * per_patch / rows) << "target patch vs mean patch";
}

TEST(Synth, VisionHeadsAttendToVisionMoreThanTextHeads) {
  const auto g = make();
  const auto& geo = g.header().geometry;
  const int T = static_cast<int>(g.num_tokens());
  double share[3] = {0, 0, 0};
  int rows[3] = {0, 0, 0};
  for (int l = 0; l < geo.num_layers; ++l) {
    const auto L = g.prefill_layer(l);
    for (int j = 0; j < geo.num_q_heads; ++j) {
      const int role = static_cast<int>(g.head_role(l, j / geo.group_size()));
      for (int i = T - 15; i < T; ++i) {
        const auto p = attention_row(g, L, j, i);
        double v = 0;
        for (int t = 0; t <= i; ++t) v += g.tokens().modality[t] == 1 ? p[static_cast<std::size_t>(t)] : 0.0;
        share[role] += v;
        ++rows[role];
      }
    }
  }
  const double vis = share[0] / rows[0], txt = share[1] / rows[1];
  EXPECT_GT(vis, txt + 0.2) << "vision heads " << vis << ", text heads " << txt;
}

}  // namespace
