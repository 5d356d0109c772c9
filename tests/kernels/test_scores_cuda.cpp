// CUDA token scores vs the CPU backend on the same inputs (skipped without a GPU).
#include <gtest/gtest.h>

#include <vector>

#include "common/gpu.hpp"
#include "common/test_util.hpp"
#include "kernels/reference_attention_stats.hpp"  // round_to_dtype
#include "kernels/reference_cuda_buffers.hpp"
#include "kvscope/kernels/scores.hpp"
#include "kvscope/kernels/scores_cuda.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::DeviceArray;

namespace {

// Text, then a rows x cols image (segment 0), then text; grid = -1 elsewhere.
struct Layout {
  std::vector<std::int32_t> row, col, seg;
  std::vector<std::uint8_t> mod;
};
Layout make_layout(int before, int rows, int cols, int after) {
  Layout l;
  for (int i = 0; i < before; ++i)
    l.row.push_back(-1), l.col.push_back(-1), l.seg.push_back(-1), l.mod.push_back(0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      l.row.push_back(r), l.col.push_back(c), l.seg.push_back(0), l.mod.push_back(1);
  for (int i = 0; i < after; ++i)
    l.row.push_back(-1), l.col.push_back(-1), l.seg.push_back(-1), l.mod.push_back(0);
  return l;
}

}  // namespace

TEST(ScoresCuda, KeyNormsAndRedundancyMatchCpu) {
  KVSCOPE_REQUIRE_GPU();
  std::uint64_t seed = 7;
  for (auto [before, rows, cols, after, h, d] :
       {std::tuple{1, 0, 0, 0, 1, 1}, {3, 4, 5, 2, 2, 16}, {5, 24, 24, 40, 8, 128}, {0, 0, 0, 33, 3, 64}}) {
    const Layout l = make_layout(before, rows, cols, after);
    const int T = static_cast<int>(l.row.size());
    for (kk::DType dt : {kk::DType::kF32, kk::DType::kF16, kk::DType::kBF16}) {
      std::vector<float> f = kvscope::testing::random_normal(static_cast<std::size_t>(h) * T * d, seed++);
      std::vector<std::uint16_t> bits;
      kvscope::testing::round_to_dtype(f, bits, dt);
      DeviceArray<float> df(f);
      DeviceArray<std::uint16_t> db(bits);
      kk::KeyTensor hk{dt == kk::DType::kF32 ? static_cast<const void*>(f.data()) : bits.data(), h, T, d, dt};
      kk::KeyTensor dk = hk;
      dk.k = dt == kk::DType::kF32 ? static_cast<const void*>(df.get()) : db.get();
      const std::string params = "T=" + std::to_string(T) + " h=" + std::to_string(h) +
                                 " d=" + std::to_string(d) + " " + kk::dtype_name(dt);
      std::vector<float> want(static_cast<std::size_t>(h) * T);
      DeviceArray<float> got(want.size());
      ASSERT_TRUE(kk::cpu::key_norms(hk, want.data()).ok());
      ASSERT_TRUE(kk::cuda::key_norms(dk, got.get(), nullptr).ok());
      EXPECT_TRUE(all_close(got.download(), want, 1e-5, 1e-5, params + " norms"));
      kk::NeighbourTable table;
      ASSERT_TRUE(kk::cpu::build_neighbour_lists(kk::TokenGrid{l.row.data(), l.col.data(), l.seg.data(), T},
                                                 kk::RedundancyParams{4, 1}, &table)
                      .ok());
      DeviceArray<std::int32_t> off(table.offsets), idx(table.indices);
      ASSERT_TRUE(kk::cpu::redundancy(hk, table.view(), want.data()).ok());
      ASSERT_TRUE(
          kk::cuda::redundancy(dk, kk::NeighbourLists{off.get(), idx.get(), T}, got.get(), nullptr).ok());
      EXPECT_TRUE(all_close(got.download(), want, 1e-5, 1e-5, params + " redundancy"));
    }
  }
}

TEST(ScoresCuda, UniCacheMatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  std::uint64_t seed = 70;
  for (auto [H, T] : {std::pair{1, 1}, {3, 33}, {32, 2048}}) {
    const auto a = kvscope::testing::random_uniform(static_cast<std::size_t>(H) * T, seed++, 0.0f, 2.0f);
    const auto c = kvscope::testing::random_uniform(a.size(), seed++, 0.0f, 0.5f);
    const auto d = kvscope::testing::random_uniform(a.size(), seed++, -0.5f, 1.2f);
    std::vector<std::uint8_t> mod(T);
    for (int t = 0; t < T; ++t) mod[t] = static_cast<std::uint8_t>((t * 7) % 4);
    DeviceArray<float> da(a), dc(c), dd(d), got(a.size());
    DeviceArray<std::uint8_t> dm(mod);
    for (kk::NormalizeKind nk : {kk::NormalizeKind::kMax, kk::NormalizeKind::kMinMax}) {
      for (kk::RecencyKind rk : {kk::RecencyKind::kLinear, kk::RecencyKind::kExponential}) {
        kk::UniCacheParams p;
        p.normalize = nk, p.recency = rk;
        std::vector<float> want(a.size());
        ASSERT_TRUE(
            kk::cpu::unicache_score({a.data(), c.data(), d.data(), mod.data(), H, T}, p, want.data()).ok());
        ASSERT_TRUE(
            kk::cuda::unicache_score({da.get(), dc.get(), dd.get(), dm.get(), H, T}, p, got.get(), nullptr)
                .ok());
        // Not bitwise: nvcc fuses a * b + c into one FMA (one rounding) where the CPU build
        // rounds twice, and expf may differ by an ulp; measured on an H200: 1e-7 relative.
        EXPECT_TRUE(all_close(got.download(), want, 1e-7, 1e-6,
                              "H=" + std::to_string(H) + " T=" + std::to_string(T) +
                                  " norm=" + std::to_string(int(nk)) + " rec=" + std::to_string(int(rk))));
      }
    }
  }
}

TEST(ScoresCuda, RejectsBadArguments) {
  KVSCOPE_REQUIRE_GPU();
  DeviceArray<float> out(16);
  kk::KeyTensor k{nullptr, 2, 8, 4, kk::DType::kF32};
  EXPECT_FALSE(kk::cuda::key_norms(k, out.get(), nullptr).ok());
  DeviceArray<float> keys(64);
  k.k = keys.get();
  EXPECT_FALSE(kk::cuda::redundancy(k, kk::NeighbourLists{}, out.get(), nullptr).ok());
  kk::UniCacheParams p;
  p.recency = kk::RecencyKind::kExponential, p.recency_tau = -1.0f;
  DeviceArray<std::uint8_t> mod(8);
  EXPECT_FALSE(
      kk::cuda::unicache_score({out.get(), nullptr, nullptr, mod.get(), 1, 8}, p, out.get(), nullptr).ok());
}
