#include "kvscope/trace/writer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <optional>

#include "aggregates_io.hpp"
#include "h5.hpp"
#include "kvscope/trace/aggregates.hpp"
#include "kvscope/trace/limits.hpp"

namespace kvscope::trace {

using h5::Handle;

struct TraceWriter::Impl {
  h5::Ctx ctx;
  Handle file;
  TraceHeader header;
  std::size_t T = 0, S = 0;
  WriterOptions options;
  bool tokens_written = false, decode_tokens_written = false, profile_written = false, closed = false;
  std::vector<bool> layer_written, decode_written, aggregates_written;
  std::optional<AggregateDefinition> aggregates;  // set by the first write_attention_aggregates

  Handle create_group(const std::string& path) {
    if (h5::exists(file, path)) {
      return ctx.check_id(H5Gopen2(file, path.c_str(), H5P_DEFAULT), H5Gclose, path, "H5Gopen2");
    }
    return ctx.check_id(H5Gcreate2(file, path.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, path,
                        "H5Gcreate2", ErrorKind::kIo);
  }

  // Writes a 1-D or 2-D dataset in one call.
  void write_plain(const std::string& path, hid_t ftype, hid_t mtype, const std::vector<hsize_t>& dims,
                   const void* data) {
    Handle space = ctx.check_id(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose,
                                path, "H5Screate_simple");
    Handle d = ctx.check_id(H5Dcreate2(file, path.c_str(), ftype, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                            H5Dclose, path, "H5Dcreate2", ErrorKind::kIo);
    bool empty = false;
    for (auto x : dims) empty |= (x == 0);
    if (!empty) ctx.check(H5Dwrite(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), path, "H5Dwrite");
  }

  // Writes a [heads, tokens, D] tensor chunked as [1, chunk_tokens, D].
  void write_tensor(const std::string& path, const TensorView& t, std::size_t heads, std::size_t tokens) {
    const std::size_t D = static_cast<std::size_t>(header.geometry.head_dim);
    if (t.dtype != header.dtype) {
      ctx.fail(ErrorKind::kDType, path,
               std::string("tensor dtype ") + kernels::dtype_name(t.dtype) + " differs from the trace dtype " +
                   kernels::dtype_name(header.dtype));
    }
    if (t.shape[0] != heads || t.shape[1] != tokens || t.shape[2] != D) {
      ctx.fail(ErrorKind::kShape, path,
               "shape [" + std::to_string(t.shape[0]) + ", " + std::to_string(t.shape[1]) + ", " +
                   std::to_string(t.shape[2]) + "], expected [" + std::to_string(heads) + ", " +
                   std::to_string(tokens) + ", " + std::to_string(D) + "]");
    }
    if (!t.data && heads * tokens * D > 0) ctx.fail(ErrorKind::kUsage, path, "null tensor data");
    const hsize_t dims[3] = {heads, tokens, D};
    Handle space = ctx.check_id(H5Screate_simple(3, dims, nullptr), H5Sclose, path, "H5Screate_simple");
    Handle dcpl = ctx.check_id(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, path, "H5Pcreate");
    if (heads * tokens * D > 0) {
      const hsize_t chunk[3] = {1, std::max<hsize_t>(1, std::min<hsize_t>(tokens, options.chunk_tokens)), D};
      ctx.check(H5Pset_chunk(dcpl, 3, chunk), path, "H5Pset_chunk");
      if (options.deflate_level > 0) {
        ctx.check(H5Pset_shuffle(dcpl), path, "H5Pset_shuffle");
        ctx.check(H5Pset_deflate(dcpl, static_cast<unsigned>(options.deflate_level)), path, "H5Pset_deflate");
      }
    }
    Handle d = ctx.check_id(H5Dcreate2(file, path.c_str(), h5::file_type_of(t.dtype), space, H5P_DEFAULT, dcpl,
                                       H5P_DEFAULT),
                            H5Dclose, path, "H5Dcreate2", ErrorKind::kIo);
    if (t.dtype == DType::kBF16) h5::write_attr_string(ctx, d, "dtype", "bfloat16");
    if (heads * tokens * D > 0) {
      ctx.check(H5Dwrite(d, h5::memory_type_of(t.dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data), path,
                "H5Dwrite");
    }
  }

  // Role codes must be Role values (0..3).
  void check_roles(const std::string& path, const std::vector<std::uint8_t>& role) {
    for (std::size_t i = 0; i < role.size(); ++i) {
      if (role[i] >= kNumRoles) {
        ctx.fail(ErrorKind::kValue, path,
                 "bad role code " + std::to_string(role[i]) + " at index " + std::to_string(i) +
                     " (allowed: 0 context, 1 question, 2 answer, 3 template)");
      }
    }
  }
  // Roles are 1.1 content: the file says so (a 1.0 reader ignores the datasets, as minor versions allow).
  void mark_roles() {
    if (header.version_major == kVersionMajor && header.version_minor < kVersionMinorRoles) {
      header.version_minor = kVersionMinorRoles;
      h5::write_attr_string(
          ctx, file, "version",
          std::to_string(header.version_major) + "." + std::to_string(header.version_minor));
    }
  }

  void check_layer(int layer, const char* what) {
    if (closed) ctx.fail(ErrorKind::kUsage, "", std::string(what) + " after close()");
    if (layer < 0 || layer >= header.geometry.num_layers) {
      ctx.fail(ErrorKind::kUsage, "", std::string(what) + ": layer " + std::to_string(layer) + " out of range [0, " +
                                          std::to_string(header.geometry.num_layers) + ")");
    }
  }
};

namespace {
std::string utc_now() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}
}  // namespace

TraceWriter::TraceWriter(const std::string& path, const TraceHeader& header, std::size_t context_tokens,
                         std::size_t num_decode_steps, WriterOptions options)
    : impl_(std::make_unique<Impl>()) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.ctx.file = path;
  m.header = header;
  m.T = context_tokens;
  m.S = num_decode_steps;
  m.options = options;
  const ModelGeometry& g = header.geometry;
  if (g.num_layers <= 0 || g.num_q_heads <= 0 || g.num_kv_heads <= 0 || g.head_dim <= 0) {
    m.ctx.fail(ErrorKind::kUsage, "", "model geometry must have positive num_layers, heads and head_dim");
  }
  if (g.num_q_heads % g.num_kv_heads != 0) {
    m.ctx.fail(ErrorKind::kUsage, "", "num_q_heads must be a multiple of num_kv_heads");
  }
  // What the reader would refuse is refused before the file is created (limits.hpp).
  if (g.num_layers > limits::kMaxLayers || g.num_q_heads > limits::kMaxHeads ||
      g.head_dim > limits::kMaxHeadDim || context_tokens > limits::kMaxTokens ||
      num_decode_steps > limits::kMaxDecodeSteps) {
    m.ctx.fail(ErrorKind::kUsage, "",
               "geometry over the trace format's limits (layers <= 1024, heads <= 1024, head_dim <= 4096, "
               "tokens <= 16777216, decode steps <= 1048576)");
  }
  if (!(std::isfinite(g.rope_theta) && g.rope_theta > 0)) {
    m.ctx.fail(ErrorKind::kUsage, "", "rope_theta must be a finite number > 0");
  }
  if (options.chunk_tokens <= 0 || options.deflate_level < 0 || options.deflate_level > 9) {
    m.ctx.fail(ErrorKind::kUsage, "", "chunk_tokens must be > 0 and deflate_level in 0..9");
  }
  m.file = m.ctx.check_id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose, "",
                          "cannot create file: H5Fcreate", ErrorKind::kIo);
  m.layer_written.assign(static_cast<std::size_t>(g.num_layers), false);
  m.decode_written.assign(static_cast<std::size_t>(g.num_layers), false);

  hid_t root = m.file;
  h5::write_attr_string(m.ctx, root, "format", kFormatName);
  h5::write_attr_string(m.ctx, root, "version",
                        std::to_string(header.version_major) + "." + std::to_string(header.version_minor));
  h5::write_attr_u8(m.ctx, root, "synthetic", header.synthetic ? 1 : 0);
  h5::write_attr_u8(m.ctx, root, "complete", 0);
  h5::write_attr_string(m.ctx, root, "creator", header.creator.empty() ? "kvscope" : header.creator);
  h5::write_attr_string(m.ctx, root, "created", header.created.empty() ? utc_now() : header.created);
  h5::write_attr_string(m.ctx, root, "model_name", g.model_name);
  h5::write_attr_string(m.ctx, root, "device", header.device);
  h5::write_attr_string(m.ctx, root, "dtype", kernels::dtype_name(header.dtype));
  h5::write_attr_i64(m.ctx, root, "num_layers", g.num_layers);
  h5::write_attr_i64(m.ctx, root, "num_q_heads", g.num_q_heads);
  h5::write_attr_i64(m.ctx, root, "num_kv_heads", g.num_kv_heads);
  h5::write_attr_i64(m.ctx, root, "head_dim", g.head_dim);
  h5::write_attr_f64(m.ctx, root, "rope_theta", g.rope_theta);
  m.create_group("/tokens");
  m.create_group("/layers");
  m.create_group("/decode");
  m.create_group("/decode/layers");
  m.create_group("/profile");
  H5Fflush(m.file, H5F_SCOPE_GLOBAL);
}

TraceWriter::~TraceWriter() = default;

const std::string& TraceWriter::path() const { return impl_->ctx.file; }

// Every method silences HDF5 on its calling thread (HDF5 prints errors per thread, and a capture
// session writes on a thread of its own, not the one that made the writer).
void TraceWriter::write_tokens(const Tokens& t) {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) m.ctx.fail(ErrorKind::kUsage, "/tokens", "write after close()");
  if (m.tokens_written) m.ctx.fail(ErrorKind::kUsage, "/tokens", "written twice");
  const std::size_t T = m.T;
  auto need = [&](std::size_t n, const char* name) {
    if (n != T) {
      m.ctx.fail(ErrorKind::kShape, std::string("/tokens/") + name,
                 "length " + std::to_string(n) + ", expected " + std::to_string(T));
    }
  };
  need(t.modality.size(), "modality");
  need(t.position.size(), "position");
  need(t.token_id.size(), "token_id");
  need(t.segment.size(), "segment");
  need(t.grid_row.size(), "grid");
  need(t.grid_col.size(), "grid");
  if (!t.text.empty()) need(t.text.size(), "text");
  if (!t.role.empty()) {
    need(t.role.size(), "role");
    m.check_roles("/tokens/role", t.role);
  }
  for (std::size_t i = 0; i < T; ++i) {
    if (t.modality[i] >= kernels::kNumModalities) {
      m.ctx.fail(ErrorKind::kValue, "/tokens/modality",
                 "bad modality code " + std::to_string(t.modality[i]) + " at token " + std::to_string(i));
    }
  }
  const hsize_t n = T;
  m.write_plain("/tokens/modality", H5T_STD_U8LE, H5T_NATIVE_UINT8, {n}, t.modality.data());
  m.write_plain("/tokens/position", H5T_STD_I32LE, H5T_NATIVE_INT32, {n}, t.position.data());
  m.write_plain("/tokens/token_id", H5T_STD_I32LE, H5T_NATIVE_INT32, {n}, t.token_id.data());
  m.write_plain("/tokens/segment", H5T_STD_I32LE, H5T_NATIVE_INT32, {n}, t.segment.data());
  std::vector<std::int32_t> grid(2 * T);
  for (std::size_t i = 0; i < T; ++i) {
    grid[2 * i] = t.grid_row[i];
    grid[2 * i + 1] = t.grid_col[i];
  }
  m.write_plain("/tokens/grid", H5T_STD_I32LE, H5T_NATIVE_INT32, {n, 2}, grid.data());
  if (!t.text.empty()) {
    Handle st = m.ctx.check_id(H5Tcopy(H5T_C_S1), H5Tclose, "/tokens/text", "H5Tcopy");
    H5Tset_size(st, H5T_VARIABLE);
    H5Tset_cset(st, H5T_CSET_UTF8);
    std::vector<const char*> ptrs(T);
    for (std::size_t i = 0; i < T; ++i) ptrs[i] = t.text[i].c_str();
    m.write_plain("/tokens/text", st, st, {n}, ptrs.data());
  }
  if (!t.role.empty()) {
    m.write_plain("/tokens/role", H5T_STD_U8LE, H5T_NATIVE_UINT8, {n}, t.role.data());
    m.mark_roles();
  }
  m.tokens_written = true;
}

void TraceWriter::write_token_roles(const std::vector<std::uint8_t>& role) {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) m.ctx.fail(ErrorKind::kUsage, "/tokens/role", "write after close()");
  if (h5::exists(m.file, "/tokens/role")) m.ctx.fail(ErrorKind::kUsage, "/tokens/role", "written twice");
  if (role.size() != m.T) {
    m.ctx.fail(ErrorKind::kShape, "/tokens/role",
               "length " + std::to_string(role.size()) + ", expected " + std::to_string(m.T));
  }
  m.check_roles("/tokens/role", role);
  m.write_plain("/tokens/role", H5T_STD_U8LE, H5T_NATIVE_UINT8, {static_cast<hsize_t>(m.T)}, role.data());
  m.mark_roles();
}

void TraceWriter::write_layer(int layer, const TensorView& q, const TensorView& k, const TensorView& v) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.check_layer(layer, "write_layer");
  const auto li = static_cast<std::size_t>(layer);
  const std::string g = layer_group_name(layer);
  if (m.layer_written[li]) m.ctx.fail(ErrorKind::kUsage, g, "layer written twice");
  m.create_group(g);
  const ModelGeometry& geo = m.header.geometry;
  m.write_tensor(g + "/q", q, static_cast<std::size_t>(geo.num_q_heads), m.T);
  m.write_tensor(g + "/k", k, static_cast<std::size_t>(geo.num_kv_heads), m.T);
  m.write_tensor(g + "/v", v, static_cast<std::size_t>(geo.num_kv_heads), m.T);
  m.layer_written[li] = true;
}

void TraceWriter::write_layer_aggregates(int layer, const LayerAggregates& a) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.check_layer(layer, "write_layer_aggregates");
  const std::string g = layer_group_name(layer);
  m.create_group(g);
  const hsize_t Hq = static_cast<hsize_t>(m.header.geometry.num_q_heads), T = m.T;
  if (!a.attn_colsum.empty()) {
    if (a.attn_colsum.size() != Hq * T) m.ctx.fail(ErrorKind::kShape, g + "/attn_colsum", "expected [Hq, T] values");
    m.write_plain(g + "/attn_colsum", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {Hq, T}, a.attn_colsum.data());
  }
  if (!a.attn_window.empty()) {
    const hsize_t W = static_cast<hsize_t>(a.window);
    if (W == 0 || a.attn_window.size() != Hq * W * T) {
      m.ctx.fail(ErrorKind::kShape, g + "/attn_window", "expected [Hq, W, T] values with W = window > 0");
    }
    m.write_plain(g + "/attn_window", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {Hq, W, T}, a.attn_window.data());
  }
}

void TraceWriter::write_attention_aggregates(int layer, const AggregateDefinition& def,
                                             const LayerAttentionAggregates& a) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.check_layer(layer, "write_attention_aggregates");
  const std::string g = aggregate_layer_group_name(layer);
  if (!m.aggregates) {
    const std::string problem = aggregate_definition_problem(def, m.header.geometry, m.header.dtype, m.T);
    if (!problem.empty()) m.ctx.fail(ErrorKind::kUsage, kAggregatesGroup, problem);
    aggregates_io::create_group(m.ctx, m.file, kAggregatesGroup, def);
    m.aggregates = def;
    m.aggregates_written.assign(m.layer_written.size(), false);
    if (m.header.version_major == kVersionMajor && m.header.version_minor < kVersionMinorAggregates) {
      m.header.version_minor = kVersionMinorAggregates;
      h5::write_attr_string(
          m.ctx, m.file, "version",
          std::to_string(m.header.version_major) + "." + std::to_string(m.header.version_minor));
    }
  } else if (def.window != m.aggregates->window || def.seq_radius != m.aggregates->seq_radius ||
             def.grid_radius != m.aggregates->grid_radius || def.definition != m.aggregates->definition) {
    m.ctx.fail(ErrorKind::kUsage, g, "another definition than the first layer's aggregates");
  }
  if (m.aggregates_written[static_cast<std::size_t>(layer)])
    m.ctx.fail(ErrorKind::kUsage, g, "written twice");
  aggregates_io::write_layer(m.ctx, m.file, layer, *m.aggregates, a);
  m.aggregates_written[static_cast<std::size_t>(layer)] = true;
}

void TraceWriter::write_decode_layer(int layer, const TensorView& q, const TensorView& k, const TensorView& v) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.check_layer(layer, "write_decode_layer");
  const auto li = static_cast<std::size_t>(layer);
  const std::string g = decode_layer_group_name(layer);
  if (m.decode_written[li]) m.ctx.fail(ErrorKind::kUsage, g, "decode layer written twice");
  m.create_group(g);
  const ModelGeometry& geo = m.header.geometry;
  m.write_tensor(g + "/q", q, static_cast<std::size_t>(geo.num_q_heads), m.S);
  m.write_tensor(g + "/k", k, static_cast<std::size_t>(geo.num_kv_heads), m.S);
  m.write_tensor(g + "/v", v, static_cast<std::size_t>(geo.num_kv_heads), m.S);
  m.decode_written[li] = true;
}

void TraceWriter::write_decode_tokens(const std::vector<std::int32_t>& token_id,
                                      const std::vector<std::int32_t>& position,
                                      const std::vector<std::string>& text,
                                      const std::vector<std::uint8_t>& role) {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) m.ctx.fail(ErrorKind::kUsage, "/decode/tokens", "write after close()");
  if (m.decode_tokens_written) m.ctx.fail(ErrorKind::kUsage, "/decode/tokens", "written twice");
  if (token_id.size() != m.S || position.size() != m.S || (!text.empty() && text.size() != m.S) ||
      (!role.empty() && role.size() != m.S)) {
    m.ctx.fail(ErrorKind::kShape, "/decode/tokens", "expected " + std::to_string(m.S) + " entries");
  }
  if (!role.empty()) m.check_roles("/decode/tokens/role", role);
  m.create_group("/decode/tokens");
  const hsize_t S = m.S;
  m.write_plain("/decode/tokens/token_id", H5T_STD_I32LE, H5T_NATIVE_INT32, {S}, token_id.data());
  m.write_plain("/decode/tokens/position", H5T_STD_I32LE, H5T_NATIVE_INT32, {S}, position.data());
  if (!text.empty()) {
    Handle st = m.ctx.check_id(H5Tcopy(H5T_C_S1), H5Tclose, "/decode/tokens/text", "H5Tcopy");
    H5Tset_size(st, H5T_VARIABLE);
    H5Tset_cset(st, H5T_CSET_UTF8);
    std::vector<const char*> ptrs(m.S);
    for (std::size_t i = 0; i < m.S; ++i) ptrs[i] = text[i].c_str();
    m.write_plain("/decode/tokens/text", st, st, {S}, ptrs.data());
  }
  if (!role.empty()) {
    m.write_plain("/decode/tokens/role", H5T_STD_U8LE, H5T_NATIVE_UINT8, {S}, role.data());
    m.mark_roles();
  }
  m.decode_tokens_written = true;
}

void TraceWriter::write_profile(const Profile& p) {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) m.ctx.fail(ErrorKind::kUsage, "/profile", "write after close()");
  if (m.profile_written) m.ctx.fail(ErrorKind::kUsage, "/profile", "written twice");
  const h5::Ctx& c = m.ctx;
  Handle kt = h5::kernel_row_type(c);
  std::vector<h5::KernelRow> krows(p.kernels.size());
  for (std::size_t i = 0; i < p.kernels.size(); ++i) {
    const KernelRecord& r = p.kernels[i];
    krows[i] = h5::KernelRow{const_cast<char*>(r.name.c_str()), const_cast<char*>(r.kind.c_str()), r.start_ns, r.end_ns, r.stream, r.bytes, r.device,
                         {r.grid[0], r.grid[1], r.grid[2]}, {r.block[0], r.block[1], r.block[2]}};
  }
  m.write_plain("/profile/kernels", kt, kt, {krows.size()}, krows.data());

  Handle rt = h5::range_row_type(c);
  std::vector<h5::RangeRow> rrows(p.ranges.size());
  for (std::size_t i = 0; i < p.ranges.size(); ++i) {
    const RangeRecord& r = p.ranges[i];
    rrows[i] = h5::RangeRow{const_cast<char*>(r.name.c_str()), r.start_ns, r.end_ns, r.thread, r.depth};
  }
  m.write_plain("/profile/ranges", rt, rt, {rrows.size()}, rrows.data());
  m.profile_written = true;
}

void TraceWriter::set_num_decode_steps(std::size_t num_decode_steps) {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) m.ctx.fail(ErrorKind::kUsage, "/decode", "set_num_decode_steps after close()");
  const bool any_decode_layer =
      std::find(m.decode_written.begin(), m.decode_written.end(), true) != m.decode_written.end();
  const bool any_decode = m.decode_tokens_written || any_decode_layer;
  if (any_decode && num_decode_steps != m.S) {
    m.ctx.fail(ErrorKind::kUsage, "/decode", "set_num_decode_steps after /decode data was written");
  }
  m.S = num_decode_steps;
}

std::size_t TraceWriter::num_decode_steps() const { return impl_->S; }

void TraceWriter::flush() {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) return;
  m.ctx.check(H5Fflush(m.file, H5F_SCOPE_GLOBAL), "", "H5Fflush");
}

void TraceWriter::close() {
  h5::silence_errors();
  Impl& m = *impl_;
  if (m.closed) return;
  auto missing = [&](const std::string& what) {
    m.ctx.fail(ErrorKind::kUsage, "", "close(): " + what + " not written; trace left incomplete");
  };
  if (!m.tokens_written) missing("/tokens");
  for (std::size_t l = 0; l < m.layer_written.size(); ++l) {
    if (!m.layer_written[l]) missing(layer_group_name(static_cast<int>(l)));
    if (!m.decode_written[l]) missing(decode_layer_group_name(static_cast<int>(l)));
  }
  if (!m.decode_tokens_written) missing("/decode/tokens");
  if (!m.profile_written) write_profile(Profile{});
  if (m.aggregates &&
      std::all_of(m.aggregates_written.begin(), m.aggregates_written.end(), [](bool b) { return b; })) {
    m.ctx.check(H5Fflush(m.file, H5F_SCOPE_GLOBAL), "", "H5Fflush");
    aggregates_io::set_complete(m.ctx, m.file, true);
  }
  h5::write_attr_u8(m.ctx, m.file, "complete", 1);
  m.ctx.check(H5Fflush(m.file, H5F_SCOPE_GLOBAL), "", "H5Fflush");
  m.file.reset();
  m.closed = true;
}

}  // namespace kvscope::trace
