// CUDA token merging against the CPU backend on the same inputs (skipped without a GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/gpu.hpp"
#include "common/test_util.hpp"
#include "kernels/reference_cuda_buffers.hpp"
#include "kernels/reference_merge.hpp"
#include "kvscope/kernels/merge.hpp"
#include "kvscope/kernels/merge_cuda.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::make_merge_problem;
using kvscope::testing::MergeProblem;

namespace {

template <typename T>
using DeviceVector = kvscope::testing::DeviceArray<T>;

void compare(const MergeProblem& pr, const void* k, const void* v, std::size_t elem_bytes,
             bool with_importance) {
  const auto& p = pr.params;
  const std::size_t H = p.num_heads, T = p.num_tokens, D = p.head_dim, K = p.num_kept;
  const float* imp = with_importance ? pr.importance.data() : nullptr;
  std::vector<float> ck(H * K * D), cv(H * K * D);
  std::vector<std::int32_t> cm(H * K), cmap(H * T);
  ASSERT_TRUE(
      kk::cpu::merge_tokens(p, k, v, pr.kept.data(), imp, ck.data(), cv.data(), cm.data(), cmap.data()).ok());
  DeviceVector<std::uint8_t> dk(H * T * D * elem_bytes), dv(H * T * D * elem_bytes);
  ASSERT_EQ(cudaMemcpy(dk.get(), k, dk.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.get(), v, dv.size(), cudaMemcpyHostToDevice), cudaSuccess);
  DeviceVector<std::int32_t> dkept(pr.kept), dm(H * K), dmap(H * T);
  DeviceVector<float> dimp(pr.importance), dko(H * K * D), dvo(H * K * D);
  const kk::Status s =
      kk::cuda::merge_tokens(p, dk.get(), dv.get(), dkept.get(), with_importance ? dimp.get() : nullptr, dko.get(),
                             dvo.get(), dm.get(), dmap.get(), nullptr);
  ASSERT_TRUE(s.ok()) << s.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::string what = "H=" + std::to_string(H) + " T=" + std::to_string(T) + " D=" + std::to_string(D) +
                           " K=" + std::to_string(K) + " w=" + std::to_string(p.window) +
                           " dtype=" + kk::dtype_name(p.dtype);
  // Similarities are well separated from the threshold in these problems, so the
  // integer outputs must agree exactly.
  EXPECT_EQ(dmap.download(), cmap) << what;
  EXPECT_EQ(dm.download(), cm) << what;
  EXPECT_TRUE(all_close(dko.download(), ck, 1e-5, 1e-5, what + " k_out"));
  EXPECT_TRUE(all_close(dvo.download(), cv, 1e-5, 1e-5, what + " v_out"));
}

}  // namespace

TEST(MergeCuda, MatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  struct Shape {
    int H, T, D, K, w;
    bool shared;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 0, false},      {1, 7, 1, 3, 2, false},
                          {2, 33, 7, 11, 4, false},    {3, 64, 16, 20, 8, true},
                          {4, 300, 64, 150, 6, false}, {2, 1000, 128, 500, 10000, false},
                          {2, 129, 200, 1, 50, false}, {32, 2048, 128, 1024, 8, false}};
  std::uint64_t seed = 11;
  for (const Shape& sh : shapes) {
    for (bool with_importance : {true, false}) {
      const MergeProblem pr = make_merge_problem(sh.H, sh.T, sh.D, sh.K, sh.w, sh.shared, seed++);
      compare(pr, pr.k.data(), pr.v.data(), sizeof(float), with_importance);
    }
  }
}

TEST(MergeCuda, HalfAndBfloat16Inputs) {
  KVSCOPE_REQUIRE_GPU();
  for (kk::DType dt : {kk::DType::kF16, kk::DType::kBF16}) {
    MergeProblem pr = make_merge_problem(3, 97, 40, 31, 5, false, 77);
    pr.params.dtype = dt;
    std::vector<std::uint16_t> kb(pr.k.size()), vb(pr.v.size());
    for (std::size_t i = 0; i < kb.size(); ++i) {
      kb[i] = dt == kk::DType::kF16 ? kk::float_to_half(pr.k[i]) : kk::float_to_bf16(pr.k[i]);
      vb[i] = dt == kk::DType::kF16 ? kk::float_to_half(pr.v[i]) : kk::float_to_bf16(pr.v[i]);
    }
    compare(pr, kb.data(), vb.data(), sizeof(std::uint16_t), true);
  }
}

TEST(MergeCuda, RejectsBadKeptList) {
  KVSCOPE_REQUIRE_GPU();
  MergeProblem pr = make_merge_problem(2, 10, 4, 3, 2, false, 1);
  pr.kept[1] = pr.kept[0];
  DeviceVector<float> dk(pr.k), dv(pr.v), dko(24), dvo(24);
  DeviceVector<std::int32_t> dkept(pr.kept), dm(6), dmap(20);
  EXPECT_FALSE(kk::cuda::merge_tokens(pr.params, dk.get(), dv.get(), dkept.get(), nullptr, dko.get(), dvo.get(), dm.get(),
                                      dmap.get(), nullptr)
                   .ok());
  kk::MergeParams p = pr.params;
  p.num_kept = 0;
  EXPECT_FALSE(kk::cuda::merge_tokens(p, dk.get(), dv.get(), dkept.get(), nullptr, dko.get(), dvo.get(), dm.get(),
                                      dmap.get(), nullptr)
                   .ok());
}
