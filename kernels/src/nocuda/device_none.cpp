// CPU-only builds: there are no CUDA devices to report.
#include "kvscope/kernels/device.hpp"

namespace kvscope::kernels {
int cuda_device_count() { return 0; }
std::string cuda_device_description() { return "built without CUDA"; }
}  // namespace kvscope::kernels
