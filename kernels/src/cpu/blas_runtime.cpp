#include "kvscope/kernels/blas_runtime.hpp"

#include <cblas.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace kvscope::kernels {

const char* blas_core_name() { return openblas_get_corename(); }

void pin_blas_to_one_thread() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

double measure_sgemm_flops_per_s(int threads, int n, int reps) {
  if (n <= 0 || threads <= 0 || reps <= 0) return 0;
  openblas_set_num_threads(threads);
  const std::size_t nn = static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
  std::vector<float> a(nn), b(nn), c(nn, 0.0f);
  for (std::size_t i = 0; i < nn; ++i) {
    a[i] = static_cast<float>((i * 7) % 13) * 0.1f - 0.6f;
    b[i] = static_cast<float>((i * 5) % 11) * 0.1f - 0.5f;
  }
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 is the untimed warm-up
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0 && dt > 0) best = std::max(best, 2.0 * n * static_cast<double>(n) * n / dt);
  }
  return best;
}

void keep_freed_memory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
#endif
}

void use_fast_blas_runtime(char** argv, const BlasRuntimeOptions& options) {
  if (std::getenv("KVSCOPE_ENV_SET") != nullptr) return;
  bool changed = false;
  if (options.passive_omp_wait && std::getenv("OMP_WAIT_POLICY") == nullptr) {
    changed |= setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0;
  }
#if defined(__x86_64__)
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    const std::string core = openblas_get_corename();
    const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" || core == "Nehalem";
    const char* better = __builtin_cpu_supports("avx512f") ? "SkylakeX"
                         : __builtin_cpu_supports("avx2")  ? "Haswell"
                                                           : nullptr;
    if (generic && better != nullptr && setenv("OPENBLAS_CORETYPE", better, 1) == 0) {
      changed = true;
      if (options.announce_as != nullptr) {
        std::fprintf(stderr,
                     "%s: OpenBLAS chose the generic core %s on this CPU; re-running with "
                     "OPENBLAS_CORETYPE=%s\n",
                     options.announce_as, core.c_str(), better);
        std::fflush(stderr);
      }
    }
  }
#endif
  if (!changed) return;
  setenv("KVSCOPE_ENV_SET", "1", 1);
  execv("/proc/self/exe", argv);
  // exec failed: carry on in this process with the settings it started with
}

}  // namespace kvscope::kernels
