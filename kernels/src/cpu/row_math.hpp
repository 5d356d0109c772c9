// Row primitives shared by the CPU attention kernels (attention statistics and
// evaluation): single-threaded OpenBLAS inside OpenMP, a vectorisable exp, and
// dtype -> float conversion. Internal to kernels/src/cpu; no I/O.
#pragma once

#include <cblas.h>

#include "simd.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "kvscope/kernels/common.hpp"
#include "kvscope/kernels/fast_math.hpp"

namespace kvscope::kernels::cpu::rowmath {

// exp(x) for a vectorisable loop: kernels::exp_fast (kvscope/kernels/fast_math.hpp).
inline float exp_vec(float x) { return exp_fast(x); }

// log(x) in double for a vectorisable loop (no libm call), x finite and > 0 and
// normal (every positive float is). x = 2^e m with m in [sqrt(1/2), sqrt(2)) taken from
// the exponent bits, f = m - 1 (exact), log m = 2 atanh(s) with s = f / (2 + f),
// |s| <= 0.1716, from the atanh series to the s^21 term (truncation below 3e-17
// relative); e ln2 in two parts. Error within a few ulp of the exact logarithm.
inline double log_vec(double x) {
  const std::uint64_t bits = std::bit_cast<std::uint64_t>(x);
  const std::uint64_t sqrt_half = 0x3fe6a09e667f3bcdull;  // bits of sqrt(1/2)
  const std::int64_t e = static_cast<std::int64_t>(bits - sqrt_half) >> 52;
  const double m = std::bit_cast<double>(bits - (static_cast<std::uint64_t>(e) << 52));
  const double f = m - 1.0;
  const double sv = f / (2.0 + f), z = sv * sv;
  double p = 1.0 / 21;
  p = p * z + 1.0 / 19;
  p = p * z + 1.0 / 17;
  p = p * z + 1.0 / 15;
  p = p * z + 1.0 / 13;
  p = p * z + 1.0 / 11;
  p = p * z + 1.0 / 9;
  p = p * z + 1.0 / 7;
  p = p * z + 1.0 / 5;
  p = p * z + 1.0 / 3;
  const double ed = static_cast<double>(e);
  const double ln2_hi = 0x1.62e42fee00000p-1, ln2_lo = 0x1.a39ef35793c76p-33;  // ln2_hi * e is exact
  return ed * ln2_hi + ((2.0 * sv + 2.0 * sv * (z * p)) + ed * ln2_lo);
}

// Converts elements [offset, offset + n) of a dtype tensor to float.
inline void to_float(const void* src, DType t, std::size_t offset, std::size_t n, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
    return;
  }
  const std::uint16_t* p = static_cast<const std::uint16_t*>(src) + offset;
  if (t == DType::kF16) {
    std::size_t i = 0;
#if defined(__F16C__)
    // Hardware conversion, exact like half_to_float (fp16 -> fp32 never rounds).
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    }
#endif
    for (; i < n; ++i) dst[i] = half_to_float(p[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(p[i]);
  }
}

}  // namespace kvscope::kernels::cpu::rowmath
