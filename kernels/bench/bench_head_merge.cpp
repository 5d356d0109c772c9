// Head merging (kvscope/kernels/head_merge.hpp) on one llava-1.5-7b layer: 32 kv
// heads = 32 q heads, T in {576, 2048, 8192}, head_dim 128, fp16 K/V, key similarity,
// threshold 0.88, uniform weights.
//
// Counted as compute-bound (label "compute"): the Gram matrix of the flattened heads
// dominates, 2 FLOPs per multiply-add over the upper triangle:
//   flops = H*(H+1)/2 * 2*T*D  +  2 * 2*H*T*D   (similarity + weighted average of K and V)
// Bytes: K and V read (fp16), merged K and V written (fp32, H' <= H heads; H is counted).
#include <cstdint>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/head_merge.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/head_merge_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

kk::HeadMergeParams head_params(int T) {
  kk::HeadMergeParams p;
  p.num_kv_heads = kHeads;
  p.num_q_heads = kHeads;
  p.num_tokens = T;
  p.head_dim = kHeadDim;
  p.dtype = kk::DType::kF16;
  return p;
}
double head_flops(int T) {
  const double n = static_cast<double>(T) * kHeadDim;
  return kHeads * (kHeads + 1) / 2.0 * 2.0 * n + 4.0 * kHeads * n;
}
double head_bytes(int T) { return static_cast<double>(kHeads) * T * kHeadDim * (2 * 2 + 2 * 4); }

void BM_merge_heads_cpu(benchmark::State& state) {
  const int T = static_cast<int>(state.range(0));
  const kk::HeadMergeParams p = head_params(T);
  const std::size_t n = static_cast<std::size_t>(kHeads) * T * kHeadDim;
  const auto k = kvscope::bench::random_tensor(kk::DType::kF16, n, 1);
  const auto v = kvscope::bench::random_tensor(kk::DType::kF16, n, 2);
  std::vector<float> sim(kHeads * kHeads), ko(n), vo(n);
  std::vector<std::int32_t> cid(kHeads), qmap(kHeads);
  int merged = 0;
  for (auto _ : state) {
    const kk::Status s = kk::cpu::merge_heads(p, k.data(), v.data(), nullptr, sim.data(), cid.data(), &merged,
                                              ko.data(), vo.data(), qmap.data());
    if (!s.ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(ko.data());
  }
  kvscope::bench::set_compute_counters(state, head_flops(T), head_bytes(T));
}
BENCHMARK(BM_merge_heads_cpu)
    ->Name("BM_merge_heads/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
void BM_merge_heads_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const int T = static_cast<int>(state.range(0));
  const kk::HeadMergeParams p = head_params(T);
  const std::size_t n = static_cast<std::size_t>(kHeads) * T * kHeadDim;
  using kvscope::bench::DeviceBuffer;
  DeviceBuffer<unsigned char> k(kvscope::bench::random_tensor(kk::DType::kF16, n, 1));
  DeviceBuffer<unsigned char> v(kvscope::bench::random_tensor(kk::DType::kF16, n, 2));
  DeviceBuffer<float> sim(kHeads * kHeads), ko(n), vo(n);
  DeviceBuffer<std::int32_t> cid(kHeads), qmap(kHeads);
  if (!k.ok() || !v.ok() || !ko.ok() || !vo.ok()) {
    state.SkipWithError("device allocation failed");
    return;
  }
  int merged = 0;
  const bool ok = kvscope::bench::time_cuda(state, nullptr, [&]() {
    return kk::cuda::merge_heads(p, k.get(), v.get(), nullptr, sim.get(), cid.get(), &merged, ko.get(),
                                 vo.get(), qmap.get(), nullptr);
  });
  if (ok) kvscope::bench::set_compute_counters(state, head_flops(T), head_bytes(T));
}
BENCHMARK(BM_merge_heads_cuda)
    ->Name("BM_merge_heads/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
