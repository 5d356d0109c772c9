#include "kvscope/trace/reader.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "aggregates_io.hpp"
#include "h5.hpp"
#include "kvscope/trace/limits.hpp"

namespace kvscope::trace {

using h5::Handle;

const char* tensor_kind_name(TensorKind k) {
  return k == TensorKind::kQ ? "q" : k == TensorKind::kK ? "k" : "v";
}

struct TraceReader::Impl {
  h5::Ctx ctx;
  Handle file;
  ReaderOptions options;
  TraceHeader header;
  std::size_t T = 0, S = 0;
  Tokens tokens;
  DecodeTokens decode;
  int layers_present = 0, decode_layers_present = 0;
  bool has_roles = false;

  // An optional role dataset of length n: any integer type, every value a Role code (0..3).
  std::vector<std::uint8_t> read_roles(const std::string& path, std::size_t n, std::uint8_t fallback) {
    if (!exists(path)) return std::vector<std::uint8_t>(n, fallback);
    has_roles = true;
    const std::vector<hsize_t> shape = h5::dataset_shape(ctx, file, path);
    if (shape.size() != 1 || shape[0] != n) {
      ctx.fail(ErrorKind::kShape, path,
               "shape " + shape_text(shape) + ", expected [" + std::to_string(n) + "] (one role per token)");
    }
    const std::vector<std::int64_t> v = h5::read_i64(ctx, file, path, {n});
    std::vector<std::uint8_t> out(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (v[i] < 0 || v[i] >= kNumRoles) {
        ctx.fail(ErrorKind::kValue, path,
                 "bad role code " + std::to_string(v[i]) + " at index " + std::to_string(i) +
                     " (allowed: 0 context, 1 question, 2 answer, 3 template)");
      }
      out[i] = static_cast<std::uint8_t>(v[i]);
    }
    return out;
  }

  std::vector<std::string> read_strings(const std::string& path, hsize_t n) {
    return h5::read_strings(ctx, file, path, n);
  }

  std::vector<hsize_t> dataset_shape_checked(const std::string& path) {
    return h5::dataset_shape(ctx, file, path);
  }

  static std::string shape_text(const std::vector<hsize_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }

  void expect_tensor(const std::string& path, hsize_t heads, hsize_t tokens) {
    const std::vector<hsize_t> want{heads, tokens, static_cast<hsize_t>(header.geometry.head_dim)};
    const std::vector<hsize_t> got = h5::dataset_shape(ctx, file, path);
    if (got != want) {
      auto str = [](const std::vector<hsize_t>& v) {
        std::string s = "[";
        for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
        return s + "]";
      };
      ctx.fail(ErrorKind::kShape, path,
               "shape " + str(got) + ", expected " + str(want) + " [heads, tokens, head_dim]");
    }
    const DType dt = h5::tensor_dtype(ctx, file, path);
    if (dt != header.dtype) {
      ctx.fail(ErrorKind::kDType, path,
               std::string("dtype ") + kernels::dtype_name(dt) + " differs from the trace's " +
                   kernels::dtype_name(header.dtype) + " (first tensor /layers/000/k)");
    }
  }

  void read_header() {
    hid_t root = file;
    const std::string fmt = h5::read_attr_string(ctx, root, "/", "format");
    if (fmt != kFormatName)
      ctx.fail(ErrorKind::kFormat, "/@format", "is '" + fmt + "', not '" + kFormatName + "'");
    const std::string ver = h5::read_attr_string(ctx, root, "/", "version");
    int major = -1, minor = -1;
    if (!parse_version(ver, major, minor)) {
      ctx.fail(ErrorKind::kVersion, "/@version", "'" + ver + "' is not MAJOR.MINOR (digits only, e.g. 1.0)");
    }
    if (major != kVersionMajor) {
      ctx.fail(ErrorKind::kVersion, "/@version",
               "unsupported trace version " + ver + " (this reader supports " +
                   std::to_string(kVersionMajor) + ".x)");
    }
    header.version_major = major;
    header.version_minor = minor;
    header.synthetic = h5::read_attr_bool(ctx, root, "/", "synthetic");
    header.complete = !h5::attr_exists(root, "complete") || h5::read_attr_bool(ctx, root, "/", "complete");
    auto opt_string = [&](const char* name) {
      return h5::attr_exists(root, name) ? h5::read_attr_string(ctx, root, "/", name) : std::string();
    };
    header.creator = opt_string("creator");
    header.created = opt_string("created");
    header.device = opt_string("device");
    ModelGeometry& g = header.geometry;
    g.model_name = opt_string("model_name");
    auto positive = [&](const char* name, std::int64_t max) {
      const std::int64_t v = h5::read_attr_i64(ctx, root, "/", name);
      if (v <= 0)
        ctx.fail(ErrorKind::kValue, std::string("/@") + name,
                 "must be a positive count, got " + std::to_string(v));
      if (v > max) {
        ctx.fail(ErrorKind::kValue, std::string("/@") + name,
                 std::to_string(v) + " is more than the limit of " + std::to_string(max) +
                     " (docs/trace-format.md)");
      }
      return static_cast<int>(v);
    };
    g.num_layers = positive("num_layers", limits::kMaxLayers);
    g.num_q_heads = positive("num_q_heads", limits::kMaxHeads);
    g.num_kv_heads = positive("num_kv_heads", limits::kMaxHeads);
    g.head_dim = positive("head_dim", limits::kMaxHeadDim);
    g.rope_theta = h5::read_attr_f64(ctx, root, "/", "rope_theta");
    if (!std::isfinite(g.rope_theta) || !(g.rope_theta > 0)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%g", g.rope_theta);
      ctx.fail(ErrorKind::kValue, "/@rope_theta", std::string("must be a finite number > 0, got ") + buf);
    }
    if (g.num_q_heads % g.num_kv_heads != 0) {
      ctx.fail(ErrorKind::kValue, "/@num_kv_heads",
               "num_q_heads " + std::to_string(g.num_q_heads) + " is not a multiple of num_kv_heads " +
                   std::to_string(g.num_kv_heads));
    }
  }

  void read_tokens() {
    const std::vector<hsize_t> ms = h5::dataset_shape(ctx, file, "/tokens/modality");
    if (ms.size() != 1) ctx.fail(ErrorKind::kShape, "/tokens/modality", "must be 1-D [T]");
    T = ms[0];
    if (T == 0)
      ctx.fail(ErrorKind::kValue, "/tokens/modality", "T = 0: a trace needs at least one context token");
    if (T > limits::kMaxTokens) {
      ctx.fail(ErrorKind::kValue, "/tokens/modality",
               "T = " + std::to_string(T) + " tokens, more than the limit of " +
                   std::to_string(limits::kMaxTokens));
    }
    // The layers' token axis must agree before /tokens is read whole.
    if (exists(layer_group_name(0) + "/k")) {
      const auto ks = h5::dataset_shape(ctx, file, layer_group_name(0) + "/k");
      if (ks.size() == 3 && ks[1] != T) {
        ctx.fail(
            ErrorKind::kShape, layer_group_name(0) + "/k",
            "has " + std::to_string(ks[1]) + " tokens but /tokens/modality has T = " + std::to_string(T));
      }
    }
    const std::vector<std::int64_t> modality = h5::read_i64(ctx, file, "/tokens/modality", {T});
    tokens.modality.resize(T);
    for (std::size_t i = 0; i < T; ++i) {
      if (modality[i] < 0 || modality[i] >= kernels::kNumModalities) {
        ctx.fail(ErrorKind::kValue, "/tokens/modality",
                 "bad modality code " + std::to_string(modality[i]) + " at token " + std::to_string(i) +
                     " (allowed: 0 text, 1 vision, 2 audio, 3 special)");
      }
      tokens.modality[i] = static_cast<std::uint8_t>(modality[i]);
    }
    tokens.position = h5::read_i32(ctx, file, "/tokens/position", {T});
    tokens.token_id = h5::read_i32(ctx, file, "/tokens/token_id", {T});
    tokens.segment = h5::read_i32(ctx, file, "/tokens/segment", {T});
    const std::vector<std::int32_t> grid = h5::read_i32(ctx, file, "/tokens/grid", {T, 2});
    tokens.grid_row.resize(T);
    tokens.grid_col.resize(T);
    for (std::size_t i = 0; i < T; ++i) {
      tokens.grid_row[i] = grid[2 * i];
      tokens.grid_col[i] = grid[2 * i + 1];
    }
    check_grid();
    if (exists("/tokens/text")) tokens.text = read_strings("/tokens/text", T);
    tokens.role = read_roles("/tokens/role", T, static_cast<std::uint8_t>(Role::kContext));
  }

  // Vision tokens have a cell (row, col >= 0), every other token (-1, -1); the vision tokens of one
  // segment (one image) are one contiguous run whose cells are distinct and include (0, 0).
  void check_grid() {
    const std::string obj = "/tokens/grid";
    auto cell = [&](std::size_t i) {
      return "(" + std::to_string(tokens.grid_row[i]) + ", " + std::to_string(tokens.grid_col[i]) + ")";
    };
    auto key = [&](std::size_t i) {
      return static_cast<std::uint64_t>(static_cast<std::uint32_t>(tokens.grid_row[i])) << 32 |
             static_cast<std::uint32_t>(tokens.grid_col[i]);
    };
    std::set<std::int32_t> done_segments;
    std::vector<std::uint64_t> cells;  // of the current run; sorted at its end (8 bytes per token)
    std::size_t run_start = 0;
    bool in_run = false;
    auto end_run = [&](std::size_t end) {
      if (!in_run) return;
      in_run = false;
      std::sort(cells.begin(), cells.end());
      const auto dup = std::adjacent_find(cells.begin(), cells.end());
      if (dup != cells.end()) {
        std::size_t second = run_start, seen = 0;
        for (std::size_t i = run_start; i < end; ++i) {
          if (key(i) == *dup && ++seen == 2) second = i;
        }
        ctx.fail(ErrorKind::kValue, obj,
                 "duplicate grid cell " + cell(second) + " at token " + std::to_string(second) +
                     " in the image of segment " + std::to_string(tokens.segment[run_start]));
      }
      if (cells.front() != 0) {  // (0, 0) sorts first
        ctx.fail(ErrorKind::kValue, obj,
                 "image of segment " + std::to_string(tokens.segment[run_start]) + " (tokens " +
                     std::to_string(run_start) + ".." + std::to_string(end - 1) +
                     ") has no cell (0, 0): one image split over two segments?");
      }
    };
    for (std::size_t i = 0; i < T; ++i) {
      const bool vision = tokens.modality[i] == static_cast<std::uint8_t>(kernels::Modality::kVision);
      if (!vision) {
        end_run(i);
        if (tokens.grid_row[i] != -1 || tokens.grid_col[i] != -1) {
          ctx.fail(ErrorKind::kValue, obj,
                   "token " + std::to_string(i) + " is not a vision token but has grid cell " + cell(i) +
                       " (non-vision tokens have (-1, -1))");
        }
        continue;
      }
      if (tokens.grid_row[i] < 0 || tokens.grid_col[i] < 0) {
        ctx.fail(ErrorKind::kValue, obj,
                 "vision token " + std::to_string(i) + " has grid cell " + cell(i) +
                     " (row and col must be >= 0)");
      }
      if (in_run && tokens.segment[i] != tokens.segment[run_start]) end_run(i);
      if (!in_run) {
        if (!done_segments.insert(tokens.segment[i]).second) {
          ctx.fail(ErrorKind::kValue, "/tokens/segment",
                   "vision tokens of segment " + std::to_string(tokens.segment[i]) +
                       " are not one contiguous run (again at token " + std::to_string(i) +
                       "): one image must be one run of tokens");
        }
        in_run = true;
        run_start = i;
        cells.clear();
      }
      cells.push_back(key(i));
    }
    end_run(T);
  }

  bool exists(const std::string& path) const { return h5::exists(ctx, file, path); }

  void read_decode_tokens() {
    const std::vector<hsize_t> s = h5::dataset_shape(ctx, file, "/decode/tokens/token_id");
    if (s.size() != 1) ctx.fail(ErrorKind::kShape, "/decode/tokens/token_id", "must be 1-D [S]");
    S = s[0];
    if (S > limits::kMaxDecodeSteps) {
      ctx.fail(ErrorKind::kValue, "/decode/tokens/token_id",
               "S = " + std::to_string(S) + " decode steps, more than the limit of " +
                   std::to_string(limits::kMaxDecodeSteps));
    }
    decode.token_id = h5::read_i32(ctx, file, "/decode/tokens/token_id", {S});
    decode.position = h5::read_i32(ctx, file, "/decode/tokens/position", {S});
    if (exists("/decode/tokens/text")) decode.text = read_strings("/decode/tokens/text", S);
    decode.role = read_roles("/decode/tokens/role", S, static_cast<std::uint8_t>(Role::kAnswer));
  }

  void check_layers() {
    const ModelGeometry& g = header.geometry;
    const auto Hq = static_cast<hsize_t>(g.num_q_heads), Hkv = static_cast<hsize_t>(g.num_kv_heads);
    layers_present = decode_layers_present = 0;
    if (!header.complete && !exists(layer_group_name(0) + "/k")) return;  // nothing captured yet
    // The trace dtype is the dtype of the first layer's keys; a root `dtype` attribute must agree.
    header.dtype = h5::tensor_dtype(ctx, file, layer_group_name(0) + "/k");
    if (h5::attr_exists(file, "dtype")) {
      const std::string d = h5::read_attr_string(ctx, file, "/", "dtype");
      if (d != kernels::dtype_name(header.dtype)) {
        ctx.fail(ErrorKind::kDType, "/@dtype",
                 "says '" + d + "' but tensors are " + kernels::dtype_name(header.dtype));
      }
    }
    // A writer that stopped before /tokens (a live capture records layers as they come) left
    // the layers' T as the only record of the context length.
    if (!header.complete && !exists("/tokens/modality")) {
      const std::vector<hsize_t> ks = h5::dataset_shape(ctx, file, layer_group_name(0) + "/k");
      if (ks.size() == 3) T = ks[1];
    }
    // An incomplete trace (its writer stopped) is described up to the first missing group.
    for (int l = 0; l < g.num_layers; ++l) {
      const std::string lg = layer_group_name(l);
      if (!exists(lg + "/v")) {
        if (!header.complete) break;
        if (!exists(lg)) {
          ctx.fail(ErrorKind::kMissing, lg,
                   "layer group is missing (num_layers = " + std::to_string(g.num_layers) + ")");
        }
      }
      expect_tensor(lg + "/q", Hq, T);
      expect_tensor(lg + "/k", Hkv, T);
      expect_tensor(lg + "/v", Hkv, T);
      if (exists(lg + "/attn_colsum")) {
        const auto cs = h5::dataset_shape(ctx, file, lg + "/attn_colsum");
        if (cs != std::vector<hsize_t>{Hq, T}) {
          ctx.fail(ErrorKind::kShape, lg + "/attn_colsum",
                   "shape " + shape_text(cs) + ", expected [num_q_heads, T] = " + shape_text({Hq, T}));
        }
      }
      if (exists(lg + "/attn_window")) {
        const auto ws = h5::dataset_shape(ctx, file, lg + "/attn_window");
        if (ws.size() != 3 || ws[0] != Hq || ws[2] != T) {
          ctx.fail(
              ErrorKind::kShape, lg + "/attn_window",
              "shape " + shape_text(ws) + ", expected [num_q_heads, W, T] with T = " + std::to_string(T));
        }
        if (ws[1] < 1 || ws[1] > T) {
          ctx.fail(ErrorKind::kShape, lg + "/attn_window",
                   "window W = " + std::to_string(ws[1]) + " must be between 1 and T = " + std::to_string(T));
        }
      }
      ++layers_present;
    }
    for (int l = 0; l < g.num_layers; ++l) {
      const std::string dg = decode_layer_group_name(l);
      if (!exists(dg + "/v")) {
        if (!header.complete) break;
        if (!exists(dg)) ctx.fail(ErrorKind::kMissing, dg, "decode layer group is missing");
      }
      expect_tensor(dg + "/q", Hq, S);
      expect_tensor(dg + "/k", Hkv, S);
      expect_tensor(dg + "/v", Hkv, S);
      ++decode_layers_present;
    }
  }

  Tensor read_slab(const std::string& path, std::vector<hsize_t> start, std::vector<hsize_t> count) const {
    Tensor t;
    t.dtype = header.dtype;
    t.shape.assign(count.begin(), count.end());
    h5::check_tensor_read(ctx, file, path, t.dtype, t.numel());
    t.data.resize(t.numel() * kernels::dtype_bytes(t.dtype));
    if (t.numel()) h5::read_tensor_slab(ctx, file, path, t.dtype, start, count, t.data.data());
    if (options.check_finite) {
      const std::ptrdiff_t bad = first_non_finite(t);
      if (bad >= 0) {
        const auto D = static_cast<std::size_t>(header.geometry.head_dim);
        const std::size_t i = static_cast<std::size_t>(bad);
        const std::size_t per_head = count[1] * D;
        ctx.fail(ErrorKind::kValue, path,
                 std::string(std::isnan(t.at(i)) ? "NaN" : "Inf") + " at [" +
                     std::to_string(start[0] + i / per_head) + ", " +
                     std::to_string(start[1] + (i % per_head) / D) + ", " + std::to_string(i % D) + "]");
      }
    }
    return t;
  }

  void require_layer(int layer, bool decode) const {
    if (layer < 0 || layer >= (decode ? decode_layers_present : layers_present)) {
      ctx.fail(ErrorKind::kUsage, decode ? decode_layer_group_name(layer) : layer_group_name(layer),
               "layer not in trace (" + std::to_string(layers_present) + " layers present)");
    }
  }
};

TraceReader::TraceReader(const std::string& path, ReaderOptions options) : impl_(std::make_unique<Impl>()) {
  h5::silence_errors();
  Impl& m = *impl_;
  m.ctx.file = path;
  m.options = options;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) m.ctx.fail(ErrorKind::kIo, "", "no such file");
  if (std::filesystem::is_directory(path, ec))
    m.ctx.fail(ErrorKind::kIo, "", "is a directory, not a trace file");
  const htri_t is = H5Fis_hdf5(path.c_str());
  if (is <= 0) {
    h5::last_error_message();
    m.ctx.fail(ErrorKind::kNotHdf5, "", "not an HDF5 file");
  }
  // A small fixed metadata cache: by default it grows (up to 32 MiB) with every dataset opened,
  // keeping the object headers and chunk-index nodes of layers long read, while a reader that
  // streams the layers opens each dataset once. Bounded, the reader's memory does not grow with
  // the number of layers read. (A 1-point kvsim sweep of llava-1.5-7b, 32 layers: max RSS 61.9 MB
  // with a 1-2 MiB cache, 56.9 MB with 256-512 KiB, 54.5 MB with 64-128 KiB, same wall time;
  // docs/perf.md, issue 4.)
  Handle fapl = m.ctx.check_id(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, "", "H5Pcreate");
  H5AC_cache_config_t mdc{};
  mdc.version = H5AC__CURR_CACHE_CONFIG_VERSION;
  m.ctx.check(H5Pget_mdc_config(fapl, &mdc), "", "H5Pget_mdc_config");
  mdc.set_initial_size = true;
  mdc.initial_size = mdc.min_size = 64u << 10;
  mdc.max_size = 128u << 10;
  mdc.incr_mode = H5C_incr__off;
  mdc.flash_incr_mode = H5C_flash_incr__off;
  m.ctx.check(H5Pset_mdc_config(fapl, &mdc), "", "H5Pset_mdc_config");
  m.file = m.ctx.check_id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), H5Fclose, "",
                          "truncated or corrupt HDF5 file: H5Fopen");
  m.read_header();
  if (!m.header.complete && options.require_complete) {
    m.ctx.fail(ErrorKind::kIncomplete, "/@complete",
               "trace is incomplete (complete = 0): the capture that wrote it did not finish");
  }
  // A complete trace must have everything; an incomplete one is described as far as it goes.
  if (m.header.complete || m.exists("/tokens/modality")) m.read_tokens();
  if (m.header.complete || m.exists("/decode/tokens/token_id")) m.read_decode_tokens();
  m.check_layers();
}

TraceReader::~TraceReader() = default;
TraceReader::TraceReader(TraceReader&&) noexcept = default;
TraceReader& TraceReader::operator=(TraceReader&&) noexcept = default;

const std::string& TraceReader::path() const { return impl_->ctx.file; }
const TraceHeader& TraceReader::header() const { return impl_->header; }
std::size_t TraceReader::num_tokens() const { return impl_->T; }
std::size_t TraceReader::num_decode_steps() const { return impl_->S; }
const Tokens& TraceReader::tokens() const { return impl_->tokens; }
const DecodeTokens& TraceReader::decode_tokens() const { return impl_->decode; }
bool TraceReader::has_roles() const { return impl_->has_roles; }
int TraceReader::layers_present() const { return impl_->layers_present; }
int TraceReader::decode_layers_present() const { return impl_->decode_layers_present; }

LayerTensors TraceReader::read_layer(int layer) const {
  const Impl& m = *impl_;
  m.require_layer(layer, false);
  const auto& g = m.header.geometry;
  const hsize_t D = static_cast<hsize_t>(g.head_dim), T = m.T;
  const std::string lg = layer_group_name(layer);
  LayerTensors out;
  out.q = m.read_slab(lg + "/q", {0, 0, 0}, {static_cast<hsize_t>(g.num_q_heads), T, D});
  out.k = m.read_slab(lg + "/k", {0, 0, 0}, {static_cast<hsize_t>(g.num_kv_heads), T, D});
  out.v = m.read_slab(lg + "/v", {0, 0, 0}, {static_cast<hsize_t>(g.num_kv_heads), T, D});
  return out;
}

Tensor TraceReader::read_head(int layer, TensorKind kind, int head) const {
  const Impl& m = *impl_;
  m.require_layer(layer, false);
  const auto& g = m.header.geometry;
  const int heads = kind == TensorKind::kQ ? g.num_q_heads : g.num_kv_heads;
  const std::string path = layer_group_name(layer) + "/" + tensor_kind_name(kind);
  if (head < 0 || head >= heads)
    m.ctx.fail(ErrorKind::kUsage, path, "head " + std::to_string(head) + " out of range");
  return m.read_slab(path, {static_cast<hsize_t>(head), 0, 0}, {1, m.T, static_cast<hsize_t>(g.head_dim)});
}

LayerTensors TraceReader::read_decode_layer(int layer) const {
  const Impl& m = *impl_;
  m.require_layer(layer, true);
  const auto& g = m.header.geometry;
  const hsize_t D = static_cast<hsize_t>(g.head_dim), S = m.S;
  const std::string dg = decode_layer_group_name(layer);
  LayerTensors out;
  out.q = m.read_slab(dg + "/q", {0, 0, 0}, {static_cast<hsize_t>(g.num_q_heads), S, D});
  out.k = m.read_slab(dg + "/k", {0, 0, 0}, {static_cast<hsize_t>(g.num_kv_heads), S, D});
  out.v = m.read_slab(dg + "/v", {0, 0, 0}, {static_cast<hsize_t>(g.num_kv_heads), S, D});
  return out;
}

std::optional<LayerAggregates> TraceReader::read_aggregates(int layer) const {
  const Impl& m = *impl_;
  m.require_layer(layer, false);
  const std::string lg = layer_group_name(layer);
  const bool has_col = m.exists(lg + "/attn_colsum"), has_win = m.exists(lg + "/attn_window");
  if (!has_col && !has_win) return std::nullopt;
  LayerAggregates a;
  const auto Hq = static_cast<hsize_t>(m.header.geometry.num_q_heads);
  // Softmax probabilities are in [0, 1]; a column sum over at most T causal queries is in [0, T].
  // The tolerance allows for float32 rounding of those sums.
  auto check_values = [&](const std::string& path, const std::vector<float>& v, double max) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (!std::isfinite(v[i]) || v[i] < 0 || v[i] > max * (1 + 1e-3) + 1e-3) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v[i]));
        m.ctx.fail(ErrorKind::kValue, path,
                   std::string("value ") + buf + " at element " + std::to_string(i) +
                       " (must be finite and in [0, " + std::to_string(static_cast<long long>(max)) + "])");
      }
    }
  };
  if (has_col) {
    a.attn_colsum = h5::read_f32(m.ctx, m.file, lg + "/attn_colsum", {Hq, m.T});
    check_values(lg + "/attn_colsum", a.attn_colsum, static_cast<double>(m.T));
  }
  if (has_win) {
    const auto ws = h5::dataset_shape(m.ctx, m.file, lg + "/attn_window");
    a.attn_window = h5::read_f32(m.ctx, m.file, lg + "/attn_window", ws);
    a.window = static_cast<int>(ws[1]);
    check_values(lg + "/attn_window", a.attn_window, 1.0);
  }
  return a;
}

AggregateState TraceReader::aggregate_state() const { return aggregates_io::state(impl_->ctx, impl_->file); }

AggregateDefinition TraceReader::aggregate_definition() const {
  const Impl& m = *impl_;
  if (!m.exists(kAggregatesGroup)) m.ctx.fail(ErrorKind::kMissing, kAggregatesGroup, "group is missing");
  return aggregates_io::read_definition(m.ctx, m.file);
}

LayerAttentionAggregates TraceReader::read_attention_aggregates(int layer,
                                                                const AggregateDefinition& definition) const {
  const Impl& m = *impl_;
  if (layer < 0 || layer >= definition.num_layers)
    m.ctx.fail(ErrorKind::kUsage, kAggregatesGroup, "layer " + std::to_string(layer) + " out of range");
  return aggregates_io::read_layer(m.ctx, m.file, layer, definition);
}

Profile TraceReader::read_profile() const {
  const Impl& m = *impl_;
  const h5::Ctx& c = m.ctx;
  Profile p;
  // Members are matched by name, so files with fewer members or another order still read. Their
  // strings are allocated through a budget and checked against their stored lengths.
  // The rows' strings belong to `budget` (valid until it is destroyed, freed with it).
  auto read_compound = [&](const char* path, hid_t mtype, auto& rows, std::size_t record_bytes,
                           const auto& strings_of, std::optional<h5::VlenBudget>& budget) {
    if (!m.exists(path)) return;
    const auto shape = h5::dataset_shape(c, m.file, path);
    if (shape.size() != 1) c.fail(ErrorKind::kShape, path, "must be 1-D");
    if (shape[0] > limits::kMaxProfileRows) {
      c.fail(ErrorKind::kValue, path,
             std::to_string(shape[0]) + " rows, more than the limit of " +
                 std::to_string(limits::kMaxProfileRows));
    }
    if (shape[0] == 0) return;
    Handle d = c.check_id(H5Dopen2(m.file, path, H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
    Handle ft = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
    if (H5Tget_class(ft) != H5T_COMPOUND) c.fail(ErrorKind::kDType, path, "must be a compound dataset");
    h5::check_alloc(c, path, shape[0], sizeof(rows[0]) + record_bytes);
    h5::check_storage(c, d, path, shape[0] * H5Tget_size(ft));
    h5::prescan_compound_strings(c, d, path, shape[0]);
    rows.resize(shape[0]);
    std::memset(static_cast<void*>(rows.data()), 0, rows.size() * sizeof(rows[0]));
    budget.emplace(c, path, limits::kMaxStringBytes);
    const herr_t st = H5Dread(d, mtype, H5S_ALL, H5S_ALL, budget->dxpl(), rows.data());
    if (st < 0) budget->fail_read(st);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      for (char** s : strings_of(rows[i])) budget->check_string(*s, path, i);
    }
  };
  Handle kt = h5::kernel_row_type(c);
  std::vector<h5::KernelRow> krows;
  auto kernel_strings = [](h5::KernelRow& r) { return std::array<char**, 2>{&r.name, &r.kind}; };
  std::optional<h5::VlenBudget> kernel_budget, range_budget;
  read_compound("/profile/kernels", kt, krows, sizeof(KernelRecord), kernel_strings, kernel_budget);
  p.kernels.reserve(krows.size());
  for (auto& r : krows) {
    KernelRecord k;
    k.name = r.name ? r.name : "";
    k.kind = r.kind ? r.kind : "";
    k.start_ns = r.start_ns;
    k.end_ns = r.end_ns;
    k.stream = r.stream;
    k.bytes = r.bytes;
    k.device = r.device;
    for (int i = 0; i < 3; ++i) {
      k.grid[i] = r.grid[i];
      k.block[i] = r.block[i];
    }
    p.kernels.push_back(std::move(k));
  }
  Handle rt = h5::range_row_type(c);
  std::vector<h5::RangeRow> rrows;
  auto range_strings = [](h5::RangeRow& r) { return std::array<char**, 1>{&r.name}; };
  read_compound("/profile/ranges", rt, rrows, sizeof(RangeRecord), range_strings, range_budget);
  p.ranges.reserve(rrows.size());
  for (auto& r : rrows) {
    p.ranges.push_back(RangeRecord{r.name ? r.name : "", r.start_ns, r.end_ns, r.depth, r.thread});
  }
  return p;
}

std::ptrdiff_t first_non_finite(const Tensor& t) {
  const std::size_t n = t.numel();
  if (t.dtype == DType::kF32) {
    const auto* p = reinterpret_cast<const std::uint32_t*>(t.data.data());
    for (std::size_t i = 0; i < n; ++i) {
      if ((p[i] & 0x7f800000u) == 0x7f800000u) return static_cast<std::ptrdiff_t>(i);
    }
    return -1;
  }
  const auto* p = reinterpret_cast<const std::uint16_t*>(t.data.data());
  const std::uint16_t mask = t.dtype == DType::kF16 ? 0x7c00u : 0x7f80u;
  for (std::size_t i = 0; i < n; ++i) {
    if ((p[i] & mask) == mask) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

}  // namespace kvscope::trace
