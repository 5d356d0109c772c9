// Quantization of K/V tensors: symmetric or asymmetric integer codes with
// 8, 4 or 2 bits at per-tensor, per-head, per-token or per-channel granularity
// (optionally grouped), KIVI-style full-precision residual tokens, the fused
// fake-quant used by the simulator to measure error, and exact byte accounting.
// The math and the storage layout are specified in docs/kernels/quantize.md.
//
// Storage summary (T tokens, the last R = min(residual_tokens, T) kept in full
// precision, Tq = T - R quantized):
//   codes    uint8  [num_heads, Tq, row_bytes], row_bytes = ceil(head_dim * bits / 8);
//            codes are packed along head_dim, lowest bits first (4-bit: low nibble
//            = even channel; 2-bit: channel 4j+k at bits 2k..2k+1); the unused
//            bits of a row's last byte are 0. Symmetric codes are two's complement
//            in [-qmax, qmax] (qmax = 2^(bits-1) - 1); asymmetric codes are
//            unsigned in [0, 2^bits - 1].
//   scales   float32 [num_groups] (layout per Granularity below)
//   zeros    float32 [num_groups], asymmetric only: the group minimum m,
//            x^ = m + u * scale. Symmetric: x^ = q * scale, no zeros buffer.
//   residual input dtype [num_heads, R, head_dim], bit-identical copy of tokens
//            [Tq, T) of every head.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// Which elements share one scale (and zero point). Shapes of the scale tensor
// with Tq quantized tokens, D = head_dim, G = group_size:
//   kPerTensor  [1]                              group_size must be 0
//   kPerHead    [num_heads]                      group_size must be 0
//   kPerToken   [num_heads, Tq, ceil(D / G)]     groups of G channels of one token row (G = 0: G = D)
//   kPerChannel [num_heads, ceil(Tq / G), D]     groups of G tokens of one channel (G = 0: G = Tq)
// The last group along the grouped axis may be partial.
enum class Granularity : std::uint8_t { kPerTensor = 0, kPerHead, kPerToken, kPerChannel };

constexpr const char* granularity_name(Granularity g) {
  return g == Granularity::kPerTensor  ? "per_tensor"
         : g == Granularity::kPerHead  ? "per_head"
         : g == Granularity::kPerToken ? "per_token"
                                       : "per_channel";
}

struct QuantSpec {
  int bits = 8;           // 8, 4 or 2
  bool symmetric = true;  // symmetric: scale = max|x| / qmax; asymmetric: (max - min) / (2^bits - 1)
  Granularity granularity = Granularity::kPerHead;
  int group_size = 0;       // >= 0; 0 = the whole axis (see Granularity)
  int residual_tokens = 0;  // >= 0; most recent tokens kept in the input dtype, not quantized
};

// KIVI: keys per channel in groups of `group_size` tokens, asymmetric.
constexpr QuantSpec kivi_key_spec(int bits, int group_size, int residual_tokens) {
  return QuantSpec{bits, false, Granularity::kPerChannel, group_size, residual_tokens};
}
// KIVI: values per token in groups of `group_size` channels, asymmetric.
constexpr QuantSpec kivi_value_spec(int bits, int group_size, int residual_tokens) {
  return QuantSpec{bits, false, Granularity::kPerToken, group_size, residual_tokens};
}

// The tensor being quantized: [num_heads, tokens, head_dim] row-major, `dtype` elements.
struct QuantShape {
  int num_heads = 0;
  int tokens = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;
};

// Sizes of everything quantize() writes; all counts derive from spec + shape.
struct QuantLayout {
  std::int64_t quant_tokens = 0;     // Tq = tokens - residual
  std::int64_t residual_tokens = 0;  // R = min(spec.residual_tokens, tokens)
  std::int64_t row_bytes = 0;        // packed bytes per (head, token) code row
  std::int64_t group_size = 0;       // effective G along the grouped axis (0 for per-tensor/per-head)
  std::int64_t groups_per_row = 0;   // per-token: ceil(D / G); per-channel: ceil(Tq / G) token groups
  std::int64_t num_groups = 0;       // number of scales (and of zeros when asymmetric)
  std::int64_t code_bytes = 0;       // num_heads * Tq * row_bytes
  std::int64_t scale_bytes = 0;      // num_groups * 4
  std::int64_t zero_bytes = 0;       // num_groups * 4 if asymmetric, else 0
  std::int64_t residual_bytes = 0;   // num_heads * R * head_dim * dtype_bytes
  std::int64_t total_bytes() const { return code_bytes + scale_bytes + zero_bytes + residual_bytes; }
};

// Byte accounting of one quantized tensor; equals the buffer sizes quantize() writes.
struct QuantBytes {
  std::int64_t codes = 0;
  std::int64_t scales = 0;
  std::int64_t zeros = 0;
  std::int64_t residual = 0;  // full-precision residual tokens, input dtype
  std::int64_t total = 0;
};

// Checks spec and shape; the message names the parameter.
Status validate_quant(const QuantSpec& spec, const QuantShape& shape);
// Fills *layout for a valid spec/shape; returns the validation error otherwise.
Status quant_layout(const QuantSpec& spec, const QuantShape& shape, QuantLayout* layout);
// Bytes stored for a [num_heads, tokens, head_dim] tensor of `input` dtype.
// All zero when the spec or shape is invalid (validate_quant says why).
QuantBytes quantized_bytes(const QuantSpec& spec, int num_heads, int tokens, int head_dim, DType input);

// Output buffers of quantize (host memory for cpu::, device memory for cuda::).
struct QuantBuffers {
  std::uint8_t* codes = nullptr;  // [num_heads, Tq, row_bytes]; may be null when code_bytes == 0
  float* scales = nullptr;        // [num_groups]
  float* zeros = nullptr;         // [num_groups]; asymmetric only, ignored when symmetric
  void* residual = nullptr;       // [num_heads, R, head_dim] input dtype; may be null when R == 0
};

// Input buffers of dequantize.
struct QuantConstBuffers {
  const std::uint8_t* codes = nullptr;  // [num_heads, Tq, row_bytes]
  const float* scales = nullptr;        // [num_groups]
  const float* zeros = nullptr;         // [num_groups]; asymmetric only
  const void* residual = nullptr;       // [num_heads, R, head_dim] shape.dtype
};

inline QuantConstBuffers as_const(const QuantBuffers& b) {
  return QuantConstBuffers{b.codes, b.scales, b.zeros, b.residual};
}

// Scalar math shared by the CPU and CUDA backends (one definition, so both
// produce the same scales, codes and dequantized values bit for bit). On the
// device the __f*_rn intrinsics keep nvcc from contracting into FMA.
namespace quant_math {

KVSCOPE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVSCOPE_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVSCOPE_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVSCOPE_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVSCOPE_HD float min_f(float a, float b) { return b < a ? b : a; }
KVSCOPE_HD float max_f(float a, float b) { return b > a ? b : a; }

// Largest code magnitude: symmetric qmax = 2^(bits-1) - 1; asymmetric 2^bits - 1.
KVSCOPE_HD int code_max(int bits, bool symmetric) {
  return symmetric ? (1 << (bits - 1)) - 1 : (1 << bits) - 1;
}
KVSCOPE_HD int code_min(int bits, bool symmetric) { return symmetric ? -((1 << (bits - 1)) - 1) : 0; }

// Scale and zero of a group from its minimum and maximum. A constant group
// (mn == mx) is stored exactly: asymmetric scale 0, zero = the value;
// symmetric scale = |value| with codes +-1 (0 and scale 0 for a zero group).
KVSCOPE_HD void group_params(float mn, float mx, int bits, bool symmetric, float* scale, float* zero) {
  if (symmetric) {
    const float amax = max_f(-mn, mx);
    *scale = mn == mx ? amax : div_rn(amax, static_cast<float>(code_max(bits, true)));
    *zero = 0.0f;
  } else {
    *scale = div_rn(sub_rn(mx, mn), static_cast<float>(code_max(bits, false)));
    *zero = mn;
  }
}

// Divisor used to encode a group: its scale, or 1 when the scale is 0 (then every
// element of the group has x - zero = 0, or |x - zero| below 1e-42 when the scale
// underflowed, so its code is 0 without dividing by 0).
KVSCOPE_HD float encode_divisor(float scale) { return scale > 0.0f ? scale : 1.0f; }

// Integer code of x: clamp((x - zero) / divisor, lo, hi) rounded half away from zero
// (truncation plus a +-1 on the exact fraction). NaN inputs give the lowest code.
// Kept free of a divisor select so that the CPU loop vectorizes.
KVSCOPE_HD int encode_with_divisor(float x, float divisor, float zero, int lo, int hi) {
  float v = div_rn(sub_rn(x, zero), divisor);
  v = v >= static_cast<float>(lo) ? v : static_cast<float>(lo);  // also maps NaN to lo
  v = v > static_cast<float>(hi) ? static_cast<float>(hi) : v;
  const int i = static_cast<int>(v);                    // truncation toward zero, |v| <= 255
  const float frac = sub_rn(v, static_cast<float>(i));  // exact
  return i + static_cast<int>(frac >= 0.5f) - static_cast<int>(frac <= -0.5f);
}

// Integer code of x in a group with this scale and zero.
KVSCOPE_HD int encode(float x, float scale, float zero, int lo, int hi) {
  return encode_with_divisor(x, encode_divisor(scale), zero, lo, hi);
}

// x^ = zero + code * scale (symmetric: zero = 0).
KVSCOPE_HD float decode(int code, float scale, float zero) {
  return add_rn(zero, mul_rn(static_cast<float>(code), scale));
}

// Packed bit field of a code (two's complement for symmetric codes).
KVSCOPE_HD unsigned to_field(int code, int bits) { return static_cast<unsigned>(code) & ((1u << bits) - 1u); }
// Code of a packed field (sign-extended for symmetric codes).
KVSCOPE_HD int from_field(unsigned field, int bits, bool symmetric) {
  if (!symmetric) return static_cast<int>(field);
  const int half = 1 << (bits - 1);
  return static_cast<int>(field ^ static_cast<unsigned>(half)) - half;
}

}  // namespace quant_math

namespace cpu {

// x: [num_heads, tokens, head_dim] shape.dtype. Writes every buffer in `out`.
Status quantize(const QuantSpec& spec, const QuantShape& shape, const void* x, const QuantBuffers& out);

// out: [num_heads, tokens, head_dim] float32; residual tokens are converted exactly.
Status dequantize(const QuantSpec& spec, const QuantShape& shape, const QuantConstBuffers& in, float* out);

// Fake quantization: out = dequantize(quantize(x)) bit for bit, without storing codes.
// x: [num_heads, tokens, head_dim] shape.dtype; out: same shape, float32. out may not alias x.
Status quantize_dequantize(const QuantSpec& spec, const QuantShape& shape, const void* x, float* out);

}  // namespace cpu
}  // namespace kvscope::kernels
