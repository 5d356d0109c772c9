// Arrays between C++ and numpy through the buffer protocol only: no numpy C API, so one build works with
// numpy 1 and numpy 2 whatever pybind11 version compiled it.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvscope::python {

namespace py = pybind11;

// An owned block of memory exposing a C-contiguous buffer (numpy.asarray views it without copying).
struct Buffer {
  std::shared_ptr<void> owner;
  void* data = nullptr;
  std::string format;
  py::ssize_t itemsize = 0;
  std::vector<py::ssize_t> shape;
};

// Registers Buffer's Python type (module init).
void bind_buffer(py::module_& m);
// numpy.asarray over a Buffer holding `bytes`.
py::object to_numpy(Buffer b);

template <typename T>
py::object to_numpy(std::vector<T> v, std::vector<py::ssize_t> shape) {
  auto owned = std::make_shared<std::vector<T>>(std::move(v));
  Buffer b;
  b.data = owned->data();
  b.owner = owned;
  b.format = py::format_descriptor<T>::format();
  b.itemsize = static_cast<py::ssize_t>(sizeof(T));
  b.shape = std::move(shape);
  return to_numpy(std::move(b));
}

// The elements of a C-contiguous buffer of T (format checked) with `ndim` dimensions (-1: any), copied.
// `what` names the argument in errors (std::invalid_argument: ValueError in Python).
template <typename T>
std::vector<T> from_buffer(const py::buffer& obj, int ndim, const std::string& what,
                           std::vector<py::ssize_t>* shape = nullptr);

// Shapes as text: [2, 16, 64].
std::string shape_text(const std::vector<py::ssize_t>& shape);

}  // namespace kvscope::python
