// Typed errors of the trace library: every error names the file and, where it
// applies, the dataset or attribute, so a CLI can print one clear line.
#pragma once

#include <stdexcept>
#include <string>

namespace kvscope::trace {

enum class ErrorKind {
  kIo,              // missing file, permission, cannot create
  kNotHdf5,         // not an HDF5 file
  kCorrupt,         // truncated or unreadable HDF5 structure
  kFormat,          // not a kvscope trace (format attribute)
  kVersion,         // unsupported major version
  kMissing,         // a required group/dataset/attribute is absent
  kShape,           // inconsistent or wrong shapes
  kDType,           // dtype not allowed
  kValue,           // bad values: modality code, NaN/Inf, negative sizes
  kIncomplete,      // trace was never closed by its writer
  kUsage,           // API misuse (writing a layer twice, wrong order)
};

const char* error_kind_name(ErrorKind k);

// `text` with control characters escaped (\n, \r, \t, \xNN), so that a string read from a file
// (or a file name) keeps an error message on one line.
inline std::string one_line(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto u = static_cast<unsigned char>(ch);
    if (u >= 0x20 && u != 0x7f) {
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
    }
  }
  return out;
}

class TraceError : public std::runtime_error {
 public:
  TraceError(ErrorKind kind, std::string file, std::string object, const std::string& message)
      : std::runtime_error(compose(file, object, message)),
        kind_(kind), file_(std::move(file)), object_(std::move(object)) {}
  ErrorKind kind() const { return kind_; }
  const std::string& file() const { return file_; }
  // HDF5 path of the dataset/attribute concerned ("" when it is the file itself).
  const std::string& object() const { return object_; }

 private:
  static std::string compose(const std::string& file, const std::string& object, const std::string& msg) {
    return one_line(object.empty() ? file + ": " + msg : file + ": " + object + ": " + msg);
  }
  ErrorKind kind_;
  std::string file_;
  std::string object_;
};

}  // namespace kvscope::trace
