#include "kvscope/kernels/common.hpp"

#include <omp.h>

#if defined(KVSCOPE_HAVE_NVTX)
#include "kvscope/kernels/nvtx.hpp"
#endif

namespace kvscope::kernels {

void set_cpu_threads(int n) { omp_set_num_threads(n > 0 ? n : omp_get_num_procs()); }
int cpu_threads() { return omp_get_max_threads(); }

#if defined(KVSCOPE_HAVE_NVTX)
nvtxDomainHandle_t nvtx::domain() {
  static nvtxDomainHandle_t d = nvtxDomainCreateA("kvscope");
  return d;
}
#endif

}  // namespace kvscope::kernels
