// DeviceStager of a build without CUDA: every device tensor is refused with KVSCOPE_ERR_CUDA.
#include "device_stager.hpp"
#include "failure.hpp"

namespace kvscope::capture::detail {

struct DeviceStager::Impl {};

DeviceStager::DeviceStager(void*, std::uint64_t) {
  fail(KVSCOPE_ERR_CUDA,
       "a KVSCOPE_DEVICE tensor was given, but this kvscope_capture library was built without CUDA "
       "(reconfigure with the CUDA toolkit, KVSCOPE_CUDA=ON)");
}
DeviceStager::~DeviceStager() = default;
PinnedBuffer DeviceStager::acquire(std::size_t) { return {}; }
void DeviceStager::begin_job() {}
void DeviceStager::copy_to_host(const TensorLayout&, std::byte*) {}
void* DeviceStager::end_job() { return nullptr; }
void DeviceStager::wait(void*) {}
void DeviceStager::release(PinnedBuffer, void*) noexcept {}
std::uint64_t DeviceStager::pinned_peak() const { return 0; }

std::string detect_device_name() { return "cpu"; }
bool cuda_device_present() { return false; }

}  // namespace kvscope::capture::detail
