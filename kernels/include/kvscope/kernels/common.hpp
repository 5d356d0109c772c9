// Shared vocabulary of the compression kernels: element types, modality codes,
// half-precision conversion, error status and the CPU thread setting.
// No I/O, no HDF5/Boost/simulator types: kernels see raw pointers and shapes.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace kvscope::kernels {

// ---------------------------------------------------------------- status
enum class StatusCode : int { kOk = 0, kInvalidArgument, kCudaError, kUnsupported };

// Error value returned by every launcher (CPU and CUDA). Libraries never exit.
class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return {}; }
  static Status Invalid(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status Cuda(std::string msg) { return {StatusCode::kCudaError, std::move(msg)}; }
  static Status Unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode c, std::string m) : code_(c), message_(std::move(m)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

#define KVSCOPE_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::kvscope::kernels::Status _kv_s = (expr);     \
    if (!_kv_s.ok()) return _kv_s;                 \
  } while (0)

// ---------------------------------------------------------------- dtypes
// Element type of K/V/Q tensors. bfloat16 is carried as raw uint16 bits.
enum class DType : std::uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr std::size_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr const char* dtype_name(DType t) {
  return t == DType::kF32 ? "float32" : (t == DType::kF16 ? "float16" : "bfloat16");
}

// IEEE binary16 <-> float, round to nearest even; host and device.
#if defined(__CUDACC__)
#define KVSCOPE_HD __host__ __device__ inline
#else
#define KVSCOPE_HD inline
#endif

KVSCOPE_HD float bits_to_float(std::uint32_t u) {
  float f;
#if defined(__CUDA_ARCH__)
  f = __uint_as_float(u);
#else
  std::memcpy(&f, &u, 4);
#endif
  return f;
}
KVSCOPE_HD std::uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KVSCOPE_HD float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    // subnormal: normalise
    exp = 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

KVSCOPE_HD std::uint16_t float_to_half(float f) {
  const std::uint32_t x = float_to_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // Inf or NaN
    return static_cast<std::uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> Inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u) return static_cast<std::uint16_t>(sign);
    const std::uint32_t e = absx >> 23;
    const std::uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // 14..24
    std::uint32_t h = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = ((absx - 0x38000000u) >> 13);
  const std::uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

KVSCOPE_HD float bf16_to_float(std::uint16_t b) { return bits_to_float(static_cast<std::uint32_t>(b) << 16); }

KVSCOPE_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

// Reads element i of a tensor of type t as float.
KVSCOPE_HD float load_element(const void* p, DType t, std::size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  const std::uint16_t b = static_cast<const std::uint16_t*>(p)[i];
  return t == DType::kF16 ? half_to_float(b) : bf16_to_float(b);
}
// Writes element i of a tensor of type t from float (round to nearest even).
KVSCOPE_HD void store_element(void* p, DType t, std::size_t i, float v) {
  if (t == DType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<std::uint16_t*>(p)[i] = t == DType::kF16 ? float_to_half(v) : float_to_bf16(v);
  }
}

// ---------------------------------------------------------------- modality
// Per-token modality code, identical to the trace format's /tokens/modality.
enum class Modality : std::uint8_t { kText = 0, kVision = 1, kAudio = 2, kSpecial = 3 };
constexpr int kNumModalities = 4;
constexpr const char* modality_name(int m) {
  return m == 0 ? "text" : m == 1 ? "vision" : m == 2 ? "audio" : m == 3 ? "special" : "invalid";
}

// ---------------------------------------------------------------- CPU threads
// Number of threads CPU kernels use (OpenMP). 0 = library default (all cores).
void set_cpu_threads(int n);
int cpu_threads();

}  // namespace kvscope::kernels
