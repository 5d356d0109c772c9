#include "h5.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

#include "kvscope/trace/limits.hpp"

namespace kvscope::trace::h5 {

void silence_errors() {
  // Debian's libhdf5 is built thread-safe: each thread has its own error stack and its own
  // automatic printing, so every thread that calls HDF5 silences it once (kvview reads layers on
  // worker threads).
  thread_local bool silenced = false;
  if (!silenced) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    silenced = true;
  }
}

namespace {
// Start of every read helper: HDF5 silent on this thread, and the object recorded for the
// isolated pre-check's messages.
void begin_read(const std::string& object) {
  silence_errors();
  note_object_being_read(object);
}
}  // namespace

namespace {
herr_t walk_cb(unsigned n, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::string*>(data);
  // Walking downward, the last entry is the innermost: it says what actually failed.
  (void)n;
  if (e->desc && *e->desc) *out = e->desc;
  return 0;
}
}  // namespace

std::string last_error_message() {
  std::string msg;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, walk_cb, &msg);
  H5Eclear2(H5E_DEFAULT);
  return msg;
}

void Ctx::check(herr_t status, const std::string& object, const char* what) const {
  if (status < 0) {
    const std::string m = last_error_message();
    fail(ErrorKind::kCorrupt, object, std::string(what) + " failed" + (m.empty() ? "" : " (" + m + ")"));
  }
}

Handle Ctx::check_id(hid_t id, Handle::Closer closer, const std::string& object, const char* what,
                     ErrorKind kind) const {
  if (id < 0) {
    const std::string m = last_error_message();
    fail(kind, object, std::string(what) + " failed" + (m.empty() ? "" : " (" + m + ")"));
  }
  return Handle(id, closer);
}

namespace {
// H5Lexists needs every intermediate component to exist: walks them. Returns 1 when all exist, 0
// when one is missing, and the H5Lexists status (< 0) when HDF5 failed on one, with its prefix in
// `failed`.
htri_t links_exist(hid_t loc, const std::string& path, std::string& failed) {
  std::size_t pos = 0;
  while (true) {
    const std::size_t next = path.find('/', pos + 1);
    const std::string prefix = path.substr(0, next);
    if (!prefix.empty() && prefix != "/") {
      const htri_t r = H5Lexists(loc, prefix.c_str(), H5P_DEFAULT);
      if (r < 0) failed = prefix;
      if (r <= 0) return r;
    }
    if (next == std::string::npos) return 1;
    pos = next;
  }
}
}  // namespace

bool exists(hid_t loc, const std::string& path) {
  begin_read(path);
  std::string failed;
  const htri_t r = links_exist(loc, path, failed);
  if (r < 0) H5Eclear2(H5E_DEFAULT);
  return r > 0;
}

bool exists(const Ctx& c, hid_t loc, const std::string& path) {
  begin_read(path);
  std::string failed;
  const htri_t r = links_exist(loc, path, failed);
  if (r < 0) {
    const std::string m = last_error_message();
    c.fail(ErrorKind::kCorrupt, failed,
           "cannot be read (corrupt group or link" + (m.empty() ? std::string(")") : ": " + m + ")"));
  }
  return r > 0;
}

bool attr_exists(hid_t obj, const std::string& name) {
  const htri_t r = H5Aexists(obj, name.c_str());
  if (r < 0) H5Eclear2(H5E_DEFAULT);
  return r > 0;
}

namespace {
Handle scalar_space(const Ctx& c, const std::string& name) {
  return c.check_id(H5Screate(H5S_SCALAR), H5Sclose, name, "H5Screate");
}

Handle open_attr(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  if (!attr_exists(obj, name)) c.fail(ErrorKind::kMissing, objpath, "attribute '" + name + "' is missing");
  return c.check_id(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose, objpath + "@" + name, "H5Aopen");
}

void replace_attr(hid_t obj, const std::string& name) {
  if (attr_exists(obj, name)) H5Adelete(obj, name.c_str());
}
}  // namespace

void write_attr_string(const Ctx& c, hid_t obj, const std::string& name, const std::string& value) {
  replace_attr(obj, name);
  Handle type = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, name, "H5Tcopy");
  c.check(H5Tset_size(type, H5T_VARIABLE), name, "H5Tset_size");
  c.check(H5Tset_cset(type, H5T_CSET_UTF8), name, "H5Tset_cset");
  Handle space = scalar_space(c, name);
  Handle a = c.check_id(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose, name,
                        "H5Acreate2", ErrorKind::kIo);
  const char* p = value.c_str();
  c.check(H5Awrite(a, type, &p), name, "H5Awrite");
}

template <typename T>
static void write_attr_num(const Ctx& c, hid_t obj, const std::string& name, hid_t ftype, hid_t mtype,
                           T value) {
  replace_attr(obj, name);
  Handle space = scalar_space(c, name);
  Handle a = c.check_id(H5Acreate2(obj, name.c_str(), ftype, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose, name,
                        "H5Acreate2", ErrorKind::kIo);
  c.check(H5Awrite(a, mtype, &value), name, "H5Awrite");
}

void write_attr_i64(const Ctx& c, hid_t obj, const std::string& name, std::int64_t value) {
  write_attr_num(c, obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, value);
}
void write_attr_f64(const Ctx& c, hid_t obj, const std::string& name, double value) {
  write_attr_num(c, obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, value);
}
void write_attr_u8(const Ctx& c, hid_t obj, const std::string& name, std::uint8_t value) {
  write_attr_num(c, obj, name, H5T_STD_U8LE, H5T_NATIVE_UINT8, value);
}

std::string read_attr_string(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  begin_read(objpath + "@" + name);
  Handle a = open_attr(c, obj, objpath, name);
  const std::string where = objpath + "@" + name;
  Handle ftype = c.check_id(H5Aget_type(a), H5Tclose, where, "H5Aget_type");
  if (H5Tget_class(ftype) != H5T_STRING) c.fail(ErrorKind::kDType, where, "attribute must be a string");
  Handle space = c.check_id(H5Aget_space(a), H5Sclose, where, "H5Aget_space");
  if (H5Sget_simple_extent_npoints(space) != 1)
    c.fail(ErrorKind::kShape, where, "attribute must be a scalar");
  const H5T_cset_t cset = H5Tget_cset(ftype);
  if (cset != H5T_CSET_ASCII && cset != H5T_CSET_UTF8)
    c.fail(ErrorKind::kDType, where, "string is neither ASCII nor UTF-8");
  if (H5Tis_variable_str(ftype) > 0) {
    Handle mtype = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, where, "H5Tcopy");
    H5Tset_size(mtype, H5T_VARIABLE);
    H5Tset_cset(mtype, cset);
    char* p = nullptr;
    c.check(H5Aread(a, mtype, &p), where, "H5Aread");
    std::string s = p ? p : "";
    H5free_memory(p);
    if (s.size() > limits::kMaxAttrStringBytes) {
      c.fail(ErrorKind::kValue, where,
             "string of " + std::to_string(s.size()) + " bytes, more than the limit of " +
                 std::to_string(limits::kMaxAttrStringBytes));
    }
    return s;
  }
  const std::size_t n = H5Tget_size(ftype);
  if (n == 0 || n > limits::kMaxAttrStringBytes) {
    c.fail(ErrorKind::kValue, where,
           "fixed-length string of " + std::to_string(n) + " bytes (limit " +
               std::to_string(limits::kMaxAttrStringBytes) + ")");
  }
  std::string s(n, '\0');
  Handle mtype = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, where, "H5Tcopy");
  H5Tset_size(mtype, n);
  H5Tset_strpad(mtype, H5T_STR_NULLPAD);
  H5Tset_cset(mtype, cset);  // no conversion path between character sets: read in the stored one
  c.check(H5Aread(a, mtype, s.data()), where, "H5Aread");
  s.resize(s.find('\0') == std::string::npos ? n : s.find('\0'));
  return s;
}

namespace {
// A scalar numeric attribute read without narrowing: integers (and h5py bools, HDF5 enums over an
// integer) as int64, floats as double.
struct AttrNumber {
  bool is_integer = false;
  std::int64_t i = 0;
  double f = 0;
};

AttrNumber read_attr_number(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  begin_read(objpath + "@" + name);
  Handle a = open_attr(c, obj, objpath, name);
  const std::string where = objpath + "@" + name;
  Handle ftype = c.check_id(H5Aget_type(a), H5Tclose, where, "H5Aget_type");
  Handle space = c.check_id(H5Aget_space(a), H5Sclose, where, "H5Aget_space");
  if (H5Sget_simple_extent_npoints(space) != 1)
    c.fail(ErrorKind::kShape, where, "attribute must be a scalar");
  AttrNumber out;
  H5T_class_t cls = H5Tget_class(ftype);
  Handle base;
  hid_t itype = ftype;
  if (cls == H5T_ENUM) {
    base = c.check_id(H5Tget_super(ftype), H5Tclose, where, "H5Tget_super");
    itype = base;
    cls = H5Tget_class(base);
  }
  if (cls == H5T_INTEGER) {
    const std::size_t size = H5Tget_size(itype);
    if (size == 0 || size > 8)
      c.fail(ErrorKind::kDType, where, "integer of " + std::to_string(size) + " bytes (at most 8)");
    out.is_integer = true;
    std::vector<unsigned char> buf(H5Tget_size(ftype) + 8, 0);
    c.check(H5Aread(a, ftype, buf.data()), where, "H5Aread");
    const bool is_unsigned = H5Tget_sign(itype) == H5T_SGN_NONE;
    // The stored bytes converted to a 64-bit integer of the same signedness: exact.
    c.check(H5Tconvert(itype, is_unsigned ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64, 1, buf.data(), nullptr,
                       H5P_DEFAULT),
            where, "H5Tconvert");
    if (is_unsigned) {
      std::uint64_t u = 0;
      std::memcpy(&u, buf.data(), sizeof u);
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        c.fail(ErrorKind::kValue, where, "value " + std::to_string(u) + " is out of range");
      }
      out.i = static_cast<std::int64_t>(u);
    } else {
      std::memcpy(&out.i, buf.data(), sizeof out.i);
    }
    out.f = static_cast<double>(out.i);
    return out;
  }
  if (cls != H5T_FLOAT) c.fail(ErrorKind::kDType, where, "attribute must be numeric");
  if (H5Tget_size(ftype) > 8) c.fail(ErrorKind::kDType, where, "float of more than 8 bytes");
  c.check(H5Aread(a, H5T_NATIVE_DOUBLE, &out.f), where, "H5Aread");
  return out;
}

std::string number_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

std::int64_t read_attr_i64(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  const AttrNumber n = read_attr_number(c, obj, objpath, name);
  if (n.is_integer) return n.i;
  // A float attribute is accepted where an integer is expected only when it holds an integer.
  if (!std::isfinite(n.f) || n.f != std::floor(n.f) || std::fabs(n.f) >= 9.2e18) {
    c.fail(ErrorKind::kValue, objpath + "@" + name, "must be an integer, got " + number_text(n.f));
  }
  return static_cast<std::int64_t>(n.f);
}
double read_attr_f64(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  return read_attr_number(c, obj, objpath, name).f;
}
bool read_attr_bool(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  const AttrNumber n = read_attr_number(c, obj, objpath, name);
  if (n.is_integer ? (n.i != 0 && n.i != 1) : (n.f != 0.0 && n.f != 1.0)) {
    c.fail(ErrorKind::kValue, objpath + "@" + name,
           "must be 0 or 1, got " + (n.is_integer ? std::to_string(n.i) : number_text(n.f)));
  }
  return n.is_integer ? n.i != 0 : n.f != 0.0;
}

std::vector<hsize_t> dataset_shape(const Ctx& c, hid_t file, const std::string& path) {
  begin_read(path);
  if (!exists(c, file, path)) c.fail(ErrorKind::kMissing, path, "dataset is missing");
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle s = c.check_id(H5Dget_space(d), H5Sclose, path, "H5Dget_space");
  const int rank = H5Sget_simple_extent_ndims(s);
  if (rank < 0) c.fail(ErrorKind::kCorrupt, path, "cannot read dataspace");
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  if (rank > 0) H5Sget_simple_extent_dims(s, dims.data(), nullptr);
  return dims;
}

hid_t half_type() {
  // IEEE binary16, little-endian: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits.
  // HDF5 1.10 has no predefined half type; this one is equal to numpy's '<f2'.
  static hid_t t = [] {
    hid_t h = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(h, 15, 10, 5, 0, 10);
    H5Tset_precision(h, 16);
    H5Tset_size(h, 2);
    H5Tset_ebias(h, 15);
    H5Tset_norm(h, H5T_NORM_IMPLIED);
    H5Tlock(h);
    return h;
  }();
  return t;
}

hid_t file_type_of(DType t) {
  switch (t) {
    case DType::kF32:
      return H5T_IEEE_F32LE;
    case DType::kBF16:
      return H5T_STD_U16LE;
    case DType::kF16:
      return half_type();
  }
  return H5T_IEEE_F32LE;
}

hid_t memory_type_of(DType t) {
  switch (t) {
    case DType::kF32:
      return H5T_NATIVE_FLOAT;
    case DType::kBF16:
      return H5T_NATIVE_UINT16;
    case DType::kF16:
      return half_type();
  }
  return H5T_NATIVE_FLOAT;
}

namespace {
// Checks every field of a stored float type against IEEE binary16 / binary32 little-endian.
// Precision covers all bits (sign + exponent + mantissa = 8 * size), so there is no padding.
void check_ieee_float(const Ctx& c, const std::string& path, hid_t t, std::size_t size) {
  const bool half = size == 2;
  const char* name = half ? "float16" : "float32";
  auto bad = [&](const std::string& what, long long got, long long want) {
    c.fail(ErrorKind::kDType, path,
           std::string(name) + " datatype is not IEEE binary" + (half ? "16" : "32") +
               " little-endian: " + what + " " + std::to_string(got) + ", expected " + std::to_string(want));
  };
  const H5T_order_t order = H5Tget_order(t);
  if (order == H5T_ORDER_BE) {
    c.fail(ErrorKind::kDType, path,
           std::string("big-endian ") + name +
               " not allowed (tensors are stored little-endian, docs/trace-format.md section 5)");
  }
  if (order != H5T_ORDER_LE) bad("byte order", order, H5T_ORDER_LE);
  const long long prec = static_cast<long long>(H5Tget_precision(t));
  if (prec != static_cast<long long>(8 * size)) bad("precision", prec, static_cast<long long>(8 * size));
  if (H5Tget_offset(t) != 0) bad("bit offset", H5Tget_offset(t), 0);
  std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
  c.check(H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize), path, "H5Tget_fields");
  const std::size_t want_e = half ? 5 : 8, want_m = half ? 10 : 23;
  if (spos != 8 * size - 1)
    bad("sign position", static_cast<long long>(spos), static_cast<long long>(8 * size - 1));
  if (esize != want_e) bad("exponent size", static_cast<long long>(esize), static_cast<long long>(want_e));
  if (epos != want_m) bad("exponent position", static_cast<long long>(epos), static_cast<long long>(want_m));
  if (msize != want_m) bad("mantissa size", static_cast<long long>(msize), static_cast<long long>(want_m));
  if (mpos != 0) bad("mantissa position", static_cast<long long>(mpos), 0);
  const long long bias = static_cast<long long>(H5Tget_ebias(t));
  if (bias != (half ? 15 : 127)) bad("exponent bias", bias, half ? 15 : 127);
  if (H5Tget_norm(t) != H5T_NORM_IMPLIED) bad("mantissa normalization", H5Tget_norm(t), H5T_NORM_IMPLIED);
}
}  // namespace

DType tensor_dtype(const Ctx& c, hid_t file, const std::string& path) {
  begin_read(path);
  if (!exists(c, file, path)) c.fail(ErrorKind::kMissing, path, "dataset is missing");
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle t = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  const H5T_class_t cls = H5Tget_class(t);
  const std::size_t size = H5Tget_size(t);
  if (cls == H5T_FLOAT && (size == 4 || size == 2)) {
    check_ieee_float(c, path, t, size);
    return size == 4 ? DType::kF32 : DType::kF16;
  }
  if (cls == H5T_INTEGER && size == 2 && H5Tget_sign(t) == H5T_SGN_NONE) {
    if (attr_exists(d, "dtype") && read_attr_string(c, d, path, "dtype") == "bfloat16") {
      if (H5Tget_order(t) != H5T_ORDER_LE || H5Tget_precision(t) != 16 || H5Tget_offset(t) != 0) {
        c.fail(ErrorKind::kDType, path, "bfloat16 must be stored as 16-bit little-endian unsigned integers");
      }
      return DType::kBF16;
    }
    c.fail(ErrorKind::kDType, path,
           "uint16 tensor without attribute dtype=\"bfloat16\" (allowed: float16, float32, bfloat16)");
  }
  std::string desc = cls == H5T_FLOAT ? "float" + std::to_string(size * 8)
                     : cls == H5T_INTEGER
                         ? (H5Tget_sign(t) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(size * 8)
                         : "non-numeric";
  c.fail(ErrorKind::kDType, path, "dtype " + desc + " not allowed (allowed: float16, float32, bfloat16)");
}

namespace {
std::string bytes_text(std::uint64_t b) { return std::to_string(b) + " bytes"; }
}  // namespace

void check_alloc(const Ctx& c, const std::string& path, std::uint64_t count, std::uint64_t elem_bytes) {
  if (elem_bytes && count > limits::kMaxReadBytes / elem_bytes) {
    c.fail(ErrorKind::kValue, path,
           "reading " + std::to_string(count) + " elements of " + std::to_string(elem_bytes) +
               " bytes needs more than the reader's limit of " + bytes_text(limits::kMaxReadBytes));
  }
}

void check_storage(const Ctx& c, hid_t dset, const std::string& path, std::uint64_t declared_bytes) {
  if (declared_bytes <= limits::kStorageSlackBytes) return;
  Handle dcpl = c.check_id(H5Dget_create_plist(dset), H5Pclose, path, "H5Dget_create_plist");
  // Data in external files or virtual sources is not in this file: only the limit above applies.
  if (H5Pget_external_count(dcpl) > 0 || H5Pget_layout(dcpl) == H5D_VIRTUAL) return;
  const std::uint64_t stored = H5Dget_storage_size(dset);
  hsize_t file_size = 0;
  {
    Handle f = c.check_id(H5Iget_file_id(dset), H5Fclose, path, "H5Iget_file_id");
    c.check(H5Fget_filesize(f, &file_size), path, "H5Fget_filesize");
  }
  if (stored > file_size) {
    c.fail(ErrorKind::kCorrupt, path,
           "claims " + bytes_text(stored) + " of storage in a file of " + bytes_text(file_size) +
               ": the file is corrupt");
  }
  const bool filtered = H5Pget_nfilters(dcpl) > 0;
  const std::uint64_t ratio = filtered ? limits::kMaxCompressionRatio : 1;
  const std::uint64_t can_hold = stored > (std::numeric_limits<std::uint64_t>::max() / 2) / ratio
                                     ? std::numeric_limits<std::uint64_t>::max()
                                     : stored * ratio + limits::kStorageSlackBytes;
  if (declared_bytes > can_hold) {
    c.fail(ErrorKind::kCorrupt, path,
           "declares " + bytes_text(declared_bytes) + " of data but stores " + bytes_text(stored) +
               (filtered ? " (at most " + std::to_string(limits::kMaxCompressionRatio) + "x that compressed)"
                         : "") +
               ": the data is not in the file");
  }
}

namespace {
void check_shape(const Ctx& c, const std::string& path, const std::vector<hsize_t>& got,
                 const std::vector<hsize_t>& want) {
  if (got != want) {
    auto str = [](const std::vector<hsize_t>& v) {
      std::string s = "[";
      for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
      return s + "]";
    };
    c.fail(ErrorKind::kShape, path, "shape " + str(got) + ", expected " + str(want));
  }
}

std::uint64_t numel(const std::vector<hsize_t>& shape) {
  std::uint64_t n = 1;
  for (auto e : shape) {
    if (e != 0 && n > std::numeric_limits<std::uint64_t>::max() / e)
      return std::numeric_limits<std::uint64_t>::max();
    n *= e;
  }
  return n;
}
}  // namespace

std::vector<std::int64_t> read_i64(const Ctx& c, hid_t file, const std::string& path,
                                   const std::vector<hsize_t>& expect) {
  check_shape(c, path, dataset_shape(c, file, path), expect);
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle t = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  if (H5Tget_class(t) != H5T_INTEGER) c.fail(ErrorKind::kDType, path, "must be an integer dataset");
  const std::size_t size = H5Tget_size(t);
  if (size == 0 || size > 8)
    c.fail(ErrorKind::kDType, path, "integer of " + std::to_string(size) + " bytes (at most 8)");
  const std::uint64_t n = numel(expect);
  check_alloc(c, path, n, 8);
  check_storage(c, d, path, n * size);
  std::vector<std::int64_t> out(n);
  if (!n) return out;
  if (H5Tget_sign(t) == H5T_SGN_NONE && size == 8) {
    // Read unsigned 64-bit values as such: converting them to int64 would clamp silently.
    std::vector<std::uint64_t> u(n);
    c.check(H5Dread(d, H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, u.data()), path, "H5Dread");
    for (std::uint64_t i = 0; i < n; ++i) {
      if (u[i] > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        c.fail(ErrorKind::kValue, path,
               "value " + std::to_string(u[i]) + " at index " + std::to_string(i) + " is out of range");
      }
      out[i] = static_cast<std::int64_t>(u[i]);
    }
    return out;
  }
  c.check(H5Dread(d, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), path, "H5Dread");
  return out;
}

std::vector<std::int32_t> read_i32(const Ctx& c, hid_t file, const std::string& path,
                                   const std::vector<hsize_t>& expect_shape) {
  const std::vector<std::int64_t> wide = read_i64(c, file, path, expect_shape);
  std::vector<std::int32_t> out(wide.size());
  for (std::size_t i = 0; i < wide.size(); ++i) {
    if (wide[i] < std::numeric_limits<std::int32_t>::min() ||
        wide[i] > std::numeric_limits<std::int32_t>::max()) {
      c.fail(
          ErrorKind::kValue, path,
          "value " + std::to_string(wide[i]) + " at index " + std::to_string(i) + " does not fit in int32");
    }
    out[i] = static_cast<std::int32_t>(wide[i]);
  }
  return out;
}

std::vector<float> read_f32(const Ctx& c, hid_t file, const std::string& path,
                            const std::vector<hsize_t>& expect) {
  check_shape(c, path, dataset_shape(c, file, path), expect);
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle t = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  if (H5Tget_class(t) != H5T_FLOAT || H5Tget_size(t) != 4) c.fail(ErrorKind::kDType, path, "must be float32");
  check_ieee_float(c, path, t, 4);
  const std::uint64_t n = numel(expect);
  check_alloc(c, path, n, 4);
  check_storage(c, d, path, n * 4);
  std::vector<float> out(n);
  if (n) c.check(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), path, "H5Dread");
  return out;
}

void read_tensor_slab(const Ctx& c, hid_t file, const std::string& path, DType dtype,
                      const std::vector<hsize_t>& start, const std::vector<hsize_t>& count, void* out) {
  begin_read(path);
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle fs = c.check_id(H5Dget_space(d), H5Sclose, path, "H5Dget_space");
  c.check(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr), path,
          "H5Sselect_hyperslab");
  Handle ms = c.check_id(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose,
                         path, "H5Screate_simple");
  c.check(H5Dread(d, memory_type_of(dtype), ms, fs, H5P_DEFAULT, out), path,
          "H5Dread (truncated or corrupt data?)");
}

void check_tensor_read(const Ctx& c, hid_t file, const std::string& path, DType dtype,
                       std::uint64_t alloc_count) {
  const std::uint64_t eb = kernels::dtype_bytes(dtype);
  check_alloc(c, path, alloc_count, eb);
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle fs = c.check_id(H5Dget_space(d), H5Sclose, path, "H5Dget_space");
  const hssize_t total = H5Sget_simple_extent_npoints(fs);
  if (total < 0) c.fail(ErrorKind::kCorrupt, path, "cannot read dataspace");
  // The whole dataset must be in the file, not only the part read: a reader of one head would
  // otherwise accept a file whose other heads read as fill values.
  const std::uint64_t n = static_cast<std::uint64_t>(total);
  check_storage(c, d, path,
                n > std::numeric_limits<std::uint64_t>::max() / eb ? std::numeric_limits<std::uint64_t>::max()
                                                                   : n * eb);
}

VlenBudget::VlenBudget(const Ctx& c, const std::string& path, std::uint64_t budget)
    : c_(c), path_(path), budget_(budget) {
  dxpl_ = c.check_id(H5Pcreate(H5P_DATASET_XFER), H5Pclose, path, "H5Pcreate");
  c.check(H5Pset_vlen_mem_manager(dxpl_, &VlenBudget::alloc, this, &VlenBudget::release, this), path,
          "H5Pset_vlen_mem_manager");
}

// Every block carries its size in front, so a string can be checked against its stored length.
namespace {
constexpr std::size_t kVlenHeader = 16;
}

VlenBudget::~VlenBudget() {
  for (void* block : live_) std::free(block);
}

void* VlenBudget::alloc(std::size_t size, void* info) {
  auto* self = static_cast<VlenBudget*>(info);
  if (size > self->budget_ - std::min(self->budget_, self->used_)) {
    self->exhausted_ = true;
    return nullptr;
  }
  auto* p = static_cast<unsigned char*>(std::malloc(size + kVlenHeader));
  if (!p) return nullptr;
  self->live_.insert(p);
  self->used_ += size;
  std::memcpy(p, &size, sizeof size);
  return p + kVlenHeader;
}

void VlenBudget::release(void* p, void* info) {
  if (!p) return;
  void* block = static_cast<unsigned char*>(p) - kVlenHeader;
  static_cast<VlenBudget*>(info)->live_.erase(block);
  std::free(block);
}

void VlenBudget::fail_read(herr_t status) const {
  if (exhausted_) {
    last_error_message();
    c_.fail(ErrorKind::kValue, path_,
            "strings of more than " + std::to_string(budget_) + " bytes in all (the limit)");
  }
  c_.check(status, path_, "H5Dread");
  c_.fail(ErrorKind::kCorrupt, path_, "H5Dread failed");
}

void VlenBudget::check_string(const char* s, const std::string& object, std::size_t index) const {
  if (!s) return;
  std::size_t size = 0;
  std::memcpy(&size, reinterpret_cast<const unsigned char*>(s) - kVlenHeader, sizeof size);
  const std::size_t len = strnlen(s, size);
  if (len + 1 != size) {
    c_.fail(ErrorKind::kCorrupt, object,
            (object.rfind("/profile", 0) == 0 ? "row " : "string ") + std::to_string(index) +
                ": stored length " + std::to_string(size - 1) + " bytes, but the string has " +
                std::to_string(len) + " (corrupt string length)");
  }
}

namespace {
// For a contiguous variable-length string dataset, reads the stored lengths (the first 4 bytes,
// little-endian, of each element: length, then the global heap id) straight from the file and
// checks them before HDF5 allocates a buffer of each length.
// `offsets` are the byte offsets of the variable-length strings inside one stored element of
// `elem` bytes (0: the element is one string and its size is the stored bytes / n).
void prescan_vlen_lengths(const Ctx& c, hid_t d, const std::string& path, hsize_t n,
                          const std::vector<std::size_t>& offsets, std::uint64_t elem) {
  Handle dcpl = c.check_id(H5Dget_create_plist(d), H5Pclose, path, "H5Dget_create_plist");
  if (H5Pget_layout(dcpl) != H5D_CONTIGUOUS || H5Pget_external_count(dcpl) > 0) return;
  const haddr_t off = H5Dget_offset(d);
  if (off == HADDR_UNDEF) {
    H5Eclear2(H5E_DEFAULT);
    return;
  }
  const std::uint64_t stored = H5Dget_storage_size(d);
  hsize_t file_size = 0;
  {
    Handle f = c.check_id(H5Iget_file_id(d), H5Fclose, path, "H5Iget_file_id");
    c.check(H5Fget_filesize(f, &file_size), path, "H5Fget_filesize");
  }
  if (off > file_size || stored > file_size - off) {
    c.fail(ErrorKind::kCorrupt, path,
           "stores " + std::to_string(stored) + " bytes at offset " + std::to_string(off) + " in a file of " +
               std::to_string(file_size) + " bytes");
  }
  const bool rows = elem != 0;  // compound rows, not a string dataset
  if (elem == 0) {
    if (stored % n != 0 || stored / n < 12 || stored / n > 64) {
      c.fail(ErrorKind::kCorrupt, path,
             "stores " + std::to_string(stored) + " bytes for " + std::to_string(n) +
                 " variable-length strings");
    }
    elem = stored / n;
  } else if (stored != n * elem) {
    return;  // a layout this scan does not know: the allocation budget still applies
  }
  std::vector<unsigned char> raw(stored);
  std::FILE* fp = std::fopen(c.file.c_str(), "rb");
  if (!fp) return;
  const bool ok =
      fseeko(fp, static_cast<off_t>(off), SEEK_SET) == 0 && std::fread(raw.data(), 1, stored, fp) == stored;
  std::fclose(fp);
  if (!ok) return;
  std::uint64_t total = 0;
  for (hsize_t i = 0; i < n; ++i) {
    for (const std::size_t o : offsets) {
      const unsigned char* e = raw.data() + i * elem + o;
      const std::uint64_t len = std::uint64_t{e[0]} | std::uint64_t{e[1]} << 8 | std::uint64_t{e[2]} << 16 |
                                std::uint64_t{e[3]} << 24;
      if (len > file_size) {
        c.fail(ErrorKind::kCorrupt, path,
               (rows ? "row " : "string ") + std::to_string(i) + ": stored string length " +
                   std::to_string(len) + " bytes, more than the file's " + std::to_string(file_size) +
                   " (corrupt string length)");
      }
      total += len;
    }
  }
  if (total > limits::kMaxStringBytes) {
    c.fail(ErrorKind::kValue, path,
           "strings of " + std::to_string(total) + " bytes in all, more than the limit of " +
               std::to_string(limits::kMaxStringBytes));
  }
}
}  // namespace

std::vector<std::string> read_strings(const Ctx& c, hid_t file, const std::string& path, hsize_t n) {
  check_shape(c, path, dataset_shape(c, file, path), {n});
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle ft = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  if (H5Tget_class(ft) != H5T_STRING) c.fail(ErrorKind::kDType, path, "must be a string dataset");
  const H5T_cset_t cset = H5Tget_cset(ft);
  if (cset != H5T_CSET_ASCII && cset != H5T_CSET_UTF8)
    c.fail(ErrorKind::kDType, path, "strings are neither ASCII nor UTF-8");
  check_alloc(c, path, n, sizeof(std::string) + sizeof(char*));
  std::vector<std::string> out(n);
  if (n == 0) return out;
  if (H5Tis_variable_str(ft) > 0) {
    check_storage(c, d, path, n * 16);  // 16 bytes per element on disk: length + global heap id
    prescan_vlen_lengths(c, d, path, n, {0}, 0);
    Handle mt = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, path, "H5Tcopy");
    H5Tset_size(mt, H5T_VARIABLE);
    H5Tset_cset(mt, cset);
    VlenBudget budget(c, path, limits::kMaxStringBytes);
    std::vector<char*> ptrs(n, nullptr);
    const herr_t st = H5Dread(d, mt, H5S_ALL, H5S_ALL, budget.dxpl(), ptrs.data());
    if (st < 0) budget.fail_read(st);
    for (hsize_t i = 0; i < n; ++i) {
      budget.check_string(ptrs[i], path, i);
      out[i] = ptrs[i] ? ptrs[i] : "";
    }
  } else {
    const std::size_t w = H5Tget_size(ft);
    check_alloc(c, path, n, w);
    check_storage(c, d, path, n * w);
    std::vector<char> buf(w * n);
    Handle mt = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, path, "H5Tcopy");
    H5Tset_size(mt, w);
    H5Tset_strpad(mt, H5T_STR_NULLPAD);
    H5Tset_cset(mt, cset);  // no conversion path between character sets: read in the stored one
    c.check(H5Dread(d, mt, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()), path, "H5Dread");
    for (hsize_t i = 0; i < n; ++i) out[i] = std::string(buf.data() + i * w, strnlen(buf.data() + i * w, w));
  }
  return out;
}

void prescan_compound_strings(const Ctx& c, hid_t d, const std::string& path, hsize_t n) {
  if (n == 0) return;
  Handle ft = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  if (H5Tget_class(ft) != H5T_COMPOUND) return;
  // H5Dget_type describes the element in memory (a string is a char*); on disk a variable-length
  // string is 16 bytes (length, heap address, index), and later members shift by the difference.
  struct Member {
    std::size_t offset, size;
    bool vstr;
  };
  std::vector<Member> members;
  const int nm = H5Tget_nmembers(ft);
  for (int i = 0; i < nm; ++i) {
    Handle mt =
        c.check_id(H5Tget_member_type(ft, static_cast<unsigned>(i)), H5Tclose, path, "H5Tget_member_type");
    const bool vstr = H5Tget_class(mt) == H5T_STRING && H5Tis_variable_str(mt) > 0;
    if (H5Tget_class(mt) == H5T_VLEN || H5Tget_class(mt) == H5T_COMPOUND) return;  // not scanned
    members.push_back({H5Tget_member_offset(ft, static_cast<unsigned>(i)), H5Tget_size(mt), vstr});
  }
  std::sort(members.begin(), members.end(),
            [](const Member& a, const Member& b) { return a.offset < b.offset; });
  std::vector<std::size_t> offsets;
  std::size_t shift = 0;
  for (const Member& m : members) {
    if (!m.vstr) continue;
    offsets.push_back(m.offset + shift);
    shift += 16 - m.size;
  }
  if (offsets.empty()) return;
  prescan_vlen_lengths(c, d, path, n, offsets, H5Tget_size(ft) + shift);
}

namespace {
Handle utf8_string_type(const Ctx& c) {
  Handle str = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, "/profile", "H5Tcopy");
  H5Tset_size(str, H5T_VARIABLE);
  H5Tset_cset(str, H5T_CSET_UTF8);
  return str;
}
}  // namespace

Handle kernel_row_type(const Ctx& c) {
  Handle str = utf8_string_type(c);
  const hsize_t three = 3;
  Handle i32x3 =
      c.check_id(H5Tarray_create2(H5T_NATIVE_INT32, 1, &three), H5Tclose, "/profile", "H5Tarray_create2");
  Handle t =
      c.check_id(H5Tcreate(H5T_COMPOUND, sizeof(KernelRow)), H5Tclose, "/profile/kernels", "H5Tcreate");
  H5Tinsert(t, "name", HOFFSET(KernelRow, name), str);
  H5Tinsert(t, "kind", HOFFSET(KernelRow, kind), str);
  H5Tinsert(t, "start_ns", HOFFSET(KernelRow, start_ns), H5T_NATIVE_INT64);
  H5Tinsert(t, "end_ns", HOFFSET(KernelRow, end_ns), H5T_NATIVE_INT64);
  H5Tinsert(t, "stream", HOFFSET(KernelRow, stream), H5T_NATIVE_INT64);
  H5Tinsert(t, "bytes", HOFFSET(KernelRow, bytes), H5T_NATIVE_INT64);
  H5Tinsert(t, "device", HOFFSET(KernelRow, device), H5T_NATIVE_INT32);
  H5Tinsert(t, "grid", HOFFSET(KernelRow, grid), i32x3);
  H5Tinsert(t, "block", HOFFSET(KernelRow, block), i32x3);
  return t;
}

Handle range_row_type(const Ctx& c) {
  Handle str = utf8_string_type(c);
  Handle t = c.check_id(H5Tcreate(H5T_COMPOUND, sizeof(RangeRow)), H5Tclose, "/profile/ranges", "H5Tcreate");
  H5Tinsert(t, "name", HOFFSET(RangeRow, name), str);
  H5Tinsert(t, "start_ns", HOFFSET(RangeRow, start_ns), H5T_NATIVE_INT64);
  H5Tinsert(t, "end_ns", HOFFSET(RangeRow, end_ns), H5T_NATIVE_INT64);
  H5Tinsert(t, "thread", HOFFSET(RangeRow, thread), H5T_NATIVE_INT64);
  H5Tinsert(t, "depth", HOFFSET(RangeRow, depth), H5T_NATIVE_INT32);
  return t;
}

}  // namespace kvscope::trace::h5
