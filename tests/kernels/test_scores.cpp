// CPU token scores vs float64 references: key norms, neighbour lists (1-D and
// per-segment 2-D grids), redundancy, UniCache score; properties and
// argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "common/test_util.hpp"
#include "kernels/reference_attention_stats.hpp"  // round_to_dtype
#include "kvscope/kernels/scores.hpp"

namespace kk = kvscope::kernels;
namespace kc = kvscope::kernels::cpu;
using kvscope::testing::all_close;

namespace {

struct Keys {
  int h, t, d;
  kk::DType dtype;
  std::vector<float> f;
  std::vector<std::uint16_t> bits;
  kk::KeyTensor tensor() const {
    return kk::KeyTensor{dtype == kk::DType::kF32 ? static_cast<const void*>(f.data()) : bits.data(), h, t, d,
                         dtype};
  }
  std::string params() const {
    return "h=" + std::to_string(h) + " t=" + std::to_string(t) + " d=" + std::to_string(d) + " " +
           kk::dtype_name(dtype);
  }
};

Keys make_keys(int h, int t, int d, kk::DType dtype, std::uint64_t seed) {
  Keys k{h, t, d, dtype, kvscope::testing::random_normal(static_cast<std::size_t>(h) * t * d, seed), {}};
  kvscope::testing::round_to_dtype(k.f, k.bits, dtype);
  return k;
}

// A layout: `text_before` text tokens, then images (segment s, rows x cols
// patches in row-major order), then `text_after` text tokens.
struct Layout {
  std::vector<std::int32_t> row, col, seg;
  std::vector<std::uint8_t> mod;
  kk::TokenGrid grid() const {
    return kk::TokenGrid{row.data(), col.data(), seg.data(), static_cast<int>(row.size())};
  }
};

Layout make_layout(int text_before, const std::vector<std::pair<int, int>>& images, int text_after) {
  Layout l;
  auto text = [&](int n) {
    for (int i = 0; i < n; ++i)
      l.row.push_back(-1), l.col.push_back(-1), l.seg.push_back(-1), l.mod.push_back(0);
  };
  text(text_before);
  int s = 0;
  for (auto [rows, cols] : images) {
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        l.row.push_back(r), l.col.push_back(c), l.seg.push_back(s), l.mod.push_back(1);
    ++s;
    text(1);  // separator
  }
  text(text_after);
  return l;
}

// Reference neighbour sets by brute force over all pairs.
std::vector<std::set<int>> reference_neighbours(const Layout& l, int k, int r) {
  const int T = static_cast<int>(l.row.size());
  std::vector<std::set<int>> nb(T);
  for (int t = 0; t < T; ++t) {
    const bool g = l.row[t] >= 0 && l.col[t] >= 0;
    for (int u = 0; u < T; ++u) {
      if (u == t) continue;
      if (g) {
        const bool ug = l.row[u] >= 0 && l.col[u] >= 0;
        if (ug && l.seg[u] == l.seg[t] && std::abs(l.row[u] - l.row[t]) <= r &&
            std::abs(l.col[u] - l.col[t]) <= r)
          nb[t].insert(u);
      } else if (std::abs(u - t) <= k) {
        nb[t].insert(u);
      }
    }
  }
  return nb;
}

std::vector<double> reference_redundancy(const Keys& k, const std::vector<std::set<int>>& nb) {
  std::vector<double> out(static_cast<std::size_t>(k.h) * k.t, 0.0);
  auto row = [&](int h, int t) { return k.f.data() + (static_cast<std::size_t>(h) * k.t + t) * k.d; };
  for (int h = 0; h < k.h; ++h) {
    for (int t = 0; t < k.t; ++t) {
      double best = -INFINITY;
      for (int u : nb[t]) {
        double dot = 0, na = 0, nb2 = 0;
        for (int e = 0; e < k.d; ++e) {
          dot += static_cast<double>(row(h, t)[e]) * row(h, u)[e];
          na += static_cast<double>(row(h, t)[e]) * row(h, t)[e];
          nb2 += static_cast<double>(row(h, u)[e]) * row(h, u)[e];
        }
        best = std::max(best, na > 0 && nb2 > 0 ? dot / std::sqrt(na * nb2) : 0.0);
      }
      out[static_cast<std::size_t>(h) * k.t + t] = nb[t].empty() ? 0.0 : best;
    }
  }
  return out;
}

}  // namespace

TEST(Scores, KeyNormsMatchReference) {
  std::uint64_t seed = 3;
  for (auto [h, t, d] : {std::tuple{1, 1, 1}, {1, 7, 3}, {2, 33, 64}, {4, 100, 128}, {32, 257, 128}}) {
    for (kk::DType dt : {kk::DType::kF32, kk::DType::kF16, kk::DType::kBF16}) {
      const Keys k = make_keys(h, t, d, dt, seed++);
      std::vector<double> want(static_cast<std::size_t>(h) * t);
      for (std::size_t e = 0; e < want.size(); ++e) {
        double s = 0;
        for (int i = 0; i < d; ++i) s += static_cast<double>(k.f[e * d + i]) * k.f[e * d + i];
        want[e] = std::sqrt(s);
      }
      std::vector<float> out(want.size(), -1.0f);
      ASSERT_TRUE(kc::key_norms(k.tensor(), out.data()).ok());
      EXPECT_TRUE(all_close(out, want, 1e-5, 1e-5, k.params()));
    }
  }
}

TEST(Scores, NeighbourListsMatchBruteForce) {
  const std::vector<Layout> layouts = {
      make_layout(1, {}, 0), make_layout(7, {}, 0), make_layout(3, {{4, 5}}, 2),
      make_layout(5, {{3, 3}, {6, 2}, {1, 1}}, 9), make_layout(10, {{24, 24}}, 30)};
  for (const Layout& l : layouts) {
    for (auto [k, r] : {std::pair{0, 0}, {1, 1}, {4, 1}, {8, 2}}) {
      kk::NeighbourTable table;
      ASSERT_TRUE(kc::build_neighbour_lists(l.grid(), kk::RedundancyParams{k, r}, &table).ok());
      const auto want = reference_neighbours(l, k, r);
      ASSERT_EQ(table.offsets.size(), want.size() + 1);
      for (std::size_t t = 0; t < want.size(); ++t) {
        std::set<int> got(table.indices.begin() + table.offsets[t],
                          table.indices.begin() + table.offsets[t + 1]);
        EXPECT_EQ(static_cast<std::size_t>(table.offsets[t + 1] - table.offsets[t]), got.size())
            << "duplicates";
        EXPECT_EQ(got, want[t]) << "T=" << want.size() << " k=" << k << " r=" << r << " token " << t;
      }
    }
  }
}

TEST(Scores, RedundancyMatchesReference) {
  std::uint64_t seed = 21;
  const std::vector<Layout> layouts = {make_layout(1, {}, 0), make_layout(7, {}, 0),
                                       make_layout(3, {{4, 5}}, 2), make_layout(5, {{6, 6}, {3, 7}}, 20)};
  for (const Layout& l : layouts) {
    const int T = static_cast<int>(l.row.size());
    for (kk::DType dt : {kk::DType::kF32, kk::DType::kF16, kk::DType::kBF16}) {
      for (auto [h, d] : {std::pair{1, 1}, {2, 16}, {4, 128}}) {
        Keys k = make_keys(h, T, d, dt, seed++);
        if (T > 3 && dt == kk::DType::kF32)
          std::fill(k.f.begin() + 2 * d, k.f.begin() + 3 * d, 0.0f);  // zero key
        for (auto [kr, gr] : {std::pair{1, 1}, {4, 1}, {8, 2}}) {
          std::vector<float> out(static_cast<std::size_t>(h) * T, -7.0f);
          ASSERT_TRUE(kc::redundancy(k.tensor(), l.grid(), kk::RedundancyParams{kr, gr}, out.data()).ok());
          EXPECT_TRUE(all_close(out, reference_redundancy(k, reference_neighbours(l, kr, gr)), 1e-5, 1e-5,
                                k.params() + " T=" + std::to_string(T) + " k=" + std::to_string(kr) +
                                    " r=" + std::to_string(gr)));
        }
      }
    }
  }
}

TEST(Scores, RedundancyIsOneWhereAPatchEqualsItsNeighbour) {
  // One 5x5 image after 4 text tokens; patch (2, 3) copies patch (2, 2) up to a scale.
  const Layout l = make_layout(4, {{5, 5}}, 3);
  const int T = static_cast<int>(l.row.size()), d = 32;
  Keys k = make_keys(2, T, d, kk::DType::kF32, 99);
  const int a = 4 + 2 * 5 + 2, b = a + 1;
  for (int h = 0; h < 2; ++h)
    for (int e = 0; e < d; ++e) k.f[(h * T + b) * d + e] = 3.0f * k.f[(h * T + a) * d + e];
  std::vector<float> out(2 * T);
  ASSERT_TRUE(kc::redundancy(k.tensor(), l.grid(), kk::RedundancyParams{4, 1}, out.data()).ok());
  for (int h = 0; h < 2; ++h) {
    EXPECT_NEAR(out[h * T + a], 1.0, 1e-6);
    EXPECT_NEAR(out[h * T + b], 1.0, 1e-6);
    // A patch two columns away is not a neighbour at radius 1: random keys in 32-D stay well below 1.
    EXPECT_LT(out[h * T + a + 2], 0.9);
  }
  // A token without neighbours (k = 0, single token) has d = 0.
  const Layout single = make_layout(1, {}, 0);
  const Keys k1 = make_keys(1, 1, 8, kk::DType::kF32, 5);
  float d1 = -1.0f;
  ASSERT_TRUE(kc::redundancy(k1.tensor(), single.grid(), kk::RedundancyParams{4, 1}, &d1).ok());
  EXPECT_EQ(d1, 0.0f);
}

TEST(Scores, UniCacheMatchesReference) {
  std::uint64_t seed = 40;
  for (auto [H, T] : {std::pair{1, 1}, {1, 7}, {3, 33}, {8, 577}}) {
    const auto a = kvscope::testing::random_uniform(static_cast<std::size_t>(H) * T, seed++, 0.0f, 2.0f);
    const auto c = kvscope::testing::random_uniform(a.size(), seed++, 0.0f, 0.5f);
    const auto d = kvscope::testing::random_uniform(a.size(), seed++, -0.5f, 1.2f);
    std::vector<std::uint8_t> mod(T);
    std::mt19937_64 rng(seed++);
    for (auto& m : mod) m = static_cast<std::uint8_t>(rng() % 3);
    for (kk::NormalizeKind nk : {kk::NormalizeKind::kMax, kk::NormalizeKind::kMinMax}) {
      for (kk::RecencyKind rk : {kk::RecencyKind::kLinear, kk::RecencyKind::kExponential}) {
        for (bool with_cd : {true, false}) {
          kk::UniCacheParams p;
          p.normalize = nk, p.recency = rk, p.recency_tau = 16.0f;
          std::vector<double> want(a.size());
          for (int h = 0; h < H; ++h) {
            for (int t = 0; t < T; ++t) {
              auto norm = [&](const std::vector<float>& x) {
                double lo = INFINITY, hi = -INFINITY;
                for (int u = 0; u < T; ++u)
                  if (mod[u] == mod[t])
                    lo = std::min(lo, double(x[h * T + u])), hi = std::max(hi, double(x[h * T + u]));
                const double v = x[h * T + t];
                if (nk == kk::NormalizeKind::kMax) return hi > 0 ? v / hi : 0.0;
                return hi > lo ? (v - lo) / (hi - lo) : (hi > 0 ? 1.0 : 0.0);
              };
              const double r = rk == kk::RecencyKind::kLinear ? (T > 1 ? double(t) / (T - 1) : 1.0)
                                                              : std::exp(-(T - 1.0 - t) / 16.0);
              const double cn = with_cd ? norm(c) : 0.0;
              const double dn = with_cd ? std::clamp(double(d[h * T + t]), 0.0, 1.0) : 0.0;
              want[h * T + t] = 0.4 * norm(a) + 0.3 * cn - 0.2 * dn + 0.1 * r;
            }
          }
          std::vector<float> out(a.size(), -9.0f);
          kk::UniCacheInputs in{
              a.data(), with_cd ? c.data() : nullptr, with_cd ? d.data() : nullptr, mod.data(), H, T};
          ASSERT_TRUE(kc::unicache_score(in, p, out.data()).ok());
          EXPECT_TRUE(all_close(out, want, 1e-6, 1e-5,
                                "H=" + std::to_string(H) + " T=" + std::to_string(T) +
                                    " norm=" + std::to_string(int(nk)) + " rec=" + std::to_string(int(rk)) +
                                    " cd=" + std::to_string(with_cd)));
        }
      }
    }
  }
}

TEST(Scores, UniCacheNormalisesWithinModality) {
  // Vision attention is 100x smaller than text; after per-modality max
  // normalisation the top token of each modality gets the same a~ = 1.
  const int T = 4;
  const std::vector<float> a = {1.0f, 0.5f, 0.01f, 0.005f};
  const std::vector<std::uint8_t> mod = {0, 0, 1, 1};
  kk::UniCacheParams p;
  p.w_a = 1.0f, p.w_c = 0.0f, p.w_d = 0.0f, p.w_r = 0.0f;
  std::vector<float> out(T);
  ASSERT_TRUE(
      kc::unicache_score(kk::UniCacheInputs{a.data(), nullptr, nullptr, mod.data(), 1, T}, p, out.data())
          .ok());
  EXPECT_FLOAT_EQ(out[0], 1.0f);
  EXPECT_FLOAT_EQ(out[1], 0.5f);
  EXPECT_FLOAT_EQ(out[2], 1.0f);
  EXPECT_FLOAT_EQ(out[3], 0.5f);
}

TEST(Scores, RejectsBadArguments) {
  const Keys k = make_keys(2, 8, 4, kk::DType::kF32, 1);
  std::vector<float> out(16);
  kk::KeyTensor bad = k.tensor();
  bad.k = nullptr;
  EXPECT_FALSE(kc::key_norms(bad, out.data()).ok());
  bad = k.tensor();
  bad.head_dim = 0;
  EXPECT_FALSE(kc::key_norms(bad, out.data()).ok());
  EXPECT_FALSE(kc::key_norms(k.tensor(), nullptr).ok());

  Layout l = make_layout(2, {{2, 3}}, 0);  // 2 + 6 + 1 = 9 tokens
  kk::NeighbourTable table;
  EXPECT_FALSE(kc::build_neighbour_lists(l.grid(), kk::RedundancyParams{-1, 1}, &table).ok());
  EXPECT_FALSE(kc::build_neighbour_lists(kk::TokenGrid{l.row.data(), nullptr, nullptr, 9}, {}, &table).ok());
  Layout dup = l;
  dup.row[3] = dup.row[2], dup.col[3] = dup.col[2];
  const kk::Status s = kc::build_neighbour_lists(dup.grid(), {}, &table);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("share grid cell"), std::string::npos) << s.message();
  // neighbour lists for another token count, or with an out-of-range index
  ASSERT_TRUE(kc::build_neighbour_lists(l.grid(), {}, &table).ok());
  EXPECT_FALSE(kc::redundancy(k.tensor(), table.view(), out.data()).ok());  // 9 != 8 tokens
  const Layout l8 = make_layout(8, {}, 0);
  ASSERT_TRUE(kc::build_neighbour_lists(l8.grid(), {}, &table).ok());
  table.indices[0] = 8;
  EXPECT_FALSE(kc::redundancy(k.tensor(), table.view(), out.data()).ok());

  const std::vector<float> a(8, 1.0f);
  std::vector<std::uint8_t> mod(8, 0);
  kk::UniCacheInputs in{a.data(), nullptr, nullptr, mod.data(), 1, 8};
  EXPECT_TRUE(kc::unicache_score(in, {}, out.data()).ok());
  kk::UniCacheParams p;
  p.recency = kk::RecencyKind::kExponential, p.recency_tau = 0.0f;
  EXPECT_FALSE(kc::unicache_score(in, p, out.data()).ok());
  mod[3] = 7;
  EXPECT_FALSE(kc::unicache_score(in, {}, out.data()).ok());
  mod[3] = 0;
  in.num_tokens = 0;
  EXPECT_FALSE(kc::unicache_score(in, {}, out.data()).ok());
  in.num_tokens = 8;
  in.attention = nullptr;
  EXPECT_FALSE(kc::unicache_score(in, {}, out.data()).ok());
}
