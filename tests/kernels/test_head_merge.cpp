// CPU head merging against a float64 reference (similarity, clustering, merged
// heads, GQA map), properties (identical heads cluster, dissimilar ones don't)
// and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kvscope/kernels/head_merge.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::random_normal;
using kvscope::testing::random_uniform;

namespace {

// cos(vec(X_a), vec(X_b)) in double; 0 for a zero head.
double ref_cos(const std::vector<float>& x, std::size_t n, int a, int b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double xa = x[a * n + i], xb = x[b * n + i];
    ab += xa * xb;
    aa += xa * xa;
    bb += xb * xb;
  }
  return aa > 0 && bb > 0 ? std::clamp(ab / std::sqrt(aa * bb), -1.0, 1.0) : 0.0;
}

struct HeadProblem {
  kk::HeadMergeParams params;
  std::vector<float> k, v, weights;
};

// Heads built from a few prototypes plus noise, so some pairs are clearly similar
// (cos ~ 0.99) and others clearly not (cos ~ 0).
HeadProblem make_problem(int H, int Hq, int T, int D, std::uint64_t seed) {
  HeadProblem pr;
  pr.params.num_kv_heads = H;
  pr.params.num_q_heads = Hq;
  pr.params.num_tokens = T;
  pr.params.head_dim = D;
  const std::size_t n = static_cast<std::size_t>(T) * D;
  const int protos = std::max(1, H / 2);
  const auto pk = random_normal(protos * n, seed), pv = random_normal(protos * n, seed + 1);
  const auto nk = random_normal(H * n, seed + 2, 0.1f), nv = random_normal(H * n, seed + 3, 0.1f);
  pr.k.resize(H * n);
  pr.v.resize(H * n);
  for (int h = 0; h < H; ++h) {
    const int pidx = (h * 7 + 3) % protos;
    for (std::size_t i = 0; i < n; ++i) {
      pr.k[h * n + i] = pk[pidx * n + i] + nk[h * n + i];
      pr.v[h * n + i] = pv[pidx * n + i] + nv[h * n + i];
    }
  }
  pr.weights = random_uniform(H, seed + 4, 0.1f, 2.0f);
  return pr;
}

}  // namespace

TEST(HeadMergeCpu, MatchesFloat64Reference) {
  struct Shape {
    int H, Hq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1}, {3, 6, 7, 5}, {5, 5, 33, 16}, {8, 32, 100, 64}, {4, 8, 300, 128}};
  std::uint64_t seed = 100;
  for (const Shape& sh : shapes) {
    for (kk::HeadSimilarity mode : {kk::HeadSimilarity::kKeys, kk::HeadSimilarity::kKeysValues}) {
      for (bool weighted : {false, true}) {
        HeadProblem pr = make_problem(sh.H, sh.Hq, sh.T, sh.D, seed++);
        pr.params.similarity = mode;
        const int H = sh.H;
        const std::size_t n = static_cast<std::size_t>(sh.T) * sh.D;
        const std::string what = "H=" + std::to_string(H) + " Hq=" + std::to_string(sh.Hq) +
                                 " T=" + std::to_string(sh.T) + " D=" + std::to_string(sh.D) +
                                 " kv=" + std::to_string(static_cast<int>(mode)) +
                                 " weighted=" + std::to_string(weighted);
        std::vector<float> sim(H * H), ko(H * n), vo(H * n);
        std::vector<std::int32_t> cid(H), qmap(sh.Hq);
        int merged = -1;
        const float* w = weighted ? pr.weights.data() : nullptr;
        const kk::Status s = kk::cpu::merge_heads(pr.params, pr.k.data(), pr.v.data(), w, sim.data(),
                                                  cid.data(), &merged, ko.data(), vo.data(), qmap.data());
        ASSERT_TRUE(s.ok()) << s.message();
        // similarity
        std::vector<double> ref_sim(H * H);
        for (int a = 0; a < H; ++a)
          for (int b = 0; b < H; ++b) {
            const double ck = ref_cos(pr.k, n, a, b), cv = ref_cos(pr.v, n, a, b);
            ref_sim[a * H + b] = a == b ? 1.0 : (mode == kk::HeadSimilarity::kKeys ? ck : 0.5 * (ck + cv));
          }
        EXPECT_TRUE(all_close(sim, ref_sim, 1e-5, 1e-5, what + " similarity"));
        // greedy clustering on the reference similarities
        std::vector<std::int32_t> ref_cid(H, -1);
        int c = 0;
        for (int a = 0; a < H; ++a) {
          if (ref_cid[a] >= 0) continue;
          ref_cid[a] = c;
          for (int b = a + 1; b < H; ++b)
            if (ref_cid[b] < 0 && ref_sim[a * H + b] > 0.88) ref_cid[b] = c;
          ++c;
        }
        EXPECT_EQ(cid, ref_cid) << what;
        EXPECT_EQ(merged, c) << what;
        // merged heads
        std::vector<double> rk(c * n, 0.0), rv(c * n, 0.0), ws(c, 0.0);
        for (int a = 0; a < H; ++a) ws[ref_cid[a]] += w ? w[a] : 1.0;
        for (int a = 0; a < H; ++a) {
          const double wa = (w ? w[a] : 1.0) / ws[ref_cid[a]];
          for (std::size_t i = 0; i < n; ++i) {
            rk[ref_cid[a] * n + i] += wa * pr.k[a * n + i];
            rv[ref_cid[a] * n + i] += wa * pr.v[a * n + i];
          }
        }
        ko.resize(c * n);
        vo.resize(c * n);
        EXPECT_TRUE(all_close(ko, rk, 1e-5, 1e-5, what + " k_out"));
        EXPECT_TRUE(all_close(vo, rv, 1e-5, 1e-5, what + " v_out"));
        for (int j = 0; j < sh.Hq; ++j)
          EXPECT_EQ(qmap[j], ref_cid[j / (sh.Hq / H)]) << what << " q head " << j;
      }
    }
  }
}

TEST(HeadMergeCpu, IdenticalHeadsClusterAndDissimilarDoNot) {
  // kv heads 0 and 2 identical, 1 and 3 independent random; GQA group 2.
  const int H = 4, Hq = 8, T = 50, D = 16;
  const std::size_t n = static_cast<std::size_t>(T) * D;
  std::vector<float> k = random_normal(H * n, 1), v = random_normal(H * n, 2);
  for (std::size_t i = 0; i < n; ++i) {
    k[2 * n + i] = k[i];
    v[2 * n + i] = 3.0f * v[i];  // values differ by scale: still cosine 1
  }
  kk::HeadMergeParams p;
  p.num_kv_heads = H;
  p.num_q_heads = Hq;
  p.num_tokens = T;
  p.head_dim = D;
  p.similarity = kk::HeadSimilarity::kKeysValues;
  std::vector<float> sim(H * H), ko(H * n), vo(H * n);
  std::vector<std::int32_t> cid(H), qmap(Hq);
  int merged = 0;
  ASSERT_TRUE(kk::cpu::merge_heads(p, k.data(), v.data(), nullptr, sim.data(), cid.data(), &merged, ko.data(),
                                   vo.data(), qmap.data())
                  .ok());
  EXPECT_NEAR(sim[0 * H + 2], 1.0f, 1e-6);
  EXPECT_LT(std::fabs(sim[0 * H + 1]), 0.2f);
  EXPECT_EQ(merged, 3);
  EXPECT_EQ(cid, (std::vector<std::int32_t>{0, 1, 0, 2}));
  EXPECT_EQ(qmap, (std::vector<std::int32_t>{0, 0, 1, 1, 0, 0, 2, 2}));
  for (std::size_t i = 0; i < n; ++i) {  // cluster 0 = average of heads 0 and 2
    ASSERT_NEAR(ko[i], k[i], 1e-6);
    ASSERT_NEAR(vo[i], 2.0f * v[i], 1e-5);
    ASSERT_EQ(ko[n + i], k[n + i]);  // singleton copied
  }
}

TEST(HeadMergeCpu, GreedyClusteringComparesWithFirstHeadOnly) {
  // 0~1 and 1~2 similar but 0 and 2 not: 2 is not pulled into 0's cluster.
  const int H = 3;
  std::vector<float> sim = {1.0f, 0.9f, 0.5f, 0.9f, 1.0f, 0.95f, 0.5f, 0.95f, 1.0f};
  std::vector<std::int32_t> cid(H);
  int c = 0;
  ASSERT_TRUE(kk::cpu::cluster_heads(H, sim.data(), 0.88f, cid.data(), &c).ok());
  EXPECT_EQ(cid, (std::vector<std::int32_t>{0, 0, 1}));
  EXPECT_EQ(c, 2);
  ASSERT_TRUE(kk::cpu::cluster_heads(H, sim.data(), 0.9f, cid.data(), &c).ok());  // strict >
  EXPECT_EQ(cid, (std::vector<std::int32_t>{0, 1, 1}));
}

TEST(HeadMergeCpu, HalfInputsAndZeroHead) {
  const int H = 3, T = 9, D = 8;
  const std::size_t n = static_cast<std::size_t>(T) * D;
  std::vector<float> kf = random_normal(H * n, 4), vf = random_normal(H * n, 5);
  for (std::size_t i = 0; i < n; ++i) kf[n + i] = 0.0f;  // head 1 all zero keys
  std::vector<std::uint16_t> kh(H * n), vh(H * n);
  for (std::size_t i = 0; i < kh.size(); ++i) {
    kh[i] = kk::float_to_half(kf[i]);
    vh[i] = kk::float_to_half(vf[i]);
  }
  kk::HeadMergeParams p;
  p.num_kv_heads = H;
  p.num_q_heads = H;
  p.num_tokens = T;
  p.head_dim = D;
  p.dtype = kk::DType::kF16;
  std::vector<float> sim(H * H);
  ASSERT_TRUE(kk::cpu::head_similarity(p, kh.data(), nullptr, sim.data()).ok());
  EXPECT_EQ(sim[0 * H + 1], 0.0f);
  EXPECT_EQ(sim[1 * H + 1], 1.0f);
  std::vector<std::int32_t> cid = {0, 0, 1};
  std::vector<float> ko(2 * n), vo(2 * n);
  std::vector<float> w = {0.0f, 0.0f, 1.0f};  // cluster 0 weights sum to 0: uniform
  ASSERT_TRUE(
      kk::cpu::apply_head_merge(p, kh.data(), vh.data(), cid.data(), 2, w.data(), ko.data(), vo.data()).ok());
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(vo[i], 0.5 * (kk::half_to_float(vh[i]) + kk::half_to_float(vh[n + i])), 1e-6);
    EXPECT_EQ(ko[n + i], kk::half_to_float(kh[2 * n + i]));
  }
}

TEST(HeadMergeCpu, RejectsBadArguments) {
  HeadProblem pr = make_problem(4, 8, 5, 4, 9);
  const std::size_t n = 20;
  std::vector<float> sim(16), ko(4 * n), vo(4 * n);
  std::vector<std::int32_t> cid(4), qmap(8);
  int merged = 0;
  auto call = [&](const kk::HeadMergeParams& p) {
    return kk::cpu::merge_heads(p, pr.k.data(), pr.v.data(), nullptr, sim.data(), cid.data(), &merged,
                                ko.data(), vo.data(), qmap.data());
  };
  EXPECT_TRUE(call(pr.params).ok());
  kk::HeadMergeParams p = pr.params;
  p.num_q_heads = 6;  // not a multiple of 4
  EXPECT_FALSE(call(p).ok());
  p = pr.params;
  p.num_tokens = 0;
  EXPECT_FALSE(call(p).ok());
  p = pr.params;
  p.head_dim = -1;
  EXPECT_FALSE(call(p).ok());
  EXPECT_FALSE(kk::cpu::head_similarity(pr.params, nullptr, pr.v.data(), sim.data()).ok());
  p = pr.params;
  p.similarity = kk::HeadSimilarity::kKeysValues;
  EXPECT_FALSE(kk::cpu::head_similarity(p, pr.k.data(), nullptr, sim.data()).ok());
  std::vector<std::int32_t> bad = {0, 1, 5, 0};
  EXPECT_FALSE(kk::cpu::apply_head_merge(pr.params, pr.k.data(), pr.v.data(), bad.data(), 2, nullptr,
                                         ko.data(), vo.data())
                   .ok());
  bad = {0, 0, 2, 2};  // cluster 1 empty
  const kk::Status s = kk::cpu::apply_head_merge(pr.params, pr.k.data(), pr.v.data(), bad.data(), 3, nullptr,
                                                 ko.data(), vo.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("cluster 1"), std::string::npos) << s.message();
  EXPECT_FALSE(kk::cpu::cluster_heads(0, sim.data(), 0.9f, cid.data(), &merged).ok());
}
