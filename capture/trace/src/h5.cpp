#include "h5.hpp"

#include <cstring>

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

bool exists(hid_t loc, const std::string& path) {
  begin_read(path);
  // H5Lexists needs every intermediate component to exist: walk them.
  std::size_t pos = 0;
  while (true) {
    std::size_t next = path.find('/', pos + 1);
    const std::string prefix = path.substr(0, next);
    if (!prefix.empty() && prefix != "/") {
      if (H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return false;
      }
    }
    if (next == std::string::npos) return true;
    pos = next;
  }
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
  if (H5Sget_simple_extent_npoints(space) != 1) c.fail(ErrorKind::kShape, where, "attribute must be a scalar");
  if (H5Tis_variable_str(ftype) > 0) {
    Handle mtype = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, where, "H5Tcopy");
    H5Tset_size(mtype, H5T_VARIABLE);
    H5Tset_cset(mtype, H5Tget_cset(ftype));
    char* p = nullptr;
    c.check(H5Aread(a, mtype, &p), where, "H5Aread");
    std::string s = p ? p : "";
    H5free_memory(p);
    return s;
  }
  const std::size_t n = H5Tget_size(ftype);
  std::string s(n, '\0');
  Handle mtype = c.check_id(H5Tcopy(H5T_C_S1), H5Tclose, where, "H5Tcopy");
  H5Tset_size(mtype, n);
  H5Tset_strpad(mtype, H5T_STR_NULLPAD);
  c.check(H5Aread(a, mtype, s.data()), where, "H5Aread");
  s.resize(s.find('\0') == std::string::npos ? n : s.find('\0'));
  return s;
}

namespace {
// Reads a scalar numeric attribute converted to `mtype`; bool enums are read through their base type.
template <typename T>
T read_attr_numeric(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name, hid_t mtype) {
  begin_read(objpath + "@" + name);
  Handle a = open_attr(c, obj, objpath, name);
  const std::string where = objpath + "@" + name;
  Handle ftype = c.check_id(H5Aget_type(a), H5Tclose, where, "H5Aget_type");
  const H5T_class_t cls = H5Tget_class(ftype);
  Handle space = c.check_id(H5Aget_space(a), H5Sclose, where, "H5Aget_space");
  if (H5Sget_simple_extent_npoints(space) != 1) c.fail(ErrorKind::kShape, where, "attribute must be a scalar");
  if (cls == H5T_ENUM) {
    Handle base = c.check_id(H5Tget_super(ftype), H5Tclose, where, "H5Tget_super");
    std::int64_t raw = 0;
    std::vector<unsigned char> buf(H5Tget_size(base) + 8);
    c.check(H5Aread(a, ftype, buf.data()), where, "H5Aread");
    Handle nbase = c.check_id(H5Tget_native_type(base, H5T_DIR_ASCEND), H5Tclose, where, "native type");
    c.check(H5Tconvert(nbase, H5T_NATIVE_INT64, 1, buf.data(), nullptr, H5P_DEFAULT), where, "H5Tconvert");
    std::memcpy(&raw, buf.data(), sizeof raw);
    return static_cast<T>(raw);
  }
  if (cls != H5T_INTEGER && cls != H5T_FLOAT) c.fail(ErrorKind::kDType, where, "attribute must be numeric");
  T v{};
  c.check(H5Aread(a, mtype, &v), where, "H5Aread");
  return v;
}
}  // namespace

std::int64_t read_attr_i64(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  return read_attr_numeric<std::int64_t>(c, obj, objpath, name, H5T_NATIVE_INT64);
}
double read_attr_f64(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  return read_attr_numeric<double>(c, obj, objpath, name, H5T_NATIVE_DOUBLE);
}
bool read_attr_bool(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name) {
  return read_attr_numeric<std::int64_t>(c, obj, objpath, name, H5T_NATIVE_INT64) != 0;
}

std::vector<hsize_t> dataset_shape(const Ctx& c, hid_t file, const std::string& path) {
  begin_read(path);
  if (!exists(file, path)) c.fail(ErrorKind::kMissing, path, "dataset is missing");
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
    case DType::kF32: return H5T_IEEE_F32LE;
    case DType::kBF16: return H5T_STD_U16LE;
    case DType::kF16: return half_type();
  }
  return H5T_IEEE_F32LE;
}

hid_t memory_type_of(DType t) {
  switch (t) {
    case DType::kF32: return H5T_NATIVE_FLOAT;
    case DType::kBF16: return H5T_NATIVE_UINT16;
    case DType::kF16: return half_type();
  }
  return H5T_NATIVE_FLOAT;
}

DType tensor_dtype(const Ctx& c, hid_t file, const std::string& path) {
  begin_read(path);
  if (!exists(file, path)) c.fail(ErrorKind::kMissing, path, "dataset is missing");
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle t = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  const H5T_class_t cls = H5Tget_class(t);
  const std::size_t size = H5Tget_size(t);
  if (cls == H5T_FLOAT && size == 4) return DType::kF32;
  if (cls == H5T_FLOAT && size == 2) return DType::kF16;
  if (cls == H5T_INTEGER && size == 2 && H5Tget_sign(t) == H5T_SGN_NONE) {
    if (attr_exists(d, "dtype") && read_attr_string(c, d, path, "dtype") == "bfloat16") return DType::kBF16;
    c.fail(ErrorKind::kDType, path, "uint16 tensor without attribute dtype=\"bfloat16\" (allowed: float16, float32, bfloat16)");
  }
  std::string desc = cls == H5T_FLOAT ? "float" + std::to_string(size * 8)
                     : cls == H5T_INTEGER ? (H5Tget_sign(t) == H5T_SGN_NONE ? "uint" : "int") + std::to_string(size * 8)
                                          : "non-numeric";
  c.fail(ErrorKind::kDType, path, "dtype " + desc + " not allowed (allowed: float16, float32, bfloat16)");
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

template <typename T>
std::vector<T> read_int_dataset(const Ctx& c, hid_t file, const std::string& path,
                                const std::vector<hsize_t>& expect, hid_t mtype) {
  check_shape(c, path, dataset_shape(c, file, path), expect);
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle t = c.check_id(H5Dget_type(d), H5Tclose, path, "H5Dget_type");
  if (H5Tget_class(t) != H5T_INTEGER) c.fail(ErrorKind::kDType, path, "must be an integer dataset");
  std::size_t n = 1;
  for (auto e : expect) n *= e;
  std::vector<T> out(n);
  if (n) c.check(H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), path, "H5Dread");
  return out;
}
}  // namespace

std::vector<std::int32_t> read_i32(const Ctx& c, hid_t file, const std::string& path,
                                   const std::vector<hsize_t>& expect_shape) {
  return read_int_dataset<std::int32_t>(c, file, path, expect_shape, H5T_NATIVE_INT32);
}

std::vector<std::uint8_t> read_u8(const Ctx& c, hid_t file, const std::string& path, hsize_t expect_len) {
  return read_int_dataset<std::uint8_t>(c, file, path, {expect_len}, H5T_NATIVE_UINT8);
}

void read_tensor_slab(const Ctx& c, hid_t file, const std::string& path, DType dtype,
                      const std::vector<hsize_t>& start, const std::vector<hsize_t>& count, void* out) {
  begin_read(path);
  Handle d = c.check_id(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose, path, "H5Dopen2");
  Handle fs = c.check_id(H5Dget_space(d), H5Sclose, path, "H5Dget_space");
  c.check(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr), path,
          "H5Sselect_hyperslab");
  Handle ms = c.check_id(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose, path,
                         "H5Screate_simple");
  c.check(H5Dread(d, memory_type_of(dtype), ms, fs, H5P_DEFAULT, out), path, "H5Dread (truncated or corrupt data?)");
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
  Handle i32x3 = c.check_id(H5Tarray_create2(H5T_NATIVE_INT32, 1, &three), H5Tclose, "/profile", "H5Tarray_create2");
  Handle t = c.check_id(H5Tcreate(H5T_COMPOUND, sizeof(KernelRow)), H5Tclose, "/profile/kernels", "H5Tcreate");
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
