// Error checking for the CUDA backend: every runtime call and every launch is
// checked and turned into a Status naming the call, never an exit().
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels::cuda {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Cuda(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace kvscope::kernels::cuda

// Returns a Status from the enclosing function if a CUDA runtime call fails.
#define KVSCOPE_CUDA_TRY(call)                                                            \
  do {                                                                                    \
    cudaError_t _kv_e = (call);                                                           \
    if (_kv_e != cudaSuccess) return ::kvscope::kernels::cuda::cuda_status(_kv_e, #call); \
  } while (0)

// After a <<<>>> launch: reports launch-configuration errors for `name`.
#define KVSCOPE_CUDA_CHECK_LAUNCH(name) \
  KVSCOPE_CUDA_TRY(cudaPeekAtLastError())
