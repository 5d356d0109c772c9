// Internal HDF5 helpers for the trace library: RAII handles, checked calls
// that turn the HDF5 error stack into TraceError, typed attribute and dataset I/O.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvscope/trace/error.hpp"
#include "kvscope/trace/schema.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace kvscope::trace::h5 {

// Disables HDF5's automatic printing of its error stack (done once).
void silence_errors();
// Innermost message of the current HDF5 error stack ("" when empty).
std::string last_error_message();

// Owning hid_t with the right close function.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }
  void reset() {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = H5I_INVALID_HID;
  }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  operator hid_t() const { return id_; }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Context for error messages: which file.
struct Ctx {
  std::string file;
  [[noreturn]] void fail(ErrorKind k, const std::string& object, const std::string& msg) const {
    note_failure(k, file, object, msg);  // survives a crash in the cleanup (isolated pre-check)
    throw TraceError(k, file, object, msg);
  }
  // Throws kCorrupt with HDF5's own message when `status` < 0.
  void check(herr_t status, const std::string& object, const char* what) const;
  Handle check_id(hid_t id, Handle::Closer closer, const std::string& object, const char* what,
                  ErrorKind kind = ErrorKind::kCorrupt) const;
};

bool exists(hid_t loc, const std::string& path);  // link exists (every path component)
bool attr_exists(hid_t obj, const std::string& name);

// Attributes (scalar). Readers accept any integer/float class the library can convert,
// bool enums written by h5py, and fixed- or variable-length strings.
void write_attr_string(const Ctx& c, hid_t obj, const std::string& name, const std::string& value);
void write_attr_i64(const Ctx& c, hid_t obj, const std::string& name, std::int64_t value);
void write_attr_f64(const Ctx& c, hid_t obj, const std::string& name, double value);
void write_attr_u8(const Ctx& c, hid_t obj, const std::string& name, std::uint8_t value);
std::string read_attr_string(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name);
std::int64_t read_attr_i64(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name);
double read_attr_f64(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name);
bool read_attr_bool(const Ctx& c, hid_t obj, const std::string& objpath, const std::string& name);

// Dataset shape (throws kMissing when absent).
std::vector<hsize_t> dataset_shape(const Ctx& c, hid_t file, const std::string& path);

// Element type of a tensor dataset: float16, float32, or uint16 + attribute dtype="bfloat16".
DType tensor_dtype(const Ctx& c, hid_t file, const std::string& path);
hid_t half_type();              // IEEE binary16 little-endian (never close it)
hid_t file_type_of(DType t);    // stored HDF5 type (never close it)
hid_t memory_type_of(DType t);  // native memory type for reading raw elements

// Reads a whole integer dataset converted to int32 / uint8; checks its length.
std::vector<std::int32_t> read_i32(const Ctx& c, hid_t file, const std::string& path,
                                   const std::vector<hsize_t>& expect_shape);
std::vector<std::uint8_t> read_u8(const Ctx& c, hid_t file, const std::string& path, hsize_t expect_len);

// Reads the hyperslab [start, start+count) of a tensor dataset as raw elements of `dtype`.
void read_tensor_slab(const Ctx& c, hid_t file, const std::string& path, DType dtype,
                      const std::vector<hsize_t>& start, const std::vector<hsize_t>& count, void* out);

// In-memory rows of the /profile compound datasets, shared by writer and reader.
// Strings are variable-length (HDF5 only reads them when writing, allocates them when reading).
struct KernelRow {
  char* name;
  char* kind;
  std::int64_t start_ns, end_ns, stream, bytes;
  std::int32_t device;
  std::int32_t grid[3];
  std::int32_t block[3];
};
struct RangeRow {
  char* name;
  std::int64_t start_ns, end_ns, thread;
  std::int32_t depth;
};
// Compound HDF5 types of those rows (members named as in docs/trace-format.md).
Handle kernel_row_type(const Ctx& c);
Handle range_row_type(const Ctx& c);

}  // namespace kvscope::trace::h5
