// Token scores on one llava-1.5-7b layer (32 heads, head_dim 128, fp16 keys),
// T in {576, 2048, 8192}; memory-bound ("mem"):
//  - key norms: read K, write [32, T] float;
//  - redundancy: read K once (neighbour rows come from cache), the neighbour
//    lists and write [32, T] float; layout = 16 text tokens, then as many
//    24 x 24 images as fit, then text; k = 4, grid radius 1;
//  - UniCache score: read a, c, d ([32, T] float each) and modality, write [32, T].
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/scores.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/scores_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

double key_bytes(int t) { return 2.0 * kHeads * t * kHeadDim; }

kk::NeighbourTable llava_neighbours(int t) {
  std::vector<std::int32_t> row(t, -1), col(t, -1), seg(t, -1);
  int pos = 16, s = 0;
  while (pos + 576 <= t) {
    for (int p = 0; p < 576; ++p) row[pos + p] = p / 24, col[pos + p] = p % 24, seg[pos + p] = s;
    pos += 576, ++s;
  }
  kk::NeighbourTable table;
  (void)kk::cpu::build_neighbour_lists(kk::TokenGrid{row.data(), col.data(), seg.data(), t},
                                       kk::RedundancyParams{4, 1}, &table);
  return table;
}

struct UniInputs {
  std::vector<float> a, c, d;
  std::vector<std::uint8_t> mod;
};
UniInputs uni_inputs(int t) {
  const std::size_t n = static_cast<std::size_t>(kHeads) * t;
  UniInputs u{kvscope::bench::random_f32(n, 3), kvscope::bench::random_f32(n, 4),
              kvscope::bench::random_f32(n, 5), std::vector<std::uint8_t>(t)};
  for (int i = 0; i < t; ++i) u.mod[i] = static_cast<std::uint8_t>(i % 5 == 0 ? 0 : 1);
  return u;
}

void BM_key_norms_cpu(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const auto k =
      kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * t * kHeadDim, 1);
  std::vector<float> out(static_cast<std::size_t>(kHeads) * t);
  for (auto _ : state) {
    const kk::Status s =
        kk::cpu::key_norms(kk::KeyTensor{k.data(), kHeads, t, kHeadDim, kk::DType::kF16}, out.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  kvscope::bench::set_mem_counters(state, key_bytes(t), 4.0 * kHeads * t);
}
BENCHMARK(BM_key_norms_cpu)
    ->Name("BM_scores_key_norms/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

void BM_redundancy_cpu(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const auto k =
      kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * t * kHeadDim, 1);
  const kk::NeighbourTable nb = llava_neighbours(t);
  std::vector<float> out(static_cast<std::size_t>(kHeads) * t);
  for (auto _ : state) {
    const kk::Status s = kk::cpu::redundancy(kk::KeyTensor{k.data(), kHeads, t, kHeadDim, kk::DType::kF16},
                                             nb.view(), out.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  kvscope::bench::set_mem_counters(state, key_bytes(t) + 4.0 * (nb.offsets.size() + nb.indices.size()),
                                   4.0 * kHeads * t);
}
BENCHMARK(BM_redundancy_cpu)
    ->Name("BM_scores_redundancy/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

void BM_unicache_cpu(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const UniInputs u = uni_inputs(t);
  std::vector<float> out(u.a.size());
  for (auto _ : state) {
    const kk::Status s = kk::cpu::unicache_score(
        kk::UniCacheInputs{u.a.data(), u.c.data(), u.d.data(), u.mod.data(), kHeads, t}, {}, out.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  kvscope::bench::set_mem_counters(state, 12.0 * kHeads * t + t, 4.0 * kHeads * t);
}
BENCHMARK(BM_unicache_cpu)
    ->Name("BM_scores_unicache/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
void BM_key_norms_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const int t = static_cast<int>(state.range(0));
  kvscope::bench::DeviceBuffer<unsigned char> k(
      kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * t * kHeadDim, 1));
  kvscope::bench::DeviceBuffer<float> out(static_cast<std::size_t>(kHeads) * t);
  if (!k.ok() || !out.ok()) return state.SkipWithError("device allocation failed");
  const kk::KeyTensor kt{k.get(), kHeads, t, kHeadDim, kk::DType::kF16};
  if (kvscope::bench::time_cuda(state, nullptr,
                                [&]() { return kk::cuda::key_norms(kt, out.get(), nullptr); })) {
    kvscope::bench::set_mem_counters(state, key_bytes(t), 4.0 * kHeads * t);
  }
}
BENCHMARK(BM_key_norms_cuda)
    ->Name("BM_scores_key_norms/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();

void BM_redundancy_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const int t = static_cast<int>(state.range(0));
  const kk::NeighbourTable nb = llava_neighbours(t);
  kvscope::bench::DeviceBuffer<unsigned char> k(
      kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * t * kHeadDim, 1));
  kvscope::bench::DeviceBuffer<std::int32_t> off(nb.offsets), idx(nb.indices);
  kvscope::bench::DeviceBuffer<float> out(static_cast<std::size_t>(kHeads) * t);
  if (!k.ok() || !off.ok() || !idx.ok() || !out.ok()) return state.SkipWithError("device allocation failed");
  const kk::KeyTensor kt{k.get(), kHeads, t, kHeadDim, kk::DType::kF16};
  const kk::NeighbourLists lists{off.get(), idx.get(), t};
  if (kvscope::bench::time_cuda(state, nullptr,
                                [&]() { return kk::cuda::redundancy(kt, lists, out.get(), nullptr); })) {
    kvscope::bench::set_mem_counters(state, key_bytes(t) + 4.0 * (nb.offsets.size() + nb.indices.size()),
                                     4.0 * kHeads * t);
  }
}
BENCHMARK(BM_redundancy_cuda)
    ->Name("BM_scores_redundancy/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();

void BM_unicache_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const int t = static_cast<int>(state.range(0));
  const UniInputs u = uni_inputs(t);
  kvscope::bench::DeviceBuffer<float> a(u.a), c(u.c), d(u.d), out(u.a.size());
  kvscope::bench::DeviceBuffer<std::uint8_t> mod(u.mod);
  if (!a.ok() || !c.ok() || !d.ok() || !out.ok() || !mod.ok())
    return state.SkipWithError("device allocation failed");
  const kk::UniCacheInputs in{a.get(), c.get(), d.get(), mod.get(), kHeads, t};
  if (kvscope::bench::time_cuda(state, nullptr,
                                [&]() { return kk::cuda::unicache_score(in, {}, out.get(), nullptr); })) {
    kvscope::bench::set_mem_counters(state, 12.0 * kHeads * t + t, 4.0 * kHeads * t);
  }
}
BENCHMARK(BM_unicache_cuda)
    ->Name("BM_scores_unicache/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
