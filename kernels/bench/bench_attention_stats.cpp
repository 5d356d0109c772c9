// Attention statistics on one llava-1.5-7b layer (32 heads, head_dim 128, fp16):
//  - H2O accumulated attention: causal prefill Tq = Tk = T for T in {576, 642, 2048}
//    (642 = the kvsim sweep target: 576 vision + 64 text + 2 special tokens), and
//    T = 8192 with only the last 32 queries (Tq = 32);
//  - SnapKV: observation window of the last 32 queries, avg pooling k = 7;
//  - cross-modal interaction (received and given in one pass) on the T = 642 prefill.
// Compute-bound ("compute"): FLOPs = visible (query, key) pairs x (2 D + 5)
// (QK^T dot product, plus max-subtract, exp, sum, normalise, accumulate).
// The count is algorithmic: the CUDA kernel evaluates every logit twice
// (two-pass softmax), which is not counted.
#include <cstdint>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/attention_stats.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/attention_stats_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

constexpr int kWindow = 32;

// (T, Tq) pairs: prefill at 576 and 2048, window-only at 8192.
void h2o_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "Tq"});
  b->Args({576, 576})->Args({642, 642})->Args({2048, 2048})->Args({8192, kWindow});
}
void snapkv_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "Tq"});
  for (int t : kvscope::bench::kTokens) b->Args({t, kWindow});
}

// Visible (query, key) pairs per head for the last `rows` of Tq queries, with
// default positions (the queries are the last Tq of the T tokens).
double visible_pairs(int tk, int tq, int rows) {
  double pairs = 0;
  for (int i = tq - rows; i < tq; ++i) pairs += static_cast<double>(tk - tq + i + 1);
  return pairs;
}

struct Inputs {
  std::vector<unsigned char> q, k;  // fp16 [32, Tq, 128], [32, T, 128]
  kk::AttentionProblem problem(const void* qp, const void* kp, int tq, int tk) const {
    kk::AttentionProblem a;
    a.q = qp, a.k = kp;
    a.num_q_heads = a.num_kv_heads = kHeads;
    a.q_len = tq, a.k_len = tk, a.head_dim = kHeadDim;
    a.dtype = kk::DType::kF16;
    return a;
  }
};

Inputs make_inputs(int tq, int tk) {
  return Inputs{
      kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * tq * kHeadDim, 1),
      kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * tk * kHeadDim, 2)};
}

void set_counters(benchmark::State& state, int tk, int tq, int rows) {
  const double flops = kHeads * visible_pairs(tk, tq, rows);
  const double bytes = 2.0 * kHeads * (static_cast<double>(tq) + tk) * kHeadDim + 4.0 * kHeads * tk;
  kvscope::bench::set_compute_counters(state, flops * (2.0 * kHeadDim + 5.0), bytes);
}

void BM_h2o_cpu(benchmark::State& state) {
  const int tk = static_cast<int>(state.range(0)), tq = static_cast<int>(state.range(1));
  const Inputs in = make_inputs(tq, tk);
  std::vector<float> out(static_cast<std::size_t>(kHeads) * tk);
  for (auto _ : state) {
    const kk::Status s =
        kk::cpu::accumulated_attention(in.problem(in.q.data(), in.k.data(), tq, tk), {}, out.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, tk, tq, tq);
}
BENCHMARK(BM_h2o_cpu)
    ->Name("BM_attention_stats_h2o/cpu")
    ->Apply(h2o_args)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_snapkv_cpu(benchmark::State& state) {
  const int tk = static_cast<int>(state.range(0)), tq = static_cast<int>(state.range(1));
  const Inputs in = make_inputs(tq, tk);
  std::vector<float> out(static_cast<std::size_t>(kHeads) * tk);
  for (auto _ : state) {
    const kk::Status s = kk::cpu::snapkv_scores(in.problem(in.q.data(), in.k.data(), tq, tk),
                                                kk::SnapKVParams{kWindow, 7, kk::PoolKind::kAvg}, out.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  set_counters(state, tk, tq, kWindow);
}
BENCHMARK(BM_snapkv_cpu)
    ->Name("BM_attention_stats_snapkv/cpu")
    ->Apply(snapkv_args)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_cross_modal_cpu(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const Inputs in = make_inputs(t, t);
  std::vector<std::uint8_t> modality(t);
  for (int i = 0; i < t; ++i) modality[i] = i >= 1 && i < 1 + 576 ? 1 : 0;  // one image after a BOS
  std::vector<float> received(static_cast<std::size_t>(kHeads) * t), given(received.size());
  for (auto _ : state) {
    const kk::Status s = kk::cpu::cross_modal_interaction(
        in.problem(in.q.data(), in.k.data(), t, t), modality.data(), nullptr, received.data(), given.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(received.data());
  }
  set_counters(state, t, t, t);
}
BENCHMARK(BM_cross_modal_cpu)
    ->Name("BM_attention_stats_cross_modal/cpu")
    ->ArgName("T")
    ->Arg(642)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

#if defined(KVSCOPE_HAVE_CUDA)
template <bool kSnapKV>
void BM_attention_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const int tk = static_cast<int>(state.range(0)), tq = static_cast<int>(state.range(1));
  const Inputs in = make_inputs(tq, tk);
  kvscope::bench::DeviceBuffer<unsigned char> q(in.q), k(in.k);
  kvscope::bench::DeviceBuffer<float> out(static_cast<std::size_t>(kHeads) * tk);
  if (!q.ok() || !k.ok() || !out.ok()) return state.SkipWithError("device allocation failed");
  const kk::AttentionProblem a = in.problem(q.get(), k.get(), tq, tk);
  const bool ok = kvscope::bench::time_cuda(state, nullptr, [&]() {
    if (kSnapKV)
      return kk::cuda::snapkv_scores(a, kk::SnapKVParams{kWindow, 7, kk::PoolKind::kAvg}, out.get(), nullptr);
    return kk::cuda::accumulated_attention(a, {}, out.get(), nullptr);
  });
  if (ok) set_counters(state, tk, tq, kSnapKV ? kWindow : tq);
}
BENCHMARK(BM_attention_cuda<false>)->Name("BM_attention_stats_h2o/cuda")->Apply(h2o_args)->UseManualTime();
BENCHMARK(BM_attention_cuda<true>)
    ->Name("BM_attention_stats_snapkv/cuda")
    ->Apply(snapkv_args)
    ->UseManualTime();
#endif

}  // namespace
