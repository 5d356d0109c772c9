#include "kvscope/kernels/blas_runtime.hpp"

#include <cblas.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvscope::kernels {

const char* blas_core_name() { return openblas_get_corename(); }

void pin_blas_to_one_thread() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
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
