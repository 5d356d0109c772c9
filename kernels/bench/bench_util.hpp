// Helpers for kvbench benchmark files (kernels/bench/bench_<family>.cpp).
//
// Conventions the kvbench ceiling table relies on:
//  - name benchmarks BM_<family>_<op>/<backend> with backend "cpu" or "cuda"
//    (BENCHMARK(BM_quantize_int8_cpu)->Name("BM_quantize_int8/cpu")->...);
//  - after the timing loop call set_mem_counters() (memory-bound: compared with the
//    triad bandwidth of the backend) or set_compute_counters() (compute-bound:
//    compared with the sgemm rate of the backend);
//  - CPU benchmarks run OpenMP kernels: register them with ->UseRealTime();
//    CUDA benchmarks time with time_cuda() and register with ->UseManualTime().
//
// Dependency-light: Google Benchmark and the kernels' common headers; CUDA headers
// only when KVSCOPE_HAVE_CUDA is defined.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvscope/kernels/common.hpp"
#include "kvscope/kernels/device.hpp"

#if defined(KVSCOPE_HAVE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kvscope::bench {

// Per-iteration work counters read by kvbench (shown as averages per iteration).
inline constexpr const char* kBytesCounter = "kv_bytes";
inline constexpr const char* kFlopsCounter = "kv_flops";
// Labels that select the ceiling a benchmark is compared with.
inline constexpr const char* kMemLabel = "mem";
inline constexpr const char* kComputeLabel = "compute";

// Realistic shapes: one llava-1.5-7b layer, evaluated with 32 queries.
inline constexpr int kHeads = 32;
inline constexpr int kHeadDim = 128;
inline constexpr int kQueries = 32;
inline constexpr int kTokens[] = {576, 2048, 8192};

// Registers the three llava token counts as the benchmark's argument "T".
inline void llava_token_args(benchmark::internal::Benchmark* b) {
  b->ArgName("T");
  for (int t : kTokens) b->Arg(t);
}

// Memory-bound benchmark: bytes read and written by ONE iteration. Call after the loop.
inline void set_mem_counters(benchmark::State& state, double bytes_read, double bytes_written) {
  const double iters = static_cast<double>(state.iterations());
  const double bytes = bytes_read + bytes_written;
  state.SetBytesProcessed(static_cast<std::int64_t>(iters * bytes));
  state.counters[kBytesCounter] = benchmark::Counter(iters * bytes, benchmark::Counter::kAvgIterations);
  state.SetLabel(kMemLabel);
}

// Compute-bound benchmark: floating-point operations and bytes moved by ONE iteration.
// Call after the loop.
inline void set_compute_counters(benchmark::State& state, double flops, double bytes) {
  const double iters = static_cast<double>(state.iterations());
  state.counters["FLOP/s"] = benchmark::Counter(iters * flops, benchmark::Counter::kIsRate);
  state.counters[kFlopsCounter] = benchmark::Counter(iters * flops, benchmark::Counter::kAvgIterations);
  if (bytes > 0) {
    state.SetBytesProcessed(static_cast<std::int64_t>(iters * bytes));
    state.counters[kBytesCounter] = benchmark::Counter(iters * bytes, benchmark::Counter::kAvgIterations);
  }
  state.SetLabel(kComputeLabel);
}

// Seeded normal(0, stddev) values.
inline std::vector<float> random_f32(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Seeded normal(0, stddev) values as IEEE fp16 bits.
inline std::vector<std::uint16_t> random_f16(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  const std::vector<float> f = random_f32(n, seed, stddev);
  std::vector<std::uint16_t> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = kernels::float_to_half(f[i]);
  return h;
}

// Seeded normal(0, stddev) values as bfloat16 bits.
inline std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  const std::vector<float> f = random_f32(n, seed, stddev);
  std::vector<std::uint16_t> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = kernels::float_to_bf16(f[i]);
  return h;
}

// n seeded elements of type t as raw bytes (n * dtype_bytes(t) bytes).
inline std::vector<unsigned char> random_tensor(kernels::DType t, std::size_t n, std::uint64_t seed,
                                                float stddev = 1.0f) {
  std::vector<unsigned char> out(n * kernels::dtype_bytes(t));
  if (t == kernels::DType::kF32) {
    const auto v = random_f32(n, seed, stddev);
    if (n) std::memcpy(out.data(), v.data(), out.size());
  } else {
    const auto v = t == kernels::DType::kF16 ? random_f16(n, seed, stddev) : random_bf16(n, seed, stddev);
    if (n) std::memcpy(out.data(), v.data(), out.size());
  }
  return out;
}

// True when a CUDA device is usable now (always false in CPU-only builds).
inline bool gpu_present() {
  static const bool present = kernels::cuda_device_count() > 0;
  return present;
}

}  // namespace kvscope::bench

// Family marker: kvbench's CMake compiles bench_<family>.cpp with KVBENCH_FAMILY="<family>".
// This registers a no-op benchmark named "kvbench_family:<family>" before the file's
// own BENCHMARK registrations (static initialisation runs in order of definition within
// a file), so kvbench assigns every benchmark registered after it to this family and
// runs each family under its own NVTX range. kvbench never runs the markers.
#if defined(KVBENCH_FAMILY)
namespace {
[[maybe_unused]] benchmark::internal::Benchmark* const kvbench_family_marker =
    benchmark::RegisterBenchmark("kvbench_family:" KVBENCH_FAMILY, [](benchmark::State& state) {
      for (auto _ : state) {
      }
    });
}  // namespace
#endif

// First statement of every CUDA benchmark: skips it with "no GPU" when none is present.
#define KVSCOPE_BENCH_REQUIRE_GPU(state)    \
  do {                                      \
    if (!::kvscope::bench::gpu_present()) { \
      (state).SkipWithError("no GPU");      \
      return;                               \
    }                                       \
  } while (0)

#if defined(KVSCOPE_HAVE_CUDA)
namespace kvscope::bench {

// Device allocation owned by a benchmark. Check ok() before use.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    err_ = cudaMalloc(reinterpret_cast<void**>(&ptr_), (n ? n : 1) * sizeof(T));
    if (err_ != cudaSuccess) ptr_ = nullptr;
  }
  // Allocates and uploads host data.
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (ok() && !host.empty())
      err_ = cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() {
    if (ptr_) (void)cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  bool ok() const { return err_ == cudaSuccess; }
  std::string error() const { return std::string("DeviceBuffer: ") + cudaGetErrorString(err_); }
  T* get() const { return ptr_; }
  std::size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
  cudaError_t err_ = cudaSuccess;
};

// Scratch buffer twice the device's L2 size, written before each timed launch so that
// inputs smaller than L2 (a 16 MiB layer vs the H200's 60 MB L2) are read from DRAM.
inline void* l2_flush_buffer(std::size_t* bytes) {
  static void* buf = nullptr;
  static std::size_t size = 0;
  if (!buf) {
    int dev = 0, l2 = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) == cudaSuccess && l2 > 0) {
      size = 2 * static_cast<std::size_t>(l2);
      if (cudaMalloc(&buf, size) != cudaSuccess) {
        (void)cudaGetLastError();
        buf = nullptr;
        size = 0;
      }
    }
  }
  *bytes = size;
  return buf;
}

// Times `launch` (a callable returning kvscope::kernels::Status that enqueues work on
// `stream`) with CUDA events around each iteration and reports the event time through
// state.SetIterationTime (register the benchmark with ->UseManualTime()). One untimed
// warm-up launch first. When flush_l2 is set, an L2-sized memset runs before each
// timed launch, outside the events. Returns false (benchmark skipped with the error
// message) on the first failed launch or CUDA call.
template <typename Launch>
bool time_cuda(benchmark::State& state, cudaStream_t stream, Launch&& launch, bool flush_l2 = true) {
  auto fail = [&state](const std::string& msg) {
    state.SkipWithError(msg.c_str());
    return false;
  };
  auto cuda_fail = [&fail](cudaError_t e, const char* what) {
    return fail(std::string(what) + ": " + cudaGetErrorString(e));
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t e = cudaEventCreate(&start);
  if (e != cudaSuccess) return cuda_fail(e, "cudaEventCreate");
  e = cudaEventCreate(&stop);
  if (e != cudaSuccess) {
    (void)cudaEventDestroy(start);
    return cuda_fail(e, "cudaEventCreate");
  }
  struct Events {
    cudaEvent_t a, b;
    ~Events() {
      (void)cudaEventDestroy(a);
      (void)cudaEventDestroy(b);
    }
  } events{start, stop};

  kernels::Status s = launch();
  if (!s.ok()) return fail(s.message());
  if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return cuda_fail(e, "warm-up");

  std::size_t flush_bytes = 0;
  void* flush = flush_l2 ? l2_flush_buffer(&flush_bytes) : nullptr;
  for (auto _ : state) {
    if (flush && (e = cudaMemsetAsync(flush, 0, flush_bytes, stream)) != cudaSuccess) {
      return cuda_fail(e, "L2 flush");
    }
    if ((e = cudaEventRecord(start, stream)) != cudaSuccess) return cuda_fail(e, "cudaEventRecord");
    s = launch();
    if (!s.ok()) return fail(s.message());
    if ((e = cudaEventRecord(stop, stream)) != cudaSuccess) return cuda_fail(e, "cudaEventRecord");
    if ((e = cudaEventSynchronize(stop)) != cudaSuccess) return cuda_fail(e, "cudaEventSynchronize");
    float ms = 0.0f;
    if ((e = cudaEventElapsedTime(&ms, start, stop)) != cudaSuccess)
      return cuda_fail(e, "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
  }
  return true;
}

}  // namespace kvscope::bench
#endif  // KVSCOPE_HAVE_CUDA
