// CPU compressed-cache evaluation against the float64 reference on random ragged
// caches, plus the properties: an uncompressed cache is lossless, dropping a
// modality gives R_m = 0, proportional attention equals duplicated tokens; and
// argument validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kernels/reference_evaluate.hpp"
#include "kvscope/kernels/evaluate.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::EvalProblem;
using kvscope::testing::make_eval_problem;
using kvscope::testing::reference_evaluate;

namespace {

struct EvalResult {
  std::vector<float> output_error, recall, kl, entropy_change, recall_modality, mass_full, mass_compressed;
  kk::EvaluateOutputs outputs() {
    return {output_error.data(),   recall.data(),          kl.data(),
            entropy_change.data(), recall_modality.data(), mass_full.data(),
            mass_compressed.data()};
  }
  explicit EvalResult(std::size_t rows)
      : output_error(rows, -9.0f),
        recall(rows, -9.0f),
        kl(rows, -9.0f),
        entropy_change(rows, -9.0f),
        recall_modality(rows * 4, -9.0f),
        mass_full(rows * 4, -9.0f),
        mass_compressed(rows * 4, -9.0f) {}
};

EvalResult run_cpu(const EvalProblem& pr, const void* q = nullptr, const void* k = nullptr,
                   const void* v = nullptr) {
  EvalResult r(static_cast<std::size_t>(pr.params.num_q_heads) * pr.params.num_queries);
  const kk::Status s =
      kk::cpu::evaluate_attention(pr.params, q ? q : pr.q.data(), k ? k : pr.k.data(), v ? v : pr.v.data(),
                                  pr.modality.data(), pr.cache(), r.outputs());
  EXPECT_TRUE(s.ok()) << s.message();
  return r;
}

std::string describe(const EvalProblem& pr) {
  const auto& p = pr.params;
  return "Hq=" + std::to_string(p.num_q_heads) + " Hkv=" + std::to_string(p.num_kv_heads) +
         " Nq=" + std::to_string(p.num_queries) + " T=" + std::to_string(p.num_tokens) +
         " D=" + std::to_string(p.head_dim) + " slots=" + std::to_string(pr.offsets.back()) +
         " prop=" + std::to_string(p.proportional_attention) + " dtype=" + kk::dtype_name(p.dtype);
}

void expect_matches_reference(const EvalResult& got, const EvalProblem& pr, double tol) {
  const auto ref = reference_evaluate(pr);
  const std::string what = describe(pr);
  EXPECT_TRUE(all_close(got.output_error, ref.output_error, tol, 1e-4, what + " output_error"));
  EXPECT_TRUE(all_close(got.recall, ref.recall, tol, 1e-5, what + " recall"));
  EXPECT_TRUE(all_close(got.kl, ref.kl, tol, 1e-4, what + " kl"));
  EXPECT_TRUE(all_close(got.entropy_change, ref.entropy_change, tol, 1e-4, what + " entropy_change"));
  EXPECT_TRUE(all_close(got.recall_modality, ref.recall_modality, tol, 1e-5, what + " recall_modality"));
  EXPECT_TRUE(all_close(got.mass_full, ref.mass_full, tol, 1e-5, what + " mass_full"));
  EXPECT_TRUE(all_close(got.mass_compressed, ref.mass_compressed, tol, 1e-5, what + " mass_compressed"));
}

// Compressed cache = the full cache: one slot per token, n = 1.
void make_lossless(EvalProblem& pr, bool int_mult) {
  const int Hkv = pr.params.num_kv_heads, T = pr.params.num_tokens;
  pr.slot_k = pr.k;
  pr.slot_v = pr.v;
  pr.offsets.clear();
  for (int h = 0; h <= Hkv; ++h) pr.offsets.push_back(h * T);
  pr.mult_f32.clear();
  pr.mult_i32.clear();
  if (int_mult) {
    pr.mult_i32.assign(static_cast<std::size_t>(Hkv) * T, 1);
  } else {
    pr.mult_f32.assign(static_cast<std::size_t>(Hkv) * T, 1.0f);
  }
  pr.slot_modality.clear();
  for (int h = 0; h < Hkv; ++h)
    pr.slot_modality.insert(pr.slot_modality.end(), pr.modality.begin(), pr.modality.end());
  for (int h = 0; h < Hkv; ++h)
    for (int t = 0; t < T; ++t) pr.token_to_slot[static_cast<std::size_t>(h) * T + t] = t;
}

}  // namespace

TEST(EvaluateCpu, MatchesFloat64Reference) {
  struct Shape {
    int Hq, Hkv, Nq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 1},     {2, 1, 3, 7, 5},     {4, 2, 5, 33, 16},
                          {6, 3, 17, 130, 64}, {8, 2, 4, 577, 128}, {3, 3, 2, 40, 37}};
  std::uint64_t seed = 1000;
  for (const Shape& sh : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      EvalProblem pr = make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed++, variant == 1);
      pr.params.proportional_attention = variant != 2;
      expect_matches_reference(run_cpu(pr), pr, 2e-5);
    }
  }
}

TEST(EvaluateCpu, HalfAndBfloat16Inputs) {
  for (kk::DType dt : {kk::DType::kF16, kk::DType::kBF16}) {
    EvalProblem pr = make_eval_problem(4, 2, 3, 70, 32, 55);
    pr.params.dtype = dt;
    auto encode = [&](std::vector<float>& x) {
      std::vector<std::uint16_t> b(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        b[i] = dt == kk::DType::kF16 ? kk::float_to_half(x[i]) : kk::float_to_bf16(x[i]);
        x[i] = kk::load_element(b.data(), dt, i);
      }
      return b;
    };
    const auto qb = encode(pr.q), kb = encode(pr.k), vb = encode(pr.v);
    expect_matches_reference(run_cpu(pr, qb.data(), kb.data(), vb.data()), pr, 2e-5);
  }
}

TEST(EvaluateCpu, UncompressedCacheIsLossless) {
  for (bool int_mult : {false, true}) {
    EvalProblem pr = make_eval_problem(4, 2, 6, 300, 64, 7);
    make_lossless(pr, int_mult);
    const EvalResult r = run_cpu(pr);
    for (std::size_t i = 0; i < r.recall.size(); ++i) {
      EXPECT_LE(r.output_error[i], 1e-6f) << i;
      EXPECT_NEAR(r.recall[i], 1.0f, 1e-6f) << i;
      EXPECT_NEAR(r.kl[i], 0.0f, 1e-6f) << i;
      EXPECT_NEAR(r.entropy_change[i], 0.0f, 1e-6f) << i;
      for (int m = 0; m < 4; ++m) {
        EXPECT_EQ(r.recall_modality[i * 4 + m], 1.0f);
        EXPECT_NEAR(r.mass_full[i * 4 + m], r.mass_compressed[i * 4 + m], 1e-6f);
      }
    }
  }
}

TEST(EvaluateCpu, DroppingAModalityGivesZeroModalityRecall) {
  EvalProblem pr = make_eval_problem(2, 2, 5, 100, 16, 8);
  make_lossless(pr, false);
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 100; ++t)
      if (pr.modality[t] == 1) pr.token_to_slot[h * 100 + t] = -1;
  const EvalResult r = run_cpu(pr);
  for (std::size_t i = 0; i < r.recall.size(); ++i) {
    EXPECT_GT(r.mass_full[i * 4 + 1], 0.0f);
    EXPECT_EQ(r.recall_modality[i * 4 + 1], 0.0f);
    EXPECT_NEAR(r.recall_modality[i * 4 + 0], 1.0f, 1e-6f);
    EXPECT_NEAR(r.recall[i], 1.0f - r.mass_full[i * 4 + 1], 1e-5f);
  }
}

TEST(EvaluateCpu, ProportionalAttentionEqualsDuplicatedTokens) {
  // Full cache: token u repeated n_u times; compressed: one slot per distinct token with n_u.
  const int Hq = 2, Hkv = 1, Nq = 4, U = 20, D = 16;
  const auto uk = kvscope::testing::random_normal(static_cast<std::size_t>(U) * D, 31);
  const auto uv = kvscope::testing::random_normal(static_cast<std::size_t>(U) * D, 32);
  EvalProblem pr;
  pr.params = {Hq, Hkv, Nq, 0, D, kk::DType::kF32, true};
  pr.q = kvscope::testing::random_normal(static_cast<std::size_t>(Hq) * Nq * D, 33);
  pr.offsets = {0, U};
  pr.slot_k = uk;
  pr.slot_v = uv;
  for (int u = 0; u < U; ++u) {
    const int n = 1 + (u * 7) % 5;
    pr.mult_i32.push_back(n);
    pr.slot_modality.push_back(static_cast<std::uint8_t>(u % 2));
    for (int c = 0; c < n; ++c) {
      pr.k.insert(pr.k.end(), uk.begin() + u * D, uk.begin() + (u + 1) * D);
      pr.v.insert(pr.v.end(), uv.begin() + u * D, uv.begin() + (u + 1) * D);
      pr.modality.push_back(static_cast<std::uint8_t>(u % 2));
      pr.token_to_slot.push_back(u);
    }
  }
  pr.params.num_tokens = static_cast<int>(pr.modality.size());
  const EvalResult r = run_cpu(pr);
  for (std::size_t i = 0; i < r.recall.size(); ++i) {
    EXPECT_LE(r.output_error[i], 1e-5f) << i;
    EXPECT_NEAR(r.kl[i], 0.0f, 1e-6f) << i;
    for (int m = 0; m < 4; ++m) EXPECT_NEAR(r.mass_full[i * 4 + m], r.mass_compressed[i * 4 + m], 1e-6f);
  }
  pr.params.proportional_attention = false;  // without log n the duplicates are under-weighted
  const EvalResult off = run_cpu(pr);
  EXPECT_GT(off.output_error[0], 1e-3f);
}

TEST(EvaluateCpu, EverythingEvictedAndEmptyHeads) {
  EvalProblem pr = make_eval_problem(2, 2, 3, 25, 8, 12);
  for (auto& m : pr.token_to_slot) m = -1;
  // head 1 has no slots at all
  const int s0 = pr.offsets[1];
  pr.slot_k.resize(static_cast<std::size_t>(s0) * 8);
  pr.slot_v.resize(static_cast<std::size_t>(s0) * 8);
  pr.mult_f32.resize(s0);
  pr.slot_modality.resize(s0);
  pr.offsets[2] = s0;
  const EvalResult r = run_cpu(pr);
  expect_matches_reference(r, pr, 2e-5);
  for (std::size_t i = 0; i < r.recall.size(); ++i) {
    EXPECT_EQ(r.recall[i], 0.0f);
    EXPECT_EQ(r.kl[i], 0.0f);
    EXPECT_TRUE(std::isfinite(r.entropy_change[i]));
  }
  for (std::size_t i = 3; i < 6; ++i) EXPECT_NEAR(r.output_error[i], 1.0f, 1e-6f);  // o~ = 0
}

TEST(EvaluateCpu, NullOutputsAreSkipped) {
  EvalProblem pr = make_eval_problem(2, 1, 2, 10, 4, 3);
  std::vector<float> recall(4, -1.0f);
  kk::EvaluateOutputs out;
  out.recall = recall.data();
  ASSERT_TRUE(kk::cpu::evaluate_attention(pr.params, pr.q.data(), pr.k.data(), pr.v.data(),
                                          pr.modality.data(), pr.cache(), out)
                  .ok());
  const auto ref = reference_evaluate(pr);
  EXPECT_TRUE(all_close(recall, ref.recall, 1e-6, 1e-5, "recall only"));
}

// Values whose attention logits or sums overflow float32 give no NaN or infinite metric: the call
// fails (the common path pays one isfinite per row). float32 q, k of 1e30: q . k ~ 1e60.
TEST(EvaluateCpu, NonFiniteMetricsFailTheCall) {
  for (int which = 0; which < 3; ++which) {
    EvalProblem pr = make_eval_problem(4, 2, 3, 40, 16, 21);
    if (which == 0) {  // logits overflow on both sides
      for (auto& x : pr.q) x *= 1e30f;
      for (auto& x : pr.k) x *= 1e30f;
      for (auto& x : pr.slot_k) x *= 1e30f;
    }
    if (which == 1) {  // only the compressed cache's keys
      for (auto& x : pr.q) x *= 1e19f;
      for (auto& x : pr.slot_k) x *= 1e20f;
    }
    if (which == 2) {  // values: the unnormalised compressed sum o~ overflows
      for (auto& x : pr.v) x *= 3e38f / 4;
      for (auto& x : pr.slot_v) x = x >= 0 ? 3.3e38f : -3.3e38f;
    }
    EvalResult r(static_cast<std::size_t>(pr.params.num_q_heads) * pr.params.num_queries);
    const kk::Status s =
        kk::cpu::evaluate_attention(pr.params, pr.q.data(), pr.k.data(), pr.v.data(), pr.modality.data(),
                                    pr.cache(), r.outputs());
    EXPECT_FALSE(s.ok()) << "case " << which;
    EXPECT_NE(s.message().find("a metric is not finite in float32"), std::string::npos) << s.message();
  }
  // The full-cache side alone.
  EvalProblem pr = make_eval_problem(2, 1, 2, 30, 8, 22);
  for (auto& x : pr.q) x *= 1e30f;
  for (auto& x : pr.k) x *= 1e30f;
  const std::size_t rows = 4;
  std::vector<float> probs(rows * 30), output(rows * 8), entropy(rows);
  const kk::Status s = kk::cpu::full_attention(pr.params, pr.q.data(), pr.k.data(), pr.v.data(), nullptr,
                                               {probs.data(), output.data(), entropy.data(), nullptr});
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message(), std::string("full_attention: a metric is not finite in float32 (attention logits, norms "
                                     "or sums overflow: inputs outside the range this kernel computes in; "
                                     "outputs undefined)"));
}

TEST(EvaluateCpu, RejectsBadArguments) {
  EvalProblem pr = make_eval_problem(4, 2, 2, 12, 8, 4);
  EvalResult r(8);
  auto call = [&](const EvalProblem& x) {
    return kk::cpu::evaluate_attention(x.params, x.q.data(), x.k.data(), x.v.data(), x.modality.data(),
                                       x.cache(), r.outputs());
  };
  EXPECT_TRUE(call(pr).ok());
  EvalProblem bad = pr;
  bad.params.num_q_heads = 3;
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.params.head_dim = 0;
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.modality[3] = 4;
  kk::Status s = call(bad);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("modality[3]"), std::string::npos) << s.message();
  bad = pr;
  bad.token_to_slot[12 + 5] = pr.offsets[2] - pr.offsets[1];  // one past head 1's slots
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.token_to_slot[0] = -2;
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.mult_f32[0] = 0.0f;
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.mult_i32.assign(bad.mult_f32.size(), 1);  // both multiplicity arrays set
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.offsets[1] = bad.offsets[2] + 1;  // decreasing
  EXPECT_FALSE(call(bad).ok());
  bad = pr;
  bad.slot_modality[0] = 9;
  EXPECT_FALSE(call(bad).ok());
  EXPECT_FALSE(kk::cpu::evaluate_attention(pr.params, pr.q.data(), pr.k.data(), pr.v.data(),
                                           pr.modality.data(), pr.cache(), kk::EvaluateOutputs{})
                   .ok());
  EXPECT_FALSE(kk::cpu::evaluate_attention(pr.params, nullptr, pr.k.data(), pr.v.data(), pr.modality.data(),
                                           pr.cache(), r.outputs())
                   .ok());
}

// ---- FullAttention: precomputed full-cache side, reused for every compressed cache ----

namespace {

struct FullBuffers {
  std::vector<float> probs, output, entropy, mass;  // [R, T], [R, D], [R], [R, 4]
  explicit FullBuffers(const kk::EvaluateParams& p) {
    const std::size_t rows = static_cast<std::size_t>(p.num_q_heads) * p.num_queries;
    probs.assign(rows * p.num_tokens, -9.0f);
    output.assign(rows * p.head_dim, -9.0f);
    entropy.assign(rows, -9.0f);
    mass.assign(rows * 4, -9.0f);
  }
  kk::FullAttention view() { return {probs.data(), output.data(), entropy.data(), mass.data()}; }
};

// Float64 full attention of every (q head, query) row.
void reference_full(const EvalProblem& pr, std::vector<double>& probs, std::vector<double>& output,
                    std::vector<double>& entropy, std::vector<double>& mass) {
  const auto& p = pr.params;
  const int Hq = p.num_q_heads, Nq = p.num_queries, T = p.num_tokens, D = p.head_dim;
  const int G = Hq / p.num_kv_heads;
  const std::size_t rows = static_cast<std::size_t>(Hq) * Nq;
  probs.assign(rows * T, 0.0);
  output.assign(rows * D, 0.0);
  entropy.assign(rows, 0.0);
  mass.assign(rows * 4, 0.0);
  for (std::size_t r = 0; r < rows; ++r) {
    const int h = static_cast<int>(r / Nq) / G;
    std::vector<double> z(T);
    double m = -1e300;
    for (int t = 0; t < T; ++t) {
      double s = 0.0;
      for (int d = 0; d < D; ++d)
        s += static_cast<double>(pr.q[r * D + d]) * pr.k[(static_cast<std::size_t>(h) * T + t) * D + d];
      z[t] = s / std::sqrt(static_cast<double>(D));
      m = std::max(m, z[t]);
    }
    double sum = 0.0;
    for (int t = 0; t < T; ++t) sum += std::exp(z[t] - m);
    for (int t = 0; t < T; ++t) {
      const double pt = std::exp(z[t] - m) / sum;
      probs[r * T + t] = pt;
      entropy[r] -= pt > 0.0 ? pt * std::log(pt) : 0.0;
      mass[r * 4 + pr.modality[t]] += pt;
      for (int d = 0; d < D; ++d)
        output[r * D + d] += pt * pr.v[(static_cast<std::size_t>(h) * T + t) * D + d];
    }
  }
}

}  // namespace

TEST(EvaluateCpu, FullAttentionMatchesFloat64Reference) {
  struct Shape {
    int Hq, Hkv, Nq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 1}, {2, 1, 3, 7, 5}, {4, 2, 33, 33, 16}, {8, 2, 20, 577, 128}};
  std::uint64_t seed = 3000;
  for (const Shape& sh : shapes) {
    const EvalProblem pr = make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed++);
    FullBuffers got(pr.params);
    const kk::Status s = kk::cpu::full_attention(pr.params, pr.q.data(), pr.k.data(), pr.v.data(),
                                                 pr.modality.data(), got.view());
    ASSERT_TRUE(s.ok()) << s.message();
    std::vector<double> probs, output, entropy, mass;
    reference_full(pr, probs, output, entropy, mass);
    const std::string what = describe(pr);
    EXPECT_TRUE(all_close(got.probs, probs, 1e-7, 1e-5, what + " probs"));
    EXPECT_TRUE(all_close(got.output, output, 1e-6, 1e-4, what + " output"));
    EXPECT_TRUE(all_close(got.entropy, entropy, 1e-5, 1e-5, what + " entropy"));
    EXPECT_TRUE(all_close(got.mass, mass, 1e-6, 1e-5, what + " modality_mass"));
  }
}

// One full_attention per layer reused for several caches gives exactly the k/v path.
TEST(EvaluateCpu, FullAttentionOverloadEqualsKvOverloadBitForBit) {
  struct Shape {
    int Hq, Hkv, Nq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 1}, {4, 2, 5, 33, 16}, {6, 3, 17, 130, 64}, {8, 2, 9, 300, 128}};
  std::uint64_t seed = 4000;
  for (const Shape& sh : shapes) {
    EvalProblem pr = make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed++);
    FullBuffers full(pr.params);
    ASSERT_TRUE(kk::cpu::full_attention(pr.params, pr.q.data(), pr.k.data(), pr.v.data(), pr.modality.data(),
                                        full.view())
                    .ok());
    for (int variant = 0; variant < 3; ++variant) {  // three caches over the same layer
      EvalProblem c = variant == 0 ? pr
                                   : make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed, variant == 1,
                                                       variant == 1 ? 0.25f : 0.9f);
      c.q = pr.q, c.k = pr.k, c.v = pr.v, c.modality = pr.modality;
      const EvalResult want = run_cpu(c);
      EvalResult got(want.recall.size());
      const kk::Status s = kk::cpu::evaluate_attention(c.params, c.q.data(), c.modality.data(), full.view(),
                                                       c.cache(), got.outputs());
      ASSERT_TRUE(s.ok()) << s.message();
      const std::string what = describe(c) + " variant " + std::to_string(variant);
      EXPECT_EQ(got.output_error, want.output_error) << what;
      EXPECT_EQ(got.recall, want.recall) << what;
      EXPECT_EQ(got.kl, want.kl) << what;
      EXPECT_EQ(got.entropy_change, want.entropy_change) << what;
      EXPECT_EQ(got.recall_modality, want.recall_modality) << what;
      EXPECT_EQ(got.mass_full, want.mass_full) << what;
      EXPECT_EQ(got.mass_compressed, want.mass_compressed) << what;
      expect_matches_reference(got, c, 2e-5);
    }
  }
}

TEST(EvaluateCpu, FullAttentionRejectsBadArguments) {
  EvalProblem pr = make_eval_problem(4, 2, 2, 12, 8, 4);
  FullBuffers full(pr.params);
  const auto run_full = [&](const kk::EvaluateParams& p, const kk::FullAttention& f,
                            const std::uint8_t* mod) {
    return kk::cpu::full_attention(p, pr.q.data(), pr.k.data(), pr.v.data(), mod, f);
  };
  EXPECT_TRUE(run_full(pr.params, full.view(), pr.modality.data()).ok());
  kk::FullAttention no_probs = full.view();
  no_probs.probs = nullptr;
  EXPECT_FALSE(run_full(pr.params, no_probs, pr.modality.data()).ok());
  kk::FullAttention no_mass = full.view();
  no_mass.modality_mass = nullptr;
  EXPECT_TRUE(run_full(pr.params, no_mass, nullptr).ok());  // modality only needed for the masses
  EXPECT_FALSE(run_full(pr.params, full.view(), nullptr).ok());
  kk::EvaluateParams bad = pr.params;
  bad.num_kv_heads = 3;
  kk::Status s = run_full(bad, full.view(), pr.modality.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("full_attention"), std::string::npos) << s.message();
  bad = pr.params;
  bad.num_tokens = 0;
  EXPECT_FALSE(run_full(bad, full.view(), pr.modality.data()).ok());

  EvalResult r(8);
  EXPECT_FALSE(kk::cpu::evaluate_attention(pr.params, pr.q.data(), pr.modality.data(), no_probs, pr.cache(),
                                           r.outputs())
                   .ok());
  EvalProblem badmap = pr;
  badmap.token_to_slot[0] = -2;
  EXPECT_FALSE(kk::cpu::evaluate_attention(pr.params, pr.q.data(), pr.modality.data(), full.view(),
                                           badmap.cache(), r.outputs())
                   .ok());
  EXPECT_FALSE(kk::cpu::evaluate_attention(pr.params, nullptr, pr.modality.data(), full.view(), pr.cache(),
                                           r.outputs())
                   .ok());
}
