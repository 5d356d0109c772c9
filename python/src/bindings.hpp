// The parts of kvscope._core (module.cpp), one per Python module of the package.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "kvscope/sim/policy.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::python {

namespace py = pybind11;

void bind_trace(py::module_& m);   // kvscope.trace
void bind_sim(py::module_& m);     // kvscope.sim
void bind_stages(py::module_& m);  // kvscope.stages
void bind_select(py::module_& m);  // kvscope.select

// A policy from a name (preset, composition, INI policy of `policy_files`) with parameters set on top
// (PolicySpec::set, as INI keys); the name becomes `rename` when given.
sim::PolicySpec make_policy(const std::string& name, const py::dict& params, const py::list& policy_files,
                            const std::string& rename);
// "float16" -> DType (the names numpy and the trace format use: float32, float16, bfloat16).
trace::DType parse_dtype(const std::string& name);

}  // namespace kvscope::python
