// Compaction benchmark on one llava-1.5-7b layer: gather K and V ([32 heads, T, 128]
// fp16) at a shared list of T/2 kept tokens (every other token) into [32, T/2, 128].
// Memory-bound: bytes = kept rows read + written for K and V, plus the index list.
// The CUDA variant times compact_unchecked (no stream synchronisation for the index check).
#include <cstdint>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/compact.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/compact_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

kk::CompactShape layer(const benchmark::State& state) {
  return kk::CompactShape{kHeads, static_cast<int>(state.range(0)), kHeadDim, kk::DType::kF16};
}
std::vector<std::int32_t> every_other(int tokens) {
  std::vector<std::int32_t> idx;
  for (int t = 0; t < tokens; t += 2) idx.push_back(t);
  return idx;
}
// Bytes read (kept K and V rows + indices) and written (the gathered K and V).
double rows_bytes(const kk::CompactShape& s, std::size_t kept) {
  return 2.0 * s.num_heads * static_cast<double>(kept) * s.head_dim *
         static_cast<double>(kk::dtype_bytes(s.dtype));
}

void BM_gather_cpu(benchmark::State& state) {
  const kk::CompactShape s = layer(state);
  const std::size_t n = static_cast<std::size_t>(s.num_heads) * s.tokens * s.head_dim;
  const auto k = kvscope::bench::random_tensor(s.dtype, n, 1),
             v = kvscope::bench::random_tensor(s.dtype, n, 2);
  const auto idx = every_other(s.tokens);
  const kk::KeptIndices kept{idx.data(), nullptr, static_cast<int>(idx.size())};
  std::vector<unsigned char> ok(static_cast<std::size_t>(rows_bytes(s, idx.size()) / 2)), ov(ok.size());
  kk::CompactInputs in;
  in.keys = k.data();
  in.values = v.data();
  kk::CompactOutputs out;
  out.keys = ok.data();
  out.values = ov.data();
  for (auto _ : state) {
    if (!kk::cpu::compact(s, kept, in, out).ok()) state.SkipWithError("compact failed");
    benchmark::ClobberMemory();
  }
  kvscope::bench::set_mem_counters(state, rows_bytes(s, idx.size()) + 4.0 * static_cast<double>(idx.size()),
                                   rows_bytes(s, idx.size()));
}
BENCHMARK(BM_gather_cpu)->Name("BM_gather/cpu")->Apply(kvscope::bench::llava_token_args)->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
void BM_gather_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const kk::CompactShape s = layer(state);
  const std::size_t n = static_cast<std::size_t>(s.num_heads) * s.tokens * s.head_dim;
  const auto idx_host = every_other(s.tokens);
  kvscope::bench::DeviceBuffer<unsigned char> k(kvscope::bench::random_tensor(s.dtype, n, 1));
  kvscope::bench::DeviceBuffer<unsigned char> v(kvscope::bench::random_tensor(s.dtype, n, 2));
  kvscope::bench::DeviceBuffer<std::int32_t> idx(idx_host);
  const std::size_t out_bytes = static_cast<std::size_t>(rows_bytes(s, idx_host.size()) / 2);
  kvscope::bench::DeviceBuffer<unsigned char> ok(out_bytes), ov(out_bytes);
  if (!k.ok() || !v.ok() || !idx.ok() || !ok.ok() || !ov.ok())
    return state.SkipWithError("device allocation failed");
  const kk::KeptIndices kept{idx.get(), nullptr, static_cast<int>(idx_host.size())};
  kk::CompactInputs in;
  in.keys = k.get();
  in.values = v.get();
  kk::CompactOutputs out;
  out.keys = ok.get();
  out.values = ov.get();
  if (kvscope::bench::time_cuda(state, nullptr, [&]() {
        return kk::cuda::compact_unchecked(s, kept, in, out, nullptr, nullptr);
      })) {
    kvscope::bench::set_mem_counters(
        state, rows_bytes(s, idx_host.size()) + 4.0 * static_cast<double>(idx_host.size()),
        rows_bytes(s, idx_host.size()));
  }
}
BENCHMARK(BM_gather_cuda)->Name("BM_gather/cuda")->Apply(kvscope::bench::llava_token_args)->UseManualTime();
#endif

}  // namespace
