// Full validation of a trace file: structure (as TraceReader::open checks it)
// plus a scan of every tensor for NaN/Inf, one (layer, head) slice at a time.
#pragma once

#include <functional>
#include <string>

#include "kvscope/trace/error.hpp"

namespace kvscope::trace {

struct ValidationReport {
  bool ok = false;
  bool incomplete = false;      // the writer never closed the trace
  ErrorKind kind = ErrorKind::kIo;
  std::string message;          // one line: "FILE: DATASET: problem" or a summary when ok
  int num_layers = 0;           // declared
  int layers_present = 0;       // prefill + decode groups present
  std::size_t num_tokens = 0;
  std::size_t num_decode_steps = 0;
};

// progress(done, total) is called after each scanned slice (may be empty).
ValidationReport validate_trace(const std::string& path,
                                const std::function<void(std::size_t, std::size_t)>& progress = {});

}  // namespace kvscope::trace
