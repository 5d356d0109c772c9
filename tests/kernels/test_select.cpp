// CPU token selection vs a sorted-walk reference (many ties, NaN, budgets,
// forced sets), plus the selection properties and argument validation.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kernels/reference_select.hpp"
#include "kvscope/kernels/select.hpp"

namespace kk = kvscope::kernels;
namespace kc = kvscope::kernels::cpu;
using kvscope::testing::reference_select;
using kvscope::testing::tied_scores;

namespace {

struct Case {
  int H, T;
  kk::SelectParams p;
  std::vector<float> scores;
  std::vector<std::uint8_t> mod, prot;
  std::string params() const {
    return "H=" + std::to_string(H) + " T=" + std::to_string(T) + " k=" + std::to_string(p.k) +
           " budgets=" + std::to_string(p.use_modality_budgets) + " [" +
           std::to_string(p.modality_budget[0]) + "," + std::to_string(p.modality_budget[1]) + "," +
           std::to_string(p.modality_budget[2]) + "," + std::to_string(p.modality_budget[3]) +
           "] redistribute=" + std::to_string(p.redistribute_leftover) +
           " sinks=" + std::to_string(p.num_sinks) + " recent=" + std::to_string(p.recent_window) +
           " protected=" + std::to_string(p.protected_mask != nullptr);
  }
};

// Random cases; modality 2 is rare so its budget often cannot be filled.
std::vector<Case> make_cases() {
  std::vector<Case> cases;
  std::uint64_t seed = 100;
  for (auto [H, T] : {std::pair{1, 1}, {1, 7}, {3, 33}, {8, 576}, {2, 2048}}) {
    for (int variant = 0; variant < 8; ++variant) {
      Case c;
      c.H = H, c.T = T;
      std::mt19937_64 rng(seed++);
      c.scores = tied_scores(static_cast<std::size_t>(H) * T, seed++, variant % 2 ? 4 : 1000, variant == 5);
      c.mod.resize(T);
      for (auto& m : c.mod) {
        const auto r = rng() % 20;
        m = static_cast<std::uint8_t>(r < 8 ? 0 : r < 17 ? 1 : r < 18 ? 2 : 3);
      }
      c.prot.resize(T);
      for (auto& x : c.prot) x = rng() % 29 == 0 ? 1 : 0;
      c.p.k = std::max(1, static_cast<int>(T * (0.2 + 0.1 * variant)));
      if (variant >= 2) c.p.num_sinks = std::min(T, static_cast<int>(rng() % 5)), c.p.recent_window = T / 16;
      if (variant >= 3) c.p.protected_mask = c.prot.data();
      if (variant >= 4) {
        c.p.use_modality_budgets = true;
        c.p.modality = c.mod.data();
        int left = c.p.k;
        for (int m = 0; m < 3; ++m) {
          c.p.modality_budget[m] = static_cast<int>(rng() % (left + 1));
          left -= c.p.modality_budget[m];
        }
        c.p.modality_budget[3] = left;
        c.p.redistribute_leftover = variant != 6;
      }
      if (!kc::validate_select(c.p, H, T, true, "test").ok()) {
        c.p.protected_mask = nullptr;  // forced set too large for this k
        c.p.num_sinks = c.p.recent_window = 0;
      }
      cases.push_back(c);
    }
  }
  for (Case& c : cases) {  // re-point the copied cases at their own arrays
    if (c.p.modality != nullptr) c.p.modality = c.mod.data();
    if (c.p.protected_mask != nullptr) c.p.protected_mask = c.prot.data();
  }
  return cases;
}

}  // namespace

TEST(Select, PerHeadMatchesReference) {
  for (Case& c : make_cases()) {
    std::vector<std::int32_t> out(static_cast<std::size_t>(c.H) * c.p.k, -5), counts(c.H, -5);
    ASSERT_TRUE(kc::select_topk(c.scores.data(), c.H, c.T, c.p, out.data(), counts.data()).ok())
        << c.params();
    for (int h = 0; h < c.H; ++h) {
      const auto want = reference_select(c.scores.data() + static_cast<std::size_t>(h) * c.T, c.T, c.p);
      std::vector<std::int32_t> got(out.begin() + h * c.p.k, out.begin() + h * c.p.k + counts[h]);
      EXPECT_EQ(got, want) << c.params() << " head " << h;
      for (int i = counts[h]; i < c.p.k; ++i) EXPECT_EQ(out[h * c.p.k + i], -1) << c.params() << " padding";
    }
  }
}

TEST(Select, SharedMatchesReferenceOnHeadMean) {
  for (Case& c : make_cases()) {
    // integer-valued scores: the float head mean is exact up to 1/H rounding, computed as the kernel does
    std::vector<float> mean(c.T);
    for (int t = 0; t < c.T; ++t) {
      float s = 0.0f;
      for (int h = 0; h < c.H; ++h) s += c.scores[static_cast<std::size_t>(h) * c.T + t];
      mean[t] = s * (1.0f / static_cast<float>(c.H));
    }
    std::vector<std::int32_t> out(c.p.k, -5);
    std::int32_t count = -5;
    ASSERT_TRUE(kc::select_topk_shared(c.scores.data(), c.H, c.T, c.p, out.data(), &count).ok())
        << c.params();
    const auto want = reference_select(mean.data(), c.T, c.p);
    EXPECT_EQ(std::vector<std::int32_t>(out.begin(), out.begin() + count), want) << c.params();
  }
}

TEST(Select, BudgetsForcedTokensAndOrderProperties) {
  int feasible_cases = 0;
  for (Case& c : make_cases()) {
    std::vector<std::int32_t> out(static_cast<std::size_t>(c.H) * c.p.k), counts(c.H);
    ASSERT_TRUE(kc::select_topk(c.scores.data(), c.H, c.T, c.p, out.data(), counts.data()).ok());
    int avail[4] = {0, 0, 0, 0}, forced_in[4] = {0, 0, 0, 0};
    for (int t = 0; t < c.T; ++t) {
      ++avail[c.mod[t]];
      if (kk::detail::select_forced(c.p, c.T, t)) ++forced_in[c.mod[t]];
    }
    bool budgets_feasible = c.p.use_modality_budgets;
    for (int m = 0; m < 4; ++m)
      budgets_feasible =
          budgets_feasible && avail[m] >= c.p.modality_budget[m] && forced_in[m] <= c.p.modality_budget[m];
    feasible_cases += budgets_feasible ? 1 : 0;
    for (int h = 0; h < c.H; ++h) {
      const std::int32_t* row = out.data() + h * c.p.k;
      if (!c.p.use_modality_budgets || c.p.redistribute_leftover || budgets_feasible) {
        EXPECT_EQ(counts[h], c.p.k) << c.params();
      }
      std::set<int> kept(row, row + counts[h]);
      EXPECT_EQ(kept.size(), static_cast<std::size_t>(counts[h])) << c.params() << " unique";
      for (int i = 1; i < counts[h]; ++i) EXPECT_LT(row[i - 1], row[i]) << c.params() << " sorted";
      for (int t = 0; t < c.T; ++t) {
        if (kk::detail::select_forced(c.p, c.T, t)) {
          EXPECT_TRUE(kept.count(t)) << c.params() << " forced " << t;
        }
      }
      if (budgets_feasible) {
        int per[4] = {0, 0, 0, 0};
        for (int t : kept) ++per[c.mod[t]];
        for (int m = 0; m < 4; ++m)
          EXPECT_EQ(per[m], c.p.modality_budget[m]) << c.params() << " modality " << m;
      }
    }
  }
  EXPECT_GE(feasible_cases, 3);  // the per-modality count check above really ran
}

TEST(Select, TiesGoToLowerIndex) {
  const int T = 50;
  std::vector<float> s(T, 1.0f);
  s[40] = 2.0f;  // the single best
  kk::SelectParams p;
  p.k = 5;
  std::vector<std::int32_t> out(5);
  ASSERT_TRUE(kc::select_topk(s.data(), 1, T, p, out.data(), nullptr).ok());
  EXPECT_EQ(out, (std::vector<std::int32_t>{0, 1, 2, 3, 40}));
  // -0 ties with +0; NaN ranks as -inf, and equal ranks go to the lower index.
  std::vector<float> z = {NAN, -0.0f, -INFINITY, 0.0f, NAN, -1.0f};
  p.k = 3;
  out.assign(3, 0);
  ASSERT_TRUE(kc::select_topk(z.data(), 1, 6, p, out.data(), nullptr).ok());
  EXPECT_EQ(out, (std::vector<std::int32_t>{1, 3, 5}));
  p.k = 5;  // then -inf (index 2) ties with NaN at index 0: lower index wins
  out.assign(5, 0);
  ASSERT_TRUE(kc::select_topk(z.data(), 1, 6, p, out.data(), nullptr).ok());
  EXPECT_EQ(out, (std::vector<std::int32_t>{0, 1, 2, 3, 5}));
}

TEST(Select, ForcedTokensCountAgainstTheirModality) {
  // 10 text (0..9) then 10 vision (10..19); vision scores are all higher.
  std::vector<float> s(20);
  std::vector<std::uint8_t> mod(20);
  for (int t = 0; t < 20; ++t) s[t] = static_cast<float>(t), mod[t] = t < 10 ? 0 : 1;
  kk::SelectParams p;
  p.k = 6;
  p.use_modality_budgets = true;
  p.modality = mod.data();
  p.modality_budget[0] = 2, p.modality_budget[1] = 4;
  p.num_sinks = 1;  // token 0 (text) is forced and uses one of the 2 text slots
  std::vector<std::int32_t> out(6);
  ASSERT_TRUE(kc::select_topk(s.data(), 1, 20, p, out.data(), nullptr).ok());
  EXPECT_EQ(out, (std::vector<std::int32_t>{0, 9, 16, 17, 18, 19}));
  // 3 forced text tokens exceed the text budget of 2: the worst vision pick makes room.
  p.num_sinks = 3;
  ASSERT_TRUE(kc::select_topk(s.data(), 1, 20, p, out.data(), nullptr).ok());
  EXPECT_EQ(out, (std::vector<std::int32_t>{0, 1, 2, 17, 18, 19}));
  // Forced set larger than k: an error naming the numbers, nothing dropped silently.
  p.num_sinks = 4, p.recent_window = 3;
  const kk::Status st = kc::select_topk(s.data(), 1, 20, p, out.data(), nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("7 forced tokens"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("k = 6"), std::string::npos) << st.message();
}

TEST(Select, LeftoverBudgetRedistribution) {
  // Only 2 audio tokens but an audio budget of 4.
  std::vector<float> s = {5, 4, 3, 2, 1, 9, 8, 7};
  std::vector<std::uint8_t> mod = {0, 0, 0, 0, 0, 2, 2, 1};
  kk::SelectParams p;
  p.k = 6;
  p.use_modality_budgets = true;
  p.modality = mod.data();
  p.modality_budget[0] = 1, p.modality_budget[1] = 1, p.modality_budget[2] = 4;
  std::vector<std::int32_t> out(6);
  std::int32_t count = 0;
  ASSERT_TRUE(kc::select_topk(s.data(), 1, 8, p, out.data(), &count).ok());
  EXPECT_EQ(count, 6);
  EXPECT_EQ(out, (std::vector<std::int32_t>{0, 1, 2, 5, 6, 7}));
  p.redistribute_leftover = false;
  ASSERT_TRUE(kc::select_topk(s.data(), 1, 8, p, out.data(), &count).ok());
  EXPECT_EQ(count, 4);
  EXPECT_EQ(out, (std::vector<std::int32_t>{0, 5, 6, 7, -1, -1}));
}

TEST(Select, RejectsBadArguments) {
  std::vector<float> s(10, 1.0f);
  std::vector<std::uint8_t> mod(10, 0);
  std::vector<std::int32_t> out(20);
  kk::SelectParams p;
  p.k = 0;
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());
  p.k = 11;
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());
  p.k = 4;
  EXPECT_FALSE(kc::select_topk(nullptr, 1, 10, p, out.data(), nullptr).ok());
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, nullptr, nullptr).ok());
  EXPECT_FALSE(kc::select_topk(s.data(), 0, 10, p, out.data(), nullptr).ok());
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 0, p, out.data(), nullptr).ok());
  p.num_sinks = -1;
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());
  p.num_sinks = 0;
  p.use_modality_budgets = true;
  p.modality_budget[0] = 4;
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());  // modality array missing
  p.modality = mod.data();
  EXPECT_TRUE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());
  p.modality_budget[0] = 3;
  const kk::Status st = kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("sum to 3"), std::string::npos) << st.message();
  p.modality_budget[0] = 5, p.modality_budget[1] = -1;
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());
  p.modality_budget[0] = 4, p.modality_budget[1] = 0;
  mod[2] = 9;
  EXPECT_FALSE(kc::select_topk(s.data(), 1, 10, p, out.data(), nullptr).ok());
  EXPECT_FALSE(kc::select_topk_shared(s.data(), 1, 10, p, out.data(), nullptr).ok());
}
