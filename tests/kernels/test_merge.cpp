// CPU token merging against the float64 reference, plus the merge properties
// (multiplicity conservation, norm restoration, threshold, duplicates) and
// argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kernels/reference_merge.hpp"
#include "kvscope/kernels/merge.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::make_merge_problem;
using kvscope::testing::MergeProblem;
using kvscope::testing::reference_merge;

namespace {

struct MergeResult {
  std::vector<float> k, v;
  std::vector<std::int32_t> mult, map;
};

MergeResult run_cpu(const kk::MergeParams& p, const void* k, const void* v,
                    const std::vector<std::int32_t>& kept, const float* importance) {
  MergeResult r;
  r.k.assign(static_cast<std::size_t>(p.num_heads) * p.num_kept * p.head_dim, -7.0f);
  r.v.assign(r.k.size(), -7.0f);
  r.mult.assign(static_cast<std::size_t>(p.num_heads) * p.num_kept, -7);
  r.map.assign(static_cast<std::size_t>(p.num_heads) * p.num_tokens, -7);
  const kk::Status s = kk::cpu::merge_tokens(p, k, v, kept.data(), importance, r.k.data(), r.v.data(),
                                             r.mult.data(), r.map.data());
  EXPECT_TRUE(s.ok()) << s.message();
  return r;
}

std::string describe(const kk::MergeParams& p) {
  return "H=" + std::to_string(p.num_heads) + " T=" + std::to_string(p.num_tokens) +
         " D=" + std::to_string(p.head_dim) + " K=" + std::to_string(p.num_kept) +
         " w=" + std::to_string(p.window) + " shared=" + std::to_string(p.shared_kept) +
         " dtype=" + kk::dtype_name(p.dtype);
}

struct Shape {
  int H, T, D, K, w;
  bool shared;
};

}  // namespace

TEST(MergeCpu, MatchesFloat64Reference) {
  const Shape shapes[] = {{1, 1, 1, 1, 0, false},      {1, 7, 1, 3, 2, false},
                          {2, 33, 7, 11, 4, false},    {3, 64, 16, 20, 8, true},
                          {4, 300, 64, 150, 6, false}, {2, 1000, 128, 500, 10000, false},
                          {2, 129, 33, 1, 50, false},  {1, 50, 8, 50, 3, false}};
  std::uint64_t seed = 11;
  for (const Shape& sh : shapes) {
    for (bool with_importance : {true, false}) {
      MergeProblem pr = make_merge_problem(sh.H, sh.T, sh.D, sh.K, sh.w, sh.shared, seed++);
      const float* imp = with_importance ? pr.importance.data() : nullptr;
      const MergeResult got = run_cpu(pr.params, pr.k.data(), pr.v.data(), pr.kept, imp);
      const auto ref = reference_merge(pr.params, pr.k, pr.v, pr.kept, imp);
      const std::string what = describe(pr.params) + " importance=" + std::to_string(with_importance);
      EXPECT_EQ(got.map, ref.token_to_slot) << what;
      EXPECT_EQ(got.mult, ref.multiplicity) << what;
      EXPECT_TRUE(all_close(got.k, ref.k_out, 1e-5, 1e-5, what + " k_out"));
      EXPECT_TRUE(all_close(got.v, ref.v_out, 1e-5, 1e-5, what + " v_out"));
    }
  }
}

TEST(MergeCpu, HalfAndBfloat16Inputs) {
  for (kk::DType dt : {kk::DType::kF16, kk::DType::kBF16}) {
    MergeProblem pr = make_merge_problem(3, 97, 40, 31, 5, false, 77);
    pr.params.dtype = dt;
    std::vector<std::uint16_t> kb(pr.k.size()), vb(pr.v.size());
    for (std::size_t i = 0; i < kb.size(); ++i) {
      kb[i] = dt == kk::DType::kF16 ? kk::float_to_half(pr.k[i]) : kk::float_to_bf16(pr.k[i]);
      vb[i] = dt == kk::DType::kF16 ? kk::float_to_half(pr.v[i]) : kk::float_to_bf16(pr.v[i]);
      pr.k[i] = kk::load_element(kb.data(), dt, i);
      pr.v[i] = kk::load_element(vb.data(), dt, i);
    }
    const MergeResult got = run_cpu(pr.params, kb.data(), vb.data(), pr.kept, pr.importance.data());
    const auto ref = reference_merge(pr.params, pr.k, pr.v, pr.kept, pr.importance.data());
    EXPECT_EQ(got.map, ref.token_to_slot) << describe(pr.params);
    EXPECT_TRUE(all_close(got.k, ref.k_out, 1e-5, 1e-5, describe(pr.params) + " k_out"));
    EXPECT_TRUE(all_close(got.v, ref.v_out, 1e-5, 1e-5, describe(pr.params) + " v_out"));
  }
}

TEST(MergeCpu, MultiplicityIsConserved) {
  MergeProblem pr = make_merge_problem(4, 257, 32, 60, 12, false, 5);
  const MergeResult got = run_cpu(pr.params, pr.k.data(), pr.v.data(), pr.kept, pr.importance.data());
  int total_merged = 0;
  for (int h = 0; h < 4; ++h) {
    long long mult = 0, evicted = 0;
    for (int s = 0; s < 60; ++s) mult += got.mult[h * 60 + s];
    for (int t = 0; t < 257; ++t) evicted += got.map[h * 257 + t] == -1;
    EXPECT_EQ(mult + evicted, 257) << "head " << h;
    total_merged += static_cast<int>(mult) - 60;
  }
  EXPECT_GT(total_merged, 50);  // the problem really merges tokens
}

TEST(MergeCpu, MergedNormIsWeightedMeanNorm) {
  MergeProblem pr = make_merge_problem(2, 200, 24, 40, 8, false, 9);
  const MergeResult got = run_cpu(pr.params, pr.k.data(), pr.v.data(), pr.kept, pr.importance.data());
  const int T = 200, D = 24, K = 40;
  int checked = 0;
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < K; ++s) {
      if (got.mult[h * K + s] < 2) continue;
      double ws = 0, target = 0;
      for (int t = 0; t < T; ++t) {
        if (got.map[h * T + t] != s) continue;
        const double w = std::max(0.0f, pr.importance[h * T + t]);
        double n = 0;
        for (int d = 0; d < D; ++d) n += std::pow(pr.k[(static_cast<std::size_t>(h) * T + t) * D + d], 2);
        ws += w;
        target += w * std::sqrt(n);
      }
      double n = 0;
      for (int d = 0; d < D; ++d) n += std::pow(got.k[(static_cast<std::size_t>(h) * K + s) * D + d], 2);
      if (ws > 0) {
        EXPECT_NEAR(std::sqrt(n), target / ws, 1e-4 * target / ws) << "head " << h << " slot " << s;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 10);
}

TEST(MergeCpu, ThresholdOneMergesNothing) {
  MergeProblem pr = make_merge_problem(2, 120, 16, 30, 1000, false, 3);
  // an exact duplicate has cosine 1, which is not > 1: make an evicted token a copy of kept token 0
  int dup = 0;
  while (std::find(pr.kept.begin(), pr.kept.begin() + 30, dup) != pr.kept.begin() + 30) ++dup;
  for (int d = 0; d < 16; ++d) pr.k[dup * 16 + d] = pr.k[pr.kept[0] * 16 + d];
  for (float thr : {1.0f, 1.5f}) {
    pr.params.threshold = thr;
    const MergeResult got = run_cpu(pr.params, pr.k.data(), pr.v.data(), pr.kept, pr.importance.data());
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 30; ++s) {
        EXPECT_EQ(got.mult[h * 30 + s], 1);
        const int t = pr.kept[h * 30 + s];
        for (int d = 0; d < 16; ++d) {  // singletons are exact copies
          ASSERT_EQ(got.k[(h * 30 + s) * 16 + d], pr.k[(static_cast<std::size_t>(h) * 120 + t) * 16 + d]);
          ASSERT_EQ(got.v[(h * 30 + s) * 16 + d], pr.v[(static_cast<std::size_t>(h) * 120 + t) * 16 + d]);
        }
      }
      for (int t = 0; t < 120; ++t) {
        const int m = got.map[h * 120 + t];
        if (m >= 0) {
          EXPECT_EQ(pr.kept[h * 30 + m], t);
        }
      }
    }
  }
}

TEST(MergeCpu, IdenticalDuplicateKeysMerge) {
  // Token 1 duplicates kept token 0's key and value; token 2 is orthogonal.
  const int T = 3, D = 4;
  std::vector<float> k = {1, 2, 3, 4, 1, 2, 3, 4, 0, 0, 0, 5};
  std::vector<float> v = {1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0};
  std::vector<std::int32_t> kept = {0};
  kk::MergeParams p;
  p.num_heads = 1;
  p.num_tokens = T;
  p.head_dim = D;
  p.num_kept = 1;
  p.window = 4;
  p.threshold = 0.999f;
  std::vector<float> imp = {0.25f, 0.75f, 1.0f};
  const MergeResult got = run_cpu(p, k.data(), v.data(), kept, imp.data());
  EXPECT_EQ(got.map, (std::vector<std::int32_t>{0, 0, -1}));
  EXPECT_EQ(got.mult[0], 2);
  EXPECT_TRUE(all_close(got.k, std::vector<float>{1, 2, 3, 4}, 1e-6, 1e-6, "duplicate key"));
  EXPECT_TRUE(all_close(got.v, std::vector<float>{1, 0, 0, 0}, 1e-6, 1e-6, "duplicate value"));
}

TEST(MergeCpu, ZeroWeightsFallBackToUniform) {
  // Two members with norms 1 and 3 along the same direction: uniform weights give norm 2.
  std::vector<float> k = {1, 0, 3, 0}, v = {0, 1, 0, 3};
  std::vector<std::int32_t> kept = {1};
  std::vector<float> imp = {0.0f, -1.0f};
  kk::MergeParams p;
  p.num_heads = 1;
  p.num_tokens = 2;
  p.head_dim = 2;
  p.num_kept = 1;
  p.window = 1;
  p.threshold = 0.5f;
  const MergeResult got = run_cpu(p, k.data(), v.data(), kept, imp.data());
  EXPECT_EQ(got.mult[0], 2);
  EXPECT_TRUE(all_close(got.k, std::vector<float>{2, 0}, 1e-6, 1e-6, "uniform fallback k"));
  EXPECT_TRUE(all_close(got.v, std::vector<float>{0, 2}, 1e-6, 1e-6, "uniform fallback v"));
}

TEST(MergeCpu, SimilarityTiesGoToLowerSlot) {
  // Token 1 has the same cosine (1) with kept tokens 0 and 2: joins slot 0.
  std::vector<float> k = {1, 1, 2, 2, 3, 3}, v(6, 1.0f);
  std::vector<std::int32_t> kept = {0, 2};
  kk::MergeParams p;
  p.num_heads = 1;
  p.num_tokens = 3;
  p.head_dim = 2;
  p.num_kept = 2;
  p.window = 1;
  p.threshold = 0.0f;
  const MergeResult got = run_cpu(p, k.data(), v.data(), kept, nullptr);
  EXPECT_EQ(got.map, (std::vector<std::int32_t>{0, 0, 1}));
}

TEST(MergeCpu, SharedKeptEqualsReplicatedKept) {
  MergeProblem pr = make_merge_problem(3, 80, 12, 25, 5, true, 21);
  const MergeResult shared = run_cpu(pr.params, pr.k.data(), pr.v.data(), pr.kept, pr.importance.data());
  std::vector<std::int32_t> rep;
  for (int h = 0; h < 3; ++h) rep.insert(rep.end(), pr.kept.begin(), pr.kept.end());
  pr.params.shared_kept = false;
  const MergeResult full = run_cpu(pr.params, pr.k.data(), pr.v.data(), rep, pr.importance.data());
  EXPECT_EQ(shared.map, full.map);
  EXPECT_EQ(shared.k, full.k);
  EXPECT_EQ(shared.v, full.v);
}

TEST(MergeCpu, RejectsBadArguments) {
  MergeProblem pr = make_merge_problem(2, 10, 4, 3, 2, false, 1);
  std::vector<float> ko(2 * 3 * 4), vo(ko.size());
  std::vector<std::int32_t> mult(6), map(20);
  auto call = [&](kk::MergeParams p, const std::vector<std::int32_t>& kept, const void* k = nullptr) {
    return kk::cpu::merge_tokens(p, k ? k : pr.k.data(), pr.v.data(), kept.data(), nullptr, ko.data(),
                                 vo.data(), mult.data(), map.data());
  };
  EXPECT_TRUE(call(pr.params, pr.kept).ok());
  kk::MergeParams p = pr.params;
  p.head_dim = 0;
  EXPECT_FALSE(call(p, pr.kept).ok());
  p = pr.params;
  p.num_kept = 11;
  EXPECT_FALSE(call(p, pr.kept).ok());
  p = pr.params;
  p.num_kept = 0;
  EXPECT_FALSE(call(p, pr.kept).ok());
  p = pr.params;
  p.window = -1;
  EXPECT_FALSE(call(p, pr.kept).ok());
  p = pr.params;
  p.num_tokens = -3;
  EXPECT_FALSE(call(p, pr.kept).ok());
  std::vector<std::int32_t> bad = pr.kept;
  bad[1] = bad[0];  // not strictly increasing
  const kk::Status s = call(pr.params, bad);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("kept"), std::string::npos) << s.message();
  bad = pr.kept;
  bad[5] = 10;  // out of range
  EXPECT_FALSE(call(pr.params, bad).ok());
  EXPECT_FALSE(kk::cpu::merge_tokens(pr.params, pr.k.data(), pr.v.data(), pr.kept.data(), nullptr, nullptr,
                                     vo.data(), mult.data(), map.data())
                   .ok());
}
