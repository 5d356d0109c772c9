// Quantization benchmarks on one llava-1.5-7b layer, [32 heads, T, 128] fp16, T in
// {576, 2048, 8192}. Memory-bound: bytes = compulsory traffic, i.e. the input read
// once plus everything written (codes, scales, zeros, residual) for quantize, and the
// stored bytes read plus the float32 output written for dequantize. Per-token and
// per-channel quantization read each input row once from memory (statistics and codes
// while the row or the 32-token block is in cache); per-tensor/per-head (the fused int4
// benchmark) must read the input twice, once for the global statistics and once to
// encode: the second read is not counted, so that rate is a lower bound on the traffic.
#include <cstdint>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/quantize.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/quantize_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;

constexpr kk::QuantSpec kInt8PerToken{8, true, kk::Granularity::kPerToken, 0, 0};
constexpr kk::QuantSpec kKivi2Keys = kk::kivi_key_spec(2, 32, 128);
constexpr kk::QuantSpec kKivi2Values = kk::kivi_value_spec(2, 32, 128);

kk::QuantShape layer(const benchmark::State& state) {
  return kk::QuantShape{kHeads, static_cast<int>(state.range(0)), kHeadDim, kk::DType::kF16};
}
double input_bytes(const kk::QuantShape& s) {
  return static_cast<double>(s.num_heads) * s.tokens * s.head_dim *
         static_cast<double>(kk::dtype_bytes(s.dtype));
}
double stored_bytes(const kk::QuantSpec& spec, const kk::QuantShape& s) {
  return static_cast<double>(kk::quantized_bytes(spec, s.num_heads, s.tokens, s.head_dim, s.dtype).total);
}

// Host buffers sized by quant_layout.
struct HostQuant {
  HostQuant(const kk::QuantSpec& spec, const kk::QuantShape& s) {
    kk::QuantLayout l;
    (void)kk::quant_layout(spec, s, &l);
    codes.resize(static_cast<std::size_t>(l.code_bytes));
    scales.resize(static_cast<std::size_t>(l.num_groups));
    zeros.resize(static_cast<std::size_t>(l.zero_bytes / 4));
    residual.resize(static_cast<std::size_t>(l.residual_bytes));
  }
  kk::QuantBuffers buffers() { return {codes.data(), scales.data(), zeros.data(), residual.data()}; }
  std::vector<std::uint8_t> codes, residual;
  std::vector<float> scales, zeros;
};

void BM_quantize_int8_per_token_cpu(benchmark::State& state) {
  const kk::QuantShape s = layer(state);
  const auto x = kvscope::bench::random_tensor(s.dtype, static_cast<std::size_t>(input_bytes(s) / 2), 1);
  HostQuant q(kInt8PerToken, s);
  for (auto _ : state) {
    if (!kk::cpu::quantize(kInt8PerToken, s, x.data(), q.buffers()).ok())
      state.SkipWithError("quantize failed");
    benchmark::ClobberMemory();
  }
  kvscope::bench::set_mem_counters(state, input_bytes(s), stored_bytes(kInt8PerToken, s));
}
BENCHMARK(BM_quantize_int8_per_token_cpu)
    ->Name("BM_quantize_int8_per_token/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

void BM_dequantize_int8_cpu(benchmark::State& state) {
  const kk::QuantShape s = layer(state);
  const auto x = kvscope::bench::random_tensor(s.dtype, static_cast<std::size_t>(input_bytes(s) / 2), 2);
  HostQuant q(kInt8PerToken, s);
  if (!kk::cpu::quantize(kInt8PerToken, s, x.data(), q.buffers()).ok())
    state.SkipWithError("quantize failed");
  std::vector<float> out(static_cast<std::size_t>(input_bytes(s) / 2));
  for (auto _ : state) {
    if (!kk::cpu::dequantize(kInt8PerToken, s, kk::as_const(q.buffers()), out.data()).ok()) {
      state.SkipWithError("dequantize failed");
    }
    benchmark::ClobberMemory();
  }
  kvscope::bench::set_mem_counters(state, stored_bytes(kInt8PerToken, s), input_bytes(s) * 2);
}
BENCHMARK(BM_dequantize_int8_cpu)
    ->Name("BM_dequantize_int8/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

// KIVI 2-bit: keys per channel (groups of 32 tokens), values per token (groups of 32
// channels), 128 residual tokens; one iteration quantizes both K and V.
void BM_quantize_kivi2_cpu(benchmark::State& state) {
  const kk::QuantShape s = layer(state);
  const std::size_t n = static_cast<std::size_t>(input_bytes(s) / 2);
  const auto k = kvscope::bench::random_tensor(s.dtype, n, 3),
             v = kvscope::bench::random_tensor(s.dtype, n, 4);
  HostQuant qk(kKivi2Keys, s), qv(kKivi2Values, s);
  for (auto _ : state) {
    if (!kk::cpu::quantize(kKivi2Keys, s, k.data(), qk.buffers()).ok() ||
        !kk::cpu::quantize(kKivi2Values, s, v.data(), qv.buffers()).ok()) {
      state.SkipWithError("quantize failed");
    }
    benchmark::ClobberMemory();
  }
  kvscope::bench::set_mem_counters(state, 2 * input_bytes(s),
                                   stored_bytes(kKivi2Keys, s) + stored_bytes(kKivi2Values, s));
}
BENCHMARK(BM_quantize_kivi2_cpu)
    ->Name("BM_quantize_kivi2/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

// Fake quantization (what the simulator runs to measure error): int4 per head, fp32 out.
void BM_quantize_dequantize_int4_cpu(benchmark::State& state) {
  const kk::QuantShape s = layer(state);
  const kk::QuantSpec spec{4, true, kk::Granularity::kPerHead, 0, 0};
  const auto x = kvscope::bench::random_tensor(s.dtype, static_cast<std::size_t>(input_bytes(s) / 2), 5);
  std::vector<float> out(static_cast<std::size_t>(input_bytes(s) / 2));
  for (auto _ : state) {
    if (!kk::cpu::quantize_dequantize(spec, s, x.data(), out.data()).ok()) state.SkipWithError("failed");
    benchmark::ClobberMemory();
  }
  kvscope::bench::set_mem_counters(state, input_bytes(s), input_bytes(s) * 2);
}
BENCHMARK(BM_quantize_dequantize_int4_cpu)
    ->Name("BM_quantize_dequantize_int4/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
// Device buffers sized by quant_layout.
struct DeviceQuant {
  DeviceQuant(const kk::QuantSpec& spec, const kk::QuantShape& s)
      : codes(size_of(spec, s).code_bytes),
        scales(static_cast<std::size_t>(size_of(spec, s).num_groups)),
        zeros(static_cast<std::size_t>(size_of(spec, s).zero_bytes / 4)),
        residual(size_of(spec, s).residual_bytes) {}
  static kk::QuantLayout size_of(const kk::QuantSpec& spec, const kk::QuantShape& s) {
    kk::QuantLayout l;
    (void)kk::quant_layout(spec, s, &l);
    return l;
  }
  bool ok() const { return codes.ok() && scales.ok() && zeros.ok() && residual.ok(); }
  kk::QuantBuffers buffers() const { return {codes.get(), scales.get(), zeros.get(), residual.get()}; }
  kvscope::bench::DeviceBuffer<std::uint8_t> codes;
  kvscope::bench::DeviceBuffer<float> scales, zeros;
  kvscope::bench::DeviceBuffer<std::uint8_t> residual;
};

void BM_quantize_int8_per_token_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const kk::QuantShape s = layer(state);
  kvscope::bench::DeviceBuffer<unsigned char> x(
      kvscope::bench::random_tensor(s.dtype, static_cast<std::size_t>(input_bytes(s) / 2), 1));
  DeviceQuant q(kInt8PerToken, s);
  if (!x.ok() || !q.ok()) return state.SkipWithError("device allocation failed");
  if (kvscope::bench::time_cuda(state, nullptr, [&]() {
        return kk::cuda::quantize(kInt8PerToken, s, x.get(), q.buffers(), nullptr);
      })) {
    kvscope::bench::set_mem_counters(state, input_bytes(s), stored_bytes(kInt8PerToken, s));
  }
}
BENCHMARK(BM_quantize_int8_per_token_cuda)
    ->Name("BM_quantize_int8_per_token/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();

void BM_dequantize_int8_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const kk::QuantShape s = layer(state);
  kvscope::bench::DeviceBuffer<unsigned char> x(
      kvscope::bench::random_tensor(s.dtype, static_cast<std::size_t>(input_bytes(s) / 2), 2));
  DeviceQuant q(kInt8PerToken, s);
  kvscope::bench::DeviceBuffer<float> out(static_cast<std::size_t>(input_bytes(s) / 2));
  if (!x.ok() || !q.ok() || !out.ok()) return state.SkipWithError("device allocation failed");
  if (!kk::cuda::quantize(kInt8PerToken, s, x.get(), q.buffers(), nullptr).ok()) {
    return state.SkipWithError("quantize failed");
  }
  if (kvscope::bench::time_cuda(state, nullptr, [&]() {
        return kk::cuda::dequantize(kInt8PerToken, s, kk::as_const(q.buffers()), out.get(), nullptr);
      })) {
    kvscope::bench::set_mem_counters(state, stored_bytes(kInt8PerToken, s), input_bytes(s) * 2);
  }
}
BENCHMARK(BM_dequantize_int8_cuda)
    ->Name("BM_dequantize_int8/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();

void BM_quantize_kivi2_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const kk::QuantShape s = layer(state);
  const std::size_t n = static_cast<std::size_t>(input_bytes(s) / 2);
  kvscope::bench::DeviceBuffer<unsigned char> k(kvscope::bench::random_tensor(s.dtype, n, 3));
  kvscope::bench::DeviceBuffer<unsigned char> v(kvscope::bench::random_tensor(s.dtype, n, 4));
  DeviceQuant qk(kKivi2Keys, s), qv(kKivi2Values, s);
  if (!k.ok() || !v.ok() || !qk.ok() || !qv.ok()) return state.SkipWithError("device allocation failed");
  if (kvscope::bench::time_cuda(state, nullptr, [&]() {
        KVSCOPE_RETURN_IF_ERROR(kk::cuda::quantize(kKivi2Keys, s, k.get(), qk.buffers(), nullptr));
        return kk::cuda::quantize(kKivi2Values, s, v.get(), qv.buffers(), nullptr);
      })) {
    kvscope::bench::set_mem_counters(state, 2 * input_bytes(s),
                                     stored_bytes(kKivi2Keys, s) + stored_bytes(kKivi2Values, s));
  }
}
BENCHMARK(BM_quantize_kivi2_cuda)
    ->Name("BM_quantize_kivi2/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();

void BM_quantize_dequantize_int4_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const kk::QuantShape s = layer(state);
  const kk::QuantSpec spec{4, true, kk::Granularity::kPerHead, 0, 0};
  kvscope::bench::DeviceBuffer<unsigned char> x(
      kvscope::bench::random_tensor(s.dtype, static_cast<std::size_t>(input_bytes(s) / 2), 5));
  kvscope::bench::DeviceBuffer<float> out(static_cast<std::size_t>(input_bytes(s) / 2));
  if (!x.ok() || !out.ok()) return state.SkipWithError("device allocation failed");
  if (kvscope::bench::time_cuda(state, nullptr, [&]() {
        return kk::cuda::quantize_dequantize(spec, s, x.get(), out.get(), nullptr);
      })) {
    kvscope::bench::set_mem_counters(state, input_bytes(s), input_bytes(s) * 2);
  }
}
BENCHMARK(BM_quantize_dequantize_int4_cuda)
    ->Name("BM_quantize_dequantize_int4/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
