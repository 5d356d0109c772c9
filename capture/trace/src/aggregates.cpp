#include "kvscope/trace/aggregates.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "aggregates_io.hpp"

namespace kvscope::trace {

using h5::Handle;

namespace {

// The datasets of a layer: name, pointer to member, rows (query or kv heads), value bound.
struct Field {
  const char* name;
  std::vector<float> LayerAttentionAggregates::*member;
  bool kv_rows;
};
constexpr Field kFields[] = {
    {"h2o", &LayerAttentionAggregates::h2o, false},
    {"window_sum", &LayerAttentionAggregates::window_sum, false},
    {"last_query", &LayerAttentionAggregates::last_query, false},
    {"cross_received", &LayerAttentionAggregates::cross_received, false},
    {"cross_given", &LayerAttentionAggregates::cross_given, false},
    {"redundancy", &LayerAttentionAggregates::redundancy, true},
};

// [lo, hi] of a field's values (probabilities and their sums; cosines).
void value_range(const Field& f, const AggregateDefinition& d, double& lo, double& hi) {
  const std::string n = f.name;
  lo = 0;
  if (n == "h2o")
    hi = d.num_tokens;
  else if (n == "window_sum")
    hi = d.window;
  else if (n == "redundancy")
    lo = -1, hi = 1;
  else
    hi = 1;
}

float softmax_scale_of(int head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

}  // namespace

std::string aggregate_definition_problem(const AggregateDefinition& d, const ModelGeometry& g, DType dtype,
                                         std::size_t T) {
  auto differ = [](const char* what, long long stored, long long trace) {
    return std::string(what) + " is " + std::to_string(stored) + ", the trace has " + std::to_string(trace);
  };
  if (d.definition != kAggregateDefinitionName)
    return "definition '" + d.definition + "' is not " + kAggregateDefinitionName;
  if (d.num_layers != g.num_layers) return differ("num_layers", d.num_layers, g.num_layers);
  if (static_cast<std::size_t>(d.num_tokens) != T)
    return differ("num_tokens", d.num_tokens, static_cast<long long>(T));
  if (d.num_q_heads != g.num_q_heads) return differ("num_q_heads", d.num_q_heads, g.num_q_heads);
  if (d.num_kv_heads != g.num_kv_heads) return differ("num_kv_heads", d.num_kv_heads, g.num_kv_heads);
  if (d.gqa_group != g.group_size()) return differ("gqa_group", d.gqa_group, g.group_size());
  if (!d.causal) return "causal is 0 (the statistics are of the causal prefill attention)";
  if (d.window < 1 || static_cast<std::size_t>(d.window) > T)
    return "window " + std::to_string(d.window) + " is outside 1..T = " + std::to_string(T);
  if (d.seq_radius < 0 || d.grid_radius < 0) return "negative redundancy radius";
  if (static_cast<float>(d.softmax_scale) != softmax_scale_of(g.head_dim)) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "softmax_scale %.9g is not float32(1/sqrt(%d)) = %.9g", d.softmax_scale,
                  g.head_dim, static_cast<double>(softmax_scale_of(g.head_dim)));
    return buf;
  }
  if (d.input_dtype != kernels::dtype_name(dtype))
    return "input_dtype is '" + d.input_dtype + "', the trace's tensors are " + kernels::dtype_name(dtype);
  if (d.accumulate_dtype != "float32") return "accumulate_dtype is '" + d.accumulate_dtype + "', not float32";
  return "";
}

namespace aggregates_io {

void create_group(const h5::Ctx& c, hid_t file, const std::string& group, const AggregateDefinition& d) {
  Handle g = c.check_id(H5Gcreate2(file, group.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose,
                        group, "H5Gcreate2", ErrorKind::kIo);
  h5::write_attr_u8(c, g, "complete", 0);
  h5::write_attr_string(c, g, "definition", d.definition);
  h5::write_attr_i64(c, g, "num_layers", d.num_layers);
  h5::write_attr_i64(c, g, "num_tokens", d.num_tokens);
  h5::write_attr_i64(c, g, "num_q_heads", d.num_q_heads);
  h5::write_attr_i64(c, g, "num_kv_heads", d.num_kv_heads);
  h5::write_attr_i64(c, g, "gqa_group", d.gqa_group);
  h5::write_attr_f64(c, g, "softmax_scale", d.softmax_scale);
  h5::write_attr_u8(c, g, "causal", d.causal ? 1 : 0);
  h5::write_attr_string(c, g, "mask",
                        "key t visible to query i iff /tokens/position[t] <= /tokens/position[i]");
  h5::write_attr_i64(c, g, "window", d.window);
  h5::write_attr_i64(c, g, "seq_radius", d.seq_radius);
  h5::write_attr_i64(c, g, "grid_radius", d.grid_radius);
  h5::write_attr_string(c, g, "input_dtype", d.input_dtype);
  h5::write_attr_string(c, g, "accumulate_dtype", d.accumulate_dtype);
  h5::write_attr_string(c, g, "creator", d.creator);
}

void write_layer(const h5::Ctx& c, hid_t file, int layer, const AggregateDefinition& d,
                 const LayerAttentionAggregates& a) {
  const std::string g = aggregate_layer_group_name(layer);
  Handle grp = c.check_id(H5Gcreate2(file, g.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, g,
                          "H5Gcreate2", ErrorKind::kIo);
  const hsize_t T = static_cast<hsize_t>(d.num_tokens);
  for (const Field& f : kFields) {
    const std::string path = g + "/" + f.name;
    const std::vector<float>& v = a.*f.member;
    const hsize_t dims[2] = {static_cast<hsize_t>(f.kv_rows ? d.num_kv_heads : d.num_q_heads), T};
    if (v.size() != dims[0] * dims[1]) {
      c.fail(ErrorKind::kShape, path,
             std::to_string(v.size()) + " values, expected [" + std::to_string(dims[0]) + ", " +
                 std::to_string(T) + "]");
    }
    Handle space = c.check_id(H5Screate_simple(2, dims, nullptr), H5Sclose, path, "H5Screate_simple");
    Handle ds =
        c.check_id(H5Dcreate2(grp, f.name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                   H5Dclose, path, "H5Dcreate2", ErrorKind::kIo);
    c.check(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), path, "H5Dwrite");
  }
}

void set_complete(const h5::Ctx& c, hid_t file, bool complete) {
  Handle g =
      c.check_id(H5Gopen2(file, kAggregatesGroup, H5P_DEFAULT), H5Gclose, kAggregatesGroup, "H5Gopen2");
  h5::write_attr_u8(c, g, "complete", complete ? 1 : 0);  // replaces: a kill in between leaves none
}

AggregateState state(const h5::Ctx& c, hid_t file) {
  if (!h5::exists(c, file, kAggregatesGroup)) return AggregateState::kAbsent;
  Handle g =
      c.check_id(H5Gopen2(file, kAggregatesGroup, H5P_DEFAULT), H5Gclose, kAggregatesGroup, "H5Gopen2");
  if (!h5::attr_exists(g, "complete")) return AggregateState::kIncomplete;
  return h5::read_attr_bool(c, g, kAggregatesGroup, "complete") ? AggregateState::kPresent
                                                                : AggregateState::kIncomplete;
}

AggregateDefinition read_definition(const h5::Ctx& c, hid_t file) {
  const std::string gp = kAggregatesGroup;
  Handle g = c.check_id(H5Gopen2(file, kAggregatesGroup, H5P_DEFAULT), H5Gclose, gp, "H5Gopen2");
  auto need = [&](const char* name) {
    if (!h5::attr_exists(g, name)) c.fail(ErrorKind::kMissing, gp + "@" + name, "attribute is missing");
  };
  auto int_attr = [&](const char* name) {
    need(name);
    const std::int64_t v = h5::read_attr_i64(c, g, gp, name);
    if (v < 0 || v > (1ll << 30))
      c.fail(ErrorKind::kValue, gp + "@" + name, "value " + std::to_string(v) + " out of range");
    return static_cast<int>(v);
  };
  auto str_attr = [&](const char* name) {
    need(name);
    return h5::read_attr_string(c, g, gp, name);
  };
  AggregateDefinition d;
  d.definition = str_attr("definition");
  d.num_layers = int_attr("num_layers");
  d.num_tokens = int_attr("num_tokens");
  d.num_q_heads = int_attr("num_q_heads");
  d.num_kv_heads = int_attr("num_kv_heads");
  d.gqa_group = int_attr("gqa_group");
  need("softmax_scale");
  d.softmax_scale = h5::read_attr_f64(c, g, gp, "softmax_scale");
  need("causal");
  d.causal = h5::read_attr_bool(c, g, gp, "causal");
  d.window = int_attr("window");
  d.seq_radius = int_attr("seq_radius");
  d.grid_radius = int_attr("grid_radius");
  d.input_dtype = str_attr("input_dtype");
  d.accumulate_dtype = str_attr("accumulate_dtype");
  if (h5::attr_exists(g, "creator")) d.creator = h5::read_attr_string(c, g, gp, "creator");
  return d;
}

LayerAttentionAggregates read_layer(const h5::Ctx& c, hid_t file, int layer, const AggregateDefinition& d) {
  const std::string g = aggregate_layer_group_name(layer);
  LayerAttentionAggregates a;
  const hsize_t T = static_cast<hsize_t>(d.num_tokens);
  for (const Field& f : kFields) {
    const std::string path = g + "/" + f.name;
    const hsize_t rows = static_cast<hsize_t>(f.kv_rows ? d.num_kv_heads : d.num_q_heads);
    const std::vector<hsize_t> shape = h5::dataset_shape(c, file, path);
    if (shape != std::vector<hsize_t>{rows, T}) {
      std::string s = "[";
      for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
      c.fail(ErrorKind::kShape, path,
             "shape " + s + "], expected [" + std::to_string(rows) + ", " + std::to_string(T) + "]");
    }
    std::vector<float>& v = a.*f.member;
    v = h5::read_f32(c, file, path, {rows, T});
    double lo = 0, hi = 0;
    value_range(f, d, lo, hi);
    // float32 sums of probabilities may exceed their bound by rounding.
    const double slack = 1e-3 * std::max(1.0, hi);
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (!std::isfinite(v[i]) || v[i] < lo - slack || v[i] > hi + slack) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "value %g at element %zu (must be finite and in [%g, %g])",
                      static_cast<double>(v[i]), i, lo, hi);
        c.fail(ErrorKind::kValue, path, buf);
      }
    }
  }
  return a;
}

}  // namespace aggregates_io

struct AggregateWriter::Impl {
  h5::Ctx ctx, staging_ctx;
  std::string trace_path, staging;
  AggregateDefinition def;
  Handle file;  // the staging file
  std::vector<bool> written;
  bool committed = false;
};

AggregateWriter::AggregateWriter(const std::string& trace_path, const AggregateDefinition& definition)
    : impl_(std::make_unique<Impl>()) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.trace_path = trace_path;
  m.staging = trace_path + ".aggregates.partial";
  m.ctx.file = trace_path;
  m.staging_ctx.file = m.staging;
  m.def = definition;
  if (m.def.num_layers <= 0) m.ctx.fail(ErrorKind::kUsage, kAggregatesGroup, "definition has no layers");
  m.file = m.staging_ctx.check_id(H5Fcreate(m.staging.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                                  H5Fclose, "", "H5Fcreate", ErrorKind::kIo);
  aggregates_io::create_group(m.staging_ctx, m.file, kAggregatesGroup, m.def);
  m.written.assign(static_cast<std::size_t>(m.def.num_layers), false);
}

AggregateWriter::~AggregateWriter() {
  if (!impl_) return;
  impl_->file.reset();
  std::error_code ec;
  std::filesystem::remove(impl_->staging, ec);
}

const std::string& AggregateWriter::staging_path() const { return impl_->staging; }

void AggregateWriter::write_layer(int layer, const LayerAttentionAggregates& a) {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.committed) m.ctx.fail(ErrorKind::kUsage, kAggregatesGroup, "write_layer after commit()");
  if (layer < 0 || layer >= m.def.num_layers)
    m.ctx.fail(ErrorKind::kUsage, kAggregatesGroup, "layer " + std::to_string(layer) + " out of range");
  if (m.written[static_cast<std::size_t>(layer)])
    m.ctx.fail(ErrorKind::kUsage, aggregate_layer_group_name(layer), "layer written twice");
  aggregates_io::write_layer(m.staging_ctx, m.file, layer, m.def, a);
  m.written[static_cast<std::size_t>(layer)] = true;
}

void AggregateWriter::commit() {
  h5::silence_errors();
  Impl& m = *impl_;
  for (int l = 0; l < m.def.num_layers; ++l) {
    if (!m.written[static_cast<std::size_t>(l)])
      m.ctx.fail(ErrorKind::kUsage, aggregate_layer_group_name(l),
                 "not written; the trace is left unchanged");
  }
  m.staging_ctx.check(H5Fflush(m.file, H5F_SCOPE_GLOBAL), "", "H5Fflush");
  Handle trace = m.ctx.check_id(H5Fopen(m.trace_path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose, "",
                                "H5Fopen (read-write)", ErrorKind::kIo);
  if (h5::exists(m.ctx, trace, kAggregatesGroup)) {
    aggregates_io::set_complete(m.ctx, trace, false);
    m.ctx.check(H5Fflush(trace, H5F_SCOPE_GLOBAL), "", "H5Fflush");
    m.ctx.check(H5Ldelete(trace, kAggregatesGroup, H5P_DEFAULT), kAggregatesGroup, "H5Ldelete");
  }
  m.ctx.check(H5Ocopy(m.file, kAggregatesGroup, trace, kAggregatesGroup, H5P_DEFAULT, H5P_DEFAULT),
              kAggregatesGroup, "H5Ocopy");
  // The datasets are on disk before the version and the mark say they are there.
  m.ctx.check(H5Fflush(trace, H5F_SCOPE_GLOBAL), "", "H5Fflush");
  int major = kVersionMajor, minor = 0;
  if (h5::attr_exists(trace, "version") &&
      parse_version(h5::read_attr_string(m.ctx, trace, "/", "version"), major, minor) &&
      minor < kVersionMinorAggregates) {
    h5::write_attr_string(m.ctx, trace, "version",
                          std::to_string(major) + "." + std::to_string(kVersionMinorAggregates));
  }
  m.ctx.check(H5Fflush(trace, H5F_SCOPE_GLOBAL), "", "H5Fflush");
  aggregates_io::set_complete(m.ctx, trace, true);
  m.ctx.check(H5Fflush(trace, H5F_SCOPE_GLOBAL), "", "H5Fflush");
  trace.reset();
  m.committed = true;
}

}  // namespace kvscope::trace
