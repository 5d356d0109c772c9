// The x86 intrinsics of the CPU kernels, included in one place (internal to
// kernels/src/cpu). KVSCOPE_CPU_AVX512 is defined where the AVX-512 row loops
// (quantize_avx512.hpp, attention_rows.hpp) can be compiled; elsewhere their portable
// loops run. F16C alone gives the fp16 conversions of row_math.hpp.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define KVSCOPE_CPU_AVX512 1
#endif

#if defined(KVSCOPE_CPU_AVX512) || defined(__F16C__)
// GCC 12's AVX-512 intrinsics pass an uninitialised pass-through operand
// (_mm512_undefined_ps) that -Wmaybe-uninitialized reports once they are inlined at
// -O3 (GCC bug 105593, fixed in 12.3); silenced for the intrinsics header only. Every
// file takes <immintrin.h> from here, so the first inclusion is always this guarded one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
