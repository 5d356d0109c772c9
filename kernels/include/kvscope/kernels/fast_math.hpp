// Elementwise math for vectorisable loops (no libm call), shared by the CPU kernels and the model runner.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace kvscope::kernels {

namespace detail {
// exp(xc) for xc <= 88 after the reduction, without the underflow clamp, on a float or a Float8; n gets
// the integer of the reduction (as a float).
template <typename T>
inline T exp_reduced(T xc, T& n) {
  n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // + 1.5 * 2^23 rounds to an integer
  const T r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r) * r + r + 1.0f;
}
}  // namespace detail

// exp(x): Cody-Waite range reduction x = n ln2 + r, a degree-6 polynomial for exp(r) on |r| <= ln2 / 2
// and 2^n from the exponent bits. Relative error below 2e-7 on [-87, 88]; exp(x) = 0 for x < -87
// (including -inf, the masked logits), which is below fp32's normal range anyway.
inline float exp_fast(float x) {
  float n;
  const float y = detail::exp_reduced(std::min(x, 88.0f), n);
  const float pow2n = std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : y * pow2n;
}

// 8 floats as one value (GCC/Clang vector extension: one AVX2 register, two SSE ones).
using Float8 = float __attribute__((vector_size(8 * sizeof(float))));

// exp_fast on 8 lanes: the same reduction, polynomial and clamps, for loops that compilers do not
// vectorise through the scalar form.
inline Float8 exp_fast(Float8 x) {
  using Int8 = std::int32_t __attribute__((vector_size(8 * sizeof(std::int32_t))));
  const Float8 hi = Float8{} + 88.0f, zero = Float8{};
  Float8 n;
  const Float8 y = detail::exp_reduced(hi < x ? hi : x, n);  // std::min(x, 88.0f), NaN kept
  const Float8 pow2n = std::bit_cast<Float8>((__builtin_convertvector(n, Int8) + 127) << 23);
  return x < zero - 87.0f ? zero : y * pow2n;
}

}  // namespace kvscope::kernels
