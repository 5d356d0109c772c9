// HDF5 results file ("kvscope-results" 1.5), written with the HDF5 C API.
// Layout (normative description: docs/results-format.md):
//   /            attributes: format, version, trace and model metadata, command line
//   /points      one entry per point:              [P] and [P, 4] / [P, 6]
//   /layers      per layer of each point:          [P, L] and [P, L, 4] / [P, L, 6]
//   /heads       per kv head of each layer:        [P, L, H] and [P, L, H, 4] / [P, L, H, 6]
//   /flags       one entry per collapse flag:      [F] and layer_mask [F, L]
//   /samples, /sample_points, /aggregate   (1.4, dataset sweeps; 1.5: proxies in /sample_points) tables
// Every dataset carries a "description" attribute.
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <system_error>

#include "kvscope/sim/report.hpp"

namespace kvscope::sim {

namespace {

class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { close(); }
  herr_t close() {
    const herr_t s = id_ >= 0 ? closer_(id_) : 0;
    id_ = H5I_INVALID_HID;
    return s;
  }
  operator hid_t() const { return id_; }

 private:
  hid_t id_;
  Closer closer_;
};

herr_t walk_innermost(unsigned n, const H5E_error2_t* e, void* out) {
  if (n == 0 && e->desc) *static_cast<std::string*>(out) = e->desc;
  return 0;
}

std::string hdf5_message() {
  std::string msg;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, walk_innermost, &msg);
  return msg.empty() ? "HDF5 error" : msg;
}

constexpr const char* kModalityNames = "text,vision,audio,special";
constexpr const char* kComponentNames = "kv,scales,zeros,residual,multiplicity,index";

// Names of a dataset's innermost axis, stored as attribute `attr` = `names`.
struct Axis {
  const char* attr;
  const char* names;
};
constexpr Axis kModalityAxis{"modalities", kModalityNames};
constexpr Axis kComponentAxis{"components", kComponentNames};
constexpr int kComponents = 6;

std::int64_t component(const Bytes& b, int k) {
  const std::int64_t parts[kComponents] = {b.kv, b.scales, b.zeros, b.residual, b.multiplicity, b.index};
  return parts[k];
}

template <typename T>
struct H5Types;
template <>
struct H5Types<double> {
  static hid_t mem() { return H5T_NATIVE_DOUBLE; }
  static hid_t file() { return H5T_IEEE_F64LE; }
};
template <>
struct H5Types<std::int64_t> {
  static hid_t mem() { return H5T_NATIVE_INT64; }
  static hid_t file() { return H5T_STD_I64LE; }
};
template <>
struct H5Types<std::int32_t> {
  static hid_t mem() { return H5T_NATIVE_INT32; }
  static hid_t file() { return H5T_STD_I32LE; }
};
template <>
struct H5Types<std::uint8_t> {
  static hid_t mem() { return H5T_NATIVE_UINT8; }
  static hid_t file() { return H5T_STD_U8LE; }
};

// Writes into one open file; every failure throws ReportError naming the final path and object.
class Writer {
 public:
  explicit Writer(std::string path) : path_(std::move(path)) {}

  hid_t check(hid_t id, const std::string& object, const char* what) const {
    if (id < 0) fail(object, what);
    return id;
  }
  [[noreturn]] void fail(const std::string& object, const char* what) const {
    throw ReportError(path_, object + ": " + what + " failed: " + hdf5_message());
  }

  static Handle string_type() {
    const hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    return Handle(t, H5Tclose);
  }

  void attr_string(hid_t obj, const std::string& object, const char* name, const std::string& value) const {
    Handle type = string_type();
    Handle space(H5Screate(H5S_SCALAR), H5Sclose);
    Handle a(
        check(H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT), object + "@" + name, "create"),
        H5Aclose);
    const char* p = value.c_str();
    if (H5Awrite(a, type, &p) < 0) fail(object + "@" + name, "write");
  }

  template <typename T>
  void attr(hid_t obj, const std::string& object, const char* name, const std::vector<T>& values,
            bool scalar) const {
    const hsize_t n = values.size();
    Handle space(scalar ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr), H5Sclose);
    Handle a(check(H5Acreate2(obj, name, H5Types<T>::file(), space, H5P_DEFAULT, H5P_DEFAULT),
                   object + "@" + name, "create"),
             H5Aclose);
    if (H5Awrite(a, H5Types<T>::mem(), values.data()) < 0) fail(object + "@" + name, "write");
  }
  template <typename T>
  void attr_scalar(hid_t obj, const std::string& object, const char* name, T value) const {
    attr<T>(obj, object, name, {value}, true);
  }

  template <typename T>
  void dataset(hid_t group, const std::string& object, const std::vector<hsize_t>& dims,
               const std::vector<T>& data, const std::string& description, const Axis* axis = nullptr) const {
    write_dataset(group, object, dims, H5Types<T>::file(), H5Types<T>::mem(), data.data(), data.size(),
                  description, axis);
  }

  void strings(hid_t group, const std::string& object, const std::vector<std::string>& values,
               const std::string& description) const {
    std::vector<const char*> ptrs;
    for (const std::string& s : values) ptrs.push_back(s.c_str());
    Handle type = string_type();
    write_dataset(group, object, {values.size()}, type, type, ptrs.data(), ptrs.size(), description, nullptr);
  }

 private:
  void write_dataset(hid_t group, const std::string& object, const std::vector<hsize_t>& dims,
                     hid_t file_type, hid_t mem_type, const void* data, std::size_t n,
                     const std::string& description, const Axis* axis) const {
    const std::string name = object.substr(object.rfind('/') + 1);
    Handle space(
        check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), object, "dataspace"),
        H5Sclose);
    Handle d(check(H5Dcreate2(group, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                   object, "create"),
             H5Dclose);
    if (n > 0 && H5Dwrite(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) fail(object, "write");
    attr_string(d, object, "description", description);
    if (axis) attr_string(d, object, axis->attr, axis->names);
  }

  std::string path_;
};

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The same per-record datasets in /points, /layers and /heads: `recs` is the row-major
// flattening of `dims`, nullptr where a point has fewer layers / heads than the file.
void write_records(const Writer& w, hid_t group, const std::string& gname, const std::vector<hsize_t>& dims,
                   const std::vector<const HeadResult*>& recs) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  auto with_inner = [&](hsize_t inner) {
    std::vector<hsize_t> d = dims;
    if (inner) d.push_back(inner);
    return d;
  };
  auto scalar_f64 = [&](const char* name, const std::string& desc,
                        std::function<double(const HeadResult&)> get) {
    std::vector<double> v;
    for (const HeadResult* r : recs) v.push_back(r ? get(*r) : kNaN);
    w.dataset(group, gname + "/" + name, with_inner(0), v, desc);
  };
  auto scalar_i64 = [&](const char* name, const std::string& desc,
                        std::function<std::int64_t(const HeadResult&)> get) {
    std::vector<std::int64_t> v;
    for (const HeadResult* r : recs) v.push_back(r ? get(*r) : -1);
    w.dataset(group, gname + "/" + name, with_inner(0), v, desc);
  };
  auto modal_f64 = [&](const char* name, const std::string& desc, const PerModality Quality::*field) {
    std::vector<double> v;
    for (const HeadResult* r : recs) {
      for (int m = 0; m < kModalities; ++m) v.push_back(r ? (r->quality.*field)[m] : kNaN);
    }
    w.dataset(group, gname + "/" + name, with_inner(kModalities), v, desc, &kModalityAxis);
  };
  auto modal_i64 = [&](const char* name, const std::string& desc, const PerModalityCount HeadResult::*field) {
    std::vector<std::int64_t> v;
    for (const HeadResult* r : recs) {
      for (int m = 0; m < kModalities; ++m) v.push_back(r ? (r->*field)[m] : -1);
    }
    w.dataset(group, gname + "/" + name, with_inner(kModalities), v, desc, &kModalityAxis);
  };
  auto components = [&](const char* name, const std::string& desc, const Bytes HeadResult::*field) {
    std::vector<std::int64_t> v;
    for (const HeadResult* r : recs) {
      for (int k = 0; k < kComponents; ++k) v.push_back(r ? component(r->*field, k) : -1);
    }
    w.dataset(group, gname + "/" + name, with_inner(kComponents), v, desc, &kComponentAxis);
  };

  scalar_i64("bytes_full", "uncompressed K+V bytes",
             [](const HeadResult& r) { return r.bytes_full.total(); });
  scalar_i64("bytes_kept", "bytes after the policy, all components",
             [](const HeadResult& r) { return r.bytes_kept.total(); });
  scalar_i64("bytes_full_end", "uncompressed cache after the last decode step (context + decode tokens)",
             [](const HeadResult& r) { return r.bytes_full_end; });
  scalar_i64("bytes_end", "resident cache after the last decode step, all components",
             [](const HeadResult& r) { return r.bytes_end; });
  scalar_i64("bytes_peak", "largest resident cache over the decode steps (after appending, before eviction)",
             [](const HeadResult& r) { return r.bytes_peak; });
  scalar_f64("bytes_ratio", "bytes_kept / bytes_full (1 when bytes_full is 0)", [](const HeadResult& r) {
    const std::int64_t full = r.bytes_full.total();
    return full ? static_cast<double>(r.bytes_kept.total()) / static_cast<double>(full) : 1.0;
  });
  components("bytes_full_components", "bytes_full split by component", &HeadResult::bytes_full);
  components("bytes_kept_components", "bytes_kept split by component", &HeadResult::bytes_kept);
  modal_i64("bytes_full_modality", "uncompressed bytes per modality", &HeadResult::bytes_full_modality);
  modal_i64("bytes_kept_modality", "kept bytes per modality (overheads apportioned by slot count)",
            &HeadResult::bytes_kept_modality);
  modal_i64("tokens", "context tokens per modality", &HeadResult::tokens);
  modal_i64("kept", "tokens kept as their own slot, per modality", &HeadResult::kept);
  modal_i64("merged", "tokens folded into another slot, per modality", &HeadResult::merged);
  modal_i64("evicted", "tokens dropped, per modality", &HeadResult::evicted);
  scalar_f64("output_error", "||o~ - o|| / ||o||, mean over evaluation queries",
             [](const HeadResult& r) { return r.quality.output_error; });
  scalar_f64("attention_recall", "full attention mass on surviving tokens",
             [](const HeadResult& r) { return r.quality.attention_recall; });
  scalar_f64("kl", "KL(full renormalised on survivors || compressed), nats",
             [](const HeadResult& r) { return r.quality.kl; });
  scalar_f64("entropy_delta", "H(p~) - H(p), nats",
             [](const HeadResult& r) { return r.quality.entropy_delta; });
  // Format 1.2: the same four metrics on each query set (docs/metrics.md "Query sets"); NaN for an empty set.
  for (int k = 0; k < kQuerySets; ++k) {
    const std::string set = query_set_name(k);
    const auto i = static_cast<std::size_t>(k);
    scalar_f64(("output_error_" + set).c_str(), "output error over the " + set + " queries only",
               [i](const HeadResult& r) { return r.quality.query_sets[i].output_error; });
    scalar_f64(("attention_recall_" + set).c_str(), "attention recall over the " + set + " queries only",
               [i](const HeadResult& r) { return r.quality.query_sets[i].attention_recall; });
    scalar_f64(("kl_" + set).c_str(), "KL over the " + set + " queries only, nats",
               [i](const HeadResult& r) { return r.quality.query_sets[i].kl; });
    scalar_f64(("entropy_delta_" + set).c_str(), "entropy change over the " + set + " queries only, nats",
               [i](const HeadResult& r) { return r.quality.query_sets[i].entropy_delta; });
  }
  // Format 1.3: the fidelity proxies (docs/metrics.md "Proxies"); NaN without answer steps.
  for (int i = 0; i < kNumProxies; ++i) {
    scalar_f64(proxy_name(i),
               std::string("fidelity proxy ") + proxy_name(i) + " (docs/metrics.md \"Proxies\")",
               [i](const HeadResult& r) { return proxy_value(r.quality.proxies, i); });
  }
  modal_f64("recall_modality", "attention recall per modality (1 where the modality has no mass)",
            &Quality::recall_modality);
  modal_f64("share_before", "full attention mass per modality", &Quality::share_before);
  modal_f64("share_after", "compressed attention mass per modality", &Quality::share_after);
}

void write_table(const Writer& w, hid_t file, const ResultsTable& t) {
  const std::string gname = "/" + t.name;
  Handle g(
      w.check(H5Gcreate2(file, gname.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), gname, "create group"),
      H5Gclose);
  w.attr_string(g, gname, "description", t.description);
  w.attr_scalar<std::int64_t>(g, gname, "num_rows", static_cast<std::int64_t>(t.rows()));
  if (!t.stream) {
    for (const ResultsColumn& c : t.columns) {
      const std::string object = gname + "/" + c.name;
      const hsize_t n = c.size();
      if (c.type == ResultsColumn::Type::kF64)
        w.dataset(g, object, {n}, c.f64, c.description);
      else if (c.type == ResultsColumn::Type::kI64)
        w.dataset(g, object, {n}, c.i64, c.description);
      else
        w.strings(g, object, c.str, c.description);
    }
    return;
  }
  // Streamed: every column created at its full length, then each block written at its rows.
  std::deque<Handle> ds;  // (Handle cannot move)
  Handle str_type = Writer::string_type();
  auto type_of = [&](const ResultsColumn& c, bool file_type) -> hid_t {
    if (c.type == ResultsColumn::Type::kF64) return file_type ? H5T_IEEE_F64LE : H5T_NATIVE_DOUBLE;
    if (c.type == ResultsColumn::Type::kI64) return file_type ? H5T_STD_I64LE : H5T_NATIVE_INT64;
    return str_type;
  };
  const hsize_t n = t.streamed_rows;
  {
    Handle space(w.check(H5Screate_simple(1, &n, nullptr), gname, "dataspace"), H5Sclose);
    for (const ResultsColumn& c : t.columns) {
      const std::string object = gname + "/" + c.name;
      ds.emplace_back(w.check(H5Dcreate2(g, c.name.c_str(), type_of(c, true), space, H5P_DEFAULT, H5P_DEFAULT,
                                         H5P_DEFAULT),
                              object, "create"),
                      H5Dclose);
      w.attr_string(ds.back(), object, "description", c.description);
    }
  }
  hsize_t at = 0;
  std::vector<const char*> ptrs;
  t.stream([&](const ResultsTable& block) {
    const hsize_t rows = block.rows();
    if (rows == 0) return;
    if (at + rows > n) w.fail(gname, "streamed rows beyond the table's length: write");
    Handle mem(w.check(H5Screate_simple(1, &rows, nullptr), gname, "dataspace"), H5Sclose);
    for (std::size_t k = 0; k < t.columns.size(); ++k) {
      const ResultsColumn& c = block.columns[k];
      const std::string object = gname + "/" + t.columns[k].name;
      Handle file_space(w.check(H5Dget_space(ds[k]), object, "dataspace"), H5Sclose);
      if (H5Sselect_hyperslab(file_space, H5S_SELECT_SET, &at, nullptr, &rows, nullptr) < 0)
        w.fail(object, "select");
      const void* data = nullptr;
      if (c.type == ResultsColumn::Type::kF64) {
        data = c.f64.data();
      } else if (c.type == ResultsColumn::Type::kI64) {
        data = c.i64.data();
      } else {
        ptrs.clear();
        for (const std::string& v : c.str) ptrs.push_back(v.c_str());
        data = ptrs.data();
      }
      if (H5Dwrite(ds[k], type_of(c, false), mem, file_space, H5P_DEFAULT, data) < 0) w.fail(object, "write");
    }
    at += rows;
  });
  if (at != n) w.fail(gname, "streamed rows short of the table's length: write");
}

void write_contents(const Writer& w, hid_t file, const std::vector<PointResult>& points,
                    const ResultsMeta& meta) {
  hsize_t L = static_cast<hsize_t>(std::max(meta.num_layers, 0));
  hsize_t H = static_cast<hsize_t>(std::max(meta.num_kv_heads, 0));
  for (const PointResult& p : points) {
    L = std::max<hsize_t>(L, p.layers.size());
    for (const LayerResult& l : p.layers) H = std::max<hsize_t>(H, l.heads.size());
  }
  const hsize_t P = points.size();

  w.attr_string(file, "/", "format", kResultsFormat);
  w.attr_string(file, "/", "version", kResultsVersion);
  w.attr_string(file, "/", "trace_path", meta.trace_path);
  w.attr_string(file, "/", "model_name", meta.model_name);
  w.attr_scalar<std::uint8_t>(file, "/", "synthetic", meta.synthetic ? 1 : 0);
  w.attr_string(file, "/", "created", meta.created.empty() ? utc_now() : meta.created);
  w.attr_string(file, "/", "command_line", meta.command_line);
  if (!meta.attention_statistics.empty())
    w.attr_string(file, "/", "attention_statistics", meta.attention_statistics);
  w.attr_scalar<std::int64_t>(file, "/", "num_points", static_cast<std::int64_t>(P));
  w.attr_scalar<std::int64_t>(file, "/", "num_layers", static_cast<std::int64_t>(L));
  w.attr_scalar<std::int64_t>(file, "/", "num_kv_heads", static_cast<std::int64_t>(H));
  w.attr_scalar<std::int64_t>(file, "/", "num_q_heads", meta.num_q_heads);
  w.attr_scalar<std::int64_t>(file, "/", "head_dim", meta.head_dim);
  w.attr_scalar<std::int64_t>(file, "/", "num_tokens", meta.num_tokens);
  w.attr_scalar<std::int64_t>(file, "/", "num_decode_steps", meta.num_decode_steps);
  w.attr<std::int64_t>(file, "/", "tokens_per_modality",
                       {meta.tokens_per_modality.begin(), meta.tokens_per_modality.end()}, false);
  w.attr_scalar<std::uint8_t>(file, "/", "has_roles", meta.has_roles ? 1 : 0);
  w.attr_scalar<std::int64_t>(file, "/", "question_in_context", meta.steps_in_context);
  w.attr_scalar<std::int64_t>(file, "/", "answer_queries", meta.query_set_steps[kAnswerQueries]);
  w.attr_scalar<std::int64_t>(file, "/", "question_queries", meta.query_set_steps[kQuestionQueries]);
  w.attr_string(file, "/", "modalities", kModalityNames);
  w.attr_string(file, "/", "bytes_components", kComponentNames);
  if (meta.dataset) {  // format 1.4: a dataset sweep
    w.attr_string(file, "/", "dataset", meta.dataset_source);
    w.attr_scalar<std::int64_t>(file, "/", "num_samples", meta.num_samples);
    w.attr_scalar<std::int64_t>(file, "/", "failed_samples", meta.failed_samples);
    w.attr_scalar<std::int64_t>(file, "/", "bootstrap_resamples", meta.bootstrap_resamples);
    w.attr_scalar<std::int64_t>(file, "/", "bootstrap_seed", static_cast<std::int64_t>(meta.bootstrap_seed));
    w.attr_scalar<double>(file, "/", "confidence", meta.confidence);
    w.attr_string(file, "/", "group_by", meta.group_by);
  }

  auto group = [&](const char* name) {
    return Handle(
        w.check(H5Gcreate2(file, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), name, "create group"),
        H5Gclose);
  };

  {  // /points
    Handle g = group("/points");
    std::vector<const HeadResult*> recs;
    std::vector<std::string> policy, budget, mode, kind;
    std::vector<double> budget_value, seconds;
    std::vector<std::uint8_t> pareto;
    std::vector<std::int32_t> num_flags;
    for (const PointResult& p : points) {
      recs.push_back(&p.total);
      policy.push_back(p.policy);
      budget.push_back(p.budget);
      mode.push_back(p.mode);
      kind.push_back(p.kind);
      budget_value.push_back(p.budget_value);
      seconds.push_back(p.seconds);
      pareto.push_back(p.pareto ? 1 : 0);
      num_flags.push_back(static_cast<std::int32_t>(p.flags.size()));
    }
    w.strings(g, "/points/policy", policy, "canonical policy name");
    w.strings(g, "/points/budget", budget, "budget as given (fraction, NNtok, NNMiB) or - for budget-free");
    w.strings(g, "/points/mode", mode, "prefill (compressed once after prefill) or decode (evicted during decoding)");
    w.strings(g, "/points/kind", kind,
              "policy, bound (oracle-topk: reads the evaluation queries) or search (alloc-search:SCORER); "
              "only policy rows can be on the Pareto front");
    w.dataset(g, "/points/budget_value", {P}, budget_value, "requested fraction of tokens kept (1 for -)");
    w.dataset(g, "/points/pareto", {P}, pareto, "1 on the bytes_ratio vs output_error Pareto front");
    w.dataset(g, "/points/seconds", {P}, seconds, "wall time of this point, seconds");
    w.dataset(g, "/points/num_flags", {P}, num_flags, "collapse flags of this point (rows of /flags)");
    write_records(w, g, "/points", {P}, recs);
  }
  {  // /layers
    Handle g = group("/layers");
    std::vector<const HeadResult*> recs;
    std::vector<std::int32_t> layer, merged_heads;
    for (const PointResult& p : points) {
      for (hsize_t i = 0; i < L; ++i) {
        const LayerResult* l = i < p.layers.size() ? &p.layers[i] : nullptr;
        recs.push_back(l ? &l->total : nullptr);
        layer.push_back(l ? l->layer : -1);
        merged_heads.push_back(l ? l->merged_heads : -1);
      }
    }
    w.dataset(g, "/layers/layer", {P, L}, layer, "model layer index (-1 where the point has no such row)");
    w.dataset(g, "/layers/merged_heads", {P, L}, merged_heads, "kv heads after head merging");
    write_records(w, g, "/layers", {P, L}, recs);
  }
  {  // /heads
    Handle g = group("/heads");
    std::vector<const HeadResult*> recs;
    std::vector<std::int32_t> kv_head;
    for (const PointResult& p : points) {
      for (hsize_t i = 0; i < L; ++i) {
        for (hsize_t h = 0; h < H; ++h) {
          const HeadResult* r =
              i < p.layers.size() && h < p.layers[i].heads.size() ? &p.layers[i].heads[h] : nullptr;
          recs.push_back(r);
          kv_head.push_back(r ? r->kv_head : -1);
        }
      }
    }
    w.dataset(g, "/heads/kv_head", {P, L, H}, kv_head, "kv head index (-1 where absent)");
    write_records(w, g, "/heads", {P, L, H}, recs);
  }
  {  // /flags
    Handle g = group("/flags");
    std::vector<std::int32_t> point;
    std::vector<std::string> mode, layers, evidence, fix;
    std::vector<std::uint8_t> mask;
    for (std::size_t i = 0; i < points.size(); ++i) {
      for (const CollapseFlag& f : points[i].flags) {
        point.push_back(static_cast<std::int32_t>(i));
        mode.push_back(f.mode);
        std::string list;
        for (int l : f.layers) list.append(list.empty() ? "" : ",").append(std::to_string(l));
        layers.push_back(list);
        evidence.push_back(f.evidence);
        fix.push_back(f.suggested_fix);
        const std::vector<LayerResult>& pl = points[i].layers;
        for (hsize_t k = 0; k < L; ++k) {
          const int number = k < pl.size() ? pl[k].layer : static_cast<int>(k);
          mask.push_back(std::find(f.layers.begin(), f.layers.end(), number) != f.layers.end() ? 1 : 0);
        }
      }
    }
    const hsize_t F = point.size();
    w.dataset(g, "/flags/point", {F}, point, "row of /points this flag belongs to");
    w.strings(g, "/flags/mode", mode, "visual_blindness, semantic_drift, repetition or over_compression");
    w.strings(g, "/flags/layers", layers, "comma-separated layer indices that triggered the flag");
    w.dataset(g, "/flags/layer_mask", {F, L}, mask,
              "1 where the layer (column of /layers) triggered the flag");
    w.strings(g, "/flags/evidence", evidence, "the numbers behind the flag");
    w.strings(g, "/flags/suggested_fix", fix, "the seed's suggested fix");
  }
}

}  // namespace

void write_hdf5(const std::string& path, const std::vector<PointResult>& points, const ResultsMeta& meta,
                const std::vector<ResultsTable>& tables) {
  static std::once_flag silence;
  std::call_once(silence, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
  const std::string partial = path + ".partial";
  const Writer w(path);
  try {
    Handle file(
        w.check(H5Fcreate(partial.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), partial, "create"),
        H5Fclose);
    write_contents(w, file, points, meta);
    for (const ResultsTable& t : tables) write_table(w, file, t);
    if (file.close() < 0) w.fail(partial, "close");
  } catch (...) {
    std::remove(partial.c_str());
    throw;
  }
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) {
    std::remove(partial.c_str());
    throw ReportError(path, "cannot rename " + partial + " to it: " + ec.message());
  }
}

}  // namespace kvscope::sim
