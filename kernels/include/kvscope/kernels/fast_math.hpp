// Elementwise math for vectorisable loops (no libm call), shared by the CPU kernels and the model runner.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace kvscope::kernels {

// exp(x): Cody-Waite range reduction x = n ln2 + r, a degree-6 polynomial for exp(r) on |r| <= ln2 / 2
// and 2^n from the exponent bits. Relative error below 2e-7 on [-87, 88]; exp(x) = 0 for x < -87
// (including -inf, the masked logits), which is below fp32's normal range anyway.
inline float exp_fast(float x) {
  const float xc = std::min(x, 88.0f);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + magic) - magic;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r) * r + r + 1.0f;
  const float pow2n = std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : y * pow2n;
}

}  // namespace kvscope::kernels
