#include "arrays.hpp"

#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace kvscope::python {

void bind_buffer(py::module_& m) {
  py::class_<Buffer>(m, "_Buffer", py::buffer_protocol()).def_buffer([](Buffer& b) {
    std::vector<py::ssize_t> strides(b.shape.size());
    py::ssize_t stride = b.itemsize;
    for (std::size_t i = b.shape.size(); i-- > 0;) {
      strides[i] = stride;
      stride *= b.shape[i];
    }
    return py::buffer_info(b.data, b.itemsize, b.format, static_cast<py::ssize_t>(b.shape.size()), b.shape,
                           strides);
  });
}

py::object to_numpy(Buffer b) {
  // Never destroyed: a static py::object would be released after the interpreter is gone.
  static const py::object* asarray = new py::object(py::module_::import("numpy").attr("asarray"));
  return (*asarray)(py::cast(std::move(b)));
}

std::string shape_text(const std::vector<py::ssize_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

template <typename T>
std::vector<T> from_buffer(const py::buffer& obj, int ndim, const std::string& what,
                           std::vector<py::ssize_t>* shape) {
  const py::buffer_info info = obj.request();
  const std::string want = py::format_descriptor<T>::format();
  // Formats may carry a byte-order prefix ("<f", "=i") and int32 may read as "i" or "l".
  std::string fmt = info.format;
  if (!fmt.empty() && (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')) fmt = fmt.substr(1);
  if (info.itemsize != static_cast<py::ssize_t>(sizeof(T)) ||
      (fmt != want && !(sizeof(T) == 4 && std::is_integral_v<T> && (fmt == "i" || fmt == "l")))) {
    throw std::invalid_argument(what + ": expected elements of format '" + want + "' (" +
                                std::to_string(sizeof(T)) + " bytes), got '" + info.format + "'");
  }
  if (ndim >= 0 && info.ndim != ndim) {
    throw std::invalid_argument(what + ": expected " + std::to_string(ndim) + " dimensions, got shape " +
                                shape_text(info.shape));
  }
  py::ssize_t n = 1, stride = info.itemsize;
  for (py::ssize_t i = info.ndim; i-- > 0;) {
    if (info.shape[static_cast<std::size_t>(i)] > 1 && info.strides[static_cast<std::size_t>(i)] != stride)
      throw std::invalid_argument(what + ": the array must be C-contiguous");
    stride *= info.shape[static_cast<std::size_t>(i)];
    n *= info.shape[static_cast<std::size_t>(i)];
  }
  std::vector<T> out(static_cast<std::size_t>(n));
  if (n > 0) std::memcpy(out.data(), info.ptr, static_cast<std::size_t>(n) * sizeof(T));
  if (shape) *shape = info.shape;
  return out;
}

template std::vector<float> from_buffer<float>(const py::buffer&, int, const std::string&,
                                               std::vector<py::ssize_t>*);
template std::vector<std::int32_t> from_buffer<std::int32_t>(const py::buffer&, int, const std::string&,
                                                             std::vector<py::ssize_t>*);
template std::vector<std::uint8_t> from_buffer<std::uint8_t>(const py::buffer&, int, const std::string&,
                                                             std::vector<py::ssize_t>*);

}  // namespace kvscope::python
