#include <cstdio>

#include "kvscope/trace/error.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::trace {

bool parse_version(const std::string& text, int& major, int& minor) {
  const std::size_t dot = text.find('.');
  auto digits = [](const std::string& x) {
    return !x.empty() && x.size() <= 6 && x.find_first_not_of("0123456789") == std::string::npos;
  };
  if (dot == std::string::npos || !digits(text.substr(0, dot)) || !digits(text.substr(dot + 1))) return false;
  major = std::stoi(text.substr(0, dot));
  minor = std::stoi(text.substr(dot + 1));
  return true;
}

std::string layer_group_name(int layer) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "/layers/%03d", layer);
  return buf;
}

std::string decode_layer_group_name(int layer) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "/decode/layers/%03d", layer);
  return buf;
}

std::string aggregate_layer_group_name(int layer) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "/aggregates/%03d", layer);
  return buf;
}

const char* role_name(int role) {
  switch (role) {
    case 0:
      return "context";
    case 1:
      return "question";
    case 2:
      return "answer";
    case 3:
      return "template";
    default:
      return "?";
  }
}

std::vector<float> Tensor::to_float() const {
  std::vector<float> out(numel());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = at(i);
  return out;
}

const char* error_kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::kIo: return "io";
    case ErrorKind::kNotHdf5: return "not-hdf5";
    case ErrorKind::kCorrupt: return "corrupt";
    case ErrorKind::kFormat: return "format";
    case ErrorKind::kVersion: return "version";
    case ErrorKind::kMissing: return "missing";
    case ErrorKind::kShape: return "shape";
    case ErrorKind::kDType: return "dtype";
    case ErrorKind::kValue: return "value";
    case ErrorKind::kIncomplete: return "incomplete";
    case ErrorKind::kUsage: return "usage";
  }
  return "unknown";
}

}  // namespace kvscope::trace
