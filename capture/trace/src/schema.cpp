#include <cstdio>

#include "kvscope/trace/error.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::trace {

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
