// CUDA attention statistics vs the CPU backend on the same inputs (skipped
// without a GPU). Per-key sums use float atomics on the GPU: compared within
// float reduction tolerance.
#include <gtest/gtest.h>

#include <vector>

#include "common/gpu.hpp"
#include "kernels/reference_attention_stats.hpp"
#include "kernels/reference_cuda_buffers.hpp"
#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/kernels/attention_stats_cuda.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::AttentionCase;
using kvscope::testing::DeviceArray;
using kvscope::testing::make_case;

namespace {

// Host case plus its device copies.
struct DeviceCase {
  const AttentionCase& c;
  DeviceArray<float> qf, kf;
  DeviceArray<std::uint16_t> q16, k16;
  DeviceArray<std::int32_t> q_pos, k_pos;
  DeviceArray<std::uint8_t> k_mod, q_mod;
  explicit DeviceCase(const AttentionCase& hc)
      : c(hc),
        qf(hc.qf),
        kf(hc.kf),
        q16(hc.q16),
        k16(hc.k16),
        q_pos(hc.q_pos),
        k_pos(hc.k_pos),
        k_mod(hc.k_mod),
        q_mod(hc.q_mod) {}
  kk::AttentionProblem problem() const {
    kk::AttentionProblem a = c.problem();
    a.q = c.dtype == kk::DType::kF32 ? static_cast<const void*>(qf.get()) : q16.get();
    a.k = c.dtype == kk::DType::kF32 ? static_cast<const void*>(kf.get()) : k16.get();
    a.q_pos = kvscope::testing::device_or_null(c.q_pos, q_pos);
    a.k_pos = kvscope::testing::device_or_null(c.k_pos, k_pos);
    return a;
  }
};

std::vector<AttentionCase> cases() {
  std::vector<AttentionCase> v;
  std::uint64_t seed = 500;
  struct S {
    int hq, hkv, tq, tk, d;
  };
  for (S s : {S{1, 1, 1, 1, 1}, S{2, 1, 7, 33, 16}, S{8, 2, 33, 33, 64}, S{8, 2, 20, 70, 128},
              S{32, 32, 576, 576, 128}, S{4, 1, 32, 2048, 128}}) {
    for (kk::DType t : {kk::DType::kF32, kk::DType::kF16, kk::DType::kBF16}) {
      v.push_back(make_case(s.hq, s.hkv, s.tq, s.tk, s.d, t, seed++));
    }
    AttentionCase c = make_case(s.hq, s.hkv, s.tq, s.tk, s.d, kk::DType::kF32, seed++);
    std::mt19937_64 rng(seed++);
    c.k_pos.resize(s.tk);
    c.q_pos.resize(s.tq);
    for (auto& p : c.k_pos) p = static_cast<std::int32_t>(rng() % (s.tk + 1));
    for (auto& p : c.q_pos) p = static_cast<std::int32_t>(rng() % (s.tk + 1)) - 1;
    v.push_back(c);
    v.push_back(make_case(s.hq, s.hkv, s.tq, s.tk, s.d, kk::DType::kF32, seed++, /*causal=*/false));
  }
  return v;
}

constexpr double kAtol = 1e-5, kRtol = 1e-4;

}  // namespace

TEST(AttentionStatsCuda, AccumulatedSnapKVTovaMatchCpu) {
  KVSCOPE_REQUIRE_GPU();
  for (const AttentionCase& c : cases()) {
    DeviceCase dc(c);
    const std::size_t n = static_cast<std::size_t>(c.hq) * c.tk;
    std::vector<float> want(n);
    DeviceArray<float> got(n);
    ASSERT_TRUE(kk::cpu::accumulated_attention(c.problem(), {0, c.tq}, want.data()).ok());
    ASSERT_TRUE(kk::cuda::accumulated_attention(dc.problem(), {0, c.tq}, got.get(), nullptr).ok());
    EXPECT_TRUE(all_close(got.download(), want, kAtol, kRtol, c.params() + " h2o"));
    ASSERT_TRUE(kk::cpu::tova_scores(c.problem(), want.data()).ok());
    ASSERT_TRUE(kk::cuda::tova_scores(dc.problem(), got.get(), nullptr).ok());
    EXPECT_TRUE(all_close(got.download(), want, kAtol, kRtol, c.params() + " tova"));
    for (kk::PoolKind pool : {kk::PoolKind::kAvg, kk::PoolKind::kMax}) {
      const kk::SnapKVParams sp{std::min(c.tq, 32), 7, pool};
      ASSERT_TRUE(kk::cpu::snapkv_scores(c.problem(), sp, want.data()).ok());
      ASSERT_TRUE(kk::cuda::snapkv_scores(dc.problem(), sp, got.get(), nullptr).ok());
      EXPECT_TRUE(all_close(got.download(), want, kAtol, kRtol, c.params() + " snapkv"));
    }
    std::vector<float> kv_want(static_cast<std::size_t>(c.hkv) * c.tk);
    DeviceArray<float> in(want), kv_got(kv_want.size());
    ASSERT_TRUE(kk::cpu::reduce_to_kv_heads(want.data(), c.hq, c.hkv, c.tk, kv_want.data()).ok());
    ASSERT_TRUE(kk::cuda::reduce_to_kv_heads(in.get(), c.hq, c.hkv, c.tk, kv_got.get(), nullptr).ok());
    EXPECT_TRUE(all_close(kv_got.download(), kv_want, 0.0, 0.0, c.params() + " reduce (same order: exact)"));
  }
}

TEST(AttentionStatsCuda, RowStatsMatchCpu) {
  KVSCOPE_REQUIRE_GPU();
  for (const AttentionCase& c : cases()) {
    DeviceCase dc(c);
    const std::size_t rows = static_cast<std::size_t>(c.hq) * c.tq;
    std::vector<float> h(rows), m(rows * 4);
    DeviceArray<float> dh(rows), dm(rows * 4);
    ASSERT_TRUE(kk::cpu::attention_row_stats(c.problem(), c.k_mod.data(), h.data(), m.data()).ok());
    ASSERT_TRUE(
        kk::cuda::attention_row_stats(dc.problem(), dc.k_mod.get(), dh.get(), dm.get(), nullptr).ok());
    EXPECT_TRUE(all_close(dh.download(), h, 1e-4, 1e-4, c.params() + " entropy"));
    EXPECT_TRUE(all_close(dm.download(), m, kAtol, kRtol, c.params() + " modality mass"));
  }
}

TEST(AttentionStatsCuda, CrossModalMatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  for (const AttentionCase& c : cases()) {
    if (c.tq != c.tk) continue;
    DeviceCase dc(c);
    const std::size_t n = static_cast<std::size_t>(c.hq) * c.tk;
    std::vector<float> r(n), g(n);
    DeviceArray<float> dr(n), dg(n);
    ASSERT_TRUE(
        kk::cpu::cross_modal_interaction(c.problem(), c.k_mod.data(), c.q_mod.data(), r.data(), g.data())
            .ok());
    ASSERT_TRUE(kk::cuda::cross_modal_interaction(dc.problem(), dc.k_mod.get(), dc.q_mod.get(), dr.get(),
                                                  dg.get(), nullptr)
                    .ok());
    EXPECT_TRUE(all_close(dr.download(), r, kAtol, kRtol, c.params() + " received"));
    EXPECT_TRUE(all_close(dg.download(), g, kAtol, kRtol, c.params() + " given"));
  }
}

TEST(AttentionStatsCuda, RejectsBadArguments) {
  KVSCOPE_REQUIRE_GPU();
  const AttentionCase c = make_case(8, 2, 8, 8, 4, kk::DType::kF32, 1);
  DeviceCase dc(c);
  DeviceArray<float> out(8 * 8 * 4);
  kk::AttentionProblem a = dc.problem();
  a.num_kv_heads = 3;
  EXPECT_FALSE(kk::cuda::accumulated_attention(a, {}, out.get(), nullptr).ok());
  EXPECT_FALSE(kk::cuda::accumulated_attention(dc.problem(), {}, nullptr, nullptr).ok());
  EXPECT_FALSE(kk::cuda::snapkv_scores(dc.problem(), {4, 4, kk::PoolKind::kAvg}, out.get(), nullptr).ok());
  EXPECT_FALSE(kk::cuda::attention_row_stats(dc.problem(), nullptr, nullptr, out.get(), nullptr).ok());
  const AttentionCase rect = make_case(2, 2, 4, 8, 4, kk::DType::kF32, 2);
  DeviceCase drect(rect);
  EXPECT_FALSE(kk::cuda::cross_modal_interaction(drect.problem(), drect.k_mod.get(), nullptr, out.get(),
                                                 nullptr, nullptr)
                   .ok());
}
