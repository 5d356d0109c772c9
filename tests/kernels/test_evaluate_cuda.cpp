// CUDA compressed-cache evaluation against the CPU backend on the same inputs
// (skipped without a GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/gpu.hpp"
#include "common/test_util.hpp"
#include "kernels/reference_cuda_buffers.hpp"
#include "kernels/reference_evaluate.hpp"
#include "kvscope/kernels/evaluate.hpp"
#include "kvscope/kernels/evaluate_cuda.hpp"

namespace kk = kvscope::kernels;
using kvscope::testing::all_close;
using kvscope::testing::EvalProblem;
using kvscope::testing::make_eval_problem;

namespace {

template <typename T>
using DeviceVector = kvscope::testing::DeviceArray<T>;

struct Outputs {
  std::vector<float> v[7];
  explicit Outputs(std::size_t rows) {
    for (int i = 0; i < 7; ++i) v[i].assign(i < 4 ? rows : rows * 4, -9.0f);
  }
  kk::EvaluateOutputs ptrs() {
    return {v[0].data(), v[1].data(), v[2].data(), v[3].data(), v[4].data(), v[5].data(), v[6].data()};
  }
};
const char* const kNames[7] = {"output_error", "recall",         "kl", "entropy_change", "recall_modality",
                               "mass_full",    "mass_compressed"};

// Runs both backends on `pr` (q, k, v given in params.dtype as raw bytes) and compares.
// cuda_only: the CUDA backend's status alone (no CPU run, no comparison).
kk::Status compare(const EvalProblem& pr, const void* q, const void* k, const void* v, bool cuda_only = false) {
  const auto& p = pr.params;
  const std::size_t rows = static_cast<std::size_t>(p.num_q_heads) * p.num_queries;
  const std::size_t eb = kk::dtype_bytes(p.dtype);
  Outputs cpu(rows);
  if (!cuda_only) {
    KVSCOPE_RETURN_IF_ERROR(
        kk::cpu::evaluate_attention(p, q, k, v, pr.modality.data(), pr.cache(), cpu.ptrs()));
  }
  DeviceVector<std::uint8_t> dq(rows * p.head_dim * eb), dk(pr.k.size() * eb), dv(pr.v.size() * eb);
  EXPECT_EQ(cudaMemcpy(dq.get(), q, dq.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dk.get(), k, dk.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dv.get(), v, dv.size(), cudaMemcpyHostToDevice), cudaSuccess);
  DeviceVector<std::uint8_t> dmod(pr.modality), dsmod(pr.slot_modality);
  DeviceVector<float> dsk(pr.slot_k), dsv(pr.slot_v), dmf(pr.mult_f32);
  DeviceVector<std::int32_t> doff(pr.offsets), dmi(pr.mult_i32), dmap(pr.token_to_slot);
  kk::CompressedCache c;
  c.k = dsk.get();
  c.v = dsv.get();
  c.slot_offsets = doff.get();
  c.multiplicity_f32 = pr.mult_f32.empty() ? nullptr : dmf.get();
  c.multiplicity_i32 = pr.mult_i32.empty() ? nullptr : dmi.get();
  c.slot_modality = dsmod.get();
  c.token_to_slot = dmap.get();
  std::vector<DeviceVector<float>*> dout;
  for (int i = 0; i < 7; ++i) dout.push_back(new DeviceVector<float>(cpu.v[i].size()));
  const kk::EvaluateOutputs o{dout[0]->get(), dout[1]->get(), dout[2]->get(), dout[3]->get(),
                              dout[4]->get(), dout[5]->get(), dout[6]->get()};
  const kk::Status s = kk::cuda::evaluate_attention(p, dq.get(), dk.get(), dv.get(), dmod.get(), c, o, nullptr);
  if (s.ok() && !cuda_only) {
    const std::string what = "Hq=" + std::to_string(p.num_q_heads) +
                             " Hkv=" + std::to_string(p.num_kv_heads) +
                             " Nq=" + std::to_string(p.num_queries) + " T=" + std::to_string(p.num_tokens) +
                             " D=" + std::to_string(p.head_dim) + " dtype=" + kk::dtype_name(p.dtype);
    // float tree reductions on the GPU vs double row sums on the CPU
    for (int i = 0; i < 7; ++i)
      EXPECT_TRUE(all_close(dout[i]->download(), cpu.v[i], 2e-5, 1e-4, what + " " + kNames[i]));
  }
  for (auto* d : dout) delete d;
  return s;
}

}  // namespace

TEST(EvaluateCuda, MatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  struct Shape {
    int Hq, Hkv, Nq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 1},       {2, 1, 3, 7, 5},     {4, 2, 5, 33, 16},
                          {6, 3, 17, 130, 64},   {8, 2, 4, 577, 128}, {3, 3, 2, 1300, 37},
                          {32, 8, 32, 2048, 128}};
  std::uint64_t seed = 1000;
  for (const Shape& sh : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      EvalProblem pr = make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed++, variant == 1);
      pr.params.proportional_attention = variant != 2;
      const kk::Status s = compare(pr, pr.q.data(), pr.k.data(), pr.v.data());
      EXPECT_TRUE(s.ok()) << s.message();
    }
  }
}

TEST(EvaluateCuda, Bfloat16InputsAndEmptyHead) {
  KVSCOPE_REQUIRE_GPU();
  EvalProblem pr = make_eval_problem(4, 2, 3, 70, 32, 55);
  pr.params.dtype = kk::DType::kBF16;
  // head 1 keeps no slot at all and evicts everything
  const int s0 = pr.offsets[1];
  pr.slot_k.resize(static_cast<std::size_t>(s0) * 32);
  pr.slot_v.resize(static_cast<std::size_t>(s0) * 32);
  pr.mult_f32.resize(s0);
  pr.slot_modality.resize(s0);
  pr.offsets[2] = s0;
  for (int t = 0; t < 70; ++t) pr.token_to_slot[70 + t] = -1;
  auto encode = [](const std::vector<float>& x) {
    std::vector<std::uint16_t> b(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) b[i] = kk::float_to_bf16(x[i]);
    return b;
  };
  const auto qb = encode(pr.q), kb = encode(pr.k), vb = encode(pr.v);
  const kk::Status s = compare(pr, qb.data(), kb.data(), vb.data());
  EXPECT_TRUE(s.ok()) << s.message();
}

// Same inputs as EvaluateCpu.NonFiniteMetricsFailTheCall: both backends fail with the same message.
TEST(EvaluateCuda, NonFiniteMetricsFailTheCallLikeTheCpu) {
  KVSCOPE_REQUIRE_GPU();
  EvalProblem pr = make_eval_problem(4, 2, 3, 40, 16, 21);
  for (auto& x : pr.q) x *= 1e30f;
  for (auto& x : pr.k) x *= 1e30f;
  for (auto& x : pr.slot_k) x *= 1e30f;
  const kk::Status s = compare(pr, pr.q.data(), pr.k.data(), pr.v.data(), /*cuda_only=*/true);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("a metric is not finite in float32"), std::string::npos) << s.message();
}

TEST(EvaluateCuda, RejectsBadDeviceData) {
  KVSCOPE_REQUIRE_GPU();
  EvalProblem pr = make_eval_problem(2, 2, 2, 12, 8, 4);
  pr.token_to_slot[3] = 1000;
  // compare() runs the CPU first, which rejects; run the CUDA backend alone here.
  DeviceVector<float> dq(pr.q), dk(pr.k), dv(pr.v), dsk(pr.slot_k), dsv(pr.slot_v), dmf(pr.mult_f32), out(4);
  DeviceVector<std::uint8_t> dmod(pr.modality), dsmod(pr.slot_modality);
  DeviceVector<std::int32_t> doff(pr.offsets), dmap(pr.token_to_slot);
  kk::CompressedCache c;
  c.k = dsk.get();
  c.v = dsv.get();
  c.slot_offsets = doff.get();
  c.multiplicity_f32 = dmf.get();
  c.slot_modality = dsmod.get();
  c.token_to_slot = dmap.get();
  kk::EvaluateOutputs o;
  o.recall = out.get();
  EXPECT_FALSE(kk::cuda::evaluate_attention(pr.params, dq.get(), dk.get(), dv.get(), dmod.get(), c, o, nullptr).ok());
  pr.token_to_slot[3] = -1;
  DeviceVector<std::int32_t> dmap_ok(pr.token_to_slot);
  c.token_to_slot = dmap_ok.get();
  EXPECT_TRUE(kk::cuda::evaluate_attention(pr.params, dq.get(), dk.get(), dv.get(), dmod.get(), c, o, nullptr).ok());
  pr.mult_f32[0] = -1.0f;
  DeviceVector<float> dmf_bad(pr.mult_f32);
  c.multiplicity_f32 = dmf_bad.get();
  EXPECT_FALSE(kk::cuda::evaluate_attention(pr.params, dq.get(), dk.get(), dv.get(), dmod.get(), c, o, nullptr).ok());
}

// cuda::full_attention and the FullAttention overload against the CPU backend: the
// full-cache side once per problem, then two compressed caches over it.
TEST(EvaluateCuda, FullAttentionMatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  struct Shape {
    int Hq, Hkv, Nq, T, D;
  };
  const Shape shapes[] = {{1, 1, 1, 1, 1}, {4, 2, 5, 33, 16}, {8, 2, 4, 577, 128}, {32, 8, 32, 2048, 128}};
  std::uint64_t seed = 5000;
  for (const Shape& sh : shapes) {
    const EvalProblem pr = make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed++);
    const auto& p = pr.params;
    const std::size_t rows = static_cast<std::size_t>(p.num_q_heads) * p.num_queries;
    std::vector<float> probs(rows * p.num_tokens), output(rows * p.head_dim), entropy(rows), mass(rows * 4);
    const kk::FullAttention host_full{probs.data(), output.data(), entropy.data(), mass.data()};
    ASSERT_TRUE(
        kk::cpu::full_attention(p, pr.q.data(), pr.k.data(), pr.v.data(), pr.modality.data(), host_full)
            .ok());
    DeviceVector<float> dq(pr.q), dk(pr.k), dv(pr.v);
    DeviceVector<std::uint8_t> dmod(pr.modality);
    DeviceVector<float> dprobs(probs.size()), doutput(output.size()), dentropy(entropy.size()),
        dmass(mass.size());
    const kk::FullAttention dev_full{dprobs.get(), doutput.get(), dentropy.get(), dmass.get()};
    kk::Status s = kk::cuda::full_attention(p, dq.get(), dk.get(), dv.get(), dmod.get(), dev_full, nullptr);
    ASSERT_TRUE(s.ok()) << s.message();
    const std::string what = "Hq=" + std::to_string(p.num_q_heads) +
                             " Hkv=" + std::to_string(p.num_kv_heads) +
                             " Nq=" + std::to_string(p.num_queries) + " T=" + std::to_string(p.num_tokens) +
                             " D=" + std::to_string(p.head_dim);
    EXPECT_TRUE(all_close(dprobs.download(), probs, 1e-7, 1e-4, what + " probs"));
    EXPECT_TRUE(all_close(doutput.download(), output, 2e-6, 1e-4, what + " output"));
    EXPECT_TRUE(all_close(dentropy.download(), entropy, 2e-5, 1e-4, what + " entropy"));
    EXPECT_TRUE(all_close(dmass.download(), mass, 2e-6, 1e-4, what + " modality_mass"));

    for (int variant = 0; variant < 2; ++variant) {
      EvalProblem c = make_eval_problem(sh.Hq, sh.Hkv, sh.Nq, sh.T, sh.D, seed++, variant == 1, 0.3f);
      Outputs cpu(rows);
      ASSERT_TRUE(
          kk::cpu::evaluate_attention(p, pr.q.data(), pr.modality.data(), host_full, c.cache(), cpu.ptrs())
              .ok());
      DeviceVector<std::uint8_t> dsmod(c.slot_modality);
      DeviceVector<float> dsk(c.slot_k), dsv(c.slot_v), dmf(c.mult_f32);
      DeviceVector<std::int32_t> doff(c.offsets), dmi(c.mult_i32), dmap(c.token_to_slot);
      kk::CompressedCache dc;
      dc.k = dsk.get();
      dc.v = dsv.get();
      dc.slot_offsets = doff.get();
      dc.multiplicity_f32 = c.mult_f32.empty() ? nullptr : dmf.get();
      dc.multiplicity_i32 = c.mult_i32.empty() ? nullptr : dmi.get();
      dc.slot_modality = dsmod.get();
      dc.token_to_slot = dmap.get();
      std::vector<DeviceVector<float>*> dout;
      for (int i = 0; i < 7; ++i) dout.push_back(new DeviceVector<float>(cpu.v[i].size()));
      const kk::EvaluateOutputs o{dout[0]->get(), dout[1]->get(), dout[2]->get(), dout[3]->get(),
                                  dout[4]->get(), dout[5]->get(), dout[6]->get()};
      s = kk::cuda::evaluate_attention(p, dq.get(), dmod.get(), dev_full, dc, o, nullptr);
      EXPECT_TRUE(s.ok()) << s.message();
      if (s.ok()) {
        for (int i = 0; i < 7; ++i)
          EXPECT_TRUE(all_close(dout[i]->download(), cpu.v[i], 2e-5, 1e-4,
                                what + " variant " + std::to_string(variant) + " " + kNames[i]));
      }
      for (auto* d : dout) delete d;
    }
  }
}
