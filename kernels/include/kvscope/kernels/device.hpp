// Which backends exist in this build and at run time.
#pragma once

#include <string>

namespace kvscope::kernels {

// True when the library was built with the CUDA backend.
constexpr bool built_with_cuda() {
#if defined(KVSCOPE_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

// Number of CUDA devices usable now (0 without CUDA or without a GPU).
int cuda_device_count();
// Human-readable name of device 0, or the reason there is none.
std::string cuda_device_description();

}  // namespace kvscope::kernels
