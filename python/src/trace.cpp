// kvscope.trace: a trace file's header, tokens and one layer's tensors at a time (trace::TraceReader).
#include <pybind11/stl.h>

#include <memory>

#include "arrays.hpp"
#include "bindings.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::python {

namespace {

// A tensor as numpy: float32 / float16 as stored (one copy of the layer), bfloat16 (no numpy type)
// converted to float32; `to_float32` converts every dtype.
py::object tensor_array(trace::Tensor t, bool to_float32) {
  std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
  if (to_float32 || t.dtype == trace::DType::kBF16) {
    std::vector<float> f;
    {
      py::gil_scoped_release release;
      f = t.to_float();
    }
    return to_numpy(std::move(f), shape);
  }
  auto owned = std::make_shared<std::vector<std::byte>>(std::move(t.data));
  Buffer b;
  b.data = owned->data();
  b.owner = owned;
  b.format = t.dtype == trace::DType::kF16 ? "e" : "f";
  b.itemsize = static_cast<py::ssize_t>(kernels::dtype_bytes(t.dtype));
  b.shape = std::move(shape);
  return to_numpy(std::move(b));
}

py::tuple layer_tuple(trace::LayerTensors l, bool to_float32) {
  return py::make_tuple(tensor_array(std::move(l.q), to_float32), tensor_array(std::move(l.k), to_float32),
                        tensor_array(std::move(l.v), to_float32));
}

}  // namespace

void bind_trace(py::module_& m) {
  using Reader = trace::TraceReader;
  py::class_<Reader, std::shared_ptr<Reader>>(m, "TraceReader")
      .def(py::init([](const std::string& path) { return std::make_shared<Reader>(path); }), py::arg("path"))
      .def_property_readonly("path", &Reader::path)
      .def_property_readonly("geometry",
                             [](const Reader& r) {
                               const auto& g = r.geometry();
                               py::dict d;
                               d["num_layers"] = g.num_layers;
                               d["num_q_heads"] = g.num_q_heads;
                               d["num_kv_heads"] = g.num_kv_heads;
                               d["head_dim"] = g.head_dim;
                               d["rope_theta"] = g.rope_theta;
                               d["model_name"] = g.model_name;
                               return d;
                             })
      .def_property_readonly("header",
                             [](const Reader& r) {
                               const auto& h = r.header();
                               py::dict d;
                               d["dtype"] = kernels::dtype_name(h.dtype);
                               d["synthetic"] = h.synthetic;
                               d["creator"] = h.creator;
                               d["created"] = h.created;
                               d["device"] = h.device;
                               d["version"] =
                                   std::to_string(h.version_major) + "." + std::to_string(h.version_minor);
                               d["complete"] = h.complete;
                               return d;
                             })
      .def_property_readonly("num_tokens", &Reader::num_tokens)
      .def_property_readonly("num_decode_steps", &Reader::num_decode_steps)
      .def_property_readonly("has_roles", &Reader::has_roles)
      .def_property_readonly("layers_present", &Reader::layers_present)
      .def_property_readonly("decode_layers_present", &Reader::decode_layers_present)
      .def("tokens",
           [](const Reader& r) {
             const trace::Tokens& t = r.tokens();
             const auto T = static_cast<py::ssize_t>(t.size());
             py::dict d;
             d["token_id"] = to_numpy(t.token_id, {T});
             d["position"] = to_numpy(t.position, {T});
             d["modality"] = to_numpy(t.modality, {T});
             d["segment"] = to_numpy(t.segment, {T});
             d["grid_row"] = to_numpy(t.grid_row, {T});
             d["grid_col"] = to_numpy(t.grid_col, {T});
             d["role"] = to_numpy(t.role, {static_cast<py::ssize_t>(t.role.size())});
             d["text"] = t.text;
             return d;
           })
      .def("decode_tokens",
           [](const Reader& r) {
             const trace::DecodeTokens& t = r.decode_tokens();
             const auto S = static_cast<py::ssize_t>(t.token_id.size());
             py::dict d;
             d["token_id"] = to_numpy(t.token_id, {S});
             d["position"] = to_numpy(t.position, {S});
             d["role"] = to_numpy(t.role, {static_cast<py::ssize_t>(t.role.size())});
             d["text"] = t.text;
             return d;
           })
      .def(
          "read_layer",
          [](const Reader& r, int layer, bool to_float32) {
            // (With the GIL held: HDF5 reads of one reader are not made concurrent.)
            return layer_tuple(r.read_layer(layer), to_float32);
          },
          py::arg("layer"), py::arg("to_float32") = false)
      .def(
          "read_decode_layer",
          [](const Reader& r, int layer, bool to_float32) {
            // (With the GIL held: HDF5 reads of one reader are not made concurrent.)
            return layer_tuple(r.read_decode_layer(layer), to_float32);
          },
          py::arg("layer"), py::arg("to_float32") = false);
  m.def(
      "role_name", [](int role) { return std::string(trace::role_name(role)); }, py::arg("role"));
  m.def(
      "modality_name", [](int modality) { return std::string(kernels::modality_name(modality)); },
      py::arg("modality"));
}

}  // namespace kvscope::python
