// Token merging (kvscope/kernels/merge.hpp) on one llava-1.5-7b layer: 32 heads,
// T in {576, 2048, 8192}, head_dim 128, fp16 K/V, every other token kept (K = T/2),
// window 8, threshold 0.5, importance weights given.
//
// Counted as compute-bound (label "compute"): each evicted token computes cosines with
// the kept tokens in its window (8 for this pattern), 2 FLOPs per multiply-add:
//   flops ~= H * [ (T - K) * 8 * 2*D      (assignment cosines)
//                + T * 2 * 2*D            (key and value norms)
//                + T * 2 * 2*D ]          (weighted sums of K and V)
// Bytes: K, V read once (fp16), importance, the outputs (fp32 slots, int32 maps).
#include <cstdint>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/merge.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/merge_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

struct MergeInputs {
  kk::MergeParams params;
  std::vector<unsigned char> k, v;
  std::vector<float> importance;
  std::vector<std::int32_t> kept;
  explicit MergeInputs(int T) {
    params.num_heads = kHeads;
    params.num_tokens = T;
    params.head_dim = kHeadDim;
    params.num_kept = (T + 1) / 2;
    params.window = 8;
    params.threshold = 0.5f;
    params.dtype = kk::DType::kF16;
    const std::size_t n = static_cast<std::size_t>(kHeads) * T * kHeadDim;
    // Smooth keys along tokens (neighbours similar), so a good share of tokens merges.
    std::vector<float> base = kvscope::bench::random_f32(n, 1),
                       noise = kvscope::bench::random_f32(n, 2, 0.4f);
    for (std::size_t i = kHeadDim; i < n; ++i) base[i] = 0.9f * base[i - kHeadDim] + noise[i];
    k.resize(n * 2);
    auto* kb = reinterpret_cast<std::uint16_t*>(k.data());
    for (std::size_t i = 0; i < n; ++i) kb[i] = kk::float_to_half(base[i]);
    v = kvscope::bench::random_tensor(kk::DType::kF16, n, 3);
    importance = kvscope::bench::random_f32(static_cast<std::size_t>(kHeads) * T, 4);
    for (int h = 0; h < kHeads; ++h)
      for (int s = 0; s < params.num_kept; ++s) kept.push_back(2 * s);
  }
  double flops() const {
    const double T = params.num_tokens, K = params.num_kept, D = kHeadDim;
    return kHeads * ((T - K) * 8 * 2 * D + T * 4 * D + T * 4 * D);
  }
  double bytes() const {
    const double T = params.num_tokens, K = params.num_kept, D = kHeadDim;
    return static_cast<double>(k.size() + v.size()) + kHeads * (4 * T + 4 * K * 2 * D + 4 * K + 4 * T);
  }
};

void BM_merge_tokens_cpu(benchmark::State& state) {
  const MergeInputs in(static_cast<int>(state.range(0)));
  const std::size_t slots = static_cast<std::size_t>(kHeads) * in.params.num_kept;
  std::vector<float> ko(slots * kHeadDim), vo(slots * kHeadDim);
  std::vector<std::int32_t> mult(slots), map(static_cast<std::size_t>(kHeads) * in.params.num_tokens);
  for (auto _ : state) {
    const kk::Status s =
        kk::cpu::merge_tokens(in.params, in.k.data(), in.v.data(), in.kept.data(), in.importance.data(),
                              ko.data(), vo.data(), mult.data(), map.data());
    if (!s.ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(ko.data());
  }
  kvscope::bench::set_compute_counters(state, in.flops(), in.bytes());
}
BENCHMARK(BM_merge_tokens_cpu)
    ->Name("BM_merge_tokens/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
void BM_merge_tokens_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const MergeInputs in(static_cast<int>(state.range(0)));
  using kvscope::bench::DeviceBuffer;
  const std::size_t slots = static_cast<std::size_t>(kHeads) * in.params.num_kept;
  DeviceBuffer<unsigned char> k(in.k), v(in.v);
  DeviceBuffer<float> imp(in.importance), ko(slots * kHeadDim), vo(slots * kHeadDim);
  DeviceBuffer<std::int32_t> kept(in.kept), mult(slots),
      map(static_cast<std::size_t>(kHeads) * in.params.num_tokens);
  if (!k.ok() || !v.ok() || !ko.ok() || !vo.ok() || !map.ok()) {
    state.SkipWithError("device allocation failed");
    return;
  }
  const bool ok = kvscope::bench::time_cuda(state, nullptr, [&]() {
    return kk::cuda::merge_tokens(in.params, k.get(), v.get(), kept.get(), imp.get(), ko.get(), vo.get(),
                                  mult.get(), map.get(), nullptr);
  });
  if (ok) kvscope::bench::set_compute_counters(state, in.flops(), in.bytes());
}
BENCHMARK(BM_merge_tokens_cuda)
    ->Name("BM_merge_tokens/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
