// kvscope._core: the simulator and the trace library for Python (docs/python.md). The Python modules of
// capture/python/kvscope (trace.py, sim.py, stages.py, select.py) wrap it with typed functions.
#include <pybind11/stl.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/trace/error.hpp"

namespace kvscope::python {

trace::DType parse_dtype(const std::string& name) {
  for (trace::DType d : {trace::DType::kF32, trace::DType::kF16, trace::DType::kBF16})
    if (name == kernels::dtype_name(d)) return d;
  throw std::invalid_argument("unknown dtype '" + name + "' (float32, float16 or bfloat16)");
}

sim::PolicySpec make_policy(const std::string& name, const py::dict& params, const py::list& policy_files,
                            const std::string& rename) {
  sim::PolicyRegistry registry;
  for (const auto& f : policy_files) registry.load_ini(py::cast<std::string>(f));
  sim::PolicySpec p = registry.get(name);
  for (const auto& [k, v] : params) {
    const std::string key = py::cast<std::string>(py::str(k));
    std::string value;
    if (py::isinstance<py::bool_>(v))
      value = py::cast<bool>(v) ? "true" : "false";
    else
      value = py::cast<std::string>(py::str(v));
    p.set(key, value, "policy " + (rename.empty() ? name : rename));
  }
  if (!rename.empty()) p.name = rename;
  return p;
}

}  // namespace kvscope::python

PYBIND11_MODULE(_core, m) {
  namespace py = pybind11;
  using namespace kvscope;
  m.doc() =
      "kvscope's C++ simulator and trace library (use kvscope.trace, kvscope.sim, kvscope.stages, "
      "kvscope.select)";
  // C++ errors as Python exceptions carrying the C++ message.
  // (Never destroyed: a static Python object would be released after the interpreter is gone.)
  static auto* trace_error = new py::exception<trace::TraceError>(m, "TraceError", PyExc_ValueError);
  static auto* policy_error = new py::exception<sim::PolicyError>(m, "PolicyError", PyExc_ValueError);
  static auto* report_error = new py::exception<sim::ReportError>(m, "ReportError", PyExc_OSError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const trace::TraceError& e) {
      (*trace_error)(e.what());
    } catch (const sim::PolicyError& e) {
      (*policy_error)(e.what());
    } catch (const sim::ReportError& e) {
      (*report_error)(e.what());
    }
  });
  python::bind_buffer(m);
  python::bind_trace(m);
  python::bind_sim(m);
  python::bind_stages(m);
  python::bind_select(m);
}
