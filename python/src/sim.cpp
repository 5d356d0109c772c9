// kvscope.sim: kvsim's replay (run_sweep) with its results as the CSV text and the HDF5 writer.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <exception>
#include <memory>
#include <mutex>

#include "bindings.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/sim/backend.hpp"
#include "kvscope/sim/info.hpp"
#include "kvscope/sim/pareto.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/sim/sweep.hpp"

namespace kvscope::python {

namespace {

// A finished replay: the points, the meta the files store, the backend that computed them.
struct Results {
  sim::SweepOutput out;
  sim::ResultsMeta meta;
  std::string backend;
};

struct ReplayOptions {
  bool bound = false;
  std::optional<sim::PolicySpec> alloc_search;
  bool question_in_context = false;
  int threads = 0;
  std::string backend = "cpu";
  double blind_recall = 0.5, kl_threshold = 0.1;
  bool batch_budgets = true;
  std::string command_line;
};

// Runs the points as kvsim sweep / run does (sweep_command.cpp), with the GIL released; `progress`
// (done, total) is called with the GIL held, its errors raised after the replay.
Results replay(const std::string& trace_path, const std::vector<sim::SweepPoint>& points,
               const ReplayOptions& o, const py::object& progress) {
  kernels::set_cpu_threads(o.threads);
  std::unique_ptr<sim::Backend> cuda;
  sim::Backend* backend = &sim::select_backend(sim::parse_backend(o.backend), cuda);
  trace::TraceReader reader(trace_path);
  sim::require_replayable(reader, "kvscope.sim");
  const sim::TraceSummary summary = sim::summarize(reader);
  sim::SweepOptions so;
  so.backend = backend;
  so.question_in_context = o.question_in_context;
  so.thresholds.blind_recall = o.blind_recall;
  so.thresholds.overcompression_kl = o.kl_threshold;
  so.batch_budgets = o.batch_budgets;
  so.bound.enabled = o.bound;
  if (o.alloc_search) {
    const sim::PolicySpec& sc = *o.alloc_search;
    if (!sc.compress_tokens || sc.adaptive || sc.mode == sim::PolicyMode::kDecode ||
        sc.stages.scorer == "oracle-topk") {
      throw sim::PolicyError(
          "alloc_search needs a prefill-mode token-scoring policy (e.g. h2o, snapkv, tova), not '" + sc.name +
          "'");
    }
    so.alloc_search.enabled = true;
    so.alloc_search.scorer = sc;
  }
  std::mutex error_mutex;
  std::exception_ptr progress_error;
  if (!progress.is_none()) {
    so.progress = [&](std::size_t done, std::size_t total) {
      py::gil_scoped_acquire gil;
      try {
        progress(done, total);
      } catch (py::error_already_set& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!progress_error) progress_error = std::current_exception();
      }
    };
  }
  Results r;
  {
    py::gil_scoped_release release;
    r.out = sim::run_sweep(reader, points, so);
    sim::mark_pareto(r.out.points, [](const sim::PointResult& pt) { return pt.kind == "policy"; });
  }
  so.progress = nullptr;
  if (progress_error) std::rethrow_exception(progress_error);
  r.meta = sim::sweep_results_meta(summary, r.out, o.command_line);
  r.backend = backend->description();
  return r;
}

py::dict point_dict(const sim::PointResult& p) {
  py::dict d;
  d["policy"] = p.policy;
  d["budget"] = p.budget;
  d["mode"] = p.mode;
  d["kind"] = p.kind;
  d["budget_value"] = p.budget_value;
  d["bytes_ratio"] = p.bytes_ratio();
  d["bytes_full"] = p.total.bytes_full.total();
  d["bytes_kept"] = p.total.bytes_kept.total();
  d["output_error"] = p.total.quality.output_error;
  d["attention_recall"] = p.total.quality.attention_recall;
  d["kl"] = p.total.quality.kl;
  d["pareto"] = p.pareto;
  d["seconds"] = p.seconds;
  py::list flags;
  for (const auto& f : p.flags) {
    py::dict fd;
    fd["mode"] = f.mode;
    fd["layers"] = f.layers;
    fd["evidence"] = f.evidence;
    fd["suggested_fix"] = f.suggested_fix;
    flags.append(fd);
  }
  d["flags"] = flags;
  return d;
}

ReplayOptions options_from(bool bound, const std::optional<sim::PolicySpec>& alloc_search,
                           bool question_in_context, int threads, const std::string& backend,
                           double blind_recall, double kl_threshold, bool batch_budgets,
                           const std::string& command_line) {
  ReplayOptions o;
  o.bound = bound;
  o.alloc_search = alloc_search;
  o.question_in_context = question_in_context;
  o.threads = threads;
  o.backend = backend;
  o.blind_recall = blind_recall;
  o.kl_threshold = kl_threshold;
  o.batch_budgets = batch_budgets;
  o.command_line = command_line;
  return o;
}

}  // namespace

void bind_sim(py::module_& m) {
  py::class_<sim::PolicySpec>(m, "Policy")
      .def_readonly("name", &sim::PolicySpec::name)
      .def_readonly("description", &sim::PolicySpec::description)
      .def_readonly("source", &sim::PolicySpec::source)
      .def_readonly("compress_tokens", &sim::PolicySpec::compress_tokens)
      .def_readonly("adaptive", &sim::PolicySpec::adaptive)
      .def_property_readonly(
          "mode",
          [](const sim::PolicySpec& p) { return p.mode == sim::PolicyMode::kDecode ? "decode" : "prefill"; })
      .def_property_readonly("stages",
                             [](const sim::PolicySpec& p) {
                               py::dict d;
                               d["head_merge"] = p.stages.head_merge;
                               d["scorer"] = p.stages.scorer;
                               d["allocator"] = p.stages.allocator;
                               d["executor"] = p.stages.executor;
                               d["quant"] = p.stages.quantizer;
                               return d;
                             })
      .def_property_readonly("params", [](const sim::PolicySpec& p) { return p.params.values(); })
      .def_property_readonly("needs_budget",
                             [](const sim::PolicySpec& p) { return sim::policy_needs_budget(p); })
      .def("__repr__", [](const sim::PolicySpec& p) { return "<kvscope Policy " + p.name + ">"; });
  m.def("make_policy", &make_policy, py::arg("name"), py::arg("params"), py::arg("policy_files"),
        py::arg("rename"));
  m.def(
      "policy_names",
      [](const py::list& policy_files) {
        sim::PolicyRegistry registry;
        for (const auto& f : policy_files) registry.load_ini(py::cast<std::string>(f));
        return registry.names();
      },
      py::arg("policy_files"));
  m.def("policy_parameters", &sim::policy_parameters);
  m.def(
      "parse_budget_list",
      [](const std::string& text) {
        std::vector<std::string> out;
        for (const auto& b : sim::parse_budget_list(text)) out.push_back(b.text);
        return out;
      },
      py::arg("text"));
  m.def(
      "check_budget", [](const std::string& text) { return sim::parse_budget(text).text; }, py::arg("text"));

  py::class_<Results, std::shared_ptr<Results>>(m, "Results")
      .def("csv", [](const Results& r) { return sim::format_csv(r.out.points, r.meta); })
      .def("table",
           [](const Results& r) {
             sim::TableOptions t;
             t.query_sets = r.out.has_roles;
             return sim::format_table(r.out.points, t);
           })
      .def(
          "write_hdf5",
          [](const Results& r, const std::string& path) { sim::write_hdf5(path, r.out.points, r.meta); },
          py::arg("path"))
      .def(
          "write_csv",
          [](const Results& r, const std::string& path) { sim::write_csv(path, r.out.points, r.meta); },
          py::arg("path"))
      .def("points",
           [](const Results& r) {
             py::list l;
             for (const auto& p : r.out.points) l.append(point_dict(p));
             return l;
           })
      .def_property_readonly("warnings", [](const Results& r) { return r.out.warnings; })
      .def_property_readonly("backend", [](const Results& r) { return r.backend; })
      .def_property_readonly("context_tokens", [](const Results& r) { return r.out.context_tokens; })
      .def_property_readonly("decode_steps", [](const Results& r) { return r.out.decode_steps; })
      .def_property_readonly("steps_in_context", [](const Results& r) { return r.out.steps_in_context; })
      .def_property_readonly("has_roles", [](const Results& r) { return r.out.has_roles; })
      .def_property_readonly("trace_path", [](const Results& r) { return r.meta.trace_path; });

  m.def(
      "sweep",
      [](const std::string& trace_path, const std::vector<sim::PolicySpec>& policies,
         const std::string& budgets, bool bound, const std::optional<sim::PolicySpec>& alloc_search,
         bool question_in_context, int threads, const std::string& backend, double blind_recall,
         double kl_threshold, bool batch_budgets, const py::object& progress,
         const std::string& command_line) {
        if (policies.empty()) throw sim::PolicyError("no policies given");
        const auto points = sim::make_sweep_points(policies, sim::parse_budget_list(budgets));
        return std::make_shared<Results>(
            replay(trace_path, points,
                   options_from(bound, alloc_search, question_in_context, threads, backend, blind_recall,
                                kl_threshold, batch_budgets, command_line),
                   progress));
      },
      py::arg("trace_path"), py::arg("policies"), py::arg("budgets"), py::arg("bound"),
      py::arg("alloc_search"), py::arg("question_in_context"), py::arg("threads"), py::arg("backend"),
      py::arg("blind_recall"), py::arg("kl_threshold"), py::arg("batch_budgets"), py::arg("progress"),
      py::arg("command_line"));
  m.def(
      "run",
      [](const std::string& trace_path, const sim::PolicySpec& policy, const std::string& budget,
         bool question_in_context, int threads, const std::string& backend, double blind_recall,
         double kl_threshold, const py::object& progress, const std::string& command_line) {
        std::string ignored;
        const sim::Budget b = budget.empty() || budget == "-" ? sim::Budget{} : sim::parse_budget(budget);
        const sim::SweepPoint point = sim::run_point(policy, b, &ignored);
        auto r = std::make_shared<Results>(
            replay(trace_path, {point},
                   options_from(false, std::nullopt, question_in_context, threads, backend, blind_recall,
                                kl_threshold, true, command_line),
                   progress));
        if (!ignored.empty())
          r->out.warnings.insert(r->out.warnings.begin(),
                                 "'" + policy.name + "' ignores the budget '" + ignored + "'");
        return r;
      },
      py::arg("trace_path"), py::arg("policy"), py::arg("budget"), py::arg("question_in_context"),
      py::arg("threads"), py::arg("backend"), py::arg("blind_recall"), py::arg("kl_threshold"),
      py::arg("progress"), py::arg("command_line"));
}

}  // namespace kvscope::python
