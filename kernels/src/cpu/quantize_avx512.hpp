// AVX-512 row pipeline of the CPU quantization kernels (internal to quantize.cpp,
// which is compiled with -ffp-contract=off). One 16-lane step encodes 16 elements of
// a float row and writes their packed code bytes (quantize) or dequantized floats
// (fake quant) straight from registers: no int32 code buffer, no second pass to pack.
// The codes are bit for bit quant_math::encode_with_divisor and the floats
// quant_math::decode; quantize.cpp keeps the portable loops for other targets and for
// group layouts that do not start every group on a 16-element boundary.
#pragma once

#include "simd.hpp"

#if defined(KVSCOPE_CPU_AVX512)

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvscope::kernels::cpu::quant_avx512 {

constexpr int kStep = 16;  // floats per 512-bit register

// Lanes [0, n) of a step, n <= 16.
inline __mmask16 lanes(int n) { return n >= kStep ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

// clamp(v, lo, hi) exactly as encode_with_divisor: v >= lo ? v : lo maps NaN to lo.
// vmaxps(v, lo) returns its second operand when either is NaN or both are equal, and
// vminps(c, hi) its second when equal: the same values (an equal lane holds lo or hi).
inline __m512 clamp(__m512 v, __m512 lo, __m512 hi) { return _mm512_min_ps(_mm512_max_ps(v, lo), hi); }

// Code of a clamped quotient c: truncation plus +-1 on the exact fraction (rounding
// half away from zero), as encode_with_divisor; *frac receives c - trunc(c).
inline __m512i round_code(__m512 c, __m512* frac) {
  const __m512i i = _mm512_cvttps_epi32(c);
  *frac = _mm512_sub_ps(c, _mm512_cvtepi32_ps(i));
  const __mmask16 up = _mm512_cmp_ps_mask(*frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __mmask16 down = _mm512_cmp_ps_mask(*frac, _mm512_set1_ps(-0.5f), _CMP_LE_OQ);
  const __m512i one = _mm512_set1_epi32(1);
  return _mm512_mask_sub_epi32(_mm512_mask_add_epi32(i, up, i, one), down, i, one);
}

// Writes the packed fields of the first n codes (lowest bits first, the unused high
// bits of a partial last byte 0) at out, which is byte-aligned because a step starts
// at a multiple of 16 elements. Full steps use plain stores: a masked vpmovdb to
// memory is slow on some cores (Zen 4).
template <int kBits>
inline void store_packed(__m512i code, int n, std::uint8_t* out) {
  const __mmask16 live = lanes(n);
  if constexpr (kBits == 8) {
    const __m128i bytes = _mm512_cvtepi32_epi8(code);  // vpmovdb keeps the low 8 bits
    if (n == kStep) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
    } else {
      _mm_mask_storeu_epi8(out, live, bytes);
    }
  } else {
    constexpr int kMask = (1 << kBits) - 1;
    // One field per byte (dead lanes 0), then pairs / quads of bytes folded into one
    // byte by multiply-adds: f0 + 16 f1 (4-bit), f0 + 4 f1 + 16 f2 + 64 f3 (2-bit).
    const __m128i fields = _mm512_cvtepi32_epi8(_mm512_maskz_and_epi32(live, code, _mm512_set1_epi32(kMask)));
    __m128i packed;
    if constexpr (kBits == 4) {
      packed = _mm_cvtepi16_epi8(_mm_maddubs_epi16(fields, _mm_set1_epi16(0x1001)));  // bytes (1, 16)
    } else {
      const __m128i pairs = _mm_maddubs_epi16(fields, _mm_set1_epi16(0x0401));        // bytes (1, 4)
      packed = _mm_cvtepi32_epi8(_mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001)));  // words (1, 16)
    }
    if (n == kStep) {
      if constexpr (kBits == 4) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out), packed);
      } else {
        const std::int32_t word = _mm_cvtsi128_si32(packed);
        std::memcpy(out, &word, sizeof(word));
      }
    } else {
      const int bytes = (n * kBits + 7) / 8;
      _mm_mask_storeu_epi8(out, __mmask16((1u << bytes) - 1u), packed);
    }
  }
}

// Four full steps of codes (64 elements from a multiple of 16 on) packed into
// 64 * kBits / 8 bytes at out, the same bytes as four store_packed calls with far fewer
// instructions (two vpmovdb per 16 codes were the hottest part of the encoding on
// Zen 4). Codes lie in [lo, hi], so vpackssdw keeps them; the field mask on the words
// makes every value an unsigned byte, so vpackuswb keeps them too. 128-bit lane L of
// the packed bytes then holds elements 4L..4L+3 of c0, c1, c2 and c3 in its four
// dwords; `order` (pack4_order) puts the dwords in element order. The 2- and 4-bit
// fields of consecutive elements are then folded into bytes by multiply-adds as in
// store_packed.
inline __m512i pack4_order() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

template <int kBits>
inline void store_packed4(__m512i c0, __m512i c1, __m512i c2, __m512i c3, __m512i order, std::uint8_t* out) {
  const __m512i mask = _mm512_set1_epi16(static_cast<short>((1 << kBits) - 1));
  const __m512i w01 = _mm512_and_si512(_mm512_packs_epi32(c0, c1), mask);
  const __m512i w23 = _mm512_and_si512(_mm512_packs_epi32(c2, c3), mask);
  const __m512i fields = _mm512_permutexvar_epi32(order, _mm512_packus_epi16(w01, w23));
  if constexpr (kBits == 8) {
    _mm512_storeu_si512(out, fields);
  } else if constexpr (kBits == 4) {
    const __m512i bytes = _mm512_maddubs_epi16(fields, _mm512_set1_epi16(0x1001));  // (1, 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(bytes));
  } else {
    const __m512i pairs = _mm512_maddubs_epi16(fields, _mm512_set1_epi16(0x0401));  // (1, 4)
    const __m512i bytes = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x00100001));  // (1, 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(bytes));
  }
}

// quant_math::decode lane by lane: zero + float(code) * scale, two roundings.
inline __m512 decode(__m512i code, __m512 scale, __m512 zero) {
  return _mm512_add_ps(zero, _mm512_mul_ps(_mm512_cvtepi32_ps(code), scale));
}

// Per-lane group parameters of one step: one group for the whole span, or one per
// element (per-channel granularity: [d] arrays indexed by the element).
struct SpanGroup {
  // Scalars, broadcast where used: the fast path needs only zero and 1 / divisor.
  float scale, zero, div, rcp;
  bool zero_is_0;  // symmetric: x - 0 is x for every non-NaN x (and NaN encodes as lo either way)
  __m512 minus_zero(__m512 x, __mmask16, int) const {
    return zero_is_0 ? x : _mm512_sub_ps(x, _mm512_set1_ps(zero));
  }
  __m512 load_scale(__mmask16, int) const { return _mm512_set1_ps(scale); }
  __m512 load_zero(__mmask16, int) const { return _mm512_set1_ps(zero); }
  __m512 load_divisor(__mmask16, int) const { return _mm512_set1_ps(div); }
  __m512 load_rcp(__mmask16, int) const { return _mm512_set1_ps(rcp); }
};
// Several groups per row, each a whole number of 16-element steps (per-token groups
// of G, a multiple of 16, smaller than the row): step i / 16 belongs to the row's group
// (i / 16) / kSpg, with kSpg = G / 16 fixed at compile time, or i / G when kSpg is 0
// (uncommon group sizes). The zero is always subtracted: x - 0 is x for every non-NaN
// x, and a NaN encodes as lo either way, so symmetric groups give the same codes.
template <int kSpg>
struct StepGroups {
  const float *scale, *zero, *divisor, *rcp;  // the row's groups
  int G;                                      // used when kSpg == 0
  int group(int i) const {
    if constexpr (kSpg > 0) return static_cast<int>(static_cast<unsigned>(i) / (kStep * kSpg));
    return i / G;
  }
  __m512 minus_zero(__m512 x, __mmask16, int i) const {
    return _mm512_sub_ps(x, _mm512_set1_ps(zero[group(i)]));
  }
  __m512 load_scale(__mmask16, int i) const { return _mm512_set1_ps(scale[group(i)]); }
  __m512 load_zero(__mmask16, int i) const { return _mm512_set1_ps(zero[group(i)]); }
  __m512 load_divisor(__mmask16, int i) const { return _mm512_set1_ps(divisor[group(i)]); }
  __m512 load_rcp(__mmask16, int i) const { return _mm512_set1_ps(rcp[group(i)]); }
};
struct EachGroup {
  const float *scale, *zero, *divisor, *rcp;
  __m512 load_scale(__mmask16 m, int i) const { return _mm512_maskz_loadu_ps(m, scale + i); }
  __m512 load_zero(__mmask16 m, int i) const { return _mm512_maskz_loadu_ps(m, zero + i); }
  __m512 load_divisor(__mmask16 m, int i) const {  // dead lanes divide by 1
    return _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, divisor + i);
  }
  __m512 load_rcp(__mmask16 m, int i) const { return _mm512_maskz_loadu_ps(m, rcp + i); }
  __m512 minus_zero(__m512 x, __mmask16 m, int i) const { return _mm512_sub_ps(x, load_zero(m, i)); }
};

// Elements [i0, i0 + n) of row x, i0 % 16 == 0: packed codes into codes_row (the
// row's bytes, quantize) or decoded floats into out_row (fake quant). Codes are
// bit for bit quant_math::encode_with_divisor: when fast (every divisor passes
// reciprocal_usable) they are first computed from c = clamp((x - zero) * (1 / divisor)),
// exact away from half-integers (see quantize.cpp's encode_span): the code is c rounded
// to nearest (vcvtps2dq; it differs from rounding half away from zero only on a tie),
// and the span keeps the largest |c - rint(c)| (vreduceps, exact; vrangeps, one
// instruction per step). If that reaches 0.5 - near, some lane lies within near of a
// half-integer (a tie included) and the whole span is recomputed with the division, as
// the portable loop does. Full steps run without lane masks.
// The clamp bounds and the redo limit as vectors, built once per kernel call.
struct CodeRange {
  CodeRange(int lo, int hi, float near)
      : lo(_mm512_set1_ps(static_cast<float>(lo))),
        hi(_mm512_set1_ps(static_cast<float>(hi))),
        far_limit(_mm512_set1_ps(0.5f - near)),
        pack_order(pack4_order()) {}
  __m512 lo, hi, far_limit;
  __m512i pack_order;
};

// The row an encode_span reads: floats, or fp16 converted by vcvtph2ps as it is read
// (exact except that it quiets a signalling NaN, whose code is lo either way; it saves
// storing the converted row and reading it back).
struct FloatRow {
  const float* p;
  __m512 load(int i) const { return _mm512_loadu_ps(p + i); }
  __m512 load(__mmask16 live, int i) const { return _mm512_maskz_loadu_ps(live, p + i); }
};
struct F16Row {
  const std::uint16_t* p;
  __m512 load(int i) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
  }
  __m512 load(__mmask16 live, int i) const { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p + i)); }
};
// An fp16 row whose full steps, as the statistics read them, are also stored as floats
// into dst (for the encoding: reading the fp16 row again there was slower per token).
struct F16RowCopy {
  const std::uint16_t* p;
  float* dst;
  __m512 load(int i) const {
    const __m512 f = F16Row{p}.load(i);
    _mm512_storeu_ps(dst + i, f);
    return f;
  }
};

template <int kBits, bool kFake, typename Group, typename Row>
[[gnu::always_inline]] inline void encode_span(const Row& x, int i0, int n, const Group& g, bool fast,
                                               const CodeRange& range, std::uint8_t* codes_row,
                                               float* out_row) {
  const __m512 vlo = range.lo, vhi = range.hi;
  const auto emit = [&](int i, int m, __mmask16 live, __m512i code) {
    if constexpr (kFake) {
      const __m512 v = decode(code, g.load_scale(live, i), g.load_zero(live, i));
      if (m == kStep) {
        _mm512_storeu_ps(out_row + i, v);
      } else {
        _mm512_mask_storeu_ps(out_row + i, live, v);
      }
    } else {
      store_packed<kBits>(code, m, codes_row + static_cast<unsigned>(i) * kBits / 8);
    }
  };
  const int end = i0 + n, full_end = i0 + (n & ~(kStep - 1));  // n >= 0
  if (fast) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    constexpr int kMaxAbs = 0x0b;  // vrangeps: max of |a|, |b|, sign cleared
    // Quotient of a step; c is never NaN (the clamp maps NaN to lo).
    const auto quotient = [&](int i, __mmask16 live, __m512 xv) {
      return clamp(_mm512_mul_ps(g.minus_zero(xv, live, i), g.load_rcp(live, i)), vlo, vhi);
    };
    __m512 far = _mm512_setzero_ps();  // largest |c - rint(c)| of the span, lane by lane
    int i = i0;
    if constexpr (!kFake) {
      for (; i + 4 * kStep <= full_end; i += 4 * kStep) {
        __m512i code[4];
        for (int k = 0; k < 4; ++k) {
          const int ik = i + k * kStep;
          const __m512 c = quotient(ik, __mmask16(0xffff), x.load(ik));
          far = _mm512_range_ps(far, _mm512_reduce_ps(c, kRound), kMaxAbs);
          code[k] = _mm512_cvt_roundps_epi32(c, kRound);
        }
        store_packed4<kBits>(code[0], code[1], code[2], code[3], range.pack_order,
                             codes_row + static_cast<unsigned>(i) * kBits / 8);
      }
    }
    for (; i < full_end; i += kStep) {
      const __m512 c = quotient(i, __mmask16(0xffff), x.load(i));
      far = _mm512_range_ps(far, _mm512_reduce_ps(c, kRound), kMaxAbs);
      emit(i, kStep, __mmask16(0xffff), _mm512_cvt_roundps_epi32(c, kRound));
    }
    if (i < end) {
      const __mmask16 live = lanes(end - i);
      const __m512 c = quotient(i, live, x.load(live, i));
      far = _mm512_mask_range_ps(far, live, far, _mm512_reduce_ps(c, kRound), kMaxAbs);
      emit(i, end - i, live, _mm512_cvt_roundps_epi32(c, kRound));
    }
    if (_mm512_cmp_ps_mask(far, range.far_limit, _CMP_GE_OQ) == 0) return;
  }
  __m512 frac;
  for (int i = i0; i < end; i += kStep) {
    const int m = end - i < kStep ? end - i : kStep;
    const __mmask16 live = lanes(m);
    const __m512 diff = g.minus_zero(x.load(live, i), live, i);
    emit(i, m, live, round_code(clamp(_mm512_div_ps(diff, g.load_divisor(live, i)), vlo, vhi), &frac));
  }
}

// quant_math::group_params, encode_divisor, 1 / divisor and reciprocal_usable of n
// groups, 16 at a time (lane by lane the same operations: IEEE division, the same
// comparisons and selects). usable[k] = 1 when divisor k passes reciprocal_usable.
// Per channel a block has D groups and per token 16 rows x (D / G) groups: done one
// by one, their divisions were a large part of the time.
inline void group_params(const float* mn, const float* mx, int n, int bits, bool symmetric, float* scale,
                         float* zero, float* divisor, float* rcp, std::uint8_t* usable) {
  const int levels = quant_math::code_max(bits, symmetric);
  const __m512 vlevels = _mm512_set1_ps(static_cast<float>(levels)), one = _mm512_set1_ps(1.0f);
  for (int i = 0; i < n; i += kStep) {
    const __mmask16 live = lanes(n - i);
    const __m512 lo = _mm512_maskz_loadu_ps(live, mn + i), hi = _mm512_maskz_loadu_ps(live, mx + i);
    __m512 s, z;
    if (symmetric) {
      // max_f(-mn, mx) = mx > -mn ? mx : -mn; a constant group keeps its magnitude.
      const __m512 amax = _mm512_max_ps(hi, _mm512_xor_ps(lo, _mm512_set1_ps(-0.0f)));
      const __mmask16 constant = _mm512_cmp_ps_mask(lo, hi, _CMP_EQ_OQ);
      s = _mm512_mask_blend_ps(constant, _mm512_div_ps(amax, vlevels), amax);
      z = _mm512_setzero_ps();
    } else {
      s = _mm512_div_ps(_mm512_sub_ps(hi, lo), vlevels);
      z = lo;
    }
    const __m512 d = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), one, s);
    const __mmask16 ok = _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ) &
                         _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p100f), _CMP_LE_OQ);
    _mm512_mask_storeu_ps(scale + i, live, s);
    _mm512_mask_storeu_ps(zero + i, live, z);
    _mm512_mask_storeu_ps(divisor + i, live, d);
    _mm512_mask_storeu_ps(rcp + i, live, _mm512_div_ps(one, d));
    _mm_mask_storeu_epi8(usable + i, live, _mm_maskz_set1_epi8(ok, 1));
  }
}

// Group statistics with the full width of the registers. quantize.cpp's min_max keeps
// 16 lane accumulators (lane j: min_f / max_f over elements j, j + 16, ... in order)
// and reduces them by a tree (lane k with lane k + 8, then + 4, + 2, + 1, the lower
// lane as the first operand). The order matters only for signed zeros and NaN, but the
// scales and zeros must keep their bits, so the functions below do exactly those
// operations: the accumulators of a group (G a multiple of 16) row by row, then the
// trees of 16 groups at once, one vpermt2ps pair and one vminps / vmaxps per level.

// min_f(a, x) = x < a ? x : a is vminps(x, a); max_f(a, x) = vmaxps(x, a).
inline __m512 min_into(__m512 a, __m512 x) { return _mm512_min_ps(x, a); }
inline __m512 max_into(__m512 a, __m512 x) { return _mm512_max_ps(x, a); }

// Tree level with stride s over groups packed (16 / w) to a register, w lanes each
// (w = 16, 8, 4, 2): the lower lanes of every group as the first operand, the lanes
// s above them as the second; the result packs twice as many groups, w / 2 lanes each.
template <bool kMax>
inline __m512 tree_level(__m512 lo_groups, __m512 hi_groups, __m512i first, int s) {
  const __m512 a = _mm512_permutex2var_ps(lo_groups, first, hi_groups);
  const __m512 x =
      _mm512_permutex2var_ps(lo_groups, _mm512_add_epi32(first, _mm512_set1_epi32(s)), hi_groups);
  return kMax ? max_into(a, x) : min_into(a, x);
}

// Lanes of the first operand of each tree level; the second is s = 8, 4, 2, 1 above.
inline __m512i tree_lanes1() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
}
inline __m512i tree_lanes2() {
  return _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
}

// The first levels of the trees of kFold (1, 2 or 4) consecutive groups' accumulators:
// one register holding their partial trees, as reduce_groups has them after one
// (kFold = 2) or two (kFold = 4) levels.
template <bool kMax, int kFold>
inline __m512 fold(const __m512* v) {
  if constexpr (kFold == 1) {
    return v[0];
  } else if constexpr (kFold == 2) {
    return tree_level<kMax>(v[0], v[1], tree_lanes1(), 8);
  } else {
    static_assert(kFold == 4);
    return tree_level<kMax>(tree_level<kMax>(v[0], v[1], tree_lanes1(), 8),
                            tree_level<kMax>(v[2], v[3], tree_lanes1(), 8), tree_lanes2(), 4);
  }
}

// NaN in the statistics. With fp16 input, vcvtph2ps quiets signalling NaNs, so a row
// or block that may hold one where it matters takes the caller's bit-exact conversion.
// Only the values that seed the accumulators can matter: min_into / max_into (as min_f
// / max_f) keep the accumulator when the new value is NaN, so a later NaN changes no
// statistic; its code is lo whether the NaN is quiet or not (the clamp), and no float
// of the row is copied to the output. The functions below return the sum of the seeding
// values per lane (one vaddps per group instead of a compare and a mask merge), and
// no_nan tells whether it is NaN-free. A lane holding both +Inf and -Inf also sums to
// NaN and takes the exact path (same result, more work); fp16 values cannot overflow
// the float sum.
inline bool no_nan(__m512 seed_sum) { return _mm512_cmp_ps_mask(seed_sum, seed_sum, _CMP_UNORD_Q) == 0; }

// Lane accumulators of the groups of G elements of a row of d read through `row`
// (FloatRow, F16RowCopy; d and G multiples of 16, the last group may be shorter): 16
// floats per group, lane j the min_f / max_f over elements j, j + 16, ... of the group
// in order. kFold = 2 or 4 (the number of groups of the row a multiple of it): the
// accumulators of groups kFold j ... kFold j + kFold - 1 leave as one register, the
// first one or two tree levels of reduce_groups applied while they are in registers,
// at mn[16 j ...], mx[16 j ...]. kSpg: steps per group (G = 16 kSpg, d a multiple of G)
// fixed at compile time, so that the group loop is unrolled; 0 for any G. Returns the
// sum of the seeding steps (no_nan).
template <int kSpg, int kFold, typename Row>
[[gnu::always_inline]] inline __m512 lane_min_max(const Row row, int d, int G, float* mn, float* mx) {
  __m512 sum = _mm512_setzero_ps();
  // Accumulators of the group at i0 into a, b.
  const auto group = [&](int i0, __m512& a, __m512& b) {
    const int end = kSpg > 0 ? i0 + kSpg * kStep : (i0 + G < d ? i0 + G : d);
    a = row.load(i0);
    b = a;
    sum = _mm512_add_ps(sum, a);
    for (int i = i0 + kStep; i < end; i += kStep) {
      const __m512 x = row.load(i);
      a = min_into(a, x);
      b = max_into(b, x);
    }
  };
  for (int i0 = 0, j = 0; i0 < d; i0 += kFold * G, ++j) {
    __m512 a[kFold], b[kFold];
    for (int k = 0; k < kFold; ++k) group(i0 + k * G, a[k], b[k]);
    _mm512_storeu_ps(mn + kStep * j, fold<false, kFold>(a));
    _mm512_storeu_ps(mx + kStep * j, fold<true, kFold>(b));
  }
  return sum;
}

// lane_min_max with the group loop unrolled for the common group sizes.
template <int kFold, typename Row>
[[gnu::always_inline]] inline __m512 lane_min_max_any(const Row row, int d, int G, float* mn, float* mx) {
  if (d % G == 0) {
    switch (G) {
      case kStep:
        return lane_min_max<1, kFold>(row, d, G, mn, mx);
      case 2 * kStep:
        return lane_min_max<2, kFold>(row, d, G, mn, mx);
      case 4 * kStep:
        return lane_min_max<4, kFold>(row, d, G, mn, mx);
      case 8 * kStep:
        return lane_min_max<8, kFold>(row, d, G, mn, mx);
      default:
        break;
    }
  }
  return lane_min_max<0, kFold>(row, d, G, mn, mx);
}

// Per-channel statistics of a [rows, d] block read through `block` (FloatRow, F16Row;
// rows >= 1, d a multiple of 16): mn[i], mx[i] = min_f / max_f of column i in row order,
// as quantize.cpp's portable loop, 16 columns at a time in registers. Returns the sum
// of the seeding (first) row (no_nan).
template <typename Block>
inline __m512 column_min_max(const Block block, int rows, int d, float* mn, float* mx) {
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < d; i += kStep) {
    __m512 a = block.load(i), b = a;
    sum = _mm512_add_ps(sum, a);
    for (int t = 1; t < rows; ++t) {
      const __m512 x = block.load(t * d + i);
      a = min_into(a, x);
      b = max_into(b, x);
    }
    _mm512_storeu_ps(mn + i, a);
    _mm512_storeu_ps(mx + i, b);
  }
  return sum;
}

// out[k] = tree reduction of the 16 lane accumulators acc[16 k ...], k < n; kFold > 1:
// acc holds them folded (n a multiple of kFold, the first levels done: lane_min_max).
template <bool kMax, int kFold = 1>
inline void reduce_groups(const float* acc, int n, float* out) {
  const __m512i l1 = tree_lanes1();
  const __m512i l2 = tree_lanes2();
  const __m512i l3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i l4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  for (int k0 = 0; k0 < n; k0 += kStep) {
    const int m = n - k0 < kStep ? n - k0 : kStep;
    __m512 v[kStep];
    // The registers of this run of 16 groups (a partial run repeats its last one).
    constexpr int kRegs = kStep / kFold;
    const int regs = m / kFold;
    for (int k = 0; k < kRegs; ++k)
      v[k] = _mm512_loadu_ps(acc + kStep * (k0 / kFold + (k < regs ? k : regs - 1)));
    if constexpr (kFold < 2) {
      for (int k = 0; k < 8; ++k) v[k] = tree_level<kMax>(v[2 * k], v[2 * k + 1], l1, 8);
    }
    if constexpr (kFold < 4) {
      for (int k = 0; k < 4; ++k) v[k] = tree_level<kMax>(v[2 * k], v[2 * k + 1], l2, 4);
    }
    for (int k = 0; k < 2; ++k) v[k] = tree_level<kMax>(v[2 * k], v[2 * k + 1], l3, 2);
    _mm512_mask_storeu_ps(out + k0, lanes(m), tree_level<kMax>(v[0], v[1], l4, 1));
  }
}

// fp16 -> float of the whole 16-element steps of n elements. vcvtph2ps is exact
// except that it quiets a signalling NaN, so when any converted value is NaN this
// returns 0 and the caller converts the row with its bit-exact path instead; else it
// returns the number of elements converted (a multiple of 16).
inline int f16_to_float_steps(const std::uint16_t* p, int n, float* dst) {
  __mmask16 nan = 0;
  int i = 0;
  for (; i + kStep <= n; i += kStep) {
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    nan |= _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    _mm512_storeu_ps(dst + i, f);
  }
  return nan == 0 ? i : 0;
}

}  // namespace kvscope::kernels::cpu::quant_avx512

#endif
