// Run-time GPU probe for CUDA test suites: they always compile and link, and
// skip with a message where no GPU is present.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

namespace kvscope::testing {

inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace kvscope::testing

#define KVSCOPE_REQUIRE_GPU()                                                  \
  do {                                                                         \
    if (!::kvscope::testing::gpu_available()) GTEST_SKIP() << "no CUDA GPU present: CUDA kernel test skipped"; \
  } while (0)
