// CPU ceilings (STREAM triad, OpenBLAS sgemm) and the assembly of all ceilings.
#include "ceilings.hpp"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/device.hpp"

namespace kvscope::bench {
namespace {

// Last-level cache size in bytes (0 when the system does not say).
std::size_t llc_bytes() {
  long l3 = 0;
#if defined(_SC_LEVEL3_CACHE_SIZE)
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  return l3 > 0 ? static_cast<std::size_t>(l3) : 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double measure_cpu_triad(int threads, std::size_t bytes_per_array, int reps) {
  const std::int64_t n = static_cast<std::int64_t>(bytes_per_array / sizeof(double));
  if (n <= 0 || threads <= 0 || reps <= 0) return 0;
  std::unique_ptr<double[]> a(new double[n]), b(new double[n]), c(new double[n]);
  double* pa = a.get();
  double* pb = b.get();
  double* pc = c.get();
  // First touch with the same static schedule as the timed loop: pages land on the
  // threads (NUMA nodes) that later stream them.
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t i = 0; i < n; ++i) {
    pa[i] = 0.0;
    pb[i] = 1.0;
    pc[i] = 2.0;
  }
  const double s = 3.0;
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 is the untimed warm-up
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::int64_t i = 0; i < n; ++i) pa[i] = pb[i] + s * pc[i];
    const double dt = seconds_since(t0);
    if (rep > 0 && dt > 0) best = std::max(best, 3.0 * static_cast<double>(n) * sizeof(double) / dt);
  }
  // Keep the stores observable: a[i] == 7 everywhere.
  if (pa[n / 2] != 7.0) return 0;
  return best;
}

double measure_cpu_sgemm(int threads, int n, int reps, std::string* note) {
#if defined(KVBENCH_HAVE_OPENBLAS)
  const double best = kernels::measure_sgemm_flops_per_s(threads, n, reps);
  // DYNAMIC_ARCH builds pick the kernel from CPUID; a VM that hides the model gets a
  // generic core (e.g. "Prescott"), which OPENBLAS_CORETYPE=SkylakeX (etc.) overrides.
  if (note) *note = std::string("OpenBLAS core ") + kernels::blas_core_name();
  return best;
#else
  (void)threads;
  (void)n;
  (void)reps;
  if (note) *note = "built without OpenBLAS: no CPU sgemm ceiling";
  return 0;
#endif
}

#if !defined(KVSCOPE_HAVE_CUDA)
double measure_gpu_triad(std::size_t, int, std::string* note) {
  if (note) *note = "built without CUDA";
  return 0;
}
double measure_gpu_sgemm(int, int, std::string* note) {
  if (note) *note = "built without CUDA";
  return 0;
}
#endif

Ceilings measure_ceilings(int threads, bool quick) {
  Ceilings c;
  c.cpu_threads = threads;
  // sgemm first: OpenBLAS's pthreads spin for a while after a call and would
  // otherwise steal cores from the triad measurement.
  const int sgemm_n = quick ? 256 : 2048;
  std::string blas_note;
  c.cpu_sgemm_flops_per_s = measure_cpu_sgemm(threads, sgemm_n, quick ? 2 : 3, &blas_note);
  // Each array at least as large as the last-level cache (this VM reports a 300 MiB L3),
  // so the three together are >= 3x LLC and the triad streams from DRAM.
  const std::size_t llc = llc_bytes();
  const std::size_t triad_bytes =
      quick ? (8u << 20)
            : std::max<std::size_t>(64u << 20, (llc + (1u << 20) - 1) & ~((std::size_t{1} << 20) - 1));
  c.cpu_triad_bytes_per_s = measure_cpu_triad(threads, triad_bytes, quick ? 3 : 10);
  c.cpu_note = "triad 3 x " + std::to_string(triad_bytes >> 20) + " MiB fp64 (LLC " +
               std::to_string(llc >> 20) + " MiB), best of " + std::to_string(quick ? 3 : 10) + "; sgemm " +
               std::to_string(sgemm_n) + "^3, " + blas_note;

  if (kernels::cuda_device_count() > 0) {
    std::string triad_note, sgemm_note;
    const std::size_t gpu_triad_bytes = (quick ? 64u : 1024u) << 20;
    c.gpu_triad_bytes_per_s = measure_gpu_triad(gpu_triad_bytes, quick ? 3 : 20, &triad_note);
    c.gpu_sgemm_flops_per_s = measure_gpu_sgemm(quick ? 1024 : 8192, quick ? 2 : 10, &sgemm_note);
    c.gpu_note = kernels::cuda_device_description() + "; " + triad_note + "; " + sgemm_note;
  } else {
    c.gpu_note = kernels::cuda_device_description();
  }
  return c;
}

}  // namespace kvscope::bench
