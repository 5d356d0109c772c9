// GPU ceilings: device triad bandwidth (a CUDA kernel over arrays far larger than L2)
// and the cuBLAS FP32 sgemm rate. Every CUDA and cuBLAS call is checked; a failure
// returns 0 with the failing call in *note.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ceilings.hpp"

namespace kvscope::bench {
namespace {

// Owns device allocations and events for one measurement.
struct DeviceScratch {
  void* ptr[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t start = nullptr, stop = nullptr;
  cublasHandle_t blas = nullptr;
  ~DeviceScratch() {
    for (void* p : ptr)
      if (p) (void)cudaFree(p);
    if (start) (void)cudaEventDestroy(start);
    if (stop) (void)cudaEventDestroy(stop);
    if (blas) (void)cublasDestroy(blas);
  }
};

bool cuda_ok(cudaError_t e, const char* what, std::string* note) {
  if (e == cudaSuccess) return true;
  if (note) *note = std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  (void)cudaGetLastError();
  return false;
}

bool cublas_ok(cublasStatus_t s, const char* what, std::string* note) {
  if (s == CUBLAS_STATUS_SUCCESS) return true;
  if (note) *note = std::string(what) + ": " + cublasGetStatusString(s);
  return false;
}

}  // namespace

__global__ void fill_kernel(double* __restrict__ p, double v, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = v;
}

__global__ void triad_kernel(double* __restrict__ a, const double* __restrict__ b,
                             const double* __restrict__ c, double s, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    a[i] = b[i] + s * c[i];
  }
}

double measure_gpu_triad(std::size_t bytes_per_array, int reps, std::string* note) {
  const std::int64_t n = static_cast<std::int64_t>(bytes_per_array / sizeof(double));
  if (n <= 0 || reps <= 0) return 0;
  DeviceScratch d;
  for (auto& p : d.ptr)
    if (!cuda_ok(cudaMalloc(&p, n * sizeof(double)), "triad cudaMalloc", note)) return 0;
  if (!cuda_ok(cudaEventCreate(&d.start), "cudaEventCreate", note)) return 0;
  if (!cuda_ok(cudaEventCreate(&d.stop), "cudaEventCreate", note)) return 0;
  int dev = 0, sms = 0;
  if (!cuda_ok(cudaGetDevice(&dev), "cudaGetDevice", note)) return 0;
  if (!cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute",
               note))
    return 0;
  const int block = 256;
  const int grid = std::max(1, sms) * 8;
  auto* a = static_cast<double*>(d.ptr[0]);
  auto* b = static_cast<double*>(d.ptr[1]);
  auto* c = static_cast<double*>(d.ptr[2]);
  fill_kernel<<<grid, block>>>(b, 1.0, n);
  if (!cuda_ok(cudaPeekAtLastError(), "fill_kernel launch", note)) return 0;
  fill_kernel<<<grid, block>>>(c, 2.0, n);
  if (!cuda_ok(cudaPeekAtLastError(), "fill_kernel launch", note)) return 0;
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
    if (!cuda_ok(cudaEventRecord(d.start), "cudaEventRecord", note)) return 0;
    triad_kernel<<<grid, block>>>(a, b, c, 3.0, n);
    if (!cuda_ok(cudaPeekAtLastError(), "triad_kernel launch", note)) return 0;
    if (!cuda_ok(cudaEventRecord(d.stop), "cudaEventRecord", note)) return 0;
    if (!cuda_ok(cudaEventSynchronize(d.stop), "cudaEventSynchronize", note)) return 0;
    float ms = 0;
    if (!cuda_ok(cudaEventElapsedTime(&ms, d.start, d.stop), "cudaEventElapsedTime", note)) return 0;
    if (rep > 0 && ms > 0) best = std::max(best, 3.0 * static_cast<double>(n) * sizeof(double) / (ms * 1e-3));
  }
  if (note) {
    *note =
        "triad 3 x " + std::to_string(bytes_per_array >> 20) + " MiB fp64, best of " + std::to_string(reps);
  }
  return best;
}

double measure_gpu_sgemm(int n, int reps, std::string* note) {
  if (n <= 0 || reps <= 0) return 0;
  DeviceScratch d;
  const std::size_t bytes = static_cast<std::size_t>(n) * n * sizeof(float);
  for (auto& p : d.ptr)
    if (!cuda_ok(cudaMalloc(&p, bytes), "sgemm cudaMalloc", note)) return 0;
  // Constant operands: sgemm's rate does not depend on the values.
  for (int i = 0; i < 2; ++i)
    if (!cuda_ok(cudaMemset(d.ptr[i], 0x3c, bytes), "cudaMemset", note)) return 0;
  if (!cuda_ok(cudaEventCreate(&d.start), "cudaEventCreate", note)) return 0;
  if (!cuda_ok(cudaEventCreate(&d.stop), "cudaEventCreate", note)) return 0;
  if (!cublas_ok(cublasCreate(&d.blas), "cublasCreate", note)) return 0;
  // Plain FP32 on the CUDA cores: no TF32 tensor-core shortcut.
  if (!cublas_ok(cublasSetMathMode(d.blas, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode", note)) return 0;
  const float alpha = 1.0f, beta = 0.0f;
  const auto* a = static_cast<const float*>(d.ptr[0]);
  const auto* b = static_cast<const float*>(d.ptr[1]);
  auto* c = static_cast<float*>(d.ptr[2]);
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {
    if (!cuda_ok(cudaEventRecord(d.start), "cudaEventRecord", note)) return 0;
    if (!cublas_ok(cublasSgemm(d.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n),
                   "cublasSgemm", note))
      return 0;
    if (!cuda_ok(cudaEventRecord(d.stop), "cudaEventRecord", note)) return 0;
    if (!cuda_ok(cudaEventSynchronize(d.stop), "cudaEventSynchronize", note)) return 0;
    float ms = 0;
    if (!cuda_ok(cudaEventElapsedTime(&ms, d.start, d.stop), "cudaEventElapsedTime", note)) return 0;
    if (rep > 0 && ms > 0) best = std::max(best, 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3));
  }
  if (note) *note = "cublasSgemm FP32 " + std::to_string(n) + "^3, best of " + std::to_string(reps);
  return best;
}

}  // namespace kvscope::bench
