// CUDA quantization vs the CPU backend on the same inputs: scales, zeros, codes,
// residual and dequantized values must be bit-identical (both backends share
// quant_math). Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/gpu.hpp"
#include "common/test_util.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/quantize_cuda.hpp"

namespace kvscope::testing {
namespace {

using kernels::DType;
using kernels::Granularity;
using kernels::QuantBuffers;
using kernels::QuantBytes;
using kernels::QuantShape;
using kernels::QuantSpec;

// Owning device buffer of n bytes (n may be 0: null pointer).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n > 0) {
      EXPECT_EQ(cudaMalloc(&p_, n), cudaSuccess);
    }
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  template <typename T>
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size() * sizeof(T), n_);
    if (n_ > 0) {
      ASSERT_EQ(cudaMemcpy(p_, v.data(), n_, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> v(n_ / sizeof(T));
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), p_, n_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

std::string describe(const QuantSpec& s, const QuantShape& sh) {
  std::ostringstream o;
  o << "bits=" << s.bits << (s.symmetric ? " sym " : " asym ") << kernels::granularity_name(s.granularity)
    << " G=" << s.group_size << " R=" << s.residual_tokens << " shape=[" << sh.num_heads << "," << sh.tokens
    << "," << sh.head_dim << "] " << kernels::dtype_name(sh.dtype);
  return o.str();
}

std::vector<std::uint8_t> to_dtype(const std::vector<float>& v, DType dt) {
  std::vector<std::uint8_t> b(v.size() * kernels::dtype_bytes(dt));
  for (std::size_t i = 0; i < v.size(); ++i) kernels::store_element(b.data(), dt, i, v[i]);
  return b;
}

void compare_backends(const QuantSpec& spec, const QuantShape& shape, const std::vector<std::uint8_t>& x) {
  const std::string params = describe(spec, shape);
  SCOPED_TRACE(params);
  const QuantBytes b =
      kernels::quantized_bytes(spec, shape.num_heads, shape.tokens, shape.head_dim, shape.dtype);
  const std::size_t n = static_cast<std::size_t>(shape.num_heads) * shape.tokens * shape.head_dim;

  // CPU.
  std::vector<std::uint8_t> codes(b.codes), residual(b.residual);
  std::vector<float> scales(b.scales / 4), zeros(b.zeros / 4), deq(n), fake(n);
  const QuantBuffers host{codes.data(), scales.data(), zeros.data(), residual.data()};
  ASSERT_TRUE(kernels::cpu::quantize(spec, shape, x.data(), host).ok());
  ASSERT_TRUE(kernels::cpu::dequantize(spec, shape, kernels::as_const(host), deq.data()).ok());
  ASSERT_TRUE(kernels::cpu::quantize_dequantize(spec, shape, x.data(), fake.data()).ok());

  // CUDA.
  DeviceBuffer dx(x.size()), dcodes(codes.size()), dscales(scales.size() * 4), dzeros(zeros.size() * 4),
      dres(residual.size()), ddeq(n * 4), dfake(n * 4);
  dx.upload(x);
  const QuantBuffers dev{dcodes.get<std::uint8_t>(), dscales.get<float>(), dzeros.get<float>(), dres.get()};
  kernels::Status st = kernels::cuda::quantize(spec, shape, dx.get(), dev, nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  st = kernels::cuda::dequantize(spec, shape, kernels::as_const(dev), ddeq.get<float>(), nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  st = kernels::cuda::quantize_dequantize(spec, shape, dx.get(), dfake.get<float>(), nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_TRUE(all_close(dscales.download<float>(), scales, 0, 0, params + " scales"));
  EXPECT_TRUE(all_close(dzeros.download<float>(), zeros, 0, 0, params + " zeros"));
  EXPECT_TRUE(all_close(dcodes.download<std::uint8_t>(), codes, 0, 0, params + " codes"));
  EXPECT_TRUE(all_close(dres.download<std::uint8_t>(), residual, 0, 0, params + " residual"));
  EXPECT_TRUE(all_close(ddeq.download<float>(), deq, 0, 0, params + " dequantize"));
  EXPECT_TRUE(all_close(dfake.download<float>(), fake, 0, 0, params + " quantize_dequantize"));
}

TEST(QuantizeCuda, MatchesCpuAllConfigs) {
  KVSCOPE_REQUIRE_GPU();
  const QuantShape shapes[] = {
      {1, 1, 1, DType::kF32}, {1, 7, 7, DType::kF32}, {3, 33, 7, DType::kF32}, {4, 96, 128, DType::kF32}};
  std::uint64_t seed = 100;
  for (QuantShape shape : shapes) {
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      shape.dtype = dt;
      const auto x = to_dtype(
          random_normal(static_cast<std::size_t>(shape.num_heads) * shape.tokens * shape.head_dim, seed++),
          dt);
      for (int bits : {8, 4, 2})
        for (bool sym : {true, false})
          for (int residual : {0, 3})
            for (Granularity g : {Granularity::kPerTensor, Granularity::kPerHead, Granularity::kPerToken,
                                  Granularity::kPerChannel})
              for (int group : {0, 5}) {
                if (group != 0 && (g == Granularity::kPerTensor || g == Granularity::kPerHead)) continue;
                compare_backends({bits, sym, g, group, residual}, shape, x);
              }
    }
  }
}

TEST(QuantizeCuda, LargeLlavaLayer) {
  KVSCOPE_REQUIRE_GPU();
  const QuantShape shape{32, 2048, 128, DType::kF16};
  const auto x = to_dtype(random_normal(32 * 2048 * 128, 7, 3.0f), DType::kF16);
  compare_backends(kernels::kivi_key_spec(2, 32, 128), shape, x);
  compare_backends(kernels::kivi_value_spec(2, 32, 128), shape, x);
  compare_backends({8, true, Granularity::kPerToken, 0, 0}, shape, x);
  compare_backends({8, true, Granularity::kPerHead, 0, 0}, shape, x);
  compare_backends({4, false, Granularity::kPerTensor, 0, 0}, shape, x);
  compare_backends({4, true, Granularity::kPerChannel, 0, 0}, shape, x);
}

TEST(QuantizeCuda, ConstantAndResidualOnly) {
  KVSCOPE_REQUIRE_GPU();
  std::vector<float> v(2 * 9 * 6, 1.25f);
  for (std::size_t i = 0; i < v.size(); i += 7) v[i] = 0.0f;
  const auto x = to_dtype(v, DType::kBF16);
  for (bool sym : {true, false}) {
    compare_backends({2, sym, Granularity::kPerChannel, 3, 0}, {2, 9, 6, DType::kBF16}, x);
    compare_backends({4, sym, Granularity::kPerHead, 0, 9}, {2, 9, 6, DType::kBF16}, x);  // all residual
  }
}

TEST(QuantizeCuda, RejectsInvalidArguments) {
  KVSCOPE_REQUIRE_GPU();
  const QuantShape shape{2, 4, 8, DType::kF32};
  DeviceBuffer x(64 * 4), codes(64), scales(64 * 4), out(64 * 4);
  const QuantBuffers b{codes.get<std::uint8_t>(), scales.get<float>(), nullptr, nullptr};
  EXPECT_FALSE(
      kernels::cuda::quantize({3, true, Granularity::kPerToken, 0, 0}, shape, x.get(), b, nullptr).ok());
  EXPECT_FALSE(
      kernels::cuda::quantize({8, false, Granularity::kPerToken, 0, 0}, shape, x.get(), b, nullptr).ok());
  EXPECT_FALSE(
      kernels::cuda::quantize({8, true, Granularity::kPerToken, 0, 2}, shape, x.get(), b, nullptr).ok());
  EXPECT_FALSE(
      kernels::cuda::quantize({8, true, Granularity::kPerToken, 0, 0}, shape, nullptr, b, nullptr).ok());
  EXPECT_FALSE(kernels::cuda::dequantize({8, true, Granularity::kPerToken, 0, 0}, shape, kernels::as_const(b),
                                         nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(kernels::cuda::quantize_dequantize({8, true, Granularity::kPerHead, 3, 0}, shape, x.get(),
                                                  out.get<float>(), nullptr)
                   .ok());
}

}  // namespace
}  // namespace kvscope::testing
