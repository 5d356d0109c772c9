// Internal HDF5 helpers for the trace library: RAII handles, checked calls
// that turn the HDF5 error stack into TraceError, typed attribute and dataset I/O.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_set>
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
// Same, but an HDF5 error while looking (a corrupt group) is a kCorrupt TraceError, not "absent".
bool exists(const Ctx& c, hid_t loc, const std::string& path);
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

// Checks that a dataset can hold `declared_bytes` of data before anything of that size is
// allocated: the bytes it stores (H5Dget_storage_size) must fit in the file, and the declared
// bytes must not exceed what those stored bytes can expand to (x1 without filters,
// x limits::kMaxCompressionRatio with filters); datasets of at most limits::kStorageSlackBytes pass.
void check_storage(const Ctx& c, hid_t dset, const std::string& path, std::uint64_t declared_bytes);
// Fails when `count` elements of `elem_bytes` exceed limits::kMaxReadBytes (one buffer).
void check_alloc(const Ctx& c, const std::string& path, std::uint64_t count, std::uint64_t elem_bytes);
// Both checks for a read of `alloc_count` elements of `dtype` from tensor dataset `path`.
void check_tensor_read(const Ctx& c, hid_t file, const std::string& path, DType dtype,
                       std::uint64_t alloc_count);

// Dataset shape (throws kMissing when absent).
std::vector<hsize_t> dataset_shape(const Ctx& c, hid_t file, const std::string& path);

// Element type of a tensor dataset: float16, float32, or uint16 + attribute dtype="bfloat16".
DType tensor_dtype(const Ctx& c, hid_t file, const std::string& path);
hid_t half_type();              // IEEE binary16 little-endian (never close it)
hid_t file_type_of(DType t);    // stored HDF5 type (never close it)
hid_t memory_type_of(DType t);  // native memory type for reading raw elements

// Reads a whole integer dataset of any integer type as int64 (unsigned values above INT64_MAX are
// an error); checks its shape and storage. read_i32 also range-checks every value to int32.
std::vector<std::int64_t> read_i64(const Ctx& c, hid_t file, const std::string& path,
                                   const std::vector<hsize_t>& expect_shape);
std::vector<std::int32_t> read_i32(const Ctx& c, hid_t file, const std::string& path,
                                   const std::vector<hsize_t>& expect_shape);
// Reads a whole float32 dataset (the datatype must be exactly IEEE binary32 little-endian).
std::vector<float> read_f32(const Ctx& c, hid_t file, const std::string& path,
                            const std::vector<hsize_t>& expect_shape);

// Reads a 1-D string dataset of length n (fixed- or variable-length, ASCII or UTF-8). Variable-length
// strings are bounded before reading (contiguous layout: the stored lengths are checked against the
// file size and limits::kMaxStringBytes) and while reading (a budget of limits::kMaxStringBytes), and a
// stored length that disagrees with the string read is an error.
std::vector<std::string> read_strings(const Ctx& c, hid_t file, const std::string& path, hsize_t n);

// For a contiguous compound dataset of n rows with variable-length string members (the /profile
// tables): reads each stored string length from the file and checks it against the file size and
// all of them against limits::kMaxStringBytes, before HDF5 allocates buffers of those lengths.
void prescan_compound_strings(const Ctx& c, hid_t d, const std::string& path, hsize_t n);

// A dataset-transfer property list whose variable-length allocations are bounded: more than
// `budget` bytes in all fails the read. The budget owns every string HDF5 allocates through it:
// they stay valid until the budget is destroyed, which frees them all, also those of a read that
// failed half-way (HDF5 then keeps them in its conversion buffer, out of the caller's reach).
// check_string() checks one (the stored length must equal the string's length).
class VlenBudget {
 public:
  VlenBudget(const Ctx& c, const std::string& path, std::uint64_t budget);
  ~VlenBudget();
  VlenBudget(const VlenBudget&) = delete;
  VlenBudget& operator=(const VlenBudget&) = delete;
  hid_t dxpl() const { return dxpl_; }
  // Throws when `s` (allocated by this budget) holds fewer bytes than its stored length said.
  void check_string(const char* s, const std::string& object, std::size_t index) const;
  // After a failed H5Dread through dxpl() (status < 0): throws kValue when the budget ran out,
  // else kCorrupt with HDF5's message.
  [[noreturn]] void fail_read(herr_t status) const;

 private:
  static void* alloc(std::size_t size, void* info);
  static void release(void* p, void* info);
  const Ctx& c_;
  std::string path_;
  Handle dxpl_;
  std::uint64_t budget_, used_ = 0;
  bool exhausted_ = false;
  std::unordered_set<void*> live_;  // blocks allocated and not released by HDF5
};

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
