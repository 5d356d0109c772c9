// Reader of HDF5 results files ("kvscope-results" 1.0 and 1.1) with the HDF5 C API. Mirrors the layout
// written by report_hdf5.cpp: /points [P], /layers [P, L], /heads [P, L, H], /flags [F].
#include "kvscope/sim/results_reader.hpp"

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <mutex>
#include <string>
#include <system_error>

#include "kvscope/trace/schema.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace kvscope::sim {

namespace {

// Limits on sizes a results file declares (docs/results-format.md, "Limits"): checked before any
// allocation, with the stored bytes of every dataset (deflate expands at most 1032:1).
constexpr std::int64_t kMaxPoints = 100000;  // a sweep makes at most kMaxSweepPoints (10,000)
constexpr std::int64_t kMaxLayers = 1024, kMaxHeads = 1024;
constexpr std::uint64_t kMaxHeadRows = std::uint64_t{1} << 22;  // P x L x H rows of /heads
constexpr std::uint64_t kMaxFlags = std::uint64_t{1} << 22;
constexpr std::uint64_t kMaxCompressionRatio = 1032, kStorageSlackBytes = 64 * 1024;
constexpr std::size_t kMaxAttrStringBytes = std::size_t{1} << 20;
constexpr std::uint64_t kMaxStringBytes = std::uint64_t{256} << 20;  // all strings of one dataset

class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    if (id_ >= 0) closer_(id_);
  }
  operator hid_t() const { return id_; }

 private:
  hid_t id_;
  Closer closer_;
};

template <typename T>
hid_t mem_type();
template <>
hid_t mem_type<double>() {
  return H5T_NATIVE_DOUBLE;
}
template <>
hid_t mem_type<std::int64_t>() {
  return H5T_NATIVE_INT64;
}
template <>
hid_t mem_type<std::int32_t>() {
  return H5T_NATIVE_INT32;
}
template <>
hid_t mem_type<std::uint8_t>() {
  return H5T_NATIVE_UINT8;
}

class Reader {
 public:
  Reader(std::string path, hid_t file) : path_(std::move(path)), file_(file) {}

  [[noreturn]] void fail(const std::string& object, const std::string& message) const {
    // Kept for the isolated pre-check: survives a crash in the cleanup that follows.
    trace::note_failure(trace::ErrorKind::kCorrupt, path_, object, message);
    throw ResultsReadError(path_, object, message);
  }

  std::string attr_string(const char* name) const {
    const std::string object = std::string("/@") + name;
    trace::note_object_being_read(object);
    if (H5Aexists(file_, name) <= 0) fail(object, "missing attribute");
    Handle a(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    Handle ftype(H5Aget_type(a), H5Tclose);
    if (a < 0 || ftype < 0 || H5Tget_class(ftype) != H5T_STRING) fail(object, "not a string attribute");
    if (H5Tis_variable_str(ftype) > 0) {
      Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mtype, H5T_VARIABLE);
      H5Tset_cset(mtype, H5Tget_cset(ftype));
      char* p = nullptr;
      if (H5Aread(a, mtype, &p) < 0) fail(object, "cannot read");
      std::string s = p ? p : "";
      Handle space(H5Aget_space(a), H5Sclose);
      H5Dvlen_reclaim(mtype, space, H5P_DEFAULT, &p);
      return s;
    }
    const std::size_t size = H5Tget_size(ftype);
    if (size == 0 || size > kMaxAttrStringBytes)
      fail(object, "fixed-length string of " + std::to_string(size) + " bytes");
    std::string s(size, '\0');
    if (H5Aread(a, ftype, s.data()) < 0) fail(object, "cannot read");
    return s.substr(0, s.find('\0'));
  }

  std::vector<std::int64_t> attr_i64(const char* name, bool optional = false) const {
    const std::string object = std::string("/@") + name;
    trace::note_object_being_read(object);
    if (H5Aexists(file_, name) <= 0) {
      if (optional) return {};
      fail(object, "missing attribute");
    }
    Handle a(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    Handle space(H5Aget_space(a), H5Sclose);
    const hssize_t n = H5Sget_simple_extent_npoints(space);
    if (n < 1) fail(object, "empty attribute");
    if (n > 1024) fail(object, std::to_string(n) + " values, more than an attribute of a results file holds");
    Handle type(H5Aget_type(a), H5Tclose);
    const H5T_class_t cls = H5Tget_class(type);
    std::vector<std::int64_t> v(static_cast<std::size_t>(n));
    if (cls == H5T_FLOAT) {
      // Accepted where it holds integers exactly: 4.0 reads as 4, 4.5 is an error (not 4).
      std::vector<double> d(static_cast<std::size_t>(n));
      if (H5Aread(a, H5T_NATIVE_DOUBLE, d.data()) < 0) fail(object, "cannot read");
      for (std::size_t i = 0; i < d.size(); ++i) {
        if (!std::isfinite(d[i]) || d[i] != std::floor(d[i]) || std::fabs(d[i]) >= 9.2e18) {
          fail(object, "must be an integer, got " + std::to_string(d[i]));
        }
        v[i] = static_cast<std::int64_t>(d[i]);
      }
      return v;
    }
    if (cls != H5T_INTEGER && cls != H5T_ENUM) fail(object, "not an integer attribute");
    if (H5Aread(a, H5T_NATIVE_INT64, v.data()) < 0) fail(object, "not an integer attribute");
    return v;
  }

  // A scalar floating-point (or integer) attribute of the root.
  double attr_f64(const char* name) const {
    const std::string object = std::string("/@") + name;
    trace::note_object_being_read(object);
    if (H5Aexists(file_, name) <= 0) fail(object, "missing attribute");
    Handle a(H5Aopen(file_, name, H5P_DEFAULT), H5Aclose);
    Handle space(H5Aget_space(a), H5Sclose);
    Handle type(H5Aget_type(a), H5Tclose);
    const H5T_class_t cls = H5Tget_class(type);
    double v = 0;
    if (H5Sget_simple_extent_npoints(space) != 1 || (cls != H5T_FLOAT && cls != H5T_INTEGER) ||
        H5Aread(a, H5T_NATIVE_DOUBLE, &v) < 0) {
      fail(object, "not a number attribute");
    }
    return v;
  }

  // A numeric dataset whose shape must equal `dims` exactly.
  template <typename T>
  std::vector<T> dataset(const std::string& object, const std::vector<hsize_t>& dims) const {
    Handle d = open(object, dims);
    std::size_t n = 1;
    for (hsize_t x : dims) n *= x;
    check_storage(d, object, n, sizeof(T));
    std::vector<T> v(n);
    if (n > 0 && H5Dread(d, mem_type<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0) {
      fail(object, "cannot read as a number array");
    }
    return v;
  }

  // Length of a 1-D dataset, or -1 when the object does not exist.
  std::int64_t length(const std::string& object) const {
    trace::note_object_being_read(object);
    if (H5Lexists(file_, object.substr(0, object.rfind('/')).c_str(), H5P_DEFAULT) <= 0 ||
        H5Lexists(file_, object.c_str(), H5P_DEFAULT) <= 0) {
      return -1;
    }
    Handle d(H5Dopen2(file_, object.c_str(), H5P_DEFAULT), H5Dclose);
    if (d < 0) fail(object, "cannot open dataset");
    Handle space(H5Dget_space(d), H5Sclose);
    if (H5Sget_simple_extent_ndims(space) != 1) fail(object, "not a 1-D column");
    hsize_t n = 0;
    H5Sget_simple_extent_dims(space, &n, nullptr);
    return static_cast<std::int64_t>(n);
  }

  std::vector<std::string> strings(const std::string& object, hsize_t n) const {
    Handle d = open(object, {n});
    Handle ftype(H5Dget_type(d), H5Tclose);
    if (H5Tget_class(ftype) != H5T_STRING) fail(object, "not a string dataset");
    check_storage(d, object, n, H5Tis_variable_str(ftype) > 0 ? 16 : H5Tget_size(ftype));
    std::vector<std::string> out;
    if (n == 0) return out;
    if (H5Tis_variable_str(ftype) > 0) {
      check_string_lengths(d, object, n);
      Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(mtype, H5T_VARIABLE);
      H5Tset_cset(mtype, H5Tget_cset(ftype));
      std::vector<char*> ptrs(n, nullptr);
      if (H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) < 0) fail(object, "cannot read");
      for (char* p : ptrs) out.emplace_back(p ? p : "");
      Handle space(H5Dget_space(d), H5Sclose);
      H5Dvlen_reclaim(mtype, space, H5P_DEFAULT, ptrs.data());
      return out;
    }
    const std::size_t size = H5Tget_size(ftype);
    std::string buf(size * n, '\0');
    if (H5Dread(d, ftype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) < 0) fail(object, "cannot read");
    for (hsize_t i = 0; i < n; ++i) {
      std::string s = buf.substr(i * size, size);
      out.push_back(s.substr(0, s.find('\0')));
    }
    return out;
  }

 private:
  // HDF5 allocates (and zeroes) a buffer of the length stored in each variable-length string before
  // reading it: for a contiguous dataset, read those lengths (the first 4 bytes, little-endian, of
  // each 16-byte element) from the file first and bound them by the file size and kMaxStringBytes.
  void check_string_lengths(hid_t d, const std::string& object, hsize_t n) const {
    Handle dcpl(H5Dget_create_plist(d), H5Pclose);
    if (dcpl < 0 || H5Pget_layout(dcpl) != H5D_CONTIGUOUS || H5Pget_external_count(dcpl) > 0) return;
    const haddr_t off = H5Dget_offset(d);
    const std::uint64_t stored = H5Dget_storage_size(d);
    hsize_t file_size = 0;
    if (off == HADDR_UNDEF || H5Fget_filesize(file_, &file_size) < 0 || n == 0) {
      H5Eclear2(H5E_DEFAULT);
      return;
    }
    if (off > file_size || stored > file_size - off || stored % n != 0 || stored / n < 12) {
      fail(object, "stores " + std::to_string(stored) + " bytes for " + std::to_string(n) + " strings");
    }
    std::vector<unsigned char> raw(stored);
    std::FILE* fp = std::fopen(path_.c_str(), "rb");
    if (!fp) return;
    const bool ok =
        fseeko(fp, static_cast<off_t>(off), SEEK_SET) == 0 && std::fread(raw.data(), 1, stored, fp) == stored;
    std::fclose(fp);
    if (!ok) return;
    const std::uint64_t elem = stored / n;
    std::uint64_t total = 0;
    for (hsize_t i = 0; i < n; ++i) {
      const unsigned char* e = raw.data() + i * elem;
      const std::uint64_t len = std::uint64_t{e[0]} | std::uint64_t{e[1]} << 8 | std::uint64_t{e[2]} << 16 |
                                std::uint64_t{e[3]} << 24;
      if (len > file_size) {
        fail(object, "string " + std::to_string(i) + ": stored length " + std::to_string(len) +
                         " bytes, more than the file's " + std::to_string(file_size) +
                         " (corrupt string length)");
      }
      total += len;
    }
    if (total > kMaxStringBytes) {
      fail(object, "strings of " + std::to_string(total) + " bytes in all, more than the limit of " +
                       std::to_string(kMaxStringBytes));
    }
  }

  // The data a dataset declares must be in the file: at most its stored bytes (x1032 with filters).
  void check_storage(hid_t d, const std::string& object, std::uint64_t n, std::uint64_t elem) const {
    if (n == 0 || elem == 0) return;
    if (n > (std::uint64_t{1} << 40) / elem)
      fail(object, std::to_string(n) + " elements is more than a results file holds");
    const std::uint64_t declared = n * elem;
    if (declared <= kStorageSlackBytes) return;
    Handle dcpl(H5Dget_create_plist(d), H5Pclose);
    if (dcpl < 0) fail(object, "cannot read the dataset's creation properties");
    if (H5Pget_external_count(dcpl) > 0 || H5Pget_layout(dcpl) == H5D_VIRTUAL) return;
    const std::uint64_t stored = H5Dget_storage_size(d);
    hsize_t file_size = 0;
    if (H5Fget_filesize(file_, &file_size) < 0 || stored > file_size) {
      fail(object, "claims " + std::to_string(stored) + " bytes of storage in a file of " +
                       std::to_string(file_size));
    }
    const std::uint64_t ratio = H5Pget_nfilters(dcpl) > 0 ? kMaxCompressionRatio : 1;
    if (declared > stored * ratio + kStorageSlackBytes) {
      fail(object, "declares " + std::to_string(declared) + " bytes of data but stores " +
                       std::to_string(stored) + ": the data is not in the file");
    }
  }

  Handle open(const std::string& object, const std::vector<hsize_t>& dims) const {
    trace::note_object_being_read(object);
    if (H5Lexists(file_, object.substr(0, object.rfind('/')).c_str(), H5P_DEFAULT) <= 0 ||
        H5Lexists(file_, object.c_str(), H5P_DEFAULT) <= 0) {
      fail(object, "missing dataset");
    }
    Handle d(H5Dopen2(file_, object.c_str(), H5P_DEFAULT), H5Dclose);
    if (d < 0) fail(object, "cannot open dataset");
    Handle space(H5Dget_space(d), H5Sclose);
    std::vector<hsize_t> got(static_cast<std::size_t>(std::max(0, H5Sget_simple_extent_ndims(space))));
    H5Sget_simple_extent_dims(space, got.data(), nullptr);
    if (got != dims) fail(object, "shape " + shape_text(got) + ", expected " + shape_text(dims));
    return Handle(H5Dopen2(file_, object.c_str(), H5P_DEFAULT), H5Dclose);
  }
  static std::string shape_text(const std::vector<hsize_t>& d) {
    std::string s = "(";
    for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + ")";
  }

  std::string path_;
  hid_t file_;
};

// The record datasets of one group, read for every row of the leading shape.
struct Records {
  std::vector<std::int64_t> bytes_full_c, bytes_kept_c, bytes_full_m, bytes_kept_m;
  std::vector<std::int64_t> tokens, kept, merged, evicted;
  std::vector<double> output_error, recall, kl, entropy, recall_m, share_before, share_after;
  std::vector<std::int64_t> bytes_full_end, bytes_end, bytes_peak;  // format 1.1; empty in a 1.0 file
  // Format 1.2: [set][metric] the query-set metrics (output error, recall, KL, entropy change); empty before.
  std::vector<double> query_sets[kQuerySets][4];
  std::vector<double> proxies[kNumProxies];  // format 1.3; empty before

  Records(const Reader& r, const std::string& g, std::vector<hsize_t> lead, bool v11, bool v12 = false,
          bool v13 = false, bool v15 = false) {
    auto with = [&](hsize_t inner) {
      std::vector<hsize_t> d = lead;
      d.push_back(inner);
      return d;
    };
    bytes_full_c = r.dataset<std::int64_t>(g + "/bytes_full_components", with(6));
    bytes_kept_c = r.dataset<std::int64_t>(g + "/bytes_kept_components", with(6));
    bytes_full_m = r.dataset<std::int64_t>(g + "/bytes_full_modality", with(kModalities));
    bytes_kept_m = r.dataset<std::int64_t>(g + "/bytes_kept_modality", with(kModalities));
    tokens = r.dataset<std::int64_t>(g + "/tokens", with(kModalities));
    kept = r.dataset<std::int64_t>(g + "/kept", with(kModalities));
    merged = r.dataset<std::int64_t>(g + "/merged", with(kModalities));
    evicted = r.dataset<std::int64_t>(g + "/evicted", with(kModalities));
    output_error = r.dataset<double>(g + "/output_error", lead);
    recall = r.dataset<double>(g + "/attention_recall", lead);
    kl = r.dataset<double>(g + "/kl", lead);
    entropy = r.dataset<double>(g + "/entropy_delta", lead);
    recall_m = r.dataset<double>(g + "/recall_modality", with(kModalities));
    share_before = r.dataset<double>(g + "/share_before", with(kModalities));
    share_after = r.dataset<double>(g + "/share_after", with(kModalities));
    if (v11) {
      bytes_full_end = r.dataset<std::int64_t>(g + "/bytes_full_end", lead);
      bytes_end = r.dataset<std::int64_t>(g + "/bytes_end", lead);
      bytes_peak = r.dataset<std::int64_t>(g + "/bytes_peak", lead);
    }
    if (v12) {
      for (int k = 0; k < kQuerySets; ++k) {
        const std::string set = query_set_name(k);
        const char* names[4] = {"output_error_", "attention_recall_", "kl_", "entropy_delta_"};
        for (int m = 0; m < 4; ++m) query_sets[k][m] = r.dataset<double>(g + "/" + names[m] + set, lead);
      }
    }
    if (v13) {
      const int n = v15 ? kNumProxies : kProxiesBefore15;
      for (int k = 0; k < n; ++k) proxies[k] = r.dataset<double>(g + "/" + proxy_name(k), lead);
    }
  }

  static Bytes bytes(const std::vector<std::int64_t>& c, std::size_t i) {
    const std::int64_t* p = &c[i * 6];
    return Bytes{p[0], p[1], p[2], p[3], p[4], p[5]};
  }
  HeadResult row(std::size_t i) const {
    HeadResult h;
    h.bytes_full = bytes(bytes_full_c, i);
    h.bytes_kept = bytes(bytes_kept_c, i);
    for (int m = 0; m < kModalities; ++m) {
      const std::size_t k = i * kModalities + static_cast<std::size_t>(m);
      h.tokens[m] = tokens[k];
      h.kept[m] = kept[k];
      h.merged[m] = merged[k];
      h.evicted[m] = evicted[k];
      h.bytes_full_modality[m] = bytes_full_m[k];
      h.bytes_kept_modality[m] = bytes_kept_m[k];
      h.quality.recall_modality[m] = recall_m[k];
      h.quality.share_before[m] = share_before[k];
      h.quality.share_after[m] = share_after[k];
    }
    h.quality.output_error = output_error[i];
    h.quality.attention_recall = recall[i];
    h.quality.kl = kl[i];
    h.quality.entropy_delta = entropy[i];
    for (int k = 0; k < kQuerySets; ++k) {
      QuerySetQuality& qs = h.quality.query_sets[static_cast<std::size_t>(k)];
      if (query_sets[k][0].empty()) {  // before 1.2: not recorded
        const double nan = std::numeric_limits<double>::quiet_NaN();
        qs = QuerySetQuality{nan, nan, nan, nan};
        continue;
      }
      qs =
          QuerySetQuality{query_sets[k][0][i], query_sets[k][1][i], query_sets[k][2][i], query_sets[k][3][i]};
    }
    for (int k = 0; k < kNumProxies; ++k)  // before 1.3 (the specific recalls before 1.5): not recorded
      proxy_value(h.quality.proxies, k) =
          proxies[k].empty() ? std::numeric_limits<double>::quiet_NaN() : proxies[k][i];
    if (!bytes_end.empty()) {
      h.bytes_full_end = bytes_full_end[i];
      h.bytes_end = bytes_end[i];
      h.bytes_peak = bytes_peak[i];
    }
    return h;
  }
};

std::vector<PointResult> read_contents(const Reader& r, ResultsMeta* meta) {
  const std::string format = r.attr_string("format");
  if (format != kResultsFormat) r.fail("/@format", "'" + format + "' is not " + kResultsFormat);
  const std::string version = r.attr_string("version");
  int major = -1, minor = -1;
  if (!trace::parse_version(version, major, minor)) {
    r.fail("/@version", "'" + version + "' is not MAJOR.MINOR (digits only, e.g. 1.1)");
  }
  if (major != 1) r.fail("/@version", "unsupported version " + version + " (this reader knows 1.x)");
  // 1.1 added bytes_full_end / bytes_end / bytes_peak and /points/mode: required from 1.1 on; a 1.0
  // file reads with those bytes 0 and every point in prefill mode (the only mode 1.0 knew).
  const bool v11 = minor >= 1;
  // 1.2 added /points/kind. An older file's rows are policies, except its "oracle-*" rows: those were
  // the allocation search of kvsim before 1.2 (kind search).
  // 1.2 also added the query-set metrics (output_error_answer, ...) and the role attributes; before 1.2 they
  // read as NaN (not recorded) and has_roles = false.
  const bool v12 = minor >= 2;
  // 1.3 added the fidelity proxies (error_worst_query, ..., topk_mass); before 1.3 they read as NaN.
  const bool v13 = minor >= 3;
  // 1.5 added the specific top-k recalls (specific_recall, specific_recall_min); before 1.5 they read as NaN.
  const bool v15 = minor >= 5;
  auto count = [&](const char* name, std::int64_t max) {
    const std::int64_t v = r.attr_i64(name)[0];
    if (v < 0) r.fail(std::string("/@") + name, "negative");
    if (v > max)
      r.fail(std::string("/@") + name,
             std::to_string(v) + " is more than the limit of " + std::to_string(max));
    return static_cast<hsize_t>(v);
  };
  const hsize_t P = count("num_points", kMaxPoints), L = count("num_layers", kMaxLayers),
                H = count("num_kv_heads", kMaxHeads);
  if (P * L * H > kMaxHeadRows) {
    r.fail("/@num_points", std::to_string(P) + " points x " + std::to_string(L) + " layers x " +
                               std::to_string(H) + " heads is more than the limit of " +
                               std::to_string(kMaxHeadRows) + " head rows");
  }
  if (meta) {
    *meta = ResultsMeta{};
    meta->trace_path = r.attr_string("trace_path");
    meta->model_name = r.attr_string("model_name");
    meta->synthetic = r.attr_i64("synthetic")[0] != 0;
    meta->created = r.attr_string("created");
    meta->command_line = r.attr_string("command_line");
    meta->num_layers = static_cast<int>(L);
    meta->num_kv_heads = static_cast<int>(H);
    meta->num_q_heads = static_cast<int>(r.attr_i64("num_q_heads")[0]);
    meta->head_dim = static_cast<int>(r.attr_i64("head_dim")[0]);
    meta->num_tokens = r.attr_i64("num_tokens")[0];
    meta->num_decode_steps = r.attr_i64("num_decode_steps")[0];
    const std::vector<std::int64_t> tpm = r.attr_i64("tokens_per_modality");
    if (tpm.size() != static_cast<std::size_t>(kModalities))
      r.fail("/@tokens_per_modality", "expected 4 values");
    std::copy(tpm.begin(), tpm.end(), meta->tokens_per_modality.begin());
    if (minor >= 4 && !r.attr_i64("num_samples", true).empty()) {  // 1.4: a dataset sweep
      meta->dataset = true;
      meta->dataset_source = r.attr_string("dataset");
      meta->num_samples = r.attr_i64("num_samples")[0];
      meta->failed_samples = r.attr_i64("failed_samples")[0];
      meta->bootstrap_resamples = r.attr_i64("bootstrap_resamples")[0];
      meta->bootstrap_seed = static_cast<std::uint64_t>(r.attr_i64("bootstrap_seed")[0]);
      meta->group_by = r.attr_string("group_by");
      meta->confidence = r.attr_f64("confidence");
    }
    if (v12) {
      meta->has_roles = r.attr_i64("has_roles")[0] != 0;
      meta->steps_in_context = r.attr_i64("question_in_context")[0];
      meta->query_set_steps[kAnswerQueries] = r.attr_i64("answer_queries")[0];
      meta->query_set_steps[kQuestionQueries] = r.attr_i64("question_queries")[0];
    }
  }

  std::vector<PointResult> points(P);
  const std::vector<std::string> policy = r.strings("/points/policy", P);
  const std::vector<std::string> budget = r.strings("/points/budget", P);
  const std::vector<double> budget_value = r.dataset<double>("/points/budget_value", {P});
  const std::vector<double> seconds = r.dataset<double>("/points/seconds", {P});
  const std::vector<std::uint8_t> pareto = r.dataset<std::uint8_t>("/points/pareto", {P});
  const Records pr(r, "/points", {P}, v11, v12, v13, v15);
  const std::vector<std::string> mode =
      v11 ? r.strings("/points/mode", P) : std::vector<std::string>(P, "prefill");
  std::vector<std::string> kind;
  if (v12) {
    kind = r.strings("/points/kind", P);
    for (hsize_t p = 0; p < P; ++p)
      if (kind[p] != "policy" && kind[p] != "bound" && kind[p] != "search")
        r.fail("/points/kind",
               "row " + std::to_string(p) + ": '" + kind[p] + "' is not policy, bound or search");
  } else {
    for (hsize_t p = 0; p < P; ++p) kind.push_back(policy[p].rfind("oracle-", 0) == 0 ? "search" : "policy");
  }
  const std::vector<std::int32_t> layer = r.dataset<std::int32_t>("/layers/layer", {P, L});
  const std::vector<std::int32_t> merged_heads = r.dataset<std::int32_t>("/layers/merged_heads", {P, L});
  const Records lr(r, "/layers", {P, L}, v11, v12, v13, v15);
  const std::vector<std::int32_t> kv_head = r.dataset<std::int32_t>("/heads/kv_head", {P, L, H});
  const Records hr(r, "/heads", {P, L, H}, v11, v12, v13, v15);
  for (hsize_t p = 0; p < P; ++p) {
    PointResult& pt = points[p];
    pt.policy = policy[p];
    pt.budget = budget[p];
    pt.mode = mode[p];
    pt.kind = kind[p];
    pt.budget_value = budget_value[p];
    pt.seconds = seconds[p];
    pt.pareto = pareto[p] != 0;
    pt.total = pr.row(p);
    for (hsize_t l = 0; l < L; ++l) {
      const std::size_t li = p * L + l;
      if (layer[li] < 0) continue;
      LayerResult lres;
      lres.layer = layer[li];
      lres.merged_heads = merged_heads[li];
      lres.total = lr.row(li);
      for (hsize_t h = 0; h < H; ++h) {
        const std::size_t hi = li * H + h;
        if (kv_head[hi] < 0) continue;
        HeadResult head = hr.row(hi);
        head.kv_head = kv_head[hi];
        lres.heads.push_back(head);
      }
      pt.layers.push_back(std::move(lres));
    }
  }

  // /flags: F is the length of /flags/point (0 when the sweep flagged nothing).
  hsize_t F = 0;
  for (const auto& n : r.dataset<std::int32_t>("/points/num_flags", {P})) {
    F += static_cast<hsize_t>(std::max(0, n));
    if (F > kMaxFlags)
      r.fail("/points/num_flags", "more than the limit of " + std::to_string(kMaxFlags) + " flags");
  }
  const std::vector<std::int32_t> fpoint = r.dataset<std::int32_t>("/flags/point", {F});
  const std::vector<std::string> flag_mode = r.strings("/flags/mode", F);
  const std::vector<std::string> flayers = r.strings("/flags/layers", F);
  const std::vector<std::string> evidence = r.strings("/flags/evidence", F);
  const std::vector<std::string> fix = r.strings("/flags/suggested_fix", F);
  for (hsize_t f = 0; f < F; ++f) {
    if (fpoint[f] < 0 || static_cast<hsize_t>(fpoint[f]) >= P) {
      r.fail("/flags/point", "row " + std::to_string(f) + " names point " + std::to_string(fpoint[f]));
    }
    CollapseFlag flag;
    flag.mode = flag_mode[f];
    flag.evidence = evidence[f];
    flag.suggested_fix = fix[f];
    std::size_t pos = 0;
    const std::string& list = flayers[f];
    while (pos < list.size()) {
      const std::size_t end = std::min(list.find(',', pos), list.size());
      try {
        flag.layers.push_back(std::stoi(list.substr(pos, end - pos)));
      } catch (const std::exception&) {
        r.fail("/flags/layers", "row " + std::to_string(f) + ": '" + list + "' is not a list of layers");
      }
      pos = end + 1;
    }
    points[static_cast<std::size_t>(fpoint[f])].flags.push_back(std::move(flag));
  }
  return points;
}

}  // namespace

namespace {
// Opens a results file read-only; throws ResultsReadError naming it.
hid_t open_results(const std::string& path) {
  // Per thread: Debian's thread-safe libhdf5 keeps one error stack (and its printing) per thread.
  thread_local bool silenced = false;
  if (!silenced) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    silenced = true;
  }
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw ResultsReadError(path, "", "cannot open: no such file");
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0) throw ResultsReadError(path, "", "cannot open: unreadable or not an HDF5 file");
  return file;
}
}  // namespace

std::vector<PointIntervals> read_point_intervals(const std::string& path) {
  Handle file(open_results(path), H5Fclose);
  const Reader r(path, file);
  const std::int64_t rows = r.length("/aggregate/by");
  if (rows < 0) return {};
  if (rows > (std::int64_t{1} << 28))
    r.fail("/aggregate/by", std::to_string(rows) + " rows is more than a results file holds");
  const auto n = static_cast<hsize_t>(rows);
  const hsize_t P = static_cast<hsize_t>(std::max<std::int64_t>(0, r.attr_i64("num_points")[0]));
  if (static_cast<std::int64_t>(P) > kMaxPoints) r.fail("/@num_points", "more than the limit");
  const std::vector<std::string> by = r.strings("/aggregate/by", n),
                                 mod = r.strings("/aggregate/modality", n);
  const std::vector<std::int64_t> point = r.dataset<std::int64_t>("/aggregate/point", {n}),
                                  layer = r.dataset<std::int64_t>("/aggregate/layer", {n}),
                                  count = r.dataset<std::int64_t>("/aggregate/n", {n});
  std::vector<PointIntervals> out(P);
  auto read = [&](const std::string& metric, PointInterval PointIntervals::*field) {
    const std::vector<double> mean = r.dataset<double>("/aggregate/" + metric + "_mean", {n}),
                              lo = r.dataset<double>("/aggregate/" + metric + "_lo", {n}),
                              hi = r.dataset<double>("/aggregate/" + metric + "_hi", {n});
    for (hsize_t i = 0; i < n; ++i) {
      if (by[i] != "all" || layer[i] != -1 || mod[i] != "all") continue;
      if (point[i] < 0 || static_cast<hsize_t>(point[i]) >= P) r.fail("/aggregate/point", "row of no point");
      PointIntervals& pi = out[static_cast<std::size_t>(point[i])];
      pi.*field = PointInterval{mean[i], lo[i], hi[i]};
      pi.n = count[i];
    }
  };
  read("output_error", &PointIntervals::output_error);
  read("attention_recall", &PointIntervals::attention_recall);
  read("kl", &PointIntervals::kl);
  read("bytes_ratio", &PointIntervals::bytes_ratio);
  return out;
}

std::vector<PointResult> read_results_hdf5(const std::string& path, ResultsMeta* meta) {
  Handle file(open_results(path), H5Fclose);
  const Reader r(path, file);
  return read_contents(r, meta);
}

namespace {
// The message of an error without its "file: object: " prefix.
std::string bare_message(const std::runtime_error& e, const std::string& file, const std::string& object) {
  std::string m = e.what();
  const std::string prefix = object.empty() ? file + ": " : file + ": " + object + ": ";
  if (m.compare(0, prefix.size(), prefix) == 0) m.erase(0, prefix.size());
  return m;
}
}  // namespace

void check_results_file(const std::string& path) {
  try {
    trace::require_regular_file(path);
    if (trace::trusted_files()) return;
    trace::run_isolated(path, [&path] {
      try {
        (void)read_results_hdf5(path);
      } catch (const ResultsReadError& e) {
        throw trace::TraceError(trace::ErrorKind::kCorrupt, e.file(), e.object(),
                                bare_message(e, e.file(), e.object()));
      }
    });
  } catch (const trace::TraceError& e) {
    throw ResultsReadError(e.file(), e.object(), bare_message(e, e.file(), e.object()));
  }
}

}  // namespace kvscope::sim
