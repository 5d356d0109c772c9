// CUDA token selection vs the CPU backend: identical index sets and counts,
// ties included (skipped without a GPU).
#include <gtest/gtest.h>

#include <vector>

#include "common/gpu.hpp"
#include "kernels/reference_cuda_buffers.hpp"
#include "kernels/reference_select.hpp"
#include "kvscope/kernels/select.hpp"
#include "kvscope/kernels/select_cuda.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::DeviceArray;

TEST(SelectCuda, MatchesCpuExactly) {
  KVSCOPE_REQUIRE_GPU();
  std::uint64_t seed = 900;
  int compared = 0;
  for (auto [H, T] : {std::pair{1, 1}, {1, 7}, {3, 33}, {8, 576}, {32, 2048}, {2, 8192}}) {
    for (int variant = 0; variant < 8; ++variant) {
      std::mt19937_64 rng(seed++);
      const auto scores = kvscope::testing::tied_scores(static_cast<std::size_t>(H) * T, seed++,
                                                        variant % 2 ? 4 : 100000, variant == 5);
      std::vector<std::uint8_t> mod(T), prot(T);
      for (auto& m : mod) m = static_cast<std::uint8_t>(rng() % 20 < 9 ? 0 : rng() % 20 < 18 ? 1 : 2);
      for (auto& x : prot) x = rng() % 31 == 0 ? 1 : 0;
      DeviceArray<float> ds(scores);
      DeviceArray<std::uint8_t> dmod(mod), dprot(prot);
      kk::SelectParams p;
      p.k = std::max(1, static_cast<int>(T * (0.15 + 0.1 * variant)));
      if (variant >= 2) p.num_sinks = std::min(T, 4), p.recent_window = T / 20;
      if (variant >= 3) p.protected_mask = prot.data();
      if (variant >= 4) {
        p.use_modality_budgets = true;
        p.modality = mod.data();
        p.modality_budget[0] = p.k / 4, p.modality_budget[1] = p.k / 2, p.modality_budget[2] = p.k / 8;
        p.modality_budget[3] = p.k - p.modality_budget[0] - p.modality_budget[1] - p.modality_budget[2];
        p.redistribute_leftover = variant != 6;
      }
      if (!kk::cpu::validate_select(p, H, T, true, "test").ok()) continue;
      kk::SelectParams dp = p;
      dp.modality = p.modality ? dmod.get() : nullptr;
      dp.protected_mask = p.protected_mask ? dprot.get() : nullptr;
      const std::string params = "H=" + std::to_string(H) + " T=" + std::to_string(T) +
                                 " variant=" + std::to_string(variant) + " k=" + std::to_string(p.k);

      std::vector<std::int32_t> want(static_cast<std::size_t>(H) * p.k), want_n(H);
      DeviceArray<std::int32_t> got(want.size()), got_n(H);
      ASSERT_TRUE(kk::cpu::select_topk(scores.data(), H, T, p, want.data(), want_n.data()).ok()) << params;
      ASSERT_TRUE(kk::cuda::select_topk(ds.get(), H, T, dp, got.get(), got_n.get(), nullptr).ok()) << params;
      EXPECT_EQ(got.download(), want) << params;
      EXPECT_EQ(got_n.download(), want_n) << params;

      std::vector<std::int32_t> want_s(p.k), want_sn(1);
      DeviceArray<std::int32_t> got_s(p.k), got_sn(1);
      ASSERT_TRUE(kk::cpu::select_topk_shared(scores.data(), H, T, p, want_s.data(), want_sn.data()).ok());
      ASSERT_TRUE(kk::cuda::select_topk_shared(ds.get(), H, T, dp, got_s.get(), got_sn.get(), nullptr).ok());
      EXPECT_EQ(got_s.download(), want_s) << params << " shared";
      EXPECT_EQ(got_sn.download(), want_sn) << params << " shared";
      ++compared;
    }
  }
  EXPECT_GE(compared, 30);
}

TEST(SelectCuda, RejectsForcedOverflowAndBadBudgets) {
  KVSCOPE_REQUIRE_GPU();
  std::vector<float> s(20, 1.0f);
  std::vector<std::uint8_t> mod(20, 0), prot(20, 0);
  prot[10] = prot[11] = 1;
  DeviceArray<float> ds(s);
  DeviceArray<std::uint8_t> dmod(mod), dprot(prot);
  DeviceArray<std::int32_t> out(20);
  kk::SelectParams p;
  p.k = 5;
  p.num_sinks = 2, p.recent_window = 2;
  p.protected_mask = dprot.get();  // 2 + 2 + 2 = 6 forced > 5
  const kk::Status st = kk::cuda::select_topk(ds.get(), 1, 20, p, out.get(), nullptr, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("6 forced tokens"), std::string::npos) << st.message();
  p.protected_mask = nullptr;
  p.use_modality_budgets = true;
  p.modality = dmod.get();
  p.modality_budget[0] = 4;  // sums to 4, k = 5
  EXPECT_FALSE(kk::cuda::select_topk(ds.get(), 1, 20, p, out.get(), nullptr, nullptr).ok());
  p.modality_budget[0] = 5;
  mod[3] = 8;
  DeviceArray<std::uint8_t> dbad(mod);
  p.modality = dbad.get();
  EXPECT_FALSE(kk::cuda::select_topk(ds.get(), 1, 20, p, out.get(), nullptr, nullptr).ok());
  p.k = 21;
  EXPECT_FALSE(kk::cuda::select_topk(ds.get(), 1, 20, p, out.get(), nullptr, nullptr).ok());
}
