// CPU backend of the quantization family (OpenMP over code rows, one pass per row).
// The scalar math lives in quant_math (quantize.hpp), shared with the CUDA backend.
#include "kvscope/kernels/quantize.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"
#include "quantize_avx512.hpp"
#include "simd.hpp"

namespace kvscope::kernels {

Status validate_quant(const QuantSpec& spec, const QuantShape& shape) {
  if (spec.bits != 8 && spec.bits != 4 && spec.bits != 2) {
    return Status::Invalid("quantize: bits " + std::to_string(spec.bits) + " not supported (8, 4 or 2)");
  }
  const int g = static_cast<int>(spec.granularity);
  if (g < 0 || g > static_cast<int>(Granularity::kPerChannel)) {
    return Status::Invalid("quantize: granularity " + std::to_string(g) + " unknown");
  }
  if (spec.group_size < 0) {
    return Status::Invalid("quantize: group_size " + std::to_string(spec.group_size) + " negative");
  }
  if (spec.group_size != 0 &&
      (spec.granularity == Granularity::kPerTensor || spec.granularity == Granularity::kPerHead)) {
    return Status::Invalid(std::string("quantize: group_size ") + std::to_string(spec.group_size) +
                           " with granularity " + granularity_name(spec.granularity) +
                           " (groups need per_token or per_channel)");
  }
  if (spec.residual_tokens < 0) {
    return Status::Invalid("quantize: residual_tokens " + std::to_string(spec.residual_tokens) + " negative");
  }
  if (shape.num_heads <= 0)
    return Status::Invalid("quantize: num_heads " + std::to_string(shape.num_heads) + " <= 0");
  if (shape.tokens <= 0) return Status::Invalid("quantize: tokens " + std::to_string(shape.tokens) + " <= 0");
  if (shape.head_dim <= 0)
    return Status::Invalid("quantize: head_dim " + std::to_string(shape.head_dim) + " <= 0");
  const int d = static_cast<int>(shape.dtype);
  if (d < 0 || d > static_cast<int>(DType::kBF16)) {
    return Status::Invalid("quantize: dtype " + std::to_string(d) + " unknown");
  }
  return Status::Ok();
}

Status quant_layout(const QuantSpec& spec, const QuantShape& shape, QuantLayout* layout) {
  KVSCOPE_RETURN_IF_ERROR(validate_quant(spec, shape));
  if (layout == nullptr) return Status::Invalid("quant_layout: layout is null");
  QuantLayout l;
  const std::int64_t h = shape.num_heads, t = shape.tokens, d = shape.head_dim;
  l.residual_tokens = std::min<std::int64_t>(spec.residual_tokens, t);
  l.quant_tokens = t - l.residual_tokens;
  l.row_bytes = (d * spec.bits + 7) / 8;
  switch (spec.granularity) {
    case Granularity::kPerTensor:
      l.num_groups = 1;
      break;
    case Granularity::kPerHead:
      l.num_groups = h;
      break;
    case Granularity::kPerToken:
      l.group_size = spec.group_size > 0 ? spec.group_size : d;
      l.groups_per_row = (d + l.group_size - 1) / l.group_size;
      l.num_groups = h * l.quant_tokens * l.groups_per_row;
      break;
    case Granularity::kPerChannel:
      l.group_size = spec.group_size > 0 ? spec.group_size : l.quant_tokens;
      l.groups_per_row = l.quant_tokens > 0 ? (l.quant_tokens + l.group_size - 1) / l.group_size : 0;
      l.num_groups = h * l.groups_per_row * d;
      break;
  }
  l.code_bytes = h * l.quant_tokens * l.row_bytes;
  l.scale_bytes = l.num_groups * static_cast<std::int64_t>(sizeof(float));
  l.zero_bytes = spec.symmetric ? 0 : l.scale_bytes;
  l.residual_bytes = h * l.residual_tokens * d * static_cast<std::int64_t>(dtype_bytes(shape.dtype));
  *layout = l;
  return Status::Ok();
}

QuantBytes quantized_bytes(const QuantSpec& spec, int num_heads, int tokens, int head_dim, DType input) {
  QuantLayout l;
  if (!quant_layout(spec, QuantShape{num_heads, tokens, head_dim, input}, &l).ok()) return {};
  return QuantBytes{l.code_bytes, l.scale_bytes, l.zero_bytes, l.residual_bytes, l.total_bytes()};
}

namespace cpu {
namespace {

using quant_math::max_f;
using quant_math::min_f;

// Below this many elements the OpenMP fork/join costs more than it saves.
constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 16;
// Code rows per block of the per-token loop (~2k elements: statistics, parameters and
// codes of a block while it is in L1). The row loops are scheduled `guided`: each
// thread takes long runs of consecutive blocks, so it reads one sequential stream that
// the hardware prefetchers follow, and the shrinking chunks at the end still let a
// running thread take the rows of one the OS has descheduled (the machines are
// shared). With `dynamic, 1` the two threads alternated 4 KiB blocks and a 2-thread
// int8 quantize of a 64 MiB layer ran no faster than 1 thread (docs/perf.md).
constexpr int kRowChunk = 16;
// Largest per-channel token group (G x head_dim floats, 256 KiB) converted into one
// block buffer per thread by the AVX-512 path.
constexpr std::int64_t kChannelBlockFloats = std::int64_t{1} << 16;
// Independent min/max accumulators per row (one 512-bit register of floats).
constexpr int kLanes = 16;

// ---------------------------------------------------------------- conversion

// Asks for the `bytes` bytes `offset` bytes after `base` to be brought into the cache
// (a hint: it never faults, so the range may lie past the end of the input; the address
// is formed as an integer, since a pointer past the end of an array is undefined). The
// row loops call it for the rows of the next block while they encode the current one,
// which overlaps the reads from memory with the encoding: the statistics pass would
// otherwise wait for each block's loads, with the cores' prefetchers only a few lines
// ahead.
inline void prefetch_bytes(const void* base, std::int64_t offset, std::size_t bytes) {
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(base) + static_cast<std::uintptr_t>(offset);
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(at + b), 0, 3);
}

// Same value as half_to_float for every bit pattern (tested, NaN payloads included),
// written branch-free so that the row loop vectorizes.
inline float f16_bits_to_float(std::uint32_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
  // Normal: rebias the exponent (15 -> 127); Inf/NaN: exponent 31 -> 255.
  const std::uint32_t normal =
      (em << 13) + 0x38000000u + static_cast<std::uint32_t>(em >= 0x7c00u) * 0x38000000u;
  // Zero and subnormal: mantissa * 2^-24, exact in float.
  const std::uint32_t sub =
      float_to_bits(static_cast<float>(static_cast<std::int32_t>(em)) * 5.9604644775390625e-8f);
  const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(em < 0x400u);  // all ones or 0
  return bits_to_float(((sub & is_sub) | (normal & ~is_sub)) | sign);
}

// Elements [offset, offset + n) of x as float: x itself for fp32, else converted into buf.
template <DType kT>
const float* row_as_float(const void* x, std::int64_t offset, int n, float* __restrict buf) {
  if constexpr (kT == DType::kF32) {
    (void)n;
    (void)buf;
    return static_cast<const float*>(x) + offset;
  } else if constexpr (kT == DType::kBF16) {
    const std::uint16_t* __restrict p = static_cast<const std::uint16_t*>(x) + offset;
    for (int i = 0; i < n; ++i) buf[i] = bf16_to_float(p[i]);
    return buf;
  } else {
    const std::uint16_t* __restrict p = static_cast<const std::uint16_t*>(x) + offset;
    int i = 0;
#if defined(KVSCOPE_CPU_AVX512)
    i = quant_avx512::f16_to_float_steps(p, n, buf);
#endif
#if defined(__F16C__)
    // vcvtph2ps converts every finite value and infinity exactly; it would quiet a
    // signalling NaN, so a group of 8 holding a NaN takes the bit-exact path below.
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
      const __m128i mag = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
      if (_mm_movemask_epi8(_mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7c00))) != 0) {
        for (int k = i; k < i + 8; ++k) buf[k] = f16_bits_to_float(p[k]);
      } else {
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(h));
      }
    }
#endif
    for (; i < n; ++i) buf[i] = f16_bits_to_float(p[i]);
    return buf;
  }
}

// dst[0..n) = elements [offset, offset + n) of x (dtype t) as float; one dtype switch per row.
void convert_row(const void* x, DType t, std::int64_t offset, int n, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(x) + offset, static_cast<std::size_t>(n) * sizeof(float));
  } else if (t == DType::kF16) {
    row_as_float<DType::kF16>(x, offset, n, dst);
  } else {
    row_as_float<DType::kBF16>(x, offset, n, dst);
  }
}

// ---------------------------------------------------------------- row primitives

// kLanes floats as one vector (GCC/Clang vector extension; 512-bit registers with
// AVX-512, split into narrower ones elsewhere).
typedef float LaneVec __attribute__((vector_size(kLanes * sizeof(float))));
// Without AVX-512 GCC warns that passing a 64-byte vector by value has another ABI:
// these functions are internal to this file and inlined, so there is no ABI to keep
// (the warning broke -DKVSCOPE_NATIVE_ARCH=OFF builds with KVSCOPE_WERROR).
#pragma GCC diagnostic ignored "-Wpsabi"

// min_f / max_f lane by lane: x < a ? x : a is one vminps.
inline LaneVec min_lanes(LaneVec a, LaneVec x) { return x < a ? x : a; }
inline LaneVec max_lanes(LaneVec a, LaneVec x) { return x > a ? x : a; }

// Minimum and maximum of v[0..n), n >= 1, with min_f/max_f in kLanes independent
// accumulators (min/max are exact, so the order does not change the result unless
// the span holds a NaN). GCC does not vectorize the scalar select-based reduction,
// hence the vector type.
inline void min_max(const float* __restrict v, int n, float* mn_out, float* mx_out) {
  int i = 0;
  float a = v[0], b = v[0];
  if (n >= kLanes) {
    LaneVec mn, mx, x;
    std::memcpy(&mn, v, sizeof(LaneVec));
    mx = mn;
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      std::memcpy(&x, v + i, sizeof(LaneVec));
      mn = min_lanes(mn, x);
      mx = max_lanes(mx, x);
    }
    // Tree reduction across the lanes (halves, quarters, ...).
    mn = min_lanes(mn, __builtin_shufflevector(mn, mn, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    mx = max_lanes(mx, __builtin_shufflevector(mx, mx, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    mn = min_lanes(mn, __builtin_shufflevector(mn, mn, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    mx = max_lanes(mx, __builtin_shufflevector(mx, mx, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    mn = min_lanes(mn, __builtin_shufflevector(mn, mn, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    mx = max_lanes(mx, __builtin_shufflevector(mx, mx, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    a = min_f(mn[0], mn[1]);
    b = max_f(mx[0], mx[1]);
  }
  for (; i < n; ++i) {
    a = min_f(a, v[i]);
    b = max_f(b, v[i]);
  }
  *mn_out = a;
  *mx_out = b;
}

// Division-free encoding. The code of v = div_rn(x - zero, divisor) only changes where
// v crosses a half-integer (rounding half away from zero; the clamp bounds are
// integers). v' = (x - zero) * (1 / divisor) has |v' - v| <= 3 * 2^-24 * |v| (two
// roundings against one), i.e. < 4.6e-5 wherever |v| <= 256 (every boundary lies in
// [-127.5, 254.5]; beyond 256 both clamp to the same code). So when v' is farther than
// kNearHalf from every half-integer, v' and v give the same code; a span where some
// element is that close is recomputed with the division. This requires a normal
// reciprocal: divisors outside [2^-100, 2^100] always divide.
constexpr float kNearHalf = 1.0f / 8192.0f;
inline bool reciprocal_usable(float divisor) { return divisor >= 0x1p-100f && divisor <= 0x1p100f; }
// 1 when the clamped quotient v lies within kNearHalf of a half-integer.
inline int near_half(float v, int lo, int hi) {
  float c = v >= static_cast<float>(lo) ? v : static_cast<float>(lo);
  c = c > static_cast<float>(hi) ? static_cast<float>(hi) : c;
  const float frac = c - static_cast<float>(static_cast<int>(c));
  return static_cast<int>(std::fabs(std::fabs(frac) - 0.5f) < kNearHalf);
}

// Codes of n elements sharing one group (divisor = encode_divisor(scale)); bit for bit
// quant_math::encode_with_divisor.
inline void encode_span(const float* __restrict x, int n, float divisor, float zero, int lo, int hi,
                        std::int32_t* __restrict q) {
  if (reciprocal_usable(divisor)) {
    const float r = 1.0f / divisor;
    int near = 0;
    for (int i = 0; i < n; ++i) {
      const float v = quant_math::mul_rn(quant_math::sub_rn(x[i], zero), r);
      q[i] = quant_math::encode_with_divisor(v, 1.0f, 0.0f, lo, hi);  // v / 1 - 0 = v
      near |= near_half(v, lo, hi);
    }
    if (near == 0) return;
  }
  for (int i = 0; i < n; ++i) q[i] = quant_math::encode_with_divisor(x[i], divisor, zero, lo, hi);
}

// Codes of n elements with one group per element (per-channel granularity).
// reciprocal[i] = 1 / divisor[i]; fast = every divisor passes reciprocal_usable.
inline void encode_span_each(const float* __restrict x, int n, const float* __restrict divisor,
                             const float* __restrict reciprocal, bool fast, const float* __restrict zero,
                             int lo, int hi, std::int32_t* __restrict q) {
  if (fast) {
    int near = 0;
    for (int i = 0; i < n; ++i) {
      const float v = quant_math::mul_rn(quant_math::sub_rn(x[i], zero[i]), reciprocal[i]);
      q[i] = quant_math::encode_with_divisor(v, 1.0f, 0.0f, lo, hi);
      near |= near_half(v, lo, hi);
    }
    if (near == 0) return;
  }
  for (int i = 0; i < n; ++i) q[i] = quant_math::encode_with_divisor(x[i], divisor[i], zero[i], lo, hi);
}

inline void decode_span(const std::int32_t* __restrict q, int n, float scale, float zero,
                        float* __restrict out) {
  for (int i = 0; i < n; ++i) out[i] = quant_math::decode(q[i], scale, zero);
}

// zero may be null (symmetric: every zero is 0).
inline void decode_span_each(const std::int32_t* __restrict q, int n, const float* __restrict scale,
                             const float* __restrict zero, float* __restrict out) {
  if (zero == nullptr) {
    for (int i = 0; i < n; ++i) out[i] = quant_math::decode(q[i], scale[i], 0.0f);
  } else {
    for (int i = 0; i < n; ++i) out[i] = quant_math::decode(q[i], scale[i], zero[i]);
  }
}

// Packs d codes into ceil(d * kBits / 8) bytes, lowest bits first, unused bits 0.
// fields: scratch of d + 3 bytes. The codes first become one field per byte; 4 (2-bit)
// or 2 (4-bit) consecutive bytes, read as one little-endian word, then fold into one
// byte with shifts and masks, a loop the compiler vectorizes.
static_assert(std::endian::native == std::endian::little, "pack_row reads bytes as little-endian words");

template <int kBits>
void pack_row(const std::int32_t* __restrict q, int d, std::uint8_t* __restrict fields,
              std::uint8_t* __restrict out) {
  if constexpr (kBits == 8) {
    (void)fields;
    for (int i = 0; i < d; ++i) out[i] = static_cast<std::uint8_t>(quant_math::to_field(q[i], 8));
  } else {
    constexpr int kPer = 8 / kBits;
    for (int i = 0; i < d; ++i) fields[i] = static_cast<std::uint8_t>(quant_math::to_field(q[i], kBits));
    for (int i = d; i < d + kPer - 1; ++i) fields[i] = 0;  // a partial last byte reads zero fields
    const int nbytes = (d + kPer - 1) / kPer;
    for (int j = 0; j < nbytes; ++j) {
      if constexpr (kBits == 4) {
        std::uint16_t w;
        std::memcpy(&w, fields + 2 * j, 2);
        out[j] = static_cast<std::uint8_t>((w & 0x0fu) | ((w >> 4) & 0xf0u));
      } else {
        std::uint32_t w;
        std::memcpy(&w, fields + 4 * j, 4);
        out[j] = static_cast<std::uint8_t>((w & 0x03u) | ((w >> 6) & 0x0cu) | ((w >> 12) & 0x30u) |
                                           ((w >> 18) & 0xc0u));
      }
    }
  }
}

template <int kBits, bool kSymmetric>
void unpack_row(const std::uint8_t* __restrict in, int d, std::int32_t* __restrict q) {
  constexpr unsigned kMask = (1u << kBits) - 1u;
  if constexpr (kBits == 8) {
    for (int i = 0; i < d; ++i) q[i] = quant_math::from_field(in[i], 8, kSymmetric);
  } else {
    constexpr int kPer = 8 / kBits;
    const int full = d / kPer;
    for (int j = 0; j < full; ++j) {
      const unsigned byte = in[j];
      for (int k = 0; k < kPer; ++k) {
        q[j * kPer + k] = quant_math::from_field((byte >> (k * kBits)) & kMask, kBits, kSymmetric);
      }
    }
    for (int i = full * kPer; i < d; ++i) {
      q[i] = quant_math::from_field((static_cast<unsigned>(in[full]) >> ((i % kPer) * kBits)) & kMask, kBits,
                                    kSymmetric);
    }
  }
}

// ---------------------------------------------------------------- plan

// Everything the row loops need, derived once from spec + shape + layout.
struct Plan {
  QuantSpec spec;
  QuantShape shape;
  QuantLayout layout;
  int lo = 0, hi = 0;     // code range
  bool parallel = false;  // worth a parallel region (small tensors run serially)
  std::int64_t row_offset(std::int64_t h, std::int64_t t) const {
    return (h * shape.tokens + t) * shape.head_dim;
  }
};

Status plan_for(const char* fn, const QuantSpec& spec, const QuantShape& shape, Plan* plan) {
  QuantLayout layout;
  const Status s = quant_layout(spec, shape, &layout);
  if (!s.ok()) return Status::Invalid(std::string(fn) + ": " + s.message());
  const std::int64_t elements = static_cast<std::int64_t>(shape.num_heads) * shape.tokens * shape.head_dim;
  *plan = Plan{spec,
               shape,
               layout,
               quant_math::code_min(spec.bits, spec.symmetric),
               quant_math::code_max(spec.bits, spec.symmetric),
               elements >= kParallelMinElements};
  return Status::Ok();
}

// Where the quantizing kernels put their result: packed codes plus scales/zeros
// (quantize), or dequantized floats (fake quant, codes == nullptr; scales/zeros are
// still written, to scratch).
struct QuantOut {
  std::uint8_t* codes = nullptr;  // [H, Tq, row_bytes]
  float* scales = nullptr;        // [num_groups]
  float* zeros = nullptr;         // [num_groups]; null when symmetric
  void* residual = nullptr;       // quantize: [H, R, D] input dtype
  float* out = nullptr;           // fake quant: [H, T, D]
};

// Orphaned worksharing loops (called inside a parallel region, no barrier at the end).
// Quantize: residual tokens copied byte for byte. Fake quant: converted to float.
template <bool kFake>
void residual_rows(const Plan& p, const void* x, const QuantOut& o) {
  const std::int64_t H = p.shape.num_heads, R = p.layout.residual_tokens, Tq = p.layout.quant_tokens;
  const int d = p.shape.head_dim;
  if (R == 0) return;
  if constexpr (kFake) {
#pragma omp for schedule(static) nowait
    for (std::int64_t r = 0; r < H * R; ++r) {
      const std::int64_t h = r / R, t = Tq + r % R;
      convert_row(x, p.shape.dtype, p.row_offset(h, t), d, o.out + p.row_offset(h, t));
    }
  } else {
    const std::size_t esz = dtype_bytes(p.shape.dtype);
    const std::size_t head_bytes = static_cast<std::size_t>(R) * d * esz;
#pragma omp for schedule(static) nowait
    for (std::int64_t h = 0; h < H; ++h) {
      std::memcpy(static_cast<char*>(o.residual) + h * head_bytes,
                  static_cast<const char*>(x) + static_cast<std::size_t>(p.row_offset(h, Tq)) * esz,
                  head_bytes);
    }
  }
}

// Stores the codes of row `row` (packed) or their dequantized values (fake quant).
template <int kBits, bool kFake>
inline void emit_row(const Plan& p, const QuantOut& o, std::int64_t row, const std::int32_t* q,
                     std::uint8_t* fields) {
  (void)fields;
  if constexpr (!kFake) pack_row<kBits>(q, p.shape.head_dim, fields, o.codes + row * p.layout.row_bytes);
}

#if defined(KVSCOPE_CPU_AVX512)
// Destinations of row `row` (element offset `off`) for the AVX-512 pipeline, which
// writes packed codes (quantize) or dequantized floats (fake quant) directly.
template <bool kFake>
inline std::uint8_t* codes_row(const Plan& p, const QuantOut& o, std::int64_t row) {
  if constexpr (kFake) return nullptr;
  return o.codes + row * p.layout.row_bytes;
}
template <bool kFake>
inline float* out_row(const QuantOut& o, std::int64_t off) {
  if constexpr (kFake) return o.out + off;
  return nullptr;
}
#endif

// ---------------------------------------------------------------- quantize kernels

// Per-token groups, a block of kRowChunk rows at a time while it is in L1: first the
// statistics and parameters of every group of the block, then the codes. Separating
// the phases gives the out-of-order core independent work: done row by row, each
// row's min/max reduction and the divisions of its parameters formed one dependency
// chain in front of its encoding.
template <DType kT, int kBits, bool kFake>
void quantize_per_token(const Plan& p, const void* x, const QuantOut& o) {
  const std::int64_t H = p.shape.num_heads, Tq = p.layout.quant_tokens, rows = H * Tq;
  const int d = p.shape.head_dim, G = static_cast<int>(p.layout.group_size);
  const int ng = static_cast<int>(p.layout.groups_per_row);
  const std::int64_t blocks = (rows + kRowChunk - 1) / kRowChunk;
  // Row r of the next block is (mostly) next_block elements after row r of this one.
  constexpr std::int64_t esz = kT == DType::kF32 ? 4 : 2;
  const std::int64_t next_block = std::int64_t{kRowChunk} * d;
  const std::size_t row_bytes = static_cast<std::size_t>(d) * esz;
#if defined(KVSCOPE_CPU_AVX512)
  // Every group starts a 16-element step (the llava layouts: G = D or G = 32).
  const bool vector_rows = G % quant_avx512::kStep == 0 || ng == 1;
  // Every group is whole 16-element steps: statistics as quant_avx512::lane_min_max.
  const bool vector_stats = G % quant_avx512::kStep == 0 && d % quant_avx512::kStep == 0;
  // Several groups per row, each whole steps (KIVI values: G = 32 of 128): a row whose
  // groups all take the reciprocal is encoded in one span (quant_avx512::StepGroups),
  // rather than a short span per group.
  const bool step_rows = G % quant_avx512::kStep == 0 && ng > 1;
#endif
#pragma omp parallel if (p.parallel)
  {
    std::vector<float> buf(static_cast<std::size_t>(kRowChunk) * d);
    std::vector<float> mn(static_cast<std::size_t>(kRowChunk) * ng), mx(mn.size()), s(mn.size()),
        z(mn.size());
    std::vector<float> div(mn.size()), rcp(mn.size());
    std::vector<std::uint8_t> usable(mn.size());
    const float* xr[kRowChunk];
    std::int64_t offsets[kRowChunk];
    std::vector<std::int32_t> q(static_cast<std::size_t>(d));
    std::vector<std::uint8_t> fields(q.size() + 3);
#if defined(KVSCOPE_CPU_AVX512)
    // 16 lane accumulators per group of the block (vector_stats).
    std::vector<float> lane_mn(vector_stats ? mn.size() * quant_avx512::kStep : 0), lane_mx(lane_mn.size());
    const quant_avx512::CodeRange range(p.lo, p.hi, kNearHalf);
    const bool symmetric = p.spec.symmetric;
#endif
    residual_rows<kFake>(p, x, o);
#pragma omp for schedule(guided)
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      const std::int64_t r0 = blk * kRowChunk;
      const int nr = static_cast<int>(std::min<std::int64_t>(kRowChunk, rows - r0));
      for (int r = 0; r < nr; ++r) offsets[r] = p.row_offset((r0 + r) / Tq, (r0 + r) % Tq);
#if defined(KVSCOPE_CPU_AVX512)
      if (vector_stats) {
        // Rows whose number of groups is a multiple of 4 (KIVI values: 128 / 32) or 2 keep
        // their accumulators folded, the first one or two tree levels done while they are
        // in registers: a quarter or half of the stores and loads.
        const auto stats = [&](auto fold_tag) {
          constexpr int kFold = decltype(fold_tag)::value;
          const std::size_t row_acc = static_cast<std::size_t>(ng / kFold) * quant_avx512::kStep;
          for (int r = 0; r < nr; ++r) {
            float* row_buf = buf.data() + static_cast<std::size_t>(r) * d;
            float* amn = lane_mn.data() + r * row_acc;
            float* amx = lane_mx.data() + r * row_acc;
            if constexpr (kT == DType::kF16) {
              // Converted into row_buf on the way. (Encoding from the fp16 row instead, as
              // the per-channel kernel does, was 20 % slower here.)
              const quant_avx512::F16RowCopy row{static_cast<const std::uint16_t*>(x) + offsets[r], row_buf};
              if (quant_avx512::no_nan(quant_avx512::lane_min_max_any<kFold>(row, d, G, amn, amx))) {
                xr[r] = row_buf;
                continue;
              }
            }
            xr[r] = row_as_float<kT>(x, offsets[r], d, row_buf);
            (void)quant_avx512::lane_min_max_any<kFold>(quant_avx512::FloatRow{xr[r]}, d, G, amn, amx);
          }
          quant_avx512::reduce_groups<false, kFold>(lane_mn.data(), nr * ng, mn.data());
          quant_avx512::reduce_groups<true, kFold>(lane_mx.data(), nr * ng, mx.data());
        };
        if (ng % 4 == 0) {
          stats(std::integral_constant<int, 4>{});
        } else if (ng % 2 == 0) {
          stats(std::integral_constant<int, 2>{});
        } else {
          stats(std::integral_constant<int, 1>{});
        }
      }
#endif
      for (int r = 0; r < nr; ++r) {
#if defined(KVSCOPE_CPU_AVX512)
        if (vector_stats) break;
#endif
        xr[r] = row_as_float<kT>(x, offsets[r], d, buf.data() + static_cast<std::size_t>(r) * d);
        for (int g = 0; g < ng; ++g) {
          const int i0 = g * G, k = r * ng + g;
          min_max(xr[r] + i0, std::min(d - i0, G), &mn[k], &mx[k]);
        }
      }
#if defined(KVSCOPE_CPU_AVX512)
      quant_avx512::group_params(mn.data(), mx.data(), nr * ng, kBits, p.spec.symmetric, s.data(), z.data(),
                                 div.data(), rcp.data(), usable.data());
      std::copy(s.begin(), s.begin() + nr * ng, o.scales + r0 * ng);
      if (o.zeros != nullptr) std::copy(z.begin(), z.begin() + nr * ng, o.zeros + r0 * ng);
#else
      for (int k = 0; k < nr * ng; ++k) {
        quant_math::group_params(mn[k], mx[k], kBits, p.spec.symmetric, &s[k], &z[k]);
        o.scales[r0 * ng + k] = s[k];
        if (o.zeros != nullptr) o.zeros[r0 * ng + k] = z[k];
      }
#endif
#if defined(KVSCOPE_CPU_AVX512)
      if (vector_rows) {
        // Everything the span loop reads, in locals: the code stores are uint8_t, which
        // may alias any object, so fields read through p, o or a vector would be
        // reloaded for every span.
        const float *sk = s.data(), *zk = z.data(), *dk = div.data(), *rk = rcp.data();
        const std::uint8_t* uk = usable.data();
        for (int r = 0; r < nr; ++r) {
          prefetch_bytes(x, (offsets[r] + next_block) * esz, row_bytes);
          std::uint8_t* codes = codes_row<kFake>(p, o, r0 + r);
          float* out = out_row<kFake>(o, offsets[r]);
          const int k0 = r * ng;
          bool one_span = step_rows;  // the whole row in one span (every group takes the reciprocal)
          for (int g = 0; one_span && g < ng; ++g) one_span = uk[k0 + g] != 0;
          const quant_avx512::FloatRow row{xr[r]};
          if (one_span) {
            const auto with_steps = [&](auto spg) {
              quant_avx512::encode_span<kBits, kFake>(
                  row, 0, d,
                  quant_avx512::StepGroups<decltype(spg)::value>{sk + k0, zk + k0, dk + k0, rk + k0, G}, true,
                  range, codes, out);
            };
            if (G == quant_avx512::kStep) {
              with_steps(std::integral_constant<int, 1>{});
            } else if (G == 2 * quant_avx512::kStep) {
              with_steps(std::integral_constant<int, 2>{});
            } else if (G == 4 * quant_avx512::kStep) {
              with_steps(std::integral_constant<int, 4>{});
            } else {
              with_steps(std::integral_constant<int, 0>{});
            }
            continue;
          }
          for (int g = 0, i0 = 0; g < ng; ++g, i0 += G) {
            const int k = k0 + g;
            quant_avx512::encode_span<kBits, kFake>(
                row, i0, std::min(d - i0, G), quant_avx512::SpanGroup{sk[k], zk[k], dk[k], rk[k], symmetric},
                uk[k] != 0, range, codes, out);
          }
        }
        continue;
      }
#endif
      for (int r = 0; r < nr; ++r) {
        const std::int64_t row = r0 + r, off = offsets[r];
        prefetch_bytes(x, (off + next_block) * esz, row_bytes);
        for (int g = 0; g < ng; ++g) {
          const int i0 = g * G, n = std::min(d - i0, G), k = r * ng + g;
          encode_span(xr[r] + i0, n, quant_math::encode_divisor(s[k]), z[k], p.lo, p.hi, q.data() + i0);
          if constexpr (kFake) decode_span(q.data() + i0, n, s[k], z[k], o.out + off + i0);
        }
        emit_row<kBits, kFake>(p, o, row, q.data(), fields.data());
      }
    }
  }
}

// Per-tensor / per-head: row minima and maxima, an exact reduction per group, then a
// second pass that encodes each row with its group's scale. One parallel region (a
// region start costs milliseconds on a loaded machine), the reduction in `single`.
template <DType kT, int kBits, bool kFake>
void quantize_whole(const Plan& p, const void* x, const QuantOut& o) {
  const std::int64_t H = p.shape.num_heads, Tq = p.layout.quant_tokens;
  const int d = p.shape.head_dim;
  const bool per_tensor = p.spec.granularity == Granularity::kPerTensor;
  std::vector<float> row_mn(static_cast<std::size_t>(H * Tq)), row_mx(row_mn.size());
#pragma omp parallel if (p.parallel)
  {
    std::vector<float> buf(static_cast<std::size_t>(d));
    std::vector<std::int32_t> q(buf.size());
    std::vector<std::uint8_t> fields(buf.size() + 3);
#if defined(KVSCOPE_CPU_AVX512)
    const quant_avx512::CodeRange range(p.lo, p.hi, kNearHalf);
#endif
    residual_rows<kFake>(p, x, o);
#pragma omp for schedule(guided, kRowChunk)
    for (std::int64_t r = 0; r < H * Tq; ++r) {
      const float* xr = row_as_float<kT>(x, p.row_offset(r / Tq, r % Tq), d, buf.data());
      min_max(xr, d, &row_mn[static_cast<std::size_t>(r)], &row_mx[static_cast<std::size_t>(r)]);
    }
#pragma omp single
    {
      const std::int64_t groups = per_tensor ? 1 : H;
      const std::int64_t rows_per_group = H * Tq / groups;
      for (std::int64_t g = 0; g < groups; ++g) {
        float mn = std::numeric_limits<float>::infinity(), mx = -mn;
        for (std::int64_t r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
          mn = min_f(mn, row_mn[static_cast<std::size_t>(r)]);
          mx = max_f(mx, row_mx[static_cast<std::size_t>(r)]);
        }
        if (rows_per_group == 0) mn = mx = 0.0f;  // everything is residual
        float s = 0.0f, z = 0.0f;
        quant_math::group_params(mn, mx, kBits, p.spec.symmetric, &s, &z);
        o.scales[g] = s;
        if (o.zeros != nullptr) o.zeros[g] = z;
      }
    }  // implicit barrier: every thread sees the scales
#pragma omp for schedule(guided, kRowChunk)
    for (std::int64_t row = 0; row < H * Tq; ++row) {
      const std::int64_t g = per_tensor ? 0 : row / Tq, off = p.row_offset(row / Tq, row % Tq);
      const float s = o.scales[g], z = o.zeros != nullptr ? o.zeros[g] : 0.0f;
      const float* xr = row_as_float<kT>(x, off, d, buf.data());
#if defined(KVSCOPE_CPU_AVX512)
      const float divisor = quant_math::encode_divisor(s);
      quant_avx512::encode_span<kBits, kFake>(
          quant_avx512::FloatRow{xr}, 0, d,
          quant_avx512::SpanGroup{s, z, divisor, 1.0f / divisor, p.spec.symmetric},
          reciprocal_usable(divisor), range, codes_row<kFake>(p, o, row), out_row<kFake>(o, off));
      continue;
#endif
      encode_span(xr, d, quant_math::encode_divisor(s), z, p.lo, p.hi, q.data());
      if constexpr (kFake) decode_span(q.data(), d, s, z, o.out + off);
      emit_row<kBits, kFake>(p, o, row, q.data(), fields.data());
    }
  }
}

// Per-channel groups of G tokens: per (head, token group), the channel minima and
// maxima over its rows, then the rows encoded (G = 32: an 8-16 KiB block, still in L1/L2).
template <DType kT, int kBits, bool kFake>
void quantize_per_channel(const Plan& p, const void* x, const QuantOut& o) {
  const std::int64_t H = p.shape.num_heads, Tq = p.layout.quant_tokens;
  const std::int64_t G = p.layout.group_size, ngt = p.layout.groups_per_row;
  const int d = p.shape.head_dim;
  // Row t of the next token group (of the same head) is next_group elements on.
  constexpr std::int64_t esz = kT == DType::kF32 ? 4 : 2;
  const std::int64_t next_group = G * d;
  const std::size_t row_bytes = static_cast<std::size_t>(d) * esz;
#if defined(KVSCOPE_CPU_AVX512)
  // A token group of whole 16-channel steps that fits in L2 is converted once into a
  // block buffer; its statistics then run 16 channels at a time down the rows in
  // registers, and the codes read the buffer (otherwise each row is converted twice).
  const bool block_rows = d % quant_avx512::kStep == 0 && G * d <= kChannelBlockFloats;
#endif
#pragma omp parallel if (p.parallel)
  {
    const std::size_t n = static_cast<std::size_t>(d);
    std::vector<float> buf(n), mn(n), mx(n), s(n), z(n), div(n), rcp(n);
    std::vector<std::uint8_t> usable(n);
    std::vector<std::int32_t> q(n);
    std::vector<std::uint8_t> fields(n + 3);
#if defined(KVSCOPE_CPU_AVX512)
    std::vector<float> block(block_rows ? static_cast<std::size_t>(G) * n : 0);  // [G, d]
    const quant_avx512::CodeRange range(p.lo, p.hi, kNearHalf);
#endif
    residual_rows<kFake>(p, x, o);
#pragma omp for schedule(guided)
    for (std::int64_t hg = 0; hg < H * ngt; ++hg) {
      const std::int64_t h = hg / ngt, t0 = (hg % ngt) * G, t1 = std::min(Tq, t0 + G);
      const float* xr = nullptr;
#if defined(KVSCOPE_CPU_AVX512)
      // fp16 without NaN: statistics straight from the input, and the codes below read
      // it again (from cache) instead of a float copy of the group.
      bool from_half = false;
      if constexpr (kT == DType::kF16) {
        from_half = block_rows &&
                    quant_avx512::no_nan(quant_avx512::column_min_max(
                        quant_avx512::F16Row{static_cast<const std::uint16_t*>(x) + p.row_offset(h, t0)},
                        static_cast<int>(t1 - t0), d, mn.data(), mx.data()));
      }
      if (block_rows && !from_half) {
        for (std::int64_t t = t0; t < t1; ++t) {
          float* dst = block.data() + (t - t0) * d;
          xr = row_as_float<kT>(x, p.row_offset(h, t), d, dst);
          if (xr != dst) std::copy(xr, xr + d, dst);  // fp32 input is not converted
        }
        (void)quant_avx512::column_min_max(quant_avx512::FloatRow{block.data()}, static_cast<int>(t1 - t0), d,
                                           mn.data(), mx.data());
      }
#endif
      for (std::int64_t t = t0; t < t1; ++t) {
#if defined(KVSCOPE_CPU_AVX512)
        if (block_rows) break;
#endif
        xr = row_as_float<kT>(x, p.row_offset(h, t), d, buf.data());
        if (t == t0) {
          std::copy(xr, xr + d, mn.begin());
          std::copy(xr, xr + d, mx.begin());
          continue;
        }
        for (int i = 0; i < d; ++i) {
          mn[i] = min_f(mn[i], xr[i]);
          mx[i] = max_f(mx[i], xr[i]);
        }
      }
      bool fast = true;
#if defined(KVSCOPE_CPU_AVX512)
      quant_avx512::group_params(mn.data(), mx.data(), d, kBits, p.spec.symmetric, s.data(), z.data(),
                                 div.data(), rcp.data(), usable.data());
      for (int i = 0; i < d; ++i) fast = fast && usable[i] != 0;
#else
      for (int i = 0; i < d; ++i) {
        quant_math::group_params(mn[i], mx[i], kBits, p.spec.symmetric, &s[i], &z[i]);
        div[i] = quant_math::encode_divisor(s[i]);
        fast = fast && reciprocal_usable(div[i]);
        rcp[i] = 1.0f / div[i];
      }
#endif
      std::copy(s.begin(), s.end(), o.scales + hg * d);
      if (o.zeros != nullptr) std::copy(z.begin(), z.end(), o.zeros + hg * d);
      for (std::int64_t t = t0; t < t1; ++t) {
        const std::int64_t off = p.row_offset(h, t);
        prefetch_bytes(x, (off + next_group) * esz, row_bytes);
#if defined(KVSCOPE_CPU_AVX512)
        const quant_avx512::EachGroup each{s.data(), z.data(), div.data(), rcp.data()};
        if (from_half) {
          quant_avx512::encode_span<kBits, kFake>(
              quant_avx512::F16Row{static_cast<const std::uint16_t*>(x) + off}, 0, d, each, fast, range,
              codes_row<kFake>(p, o, h * Tq + t), out_row<kFake>(o, off));
          continue;
        }
        quant_avx512::encode_span<kBits, kFake>(
            quant_avx512::FloatRow{block_rows ? block.data() + (t - t0) * d
                                              : row_as_float<kT>(x, off, d, buf.data())},
            0, d, each, fast, range, codes_row<kFake>(p, o, h * Tq + t), out_row<kFake>(o, off));
        continue;
#endif
        encode_span_each(row_as_float<kT>(x, off, d, buf.data()), d, div.data(), rcp.data(), fast, z.data(),
                         p.lo, p.hi, q.data());
        if constexpr (kFake) decode_span_each(q.data(), d, s.data(), z.data(), o.out + off);
        emit_row<kBits, kFake>(p, o, h * Tq + t, q.data(), fields.data());
      }
    }
  }
}

template <DType kT, int kBits, bool kFake>
void quantize_granularity(const Plan& p, const void* x, const QuantOut& o) {
  switch (p.spec.granularity) {
    case Granularity::kPerTensor:
    case Granularity::kPerHead:
      quantize_whole<kT, kBits, kFake>(p, x, o);
      break;
    case Granularity::kPerToken:
      quantize_per_token<kT, kBits, kFake>(p, x, o);
      break;
    case Granularity::kPerChannel:
      quantize_per_channel<kT, kBits, kFake>(p, x, o);
      break;
  }
}

// The dtype and bit width become template parameters here, once per call.
template <bool kFake>
void quantize_dispatch(const Plan& p, const void* x, const QuantOut& o) {
  const auto by_bits = [&](auto tag) {
    constexpr DType kT = decltype(tag)::value;
    if (p.spec.bits == 8) {
      quantize_granularity<kT, 8, kFake>(p, x, o);
    } else if (p.spec.bits == 4) {
      quantize_granularity<kT, 4, kFake>(p, x, o);
    } else {
      quantize_granularity<kT, 2, kFake>(p, x, o);
    }
  };
  if (p.shape.dtype == DType::kF32) {
    by_bits(std::integral_constant<DType, DType::kF32>{});
  } else if (p.shape.dtype == DType::kF16) {
    by_bits(std::integral_constant<DType, DType::kF16>{});
  } else {
    by_bits(std::integral_constant<DType, DType::kBF16>{});
  }
}

// ---------------------------------------------------------------- dequantize kernel

template <int kBits, bool kSymmetric>
void dequantize_rows(const Plan& p, const QuantConstBuffers& in, float* out) {
  const std::int64_t H = p.shape.num_heads, Tq = p.layout.quant_tokens, R = p.layout.residual_tokens;
  const int d = p.shape.head_dim;
  const float* zeros = kSymmetric ? nullptr : in.zeros;
  const Granularity gr = p.spec.granularity;
  const std::int64_t G = p.layout.group_size, ng = p.layout.groups_per_row;
#pragma omp parallel if (p.parallel)
  {
    std::vector<std::int32_t> q(static_cast<std::size_t>(d));
    if (R > 0) {
#pragma omp for schedule(static) nowait
      for (std::int64_t r = 0; r < H * R; ++r) {
        const std::int64_t h = r / R, t = r % R;
        convert_row(in.residual, p.shape.dtype, (h * R + t) * d, d, out + p.row_offset(h, Tq + t));
      }
    }
#pragma omp for schedule(guided, kRowChunk)
    for (std::int64_t row = 0; row < H * Tq; ++row) {
      const std::int64_t h = row / Tq, t = row % Tq;
      float* o = out + p.row_offset(h, t);
      unpack_row<kBits, kSymmetric>(in.codes + row * p.layout.row_bytes, d, q.data());
      if (gr == Granularity::kPerToken) {
        for (std::int64_t g = 0; g < ng; ++g) {
          const int i0 = static_cast<int>(g * G), n = std::min(d - i0, static_cast<int>(G));
          decode_span(q.data() + i0, n, in.scales[row * ng + g],
                      zeros != nullptr ? zeros[row * ng + g] : 0.0f, o + i0);
        }
      } else if (gr == Granularity::kPerChannel) {
        const std::int64_t base = (h * ng + t / G) * d;
        decode_span_each(q.data(), d, in.scales + base, zeros != nullptr ? zeros + base : nullptr, o);
      } else {
        const std::int64_t g = gr == Granularity::kPerTensor ? 0 : h;
        decode_span(q.data(), d, in.scales[g], zeros != nullptr ? zeros[g] : 0.0f, o);
      }
    }
  }
}

}  // namespace

Status quantize(const QuantSpec& spec, const QuantShape& shape, const void* x, const QuantBuffers& out) {
  KVSCOPE_NVTX_RANGE("cpu::quantize", kQuantize);
  Plan p;
  KVSCOPE_RETURN_IF_ERROR(plan_for("quantize", spec, shape, &p));
  const QuantLayout& l = p.layout;
  if (x == nullptr) return Status::Invalid("quantize: x is null");
  if (out.codes == nullptr && l.code_bytes > 0) return Status::Invalid("quantize: out.codes is null");
  if (out.scales == nullptr && l.num_groups > 0) return Status::Invalid("quantize: out.scales is null");
  if (out.zeros == nullptr && l.zero_bytes > 0)
    return Status::Invalid("quantize: out.zeros is null (asymmetric)");
  if (out.residual == nullptr && l.residual_bytes > 0) {
    return Status::Invalid("quantize: out.residual is null (residual_tokens > 0)");
  }
  QuantOut o;
  o.codes = out.codes;
  o.scales = out.scales;
  o.zeros = spec.symmetric ? nullptr : out.zeros;
  o.residual = out.residual;
  quantize_dispatch<false>(p, x, o);
  return Status::Ok();
}

Status dequantize(const QuantSpec& spec, const QuantShape& shape, const QuantConstBuffers& in, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::dequantize", kQuantize);
  Plan p;
  KVSCOPE_RETURN_IF_ERROR(plan_for("dequantize", spec, shape, &p));
  const QuantLayout& l = p.layout;
  if (out == nullptr) return Status::Invalid("dequantize: out is null");
  if (in.codes == nullptr && l.code_bytes > 0) return Status::Invalid("dequantize: in.codes is null");
  if (in.scales == nullptr && l.num_groups > 0) return Status::Invalid("dequantize: in.scales is null");
  if (in.zeros == nullptr && l.zero_bytes > 0)
    return Status::Invalid("dequantize: in.zeros is null (asymmetric)");
  if (in.residual == nullptr && l.residual_bytes > 0)
    return Status::Invalid("dequantize: in.residual is null");
  if (spec.symmetric) {
    if (spec.bits == 8) {
      dequantize_rows<8, true>(p, in, out);
    } else if (spec.bits == 4) {
      dequantize_rows<4, true>(p, in, out);
    } else {
      dequantize_rows<2, true>(p, in, out);
    }
  } else {
    if (spec.bits == 8) {
      dequantize_rows<8, false>(p, in, out);
    } else if (spec.bits == 4) {
      dequantize_rows<4, false>(p, in, out);
    } else {
      dequantize_rows<2, false>(p, in, out);
    }
  }
  return Status::Ok();
}

Status quantize_dequantize(const QuantSpec& spec, const QuantShape& shape, const void* x, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::quantize_dequantize", kQuantize);
  Plan p;
  KVSCOPE_RETURN_IF_ERROR(plan_for("quantize_dequantize", spec, shape, &p));
  const QuantLayout& l = p.layout;
  if (x == nullptr) return Status::Invalid("quantize_dequantize: x is null");
  if (out == nullptr) return Status::Invalid("quantize_dequantize: out is null");
  if (static_cast<const void*>(out) == x) return Status::Invalid("quantize_dequantize: out aliases x");
  std::vector<float> scales(static_cast<std::size_t>(l.num_groups));
  std::vector<float> zeros(spec.symmetric ? 0 : scales.size());
  QuantOut o;
  o.scales = scales.data();
  o.zeros = spec.symmetric ? nullptr : zeros.data();
  o.out = out;
  quantize_dispatch<true>(p, x, o);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kvscope::kernels
