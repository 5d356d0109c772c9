// Per-row loops of the CPU evaluation kernel after its GEMMs (internal to
// kernels/src/cpu): softmax numerators with their double-precision sums, per-modality
// probability sums and the KL row. GCC reported the `omp simd` forms of these loops
// vectorised, yet the object code kept them scalar (double accumulators fed by floats
// and byte-indexed selects), so with AVX-512 they are written with intrinsics; the
// portable loops below are the reference forms and run everywhere else. The sums
// are the same sums in another association order (double accumulators, one per lane).
#pragma once

#include <cstdint>

#include "row_math.hpp"
#include "simd.hpp"

namespace kvscope::kernels::cpu::rowmath {

#if defined(KVSCOPE_CPU_AVX512)
// exp_vec on 16 lanes (same reduction and polynomial, with FMAs).
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.0f), x);  // std::min(x, 88.0f)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), y, _mm512_castsi512_ps(e));
}

// log_vec on 8 lanes.
inline __m512d log8(__m512d x) {
  const __m512i bits = _mm512_castpd_si512(x);
  const __m512i e = _mm512_srai_epi64(_mm512_sub_epi64(bits, _mm512_set1_epi64(0x3fe6a09e667f3bcdll)), 52);
  const __m512d m = _mm512_castsi512_pd(_mm512_sub_epi64(bits, _mm512_slli_epi64(e, 52)));
  const __m512d f = _mm512_sub_pd(m, _mm512_set1_pd(1.0));
  const __m512d s = _mm512_div_pd(f, _mm512_add_pd(_mm512_set1_pd(2.0), f)), z = _mm512_mul_pd(s, s);
  __m512d p = _mm512_set1_pd(1.0 / 21);
  for (const double c :
       {1.0 / 19, 1.0 / 17, 1.0 / 15, 1.0 / 13, 1.0 / 11, 1.0 / 9, 1.0 / 7, 1.0 / 5, 1.0 / 3}) {
    p = _mm512_fmadd_pd(p, z, _mm512_set1_pd(c));
  }
  const __m512d two_s = _mm512_add_pd(s, s);
  const __m512d atanh2 = _mm512_fmadd_pd(two_s, _mm512_mul_pd(z, p), two_s);
  const __m512d ed = _mm512_cvtepi64_pd(e);
  return _mm512_fmadd_pd(ed, _mm512_set1_pd(0x1.62e42fee00000p-1),
                         _mm512_fmadd_pd(ed, _mm512_set1_pd(0x1.a39ef35793c76p-33), atanh2));
}

#endif

// e[k] = exp(z[k] - m) for k < n (e may alias z); *zs = sum e, *es = sum e (z - m), in
// double. With modality != nullptr, cm[j] = sum of e over the k with modality[k] == j.
inline void softmax_numerators(const float* z, int n, float m, float* e, double* zs, double* es,
                               const std::uint8_t* modality, double* cm) {
  int k = 0;
  double s = 0.0, se = 0.0, c[4] = {0.0, 0.0, 0.0, 0.0};
#if defined(KVSCOPE_CPU_AVX512)
  __m512d s_lo = _mm512_setzero_pd(), s_hi = s_lo, se_lo = s_lo, se_hi = s_lo;
  __m512d c_lo[4] = {s_lo, s_lo, s_lo, s_lo}, c_hi[4] = {s_lo, s_lo, s_lo, s_lo};
  const __m512 vm = _mm512_set1_ps(m);
  for (; k + 16 <= n; k += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(z + k), vm);
    const __m512 ev = exp16(x);
    _mm512_storeu_ps(e + k, ev);
    const __m512d e_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(ev));
    const __m512d e_hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(ev, 1));
    s_lo = _mm512_add_pd(s_lo, e_lo);
    s_hi = _mm512_add_pd(s_hi, e_hi);
    se_lo = _mm512_fmadd_pd(e_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(x)), se_lo);
    se_hi = _mm512_fmadd_pd(e_hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)), se_hi);
    if (modality != nullptr) {
      const __m128i mk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(modality + k));
      for (int j = 0; j < 4; ++j) {
        const __mmask16 is_j = _mm_cmpeq_epi8_mask(mk, _mm_set1_epi8(static_cast<char>(j)));
        c_lo[j] = _mm512_mask_add_pd(c_lo[j], static_cast<__mmask8>(is_j), c_lo[j], e_lo);
        c_hi[j] = _mm512_mask_add_pd(c_hi[j], static_cast<__mmask8>(is_j >> 8), c_hi[j], e_hi);
      }
    }
  }
  s = _mm512_reduce_add_pd(_mm512_add_pd(s_lo, s_hi));
  se = _mm512_reduce_add_pd(_mm512_add_pd(se_lo, se_hi));
  for (int j = 0; j < 4; ++j) c[j] = _mm512_reduce_add_pd(_mm512_add_pd(c_lo[j], c_hi[j]));
#endif
  for (; k < n; ++k) {
    const float x = z[k] - m;
    const float ek = exp_vec(x);
    e[k] = ek;
    s += ek;
    se += static_cast<double>(ek) * x;
    if (modality != nullptr) c[modality[k]] += ek;
  }
  *zs = s;
  *es = se;
  if (cm != nullptr) {
    for (int j = 0; j < 4; ++j) cm[j] = c[j];
  }
}

// mass[j] = sum of p[t] over the t with modality[t] == j; surv[j] the same over the
// t with map[t] >= 0 (surviving tokens). Double sums of float probabilities.
inline void modality_sums(const float* p, const std::uint8_t* modality, const std::int32_t* map, int T,
                          double* mass, double* surv) {
  int t = 0;
  double ms[4] = {0.0, 0.0, 0.0, 0.0}, ss[4] = {0.0, 0.0, 0.0, 0.0};
#if defined(KVSCOPE_CPU_AVX512)
  __m512d vm[4], vs[4];
  for (int j = 0; j < 4; ++j) vm[j] = vs[j] = _mm512_setzero_pd();
  for (; t + 8 <= T; t += 8) {
    const __m512d pt = _mm512_cvtps_pd(_mm256_loadu_ps(p + t));
    const __mmask8 alive = _mm256_cmpge_epi32_mask(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(map + t)), _mm256_setzero_si256());
    const __m128i mk = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(modality + t));
    for (int j = 0; j < 4; ++j) {
      const __mmask8 is_j =
          static_cast<__mmask8>(_mm_cmpeq_epi8_mask(mk, _mm_set1_epi8(static_cast<char>(j))));
      vm[j] = _mm512_mask_add_pd(vm[j], is_j, vm[j], pt);
      vs[j] = _mm512_mask_add_pd(vs[j], is_j & alive, vs[j], pt);
    }
  }
  for (int j = 0; j < 4; ++j) {
    ms[j] = _mm512_reduce_add_pd(vm[j]);
    ss[j] = _mm512_reduce_add_pd(vs[j]);
  }
#endif
  for (; t < T; ++t) {
    ms[modality[t]] += p[t];
    if (map[t] >= 0) ss[modality[t]] += p[t];
  }
  for (int j = 0; j < 4; ++j) {
    mass[j] = ms[j];
    surv[j] = ss[j];
  }
}

// sum over the S slots with am[k] > 0 of (am[k] / survived) * (log(am[k]) - log_surv -
// ((z[k] - m) - log_zc)): KL(P || p~) with P the renormalised full-cache slot masses.
inline double kl_row(const float* am, const float* z, int S, float m, double survived, double log_surv,
                     double log_zc) {
  int k = 0;
  double kl = 0.0;
#if defined(KVSCOPE_CPU_AVX512)
  __m512d acc = _mm512_setzero_pd();
  const __m512d vs = _mm512_set1_pd(survived), vls = _mm512_set1_pd(log_surv), vlz = _mm512_set1_pd(log_zc);
  const __m256 vm = _mm256_set1_ps(m);
  for (; k + 8 <= S; k += 8) {
    const __m256 a32 = _mm256_loadu_ps(am + k);
    const __mmask8 has_mass = _mm256_cmp_ps_mask(a32, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m512d a = _mm512_mask_blend_pd(has_mass, _mm512_set1_pd(1.0), _mm512_cvtps_pd(a32));
    const __m512d log_p = _mm512_sub_pd(log8(a), vls);
    const __m512d log_pc = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_sub_ps(_mm256_loadu_ps(z + k), vm)), vlz);
    const __m512d term = _mm512_mul_pd(_mm512_div_pd(a, vs), _mm512_sub_pd(log_p, log_pc));
    acc = _mm512_mask_add_pd(acc, has_mass, acc, term);
  }
  kl = _mm512_reduce_add_pd(acc);
#endif
  for (; k < S; ++k) {
    if (!(am[k] > 0.0f)) continue;
    const double log_p = log_vec(static_cast<double>(am[k])) - log_surv;
    const double log_pc = static_cast<double>(z[k] - m) - log_zc;
    kl += (static_cast<double>(am[k]) / survived) * (log_p - log_pc);
  }
  return kl;
}

}  // namespace kvscope::kernels::cpu::rowmath
