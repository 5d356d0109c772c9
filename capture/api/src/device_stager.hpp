// Asynchronous device-to-host staging of captured tensors. Copies run on a side stream
// that first waits for the work already queued on the model's stream, into page-locked
// buffers from a pool whose size is bounded by the capture's queue_bytes; an event per job
// tells the writer thread when the bytes have landed. Without CUDA in the build, or
// without a device, construction fails with KVSCOPE_ERR_CUDA and a message saying which.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "convert.hpp"

namespace kvscope::capture::detail {

struct PinnedBuffer {
  std::byte* data = nullptr;
  std::size_t capacity = 0;
};

class DeviceStager {
 public:
  // model_stream: the model's cudaStream_t (null = legacy default stream).
  DeviceStager(void* model_stream, std::uint64_t pool_bytes);
  ~DeviceStager();
  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  // Model thread. acquire() returns a pinned buffer of at least `bytes` (reusing pooled ones).
  PinnedBuffer acquire(std::size_t bytes);
  // Orders the side stream after everything queued on the model stream so far.
  void begin_job();
  // Enqueues the copy of a device tensor (stride[2] == 1) into `dst` as contiguous [H, T, D].
  void copy_to_host(const TensorLayout& t, std::byte* dst);
  // An event recorded after the job's copies (cudaEvent_t); later work on the model stream
  // is ordered after it.
  void* end_job();

  // Writer thread. wait() blocks until the job's copies are done (throws Failure on a CUDA
  // error); release() returns the buffer and event to the pool.
  void wait(void* event);
  void release(PinnedBuffer buffer, void* event) noexcept;

  std::uint64_t pinned_peak() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Name of the current CUDA device ("NVIDIA H200"), or "cpu" without CUDA or a device.
std::string detect_device_name();
// True if this build has CUDA and a device is present.
bool cuda_device_present();

}  // namespace kvscope::capture::detail
