// Reference benchmark: copy one llava-1.5-7b layer's K (or V) cache,
// [32 heads, T tokens, 128] fp16, with the same thread count as the kernels (CPU) or
// a device-to-device cudaMemcpyAsync (CUDA). Memory-bound: reads + writes the layer.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bench_util.hpp"

namespace {

using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

std::size_t layer_bytes(const benchmark::State& state) {
  return static_cast<std::size_t>(kHeads) * static_cast<std::size_t>(state.range(0)) * kHeadDim *
         sizeof(std::uint16_t);
}

void BM_copy_layer_cpu(benchmark::State& state) {
  const std::size_t bytes = layer_bytes(state);
  const std::vector<std::uint16_t> src = kvscope::bench::random_f16(bytes / 2, 42);
  std::vector<std::uint16_t> dst(src.size());
  const auto* s = reinterpret_cast<const unsigned char*>(src.data());
  auto* d = reinterpret_cast<unsigned char*>(dst.data());
  for (auto _ : state) {
    // One contiguous chunk per thread.
#pragma omp parallel
    {
      const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
      const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
      const std::size_t lo = bytes * t / nt, hi = bytes * (t + 1) / nt;
      std::memcpy(d + lo, s + lo, hi - lo);
    }
    benchmark::DoNotOptimize(d);
    benchmark::ClobberMemory();
  }
  kvscope::bench::set_mem_counters(state, static_cast<double>(bytes), static_cast<double>(bytes));
}
BENCHMARK(BM_copy_layer_cpu)
    ->Name("BM_copy_layer/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
void BM_copy_layer_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const std::size_t bytes = layer_bytes(state);
  kvscope::bench::DeviceBuffer<std::uint16_t> src(kvscope::bench::random_f16(bytes / 2, 42));
  kvscope::bench::DeviceBuffer<std::uint16_t> dst(bytes / 2);
  if (!src.ok() || !dst.ok()) {
    state.SkipWithError((src.ok() ? dst.error() : src.error()).c_str());
    return;
  }
  const bool ok = kvscope::bench::time_cuda(state, nullptr, [&]() {
    const cudaError_t e = cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, nullptr);
    return e == cudaSuccess
               ? kvscope::kernels::Status::Ok()
               : kvscope::kernels::Status::Cuda(std::string("cudaMemcpyAsync: ") + cudaGetErrorString(e));
  });
  if (ok) kvscope::bench::set_mem_counters(state, static_cast<double>(bytes), static_cast<double>(bytes));
}
BENCHMARK(BM_copy_layer_cuda)
    ->Name("BM_copy_layer/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
