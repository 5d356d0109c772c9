#include "convert.hpp"

#include <cmath>
#include <cstring>

#include "failure.hpp"

namespace kvscope::capture::detail {

namespace {

std::string shape_text(const std::array<std::int64_t, 3>& s) {
  std::string out = "[";
  for (int i = 0; i < 3; ++i) (out += i ? ", " : "") += std::to_string(s[i]);
  return out += "]";
}

bool bits_non_finite(std::uint16_t b, DType t) {
  const std::uint16_t exp_mask = t == DType::kF16 ? 0x7c00u : 0x7f80u;
  return (b & exp_mask) == exp_mask;
}

}  // namespace

bool valid_dtype(int d) { return d == KVSCOPE_F32 || d == KVSCOPE_F16 || d == KVSCOPE_BF16; }

DType to_dtype(int d) {
  return d == KVSCOPE_F32 ? DType::kF32 : (d == KVSCOPE_F16 ? DType::kF16 : DType::kBF16);
}

TensorLayout check_tensor(const char* where, const char* name, const kvscope_tensor* t,
                          const std::array<std::int64_t, 3>& expected, const char* expected_text) {
  const std::string who = std::string(where) + ": " + name;
  if (t == nullptr) fail(KVSCOPE_ERR_ARGUMENT, who + " is NULL");
  const int dtype = raw_enum(t->dtype), memory = raw_enum(t->memory);
  if (!valid_dtype(dtype)) {
    fail(KVSCOPE_ERR_ARGUMENT,
         who + ".dtype " + std::to_string(dtype) + " is not KVSCOPE_F32, KVSCOPE_F16 or KVSCOPE_BF16");
  }
  if (memory != KVSCOPE_HOST && memory != KVSCOPE_DEVICE) {
    fail(KVSCOPE_ERR_ARGUMENT,
         who + ".memory " + std::to_string(memory) + " is not KVSCOPE_HOST or KVSCOPE_DEVICE");
  }
  TensorLayout l;
  l.data = t->data;
  l.dtype = to_dtype(dtype);
  l.memory = memory == KVSCOPE_DEVICE ? KVSCOPE_DEVICE : KVSCOPE_HOST;
  for (int i = 0; i < 3; ++i) l.shape[i] = t->shape[i];
  if (l.shape != expected) {
    fail(KVSCOPE_ERR_ARGUMENT, who + " has shape " + shape_text(l.shape) + ", expected " + expected_text +
                                   " = " + shape_text(expected));
  }
  const std::array<std::int64_t, 3> dense{l.shape[1] * l.shape[2], l.shape[2], 1};
  for (int i = 0; i < 3; ++i) {
    if (t->stride[i] < 0) {
      fail(KVSCOPE_ERR_ARGUMENT,
           who + ".stride[" + std::to_string(i) + "] is negative (" + std::to_string(t->stride[i]) + ")");
    }
    l.stride[i] = t->stride[i] == 0 ? dense[i] : t->stride[i];
  }
  if (l.memory == KVSCOPE_DEVICE && l.stride[2] != 1) {
    fail(KVSCOPE_ERR_ARGUMENT, who + " is a device tensor with innermost stride " +
                                   std::to_string(l.stride[2]) + "; device tensors need stride[2] = 1");
  }
  if (l.data == nullptr && l.numel() > 0) fail(KVSCOPE_ERR_ARGUMENT, who + ".data is NULL");
  return l;
}

void gather_host(const TensorLayout& t, std::byte* dst) {
  const std::size_t eb = kernels::dtype_bytes(t.dtype);
  const auto* src = static_cast<const std::byte*>(t.data);
  if (t.contiguous()) {
    std::memcpy(dst, src, t.bytes());
    return;
  }
  const auto D = static_cast<std::size_t>(t.shape[2]);
  for (std::int64_t h = 0; h < t.shape[0]; ++h) {
    for (std::int64_t tok = 0; tok < t.shape[1]; ++tok) {
      const std::byte* row = src + static_cast<std::size_t>(h * t.stride[0] + tok * t.stride[1]) * eb;
      if (t.stride[2] == 1) {
        std::memcpy(dst, row, D * eb);
        dst += D * eb;
      } else {
        for (std::size_t d = 0; d < D; ++d, dst += eb) {
          std::memcpy(dst, row + d * static_cast<std::size_t>(t.stride[2]) * eb, eb);
        }
      }
    }
  }
}

std::ptrdiff_t convert_elements(const std::byte* src, DType from, std::byte* dst, DType to, std::size_t n) {
  std::ptrdiff_t first_bad = -1;
  auto note = [&](std::size_t i) {
    if (first_bad < 0) first_bad = static_cast<std::ptrdiff_t>(i);
  };
  if (from == to) {
    if (dst != src) std::memcpy(dst, src, n * kernels::dtype_bytes(to));
    for (std::size_t i = 0; i < n && first_bad < 0; ++i) {
      if (to == DType::kF32) {
        if (!std::isfinite(reinterpret_cast<const float*>(dst)[i])) note(i);
      } else if (bits_non_finite(reinterpret_cast<const std::uint16_t*>(dst)[i], to)) {
        note(i);
      }
    }
    return first_bad;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const float f = kernels::load_element(src, from, i);  // exact: every source type widens to float
    kernels::store_element(dst, to, i, f);                // one rounding, to nearest even
    if (to == DType::kF32) {
      if (!std::isfinite(f)) note(i);
    } else if (bits_non_finite(reinterpret_cast<const std::uint16_t*>(dst)[i], to)) {
      note(i);
    }
  }
  return first_bad;
}

}  // namespace kvscope::capture::detail
