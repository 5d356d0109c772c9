// kvscope.stages: the stage registry's declarations, and scorers / allocators written in Python that run
// inside the C++ pipeline (kvscope/sim/custom_stages.hpp).
#include "kvscope/sim/stages.hpp"

#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>

#include "arrays.hpp"
#include "bindings.hpp"
#include "kvscope/sim/custom_stages.hpp"

namespace kvscope::python {

namespace {

// A Python callable held by a C++ std::function: called and released with the GIL; never released
// after the interpreter is gone (registered stages live in a static registry).
class Callable {
 public:
  explicit Callable(py::object f)
      : f_(new py::object(std::move(f)), [](py::object* p) {
          if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            delete p;
          }
        }) {}
  template <typename... Args>
  py::object operator()(const std::string& who, Args&&... args) const {
    try {
      return (*f_)(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      throw std::runtime_error(who + ": " + e.what());
    }
  }

 private:
  std::shared_ptr<py::object> f_;
};

// The layer as the Python side sees it (stages.py wraps the dict into a Layer).
py::dict layer_dict(const sim::CustomLayer& in) {
  const auto T = static_cast<py::ssize_t>(in.T), D = static_cast<py::ssize_t>(in.head_dim);
  const auto Hq = static_cast<py::ssize_t>(in.num_q_heads), Hkv = static_cast<py::ssize_t>(in.num_kv_heads);
  const auto n = static_cast<std::size_t>(in.T);
  py::dict d;
  d["layer"] = in.layer;
  d["num_layers"] = in.num_layers;
  d["num_q_heads"] = in.num_q_heads;
  d["num_kv_heads"] = in.num_kv_heads;
  d["head_dim"] = in.head_dim;
  d["T"] = in.T;
  d["modality"] = to_numpy(std::vector<std::uint8_t>(in.modality, in.modality + n), {T});
  d["position"] = to_numpy(std::vector<std::int32_t>(in.position, in.position + n), {T});
  d["role"] =
      in.role ? to_numpy(std::vector<std::uint8_t>(in.role, in.role + n), {T}) : py::object(py::none());
  d["tokens_per_modality"] = in.tokens;
  auto copy = [](const float* p, std::size_t count, std::vector<py::ssize_t> shape) -> py::object {
    if (!p) return py::none();
    return to_numpy(std::vector<float>(p, p + count), std::move(shape));
  };
  d["q"] = copy(in.q, static_cast<std::size_t>(Hq * T * D), {Hq, T, D});
  d["k"] = copy(in.k, static_cast<std::size_t>(Hkv * T * D), {Hkv, T, D});
  d["v"] = copy(in.v, static_cast<std::size_t>(Hkv * T * D), {Hkv, T, D});
  return d;
}

py::dict param_dict(const sim::ParamDecl& d) {
  static const char* const types[] = {"int", "float", "bool", "choice", "text", "budget"};
  py::dict o;
  o["name"] = d.name;
  o["type"] = types[static_cast<int>(d.type)];
  o["default"] = d.default_text;
  o["lo"] = d.lo;
  o["hi"] = d.hi;
  o["choices"] = d.choices;
  o["meaning"] = d.meaning;
  o["source"] = d.source;
  return o;
}

}  // namespace

void bind_stages(py::module_& m) {
  m.def("stage_kinds", [] {
    std::vector<std::string> out;
    for (sim::StageKind k : sim::kStageKinds) out.push_back(sim::stage_kind_key(k));
    return out;
  });
  m.def("stage_infos", [] {
    py::list out;
    for (sim::StageKind k : sim::kStageKinds) {
      for (const sim::StageInfo* i : sim::stage_infos(k)) {
        py::dict d;
        d["kind"] = sim::stage_kind_key(k);
        d["name"] = i->name;
        d["meaning"] = i->meaning;
        d["source"] = i->source;
        d["decode"] = i->decode;
        d["custom"] = sim::is_custom_stage(k, i->name);
        py::list params;
        for (const auto& p : i->params) params.append(param_dict(p));
        d["params"] = params;
        out.append(d);
      }
    }
    return out;
  });
  m.def("pipeline_parameters", [] {
    py::list out;
    for (const auto& p : sim::pipeline_parameters()) out.append(param_dict(p));
    return out;
  });
  m.def("stage_listing_text", &sim::stage_listing_text);
  m.def(
      "register_scorer",
      [](const std::string& name, const py::object& fn, const std::string& meaning, bool preset) {
        const Callable call(fn);
        const std::string who = "custom scorer '" + name + "'";
        sim::register_custom_scorer(
            name, meaning,
            [call, who](const sim::CustomLayer& in) {
              py::gil_scoped_acquire gil;
              const py::object r = call(who, layer_dict(in));
              try {
                return from_buffer<float>(py::reinterpret_borrow<py::buffer>(r), -1, who + " result");
              } catch (const std::invalid_argument& e) {
                throw std::runtime_error(e.what());
              }
            },
            preset);
      },
      py::arg("name"), py::arg("fn"), py::arg("meaning"), py::arg("preset"));
  m.def(
      "register_allocator",
      [](const std::string& name, const py::object& fn, const std::string& meaning) {
        const Callable call(fn);
        const std::string who = "custom allocator '" + name + "'";
        sim::register_custom_allocator(name, meaning, [call, who](const sim::CustomLayer& in, double keep) {
          py::gil_scoped_acquire gil;
          const py::object r = call(who, layer_dict(in), keep);
          sim::CustomAllocation a;
          try {
            // stages.py returns (per_modality, layer_keep, [4 fractions]).
            const auto t = py::cast<std::tuple<bool, double, std::array<double, 4>>>(r);
            a.per_modality = std::get<0>(t);
            a.layer_keep = std::get<1>(t);
            a.modality_keep = std::get<2>(t);
          } catch (const py::cast_error&) {
            throw std::runtime_error(who + ": the allocation is not (per_modality, keep, [4 fractions])");
          }
          return a;
        });
      },
      py::arg("name"), py::arg("fn"), py::arg("meaning"));
}

}  // namespace kvscope::python
