// CPU attention statistics vs float64 references (GQA, causal masks with
// Tq != Tk, explicit positions, all dtypes) plus property and argument tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/reference_attention_stats.hpp"
#include "kvscope/kernels/attention_stats.hpp"

namespace kk = kvscope::kernels;
namespace kc = kvscope::kernels::cpu;
using kvscope::testing::all_close;
using kvscope::testing::AttentionCase;
using kvscope::testing::make_case;
using kvscope::testing::reference_colsum;
using kvscope::testing::reference_probs;

namespace {

struct Shape {
  int hq, hkv, tq, tk, d;
};

// Sizes 1, odd, GQA 8/2, Tq != Tk, typical and large head_dim.
const Shape kShapes[] = {{1, 1, 1, 1, 1},     {1, 1, 7, 7, 3},     {2, 1, 7, 33, 16},  {8, 2, 33, 33, 64},
                         {8, 2, 20, 70, 128}, {4, 4, 64, 64, 128}, {4, 1, 96, 201, 32}};

std::vector<AttentionCase> all_cases() {
  std::vector<AttentionCase> cases;
  std::uint64_t seed = 11;
  for (const Shape& s : kShapes) {
    for (kk::DType t : {kk::DType::kF32, kk::DType::kF16, kk::DType::kBF16}) {
      cases.push_back(make_case(s.hq, s.hkv, s.tq, s.tk, s.d, t, seed++));
    }
    cases.push_back(make_case(s.hq, s.hkv, s.tq, s.tk, s.d, kk::DType::kF32, seed++, /*causal=*/false));
    // Explicit, shuffled positions: some queries see nothing (q_pos = -1).
    AttentionCase c = make_case(s.hq, s.hkv, s.tq, s.tk, s.d, kk::DType::kF32, seed++);
    std::mt19937_64 rng(seed++);
    c.k_pos.resize(s.tk);
    c.q_pos.resize(s.tq);
    for (auto& p : c.k_pos) p = static_cast<std::int32_t>(rng() % (s.tk + 1));
    for (auto& p : c.q_pos) p = static_cast<std::int32_t>(rng() % (s.tk + 1)) - 1;
    cases.push_back(c);
  }
  return cases;
}

constexpr double kAtol = 2e-5, kRtol = 2e-4;

}  // namespace

TEST(AttentionStats, AccumulatedMatchesReference) {
  for (const AttentionCase& c : all_cases()) {
    const auto p = reference_probs(c);
    // full range and a sub-range
    for (auto [b, e] : {std::pair{0, c.tq}, std::pair{c.tq / 2, c.tq}}) {
      if (b >= e) continue;
      std::vector<float> out(static_cast<std::size_t>(c.hq) * c.tk, -1.0f);
      ASSERT_TRUE(kc::accumulated_attention(c.problem(), kk::QueryRange{b, e}, out.data()).ok());
      EXPECT_TRUE(all_close(out, reference_colsum(c, p, b, e), kAtol, kRtol,
                            c.params() + " range=[" + std::to_string(b) + "," + std::to_string(e) + ")"));
    }
  }
}

TEST(AttentionStats, TovaIsLastRowAndSumsToOne) {
  for (const AttentionCase& c : all_cases()) {
    const auto p = reference_probs(c);
    std::vector<float> out(static_cast<std::size_t>(c.hq) * c.tk, -1.0f);
    ASSERT_TRUE(kc::tova_scores(c.problem(), out.data()).ok());
    EXPECT_TRUE(all_close(out, reference_colsum(c, p, c.tq - 1, c.tq), kAtol, kRtol, c.params()));
    if (!c.q_pos.empty()) continue;  // default positions: the last query sees every key
    for (int j = 0; j < c.hq; ++j) {
      double s = 0.0;
      for (int t = 0; t < c.tk; ++t) s += out[static_cast<std::size_t>(j) * c.tk + t];
      EXPECT_NEAR(s, 1.0, 1e-5) << c.params() << " head " << j;
    }
  }
}

TEST(AttentionStats, ReduceToKvHeads) {
  const int hq = 8, hkv = 2, len = 37;
  const auto in = kvscope::testing::random_uniform(hq * len, 5, 0.0f, 1.0f);
  std::vector<float> out(hkv * len);
  ASSERT_TRUE(kc::reduce_to_kv_heads(in.data(), hq, hkv, len, out.data()).ok());
  std::vector<double> want(hkv * len, 0.0);
  for (int j = 0; j < hq; ++j)
    for (int t = 0; t < len; ++t) want[(j / 4) * len + t] += in[j * len + t];
  EXPECT_TRUE(all_close(out, want, 1e-6, 1e-6, "hq=8 hkv=2 len=37"));
}

TEST(AttentionStats, SnapKVMatchesReference) {
  for (const AttentionCase& c : all_cases()) {
    const auto p = reference_probs(c);
    for (int window : {1, c.tq}) {
      const auto sums = reference_colsum(c, p, c.tq - window, c.tq);
      for (int ks : {1, 7}) {
        for (kk::PoolKind pool : {kk::PoolKind::kAvg, kk::PoolKind::kMax}) {
          std::vector<double> want(sums.size());
          for (int j = 0; j < c.hq; ++j) {
            for (int t = 0; t < c.tk; ++t) {
              double acc = pool == kk::PoolKind::kAvg ? 0.0 : -INFINITY;
              for (int u = t - ks / 2; u <= t + ks / 2; ++u) {
                if (u < 0 || u >= c.tk) continue;
                const double v = sums[static_cast<std::size_t>(j) * c.tk + u];
                acc = pool == kk::PoolKind::kAvg ? acc + v : std::max(acc, v);
              }
              want[static_cast<std::size_t>(j) * c.tk + t] = pool == kk::PoolKind::kAvg ? acc / ks : acc;
            }
          }
          std::vector<float> out(sums.size(), -1.0f);
          ASSERT_TRUE(kc::snapkv_scores(c.problem(), kk::SnapKVParams{window, ks, pool}, out.data()).ok());
          EXPECT_TRUE(all_close(out, want, kAtol, kRtol,
                                c.params() + " window=" + std::to_string(window) + " k=" +
                                    std::to_string(ks) + " pool=" + std::to_string(static_cast<int>(pool))));
        }
      }
    }
  }
}

TEST(AttentionStats, RowStatsMatchReferenceAndMassSumsToOne) {
  for (const AttentionCase& c : all_cases()) {
    const auto p = reference_probs(c);
    std::vector<double> want_h(static_cast<std::size_t>(c.hq) * c.tq, 0.0);
    std::vector<double> want_m(want_h.size() * 4, 0.0);
    for (std::size_t r = 0; r < want_h.size(); ++r) {
      for (int t = 0; t < c.tk; ++t) {
        const double v = p[r * c.tk + t];
        if (v > 0) want_h[r] -= v * std::log(v);
        want_m[r * 4 + c.k_mod[t]] += v;
      }
    }
    std::vector<float> h(want_h.size(), -1.0f), m(want_m.size(), -1.0f);
    ASSERT_TRUE(kc::attention_row_stats(c.problem(), c.k_mod.data(), h.data(), m.data()).ok());
    EXPECT_TRUE(all_close(h, want_h, 1e-4, 1e-4, c.params() + " entropy"));
    EXPECT_TRUE(all_close(m, want_m, kAtol, kRtol, c.params() + " modality mass"));
    for (std::size_t r = 0; r < want_h.size(); ++r) {
      double row_mass = 0.0, ref_row = 0.0;
      for (int k = 0; k < 4; ++k) row_mass += m[r * 4 + k];
      for (int t = 0; t < c.tk; ++t) ref_row += p[r * c.tk + t];
      // 1 for every row with a visible key, 0 for fully masked rows.
      EXPECT_NEAR(row_mass, ref_row, 1e-5) << c.params() << " row " << r;
      if (c.q_pos.empty()) {
        EXPECT_NEAR(row_mass, 1.0, 1e-5) << c.params() << " row " << r;
      }
    }
  }
}

TEST(AttentionStats, EntropyOfUniformRowIsLogN) {
  // All keys equal -> every visible key gets 1/n; causal prefill row i sees i + 1 keys.
  AttentionCase c = make_case(2, 1, 50, 50, 16, kk::DType::kF32, 3);
  for (int t = 0; t < c.tk; ++t)
    for (int e = 0; e < c.d; ++e) c.kf[t * c.d + e] = c.kf[e];
  std::vector<float> h(c.hq * c.tq);
  ASSERT_TRUE(kc::attention_row_stats(c.problem(), nullptr, h.data(), nullptr).ok());
  for (int j = 0; j < c.hq; ++j)
    for (int i = 0; i < c.tq; ++i) EXPECT_NEAR(h[j * c.tq + i], std::log(i + 1.0), 1e-5) << "row " << i;
}

TEST(AttentionStats, CrossModalMatchesReference) {
  for (const AttentionCase& c0 : all_cases()) {
    if (c0.tq != c0.tk) continue;
    for (bool own_q_mod : {false, true}) {
      AttentionCase c = c0;
      if (!own_q_mod) c.q_mod = c.k_mod;
      const auto p = reference_probs(c);
      std::vector<double> want_r(static_cast<std::size_t>(c.hq) * c.tk, 0.0), want_g(want_r.size(), 0.0);
      for (int j = 0; j < c.hq; ++j) {
        for (int t = 0; t < c.tk; ++t) {
          int n = 0;
          double s = 0.0;
          for (int i = 0; i < c.tq; ++i) {
            const long long qpos = c.q_pos.empty() ? i : c.q_pos[i];
            const long long kpos = c.k_pos.empty() ? t : c.k_pos[t];
            if (c.q_mod[i] == c.k_mod[t] || (c.causal && kpos > qpos)) continue;
            ++n;
            s += p[(static_cast<std::size_t>(j) * c.tq + i) * c.tk + t];
          }
          want_r[static_cast<std::size_t>(j) * c.tk + t] = n > 0 ? s / n : 0.0;
        }
        for (int i = 0; i < c.tq; ++i)
          for (int t = 0; t < c.tk; ++t)
            if (c.k_mod[t] != c.q_mod[i])
              want_g[static_cast<std::size_t>(j) * c.tq + i] +=
                  p[(static_cast<std::size_t>(j) * c.tq + i) * c.tk + t];
      }
      std::vector<float> r(want_r.size(), -1.0f), g(want_g.size(), -1.0f);
      ASSERT_TRUE(kc::cross_modal_interaction(c.problem(), c.k_mod.data(),
                                              own_q_mod ? c.q_mod.data() : nullptr, r.data(), g.data())
                      .ok());
      EXPECT_TRUE(all_close(r, want_r, kAtol, kRtol, c.params() + " received"));
      EXPECT_TRUE(all_close(g, want_g, kAtol, kRtol, c.params() + " given"));
    }
  }
}

TEST(AttentionStats, ResultsDoNotDependOnThreadCount) {
  const AttentionCase c = make_case(8, 2, 97, 97, 32, kk::DType::kF16, 77);
  std::vector<float> a(c.hq * c.tk), b(a.size()), ra(a.size()), rb(a.size());
  kk::set_cpu_threads(1);
  ASSERT_TRUE(kc::accumulated_attention(c.problem(), {}, a.data()).ok());
  ASSERT_TRUE(
      kc::cross_modal_interaction(c.problem(), c.k_mod.data(), c.q_mod.data(), ra.data(), nullptr).ok());
  kk::set_cpu_threads(3);
  ASSERT_TRUE(kc::accumulated_attention(c.problem(), {}, b.data()).ok());
  ASSERT_TRUE(
      kc::cross_modal_interaction(c.problem(), c.k_mod.data(), c.q_mod.data(), rb.data(), nullptr).ok());
  kk::set_cpu_threads(0);
  EXPECT_EQ(a, b);
  EXPECT_EQ(ra, rb);
}

// The CPU backend computes rows in blocks of 64 queries (one sgemm per block, the
// block's key range cut at the last key its rows can see): a prefill of 150 rows
// (blocks 64, 64, 22) with GQA, query ranges starting inside a block, and the fused
// cross-modal pass (received and given together) against separate calls.
TEST(AttentionStats, BlockedRowsMatchReferenceAcrossBlockEdges) {
  for (kk::DType t : {kk::DType::kF16, kk::DType::kF32}) {
    const AttentionCase c = make_case(4, 2, 150, 150, 64, t, 901);
    const auto p = reference_probs(c);
    for (auto [b, e] : {std::pair{0, 150}, std::pair{63, 65}, std::pair{100, 150}, std::pair{149, 150}}) {
      std::vector<float> out(static_cast<std::size_t>(c.hq) * c.tk, -1.0f);
      ASSERT_TRUE(kc::accumulated_attention(c.problem(), kk::QueryRange{b, e}, out.data()).ok());
      EXPECT_TRUE(all_close(out, reference_colsum(c, p, b, e), kAtol, kRtol,
                            c.params() + " range [" + std::to_string(b) + ", " + std::to_string(e) + ")"));
    }
    std::vector<float> r(static_cast<std::size_t>(c.hq) * c.tk), g(r.size()), r1(r.size()), g1(r.size());
    ASSERT_TRUE(
        kc::cross_modal_interaction(c.problem(), c.k_mod.data(), c.q_mod.data(), r.data(), g.data()).ok());
    ASSERT_TRUE(
        kc::cross_modal_interaction(c.problem(), c.k_mod.data(), c.q_mod.data(), r1.data(), nullptr).ok());
    ASSERT_TRUE(
        kc::cross_modal_interaction(c.problem(), c.k_mod.data(), c.q_mod.data(), nullptr, g1.data()).ok());
    EXPECT_EQ(r, r1) << c.params();
    EXPECT_EQ(g, g1) << c.params();
  }
}

// The one-pass H2O + cross-modal sums of the stored aggregates (trace format 1.2) give what the
// separate kernels give (the same row blocks, sums and block order: equal up to float rounding of
// the sgemm calls, asserted with a tight tolerance), on blocks of 64 rows with GQA and a causal
// prefill; the window sums pooled give snapkv_scores.
TEST(AttentionStats, PrefillSumsAndWindowSumsMatchTheSeparateKernels) {
  for (kk::DType t : {kk::DType::kF16, kk::DType::kF32}) {
    AttentionCase c = make_case(4, 2, 150, 150, 32, t, 902);
    c.q_mod = c.k_mod;
    const std::size_t n = static_cast<std::size_t>(c.hq) * c.tk;
    std::vector<float> h(n), r(n), g(n), h1(n), r1(n), g1(n);
    ASSERT_TRUE(kc::prefill_attention_sums(c.problem(), c.k_mod.data(), h.data(), r.data(), g.data()).ok());
    ASSERT_TRUE(kc::accumulated_attention(c.problem(), {}, h1.data()).ok());
    ASSERT_TRUE(kc::cross_modal_interaction(c.problem(), c.k_mod.data(), nullptr, r1.data(), g1.data()).ok());
    EXPECT_TRUE(all_close(h, h1, 1e-7, 1e-6, c.params() + " h2o"));
    EXPECT_TRUE(all_close(r, r1, 1e-7, 1e-6, c.params() + " received"));
    EXPECT_TRUE(all_close(g, g1, 1e-7, 1e-6, c.params() + " given"));
    const auto p = reference_probs(c);
    EXPECT_TRUE(
        all_close(h, reference_colsum(c, p, 0, c.tq), kAtol, kRtol, c.params() + " h2o vs reference"));
    for (int w : {1, 32, 70}) {
      for (int k : {1, 7}) {
        kk::SnapKVParams sp;
        sp.window = w;
        sp.kernel_size = k;
        sp.pool = k == 7 ? kk::PoolKind::kMax : kk::PoolKind::kAvg;
        std::vector<float> sums(n), pooled(n), want(n);
        ASSERT_TRUE(kc::snapkv_window_sums(c.problem(), w, sums.data()).ok());
        ASSERT_TRUE(kc::snapkv_pool(sums.data(), c.hq, c.tk, sp, pooled.data()).ok());
        ASSERT_TRUE(kc::snapkv_scores(c.problem(), sp, want.data()).ok());
        EXPECT_EQ(pooled, want) << c.params() << " window " << w << " kernel " << k;
        EXPECT_TRUE(
            all_close(sums, reference_colsum(c, p, c.tq - w, c.tq), kAtol, kRtol, c.params() + " sums"));
      }
    }
  }
  const AttentionCase c = make_case(2, 1, 8, 9, 16, kk::DType::kF32, 903);
  std::vector<float> x(static_cast<std::size_t>(c.hq) * c.tk);
  EXPECT_FALSE(kc::prefill_attention_sums(c.problem(), c.k_mod.data(), x.data(), x.data(), x.data()).ok())
      << "q_len != k_len";
  EXPECT_FALSE(kc::snapkv_window_sums(c.problem(), 0, x.data()).ok());
  kk::SnapKVParams even;
  even.kernel_size = 4;
  EXPECT_FALSE(kc::snapkv_pool(x.data(), c.hq, c.tk, even, x.data()).ok());
}

// snapkv_pool_split against a direct double-precision reading of its definition: each key pools the
// taps of its own side of the edge (avg: out-of-side taps count 0, divisor the kernel size; max: they
// are skipped); edge 0 and len are snapkv_pool; edges outside 0..len are refused.
TEST(AttentionStats, SnapKVPoolSplitPoolsEachSideOfTheEdge) {
  const int heads = 3, len = 23;
  std::vector<float> sums(static_cast<std::size_t>(heads) * len);
  for (std::size_t i = 0; i < sums.size(); ++i) sums[i] = static_cast<float>((i * 37) % 11) * 0.25f - 0.5f;
  for (kk::PoolKind pool : {kk::PoolKind::kAvg, kk::PoolKind::kMax}) {
    for (int k : {1, 5, 7}) {
      kk::SnapKVParams sp;
      sp.kernel_size = k;
      sp.pool = pool;
      for (int edge : {0, 1, 2, 9, 21, 22, 23}) {
        std::vector<float> got(sums.size()), whole(sums.size());
        ASSERT_TRUE(kc::snapkv_pool_split(sums.data(), heads, len, edge, sp, got.data()).ok());
        for (int h = 0; h < heads; ++h) {
          for (int t = 0; t < len; ++t) {
            const int begin = t < edge ? 0 : edge, end = t < edge ? edge : len;
            double want = pool == kk::PoolKind::kAvg ? 0.0 : -1e30;
            for (int u = t - k / 2; u <= t + k / 2; ++u) {
              if (u < begin || u >= end) continue;
              const double x = sums[static_cast<std::size_t>(h) * len + u];
              want = pool == kk::PoolKind::kAvg ? want + x / k : std::max(want, x);
            }
            EXPECT_NEAR(got[static_cast<std::size_t>(h) * len + t], want, 1e-6)
                << "pool " << int(pool) << " kernel " << k << " edge " << edge << " head " << h << " key " << t;
          }
        }
        if (edge == 0 || edge == len) {
          ASSERT_TRUE(kc::snapkv_pool(sums.data(), heads, len, sp, whole.data()).ok());
          EXPECT_EQ(got, whole) << "edge " << edge;
        }
      }
    }
  }
  std::vector<float> out(sums.size());
  EXPECT_FALSE(kc::snapkv_pool_split(sums.data(), heads, len, -1, kk::SnapKVParams{}, out.data()).ok());
  EXPECT_FALSE(kc::snapkv_pool_split(sums.data(), heads, len, len + 1, kk::SnapKVParams{}, out.data()).ok());
}

TEST(AttentionStats, RejectsBadArguments) {
  const AttentionCase c = make_case(8, 2, 8, 8, 4, kk::DType::kF32, 1);
  std::vector<float> out(8 * 8 * 4);
  auto bad = [&](kk::AttentionProblem a) { return kc::accumulated_attention(a, {}, out.data()); };
  kk::AttentionProblem a = c.problem();
  a.q = nullptr;
  EXPECT_FALSE(bad(a).ok());
  a = c.problem();
  a.k = nullptr;
  EXPECT_FALSE(bad(a).ok());
  a = c.problem();
  a.num_kv_heads = 3;  // 8 % 3 != 0
  const kk::Status s = bad(a);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("num_kv_heads"), std::string::npos) << s.message();
  a = c.problem();
  a.head_dim = 0;
  EXPECT_FALSE(bad(a).ok());
  a = c.problem();
  a.q_len = -1;
  EXPECT_FALSE(bad(a).ok());
  EXPECT_FALSE(kc::accumulated_attention(c.problem(), {}, nullptr).ok());
  EXPECT_FALSE(kc::accumulated_attention(c.problem(), {3, 3}, out.data()).ok());
  EXPECT_FALSE(kc::accumulated_attention(c.problem(), {0, 9}, out.data()).ok());
  EXPECT_FALSE(kc::snapkv_scores(c.problem(), {0, 3, kk::PoolKind::kAvg}, out.data()).ok());
  EXPECT_FALSE(kc::snapkv_scores(c.problem(), {9, 3, kk::PoolKind::kAvg}, out.data()).ok());
  EXPECT_FALSE(kc::snapkv_scores(c.problem(), {4, 4, kk::PoolKind::kAvg}, out.data()).ok());
  EXPECT_FALSE(kc::attention_row_stats(c.problem(), c.k_mod.data(), nullptr, nullptr).ok());
  EXPECT_FALSE(kc::attention_row_stats(c.problem(), nullptr, nullptr, out.data()).ok());
  std::vector<std::uint8_t> bad_mod(c.k_mod);
  bad_mod[5] = 4;
  EXPECT_FALSE(kc::attention_row_stats(c.problem(), bad_mod.data(), nullptr, out.data()).ok());
  EXPECT_FALSE(kc::cross_modal_interaction(c.problem(), bad_mod.data(), nullptr, out.data(), nullptr).ok());
  AttentionCase rect = make_case(2, 2, 4, 8, 4, kk::DType::kF32, 2);
  EXPECT_FALSE(
      kc::cross_modal_interaction(rect.problem(), rect.k_mod.data(), nullptr, out.data(), nullptr).ok());
  EXPECT_FALSE(kc::reduce_to_kv_heads(out.data(), 8, 3, 4, out.data() + 64).ok());
}
