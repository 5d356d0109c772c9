// Device buffers for the CUDA test suites: upload a host vector, download into a
// host vector (after synchronising the device), free on scope exit.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

namespace kvscope::testing {

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, (n > 0 ? n : 1) * sizeof(T)), cudaSuccess);
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return static_cast<T*>(p_); }
  std::size_t size() const { return n_; }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

// nullptr for an empty host vector, else a device copy.
template <typename T>
const T* device_or_null(const std::vector<T>& host, const DeviceArray<T>& dev) {
  return host.empty() ? nullptr : dev.get();
}

}  // namespace kvscope::testing
