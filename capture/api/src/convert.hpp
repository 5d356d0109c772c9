// Host-side tensor movement of the capture: gathering a strided [heads, tokens, head_dim]
// tensor into a contiguous buffer (model thread, same dtype, a plain copy) and converting
// contiguous elements to the trace dtype (writer thread, round to nearest even).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "kvscope/kernels/common.hpp"
#include "kvscope_capture.h"

namespace kvscope::capture::detail {

using kernels::DType;

// A validated tensor description: shape and element strides (zeros resolved).
struct TensorLayout {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  kvscope_memory memory = KVSCOPE_HOST;
  std::array<std::int64_t, 3> shape{};   // [heads, tokens, head_dim]
  std::array<std::int64_t, 3> stride{};  // in elements
  std::size_t numel() const { return static_cast<std::size_t>(shape[0] * shape[1] * shape[2]); }
  std::size_t bytes() const { return numel() * kernels::dtype_bytes(dtype); }
  bool contiguous() const {
    return stride[2] == 1 && stride[1] == shape[2] && stride[0] == shape[1] * shape[2];
  }
};

// Checks `t` (named `name`, e.g. "q") against the expected shape and resolves its strides.
// Throws Failure(KVSCOPE_ERR_ARGUMENT) naming `where` (the API function) and the problem.
TensorLayout check_tensor(const char* where, const char* name, const kvscope_tensor* t,
                          const std::array<std::int64_t, 3>& expected, const char* expected_text);

// Copies a host tensor into `dst` as contiguous [heads, tokens, head_dim] in its own dtype.
void gather_host(const TensorLayout& t, std::byte* dst);

// Converts n contiguous elements from `from` to `to`. Returns the index of the first element
// that is NaN or Inf after conversion (overflow to float16 included), or -1.
std::ptrdiff_t convert_elements(const std::byte* src, DType from, std::byte* dst, DType to, std::size_t n);

DType to_dtype(int d);
bool valid_dtype(int d);

// The integer stored in a C enum field, read without loading it as the enum type (a caller may
// pass any int there, and loading an out-of-range enumerator is undefined behaviour in C++).
template <typename Enum>
int raw_enum(const Enum& e) {
  static_assert(sizeof(Enum) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

}  // namespace kvscope::capture::detail
