// CUDA head merging against the CPU backend on the same inputs (skipped without a GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/gpu.hpp"
#include "common/test_util.hpp"
#include "kernels/reference_cuda_buffers.hpp"
#include "kvscope/kernels/head_merge.hpp"
#include "kvscope/kernels/head_merge_cuda.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::random_normal;
using kvscope::testing::random_uniform;

namespace {

template <typename T>
using DeviceVector = kvscope::testing::DeviceArray<T>;

// Heads from a few prototypes plus noise: similarities are ~0.99 or ~0, far from 0.88.
void make_heads(int H, std::size_t n, std::uint64_t seed, std::vector<float>& k, std::vector<float>& v) {
  const int protos = std::max(1, H / 2);
  const auto pk = random_normal(protos * n, seed), pv = random_normal(protos * n, seed + 1);
  const auto nk = random_normal(H * n, seed + 2, 0.1f), nv = random_normal(H * n, seed + 3, 0.1f);
  k.resize(H * n);
  v.resize(H * n);
  for (int h = 0; h < H; ++h)
    for (std::size_t i = 0; i < n; ++i) {
      k[h * n + i] = pk[((h * 7 + 3) % protos) * n + i] + nk[h * n + i];
      v[h * n + i] = pv[((h * 7 + 3) % protos) * n + i] + nv[h * n + i];
    }
}

}  // namespace

TEST(HeadMergeCuda, MatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  struct Shape {
    int H, Hq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1}, {3, 6, 7, 5}, {5, 5, 33, 16}, {8, 32, 100, 64}, {32, 32, 2048, 128}};
  std::uint64_t seed = 100;
  for (const Shape& sh : shapes) {
    for (kk::HeadSimilarity mode : {kk::HeadSimilarity::kKeys, kk::HeadSimilarity::kKeysValues}) {
      for (kk::DType dt : {kk::DType::kF32, kk::DType::kBF16}) {
        const int H = sh.H;
        const std::size_t n = static_cast<std::size_t>(sh.T) * sh.D;
        std::vector<float> kf, vf;
        make_heads(H, n, seed++, kf, vf);
        const auto w = random_uniform(H, seed++, 0.1f, 2.0f);
        kk::HeadMergeParams p;
        p.num_kv_heads = H;
        p.num_q_heads = sh.Hq;
        p.num_tokens = sh.T;
        p.head_dim = sh.D;
        p.similarity = mode;
        p.dtype = dt;
        std::vector<std::uint16_t> kb(kf.size()), vb(vf.size());
        for (std::size_t i = 0; i < kb.size(); ++i) {
          kb[i] = kk::float_to_bf16(kf[i]);
          vb[i] = kk::float_to_bf16(vf[i]);
        }
        const void* k = dt == kk::DType::kF32 ? static_cast<const void*>(kf.data()) : kb.data();
        const void* v = dt == kk::DType::kF32 ? static_cast<const void*>(vf.data()) : vb.data();
        const std::size_t bytes = H * n * kk::dtype_bytes(dt);
        std::vector<float> sim(H * H), ko(H * n), vo(H * n);
        std::vector<std::int32_t> cid(H), qmap(sh.Hq);
        int merged = 0;
        ASSERT_TRUE(kk::cpu::merge_heads(p, k, v, w.data(), sim.data(), cid.data(), &merged, ko.data(),
                                         vo.data(), qmap.data())
                        .ok());
        DeviceVector<std::uint8_t> dk(bytes), dv(bytes);
        ASSERT_EQ(cudaMemcpy(dk.get(), k, bytes, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(dv.get(), v, bytes, cudaMemcpyHostToDevice), cudaSuccess);
        DeviceVector<float> dw(w), dsim(H * H), dko(H * n), dvo(H * n);
        DeviceVector<std::int32_t> dcid(H), dqmap(sh.Hq);
        int dmerged = -1;
        const kk::Status s = kk::cuda::merge_heads(p, dk.get(), dv.get(), dw.get(), dsim.get(), dcid.get(), &dmerged,
                                                   dko.get(), dvo.get(), dqmap.get(), nullptr);
        ASSERT_TRUE(s.ok()) << s.message();
        const std::string what =
            "H=" + std::to_string(H) + " T=" + std::to_string(sh.T) + " D=" + std::to_string(sh.D) +
            " mode=" + std::to_string(static_cast<int>(mode)) + " dtype=" + kk::dtype_name(dt);
        EXPECT_TRUE(all_close(dsim.download(), sim, 1e-5, 1e-5, what + " similarity"));
        EXPECT_EQ(dmerged, merged) << what;
        EXPECT_EQ(dcid.download(), cid) << what;
        EXPECT_EQ(dqmap.download(), qmap) << what;
        auto gk = dko.download(), gv = dvo.download();
        gk.resize(merged * n);
        gv.resize(merged * n);
        ko.resize(merged * n);
        vo.resize(merged * n);
        EXPECT_TRUE(all_close(gk, ko, 1e-6, 1e-5, what + " k_out"));
        EXPECT_TRUE(all_close(gv, vo, 1e-6, 1e-5, what + " v_out"));
      }
    }
  }
}

TEST(HeadMergeCuda, RejectsBadArguments) {
  KVSCOPE_REQUIRE_GPU();
  kk::HeadMergeParams p;
  p.num_kv_heads = 4;
  p.num_q_heads = 6;
  p.num_tokens = 5;
  p.head_dim = 4;
  DeviceVector<float> k(80), v(80), sim(16), ko(80), vo(80);
  DeviceVector<std::int32_t> cid(4), qmap(8);
  int merged = 0;
  EXPECT_FALSE(kk::cuda::merge_heads(p, k.get(), v.get(), nullptr, sim.get(), cid.get(), &merged, ko.get(), vo.get(),
                                     qmap.get(), nullptr)
                   .ok());
  DeviceVector<std::int32_t> bad(std::vector<std::int32_t>{0, 0, 2, 2});  // cluster 1 empty
  EXPECT_FALSE(
      kk::cuda::apply_head_merge(p, k.get(), v.get(), bad.get(), 3, nullptr, ko.get(), vo.get(), nullptr).ok());
}
