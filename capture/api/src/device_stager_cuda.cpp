// DeviceStager with the CUDA runtime: side stream, pinned pool, one event per job.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "device_stager.hpp"
#include "failure.hpp"

namespace kvscope::capture::detail {

namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  fail(KVSCOPE_ERR_CUDA,
       std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace

struct DeviceStager::Impl {
  int device = 0;
  cudaStream_t model_stream = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t order = nullptr;  // recorded on the model stream, waited on by the side stream
  std::uint64_t pool_bytes = 0;

  std::mutex mutex;  // guards the pools (release() runs on the writer thread)
  std::vector<PinnedBuffer> free_buffers;
  std::vector<cudaEvent_t> free_events;
  std::uint64_t allocated = 0, peak = 0;
};

DeviceStager::DeviceStager(void* model_stream, std::uint64_t pool_bytes) : impl_(std::make_unique<Impl>()) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    fail(KVSCOPE_ERR_CUDA,
         std::string("a KVSCOPE_DEVICE tensor was given, but no CUDA device is available (") +
             (e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)) + ")");
  }
  Impl& m = *impl_;
  m.pool_bytes = pool_bytes;
  m.model_stream = static_cast<cudaStream_t>(model_stream);
  check(cudaGetDevice(&m.device), "cudaGetDevice");
  check(cudaStreamCreateWithFlags(&m.side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  check(cudaEventCreateWithFlags(&m.order, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

DeviceStager::~DeviceStager() {
  Impl& m = *impl_;
  if (m.side) (void)cudaStreamSynchronize(m.side);
  for (const PinnedBuffer& b : m.free_buffers) (void)cudaFreeHost(b.data);
  for (cudaEvent_t ev : m.free_events) (void)cudaEventDestroy(ev);
  if (m.order) (void)cudaEventDestroy(m.order);
  if (m.side) (void)cudaStreamDestroy(m.side);
}

PinnedBuffer DeviceStager::acquire(std::size_t bytes) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mutex);
  auto best = m.free_buffers.end();
  for (auto it = m.free_buffers.begin(); it != m.free_buffers.end(); ++it) {
    if (it->capacity >= bytes && (best == m.free_buffers.end() || it->capacity < best->capacity)) best = it;
  }
  if (best != m.free_buffers.end()) {
    const PinnedBuffer b = *best;
    m.free_buffers.erase(best);
    return b;
  }
  // Evict cached buffers until the new one fits the pool bound (or nothing is cached).
  while (!m.free_buffers.empty() && m.allocated + bytes > m.pool_bytes) {
    (void)cudaFreeHost(m.free_buffers.back().data);
    m.allocated -= m.free_buffers.back().capacity;
    m.free_buffers.pop_back();
  }
  void* p = nullptr;
  check(cudaHostAlloc(&p, std::max<std::size_t>(bytes, 1), cudaHostAllocDefault),
        "cudaHostAlloc (pinned staging)");
  m.allocated += bytes;
  m.peak = std::max(m.peak, m.allocated);
  return PinnedBuffer{static_cast<std::byte*>(p), bytes};
}

void DeviceStager::begin_job() {
  Impl& m = *impl_;
  check(cudaEventRecord(m.order, m.model_stream), "cudaEventRecord (model stream)");
  check(cudaStreamWaitEvent(m.side, m.order, 0), "cudaStreamWaitEvent (side stream)");
}

void DeviceStager::copy_to_host(const TensorLayout& t, std::byte* dst) {
  Impl& m = *impl_;
  const std::size_t eb = kernels::dtype_bytes(t.dtype);
  const auto H = static_cast<std::size_t>(t.shape[0]), T = static_cast<std::size_t>(t.shape[1]);
  const std::size_t row = static_cast<std::size_t>(t.shape[2]) * eb;
  if (t.numel() == 0) return;
  if (t.contiguous()) {
    check(cudaMemcpyAsync(dst, t.data, t.bytes(), cudaMemcpyDefault, m.side), "cudaMemcpyAsync");
    return;
  }
  const auto* src = static_cast<const std::byte*>(t.data);
  const std::size_t pitch = std::max(static_cast<std::size_t>(t.stride[1]) * eb, row);
  for (std::size_t h = 0; h < H; ++h) {  // one 2-D copy per head: T rows of D elements
    check(cudaMemcpy2DAsync(dst + h * T * row, row, src + h * static_cast<std::size_t>(t.stride[0]) * eb,
                            pitch, row, T, cudaMemcpyDefault, m.side),
          "cudaMemcpy2DAsync");
  }
}

void* DeviceStager::end_job() {
  Impl& m = *impl_;
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (!m.free_events.empty()) {
      ev = m.free_events.back();
      m.free_events.pop_back();
    }
  }
  if (!ev) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  check(cudaEventRecord(ev, m.side), "cudaEventRecord (side stream)");
  // Work queued on the model stream after this call waits (on the GPU, not the host) for the
  // copies, so the model may overwrite the captured buffers there at once.
  check(cudaStreamWaitEvent(m.model_stream, ev, 0), "cudaStreamWaitEvent (model stream)");
  return ev;
}

void DeviceStager::wait(void* event) {
  check(cudaSetDevice(impl_->device), "cudaSetDevice (writer thread)");
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize (device copy)");
}

void DeviceStager::release(PinnedBuffer buffer, void* event) noexcept {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mutex);
  if (buffer.data) m.free_buffers.push_back(buffer);
  if (event) m.free_events.push_back(static_cast<cudaEvent_t>(event));
}

std::uint64_t DeviceStager::pinned_peak() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->peak;
}

bool cuda_device_present() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

std::string detect_device_name() {
  if (!cuda_device_present()) return "cpu";
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return "cuda";
  }
  return prop.name;
}

}  // namespace kvscope::capture::detail
