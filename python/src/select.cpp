// kvscope.select: one layer's live cache through the closed loop's compressors (sim/closed_loop.hpp), i.e.
// the policy code kvsim and `kvcap eval` run: select_on_layer + execute_selection per layer.
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>

#include "arrays.hpp"
#include "bindings.hpp"
#include "kvscope/sim/closed_loop.hpp"

namespace kvscope::python {

namespace {

sim::ContextLabels labels_from(const py::buffer& modality, const py::buffer& position,
                               const py::buffer& segment, const py::buffer& grid_row,
                               const py::buffer& grid_col) {
  sim::ContextLabels l;
  l.modality = from_buffer<std::uint8_t>(modality, 1, "modality");
  l.position = from_buffer<std::int32_t>(position, 1, "position");
  l.segment = from_buffer<std::int32_t>(segment, 1, "segment");
  l.grid_row = from_buffer<std::int32_t>(grid_row, 1, "grid_row");
  l.grid_col = from_buffer<std::int32_t>(grid_col, 1, "grid_col");
  return l;
}

trace::ModelGeometry geometry_of(int num_layers, int num_q_heads, int num_kv_heads, int head_dim) {
  if (num_layers < 1 || num_q_heads < 1 || num_kv_heads < 1 || head_dim < 1 ||
      num_q_heads % num_kv_heads != 0) {
    throw std::invalid_argument(
        "geometry: num_layers, num_q_heads, num_kv_heads, head_dim must be >= 1 and "
        "num_q_heads a multiple of num_kv_heads (got " +
        std::to_string(num_layers) + ", " + std::to_string(num_q_heads) + ", " +
        std::to_string(num_kv_heads) + ", " + std::to_string(head_dim) + ")");
  }
  trace::ModelGeometry g;
  g.num_layers = num_layers;
  g.num_q_heads = num_q_heads;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  return g;
}

sim::Budget budget_of(const std::string& text) {
  if (text.empty() || text == "-") return sim::Budget{};
  return sim::parse_budget(text);
}

// One kv head's [K] / [K, D] arrays as a dict.
py::dict head_dict(std::vector<std::int32_t> token, std::vector<float> k, std::vector<float> v,
                   std::vector<std::int32_t> multiplicity, int D) {
  const auto K = static_cast<py::ssize_t>(token.size());
  py::dict d;
  d["tokens"] = to_numpy(std::move(token), {K});
  d["keys"] = to_numpy(std::move(k), {K, D});
  d["values"] = to_numpy(std::move(v), {K, D});
  d["multiplicity"] = to_numpy(std::move(multiplicity), {K});
  return d;
}

py::dict head_result_dict(const sim::HeadResult& h) {
  py::dict d;
  d["kv_head"] = h.kv_head;
  d["bytes_full"] = h.bytes_full.total();
  d["bytes_kept"] = h.bytes_kept.total();
  py::list modality;
  for (auto b : h.bytes_kept_modality) modality.append(b);
  d["bytes_kept_modality"] = modality;
  d["bytes_end"] = h.bytes_end;
  d["bytes_peak"] = h.bytes_peak;
  std::int64_t kept = 0, merged = 0, evicted = 0;
  for (int m = 0; m < sim::kModalities; ++m) {
    kept += h.kept[static_cast<std::size_t>(m)];
    merged += h.merged[static_cast<std::size_t>(m)];
    evicted += h.evicted[static_cast<std::size_t>(m)];
  }
  d["kept"] = kept;
  d["merged"] = merged;
  d["evicted"] = evicted;
  return d;
}

// A compressor with the geometry and context length it was made for.
template <typename Compressor>
struct Holder {
  std::unique_ptr<Compressor> c;
  trace::ModelGeometry g;
  int T = 0;  // context tokens
};
using Prefill = Holder<sim::PrefillCompressor>;
using Decode = Holder<sim::DecodeCompressor>;

// Both compressors' constructor: (policy, budget, geometry, dtype, labels of the T context tokens).
template <typename Compressor>
void def_init(py::class_<Holder<Compressor>>& c) {
  c.def(py::init([](const sim::PolicySpec& policy, const std::string& budget, int num_layers, int num_q_heads,
                    int num_kv_heads, int head_dim, const std::string& dtype, const py::buffer& modality,
                    const py::buffer& position, const py::buffer& segment, const py::buffer& grid_row,
                    const py::buffer& grid_col) {
          Holder<Compressor> h;
          h.g = geometry_of(num_layers, num_q_heads, num_kv_heads, head_dim);
          const sim::ContextLabels labels = labels_from(modality, position, segment, grid_row, grid_col);
          h.T = labels.size();
          h.c = std::make_unique<Compressor>(policy, budget_of(budget), h.g, parse_dtype(dtype), labels);
          return h;
        }),
        py::arg("policy"), py::arg("budget"), py::arg("num_layers"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"), py::arg("modality"),
        py::arg("position"), py::arg("segment"), py::arg("grid_row"), py::arg("grid_col"));
}

std::vector<float> layer_tensor(const py::buffer& x, int heads, int T, int D, const std::string& what) {
  std::vector<py::ssize_t> shape;
  std::vector<float> v = from_buffer<float>(x, 3, what, &shape);
  if (shape != std::vector<py::ssize_t>{heads, T, D}) {
    throw std::invalid_argument(what + ": expected shape " + shape_text({heads, T, D}) + ", got " +
                                shape_text(shape));
  }
  return v;
}

}  // namespace

void bind_select(py::module_& m) {
  py::class_<Prefill> prefill(m, "PrefillCompressor");
  def_init(prefill);
  prefill
      .def(
          "compress_layer",
          [](Prefill& p, int layer, const py::buffer& q, const py::buffer& k, const py::buffer& v) {
            const int T = p.T, D = p.g.head_dim;
            std::vector<float> qv = layer_tensor(q, p.g.num_q_heads, T, D, "q");
            std::vector<float> kv = layer_tensor(k, p.g.num_kv_heads, T, D, "k");
            std::vector<float> vv = layer_tensor(v, p.g.num_kv_heads, T, D, "v");
            sim::CompressedLayerResult r;
            {
              py::gil_scoped_release release;
              r = p.c->compress_layer(layer, qv, kv, vv);
            }
            py::dict out;
            py::list heads, results;
            for (auto& h : r.cache.heads)
              heads.append(head_dict(std::move(h.token), std::move(h.k), std::move(h.v),
                                     std::move(h.multiplicity), D));
            for (const auto& h : r.result.heads) results.append(head_result_dict(h));
            out["cluster"] =
                to_numpy(std::move(r.cache.cluster), {static_cast<py::ssize_t>(p.g.num_kv_heads)});
            out["heads"] = heads;
            out["results"] = results;
            return out;
          },
          py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"))
      .def_property_readonly("keep", [](const Prefill& p) { return p.c->keep(); })
      .def_property_readonly("warnings", [](const Prefill& p) { return p.c->warnings(); })
      .def_property_readonly("policy", [](const Prefill& p) { return p.c->policy().name; });

  py::class_<Decode> decode(m, "DecodeCompressor");
  def_init(decode);
  decode
      .def(
          "set_prefill",
          [](Decode& d, int layer, const py::buffer& q, const py::buffer& k, const py::buffer& v) {
            if (layer < 0 || layer >= d.g.num_layers)
              throw std::invalid_argument("layer " + std::to_string(layer) + " out of range");
            const int D = d.g.head_dim, T = d.T;
            d.c->set_prefill(layer, layer_tensor(q, d.g.num_q_heads, T, D, "q"),
                             layer_tensor(k, d.g.num_kv_heads, T, D, "k"),
                             layer_tensor(v, d.g.num_kv_heads, T, D, "v"));
          },
          py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"))
      .def(
          "add_step",
          [](Decode& d, int layer, const py::buffer& q, const py::buffer& k, const py::buffer& v) {
            if (layer < 0 || layer >= d.g.num_layers)
              throw std::invalid_argument("layer " + std::to_string(layer) + " out of range");
            const int D = d.g.head_dim;
            const std::vector<float> qv = layer_tensor(q, d.g.num_q_heads, 1, D, "q");
            const std::vector<float> kv = layer_tensor(k, d.g.num_kv_heads, 1, D, "k");
            const std::vector<float> vv = layer_tensor(v, d.g.num_kv_heads, 1, D, "v");
            d.c->add_step(layer, qv.data(), kv.data(), vv.data());
          },
          py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"))
      .def(
          "steps",
          [](const Decode& d, int layer) {
            if (layer < 0 || layer >= d.g.num_layers)
              throw std::invalid_argument("layer " + std::to_string(layer) + " out of range");
            return d.c->steps(layer);
          },
          py::arg("layer"))
      .def(
          "resident",
          [](Decode& d, int layer) {
            if (layer < 0 || layer >= d.g.num_layers)
              throw std::invalid_argument("layer " + std::to_string(layer) + " out of range");
            sim::LayerResult r;
            std::vector<sim::ResidentHead> heads;
            {
              py::gil_scoped_release release;
              heads = d.c->resident(layer, &r);
            }
            py::dict out;
            py::list hs, results;
            for (auto& h : heads) {
              std::vector<std::int32_t> ones(h.token.size(), 1);
              hs.append(head_dict(std::move(h.token), std::move(h.k), std::move(h.v), std::move(ones),
                                  d.g.head_dim));
            }
            for (const auto& h : r.heads) results.append(head_result_dict(h));
            out["heads"] = hs;
            out["results"] = results;
            return out;
          },
          py::arg("layer"))
      .def_property_readonly("prefill_keep", [](const Decode& d) { return d.c->prefill_keep(); })
      .def_property_readonly("cap_keep", [](const Decode& d) { return d.c->cap_keep(); })
      .def_property_readonly("warnings", [](const Decode& d) { return d.c->warnings(); })
      .def_property_readonly("policy", [](const Decode& d) { return d.c->policy().name; });
}

}  // namespace kvscope::python
