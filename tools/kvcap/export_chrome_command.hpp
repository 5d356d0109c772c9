// kvcap export-chrome: the /profile records of a trace (ranges and CUPTI kernels/memcpys)
// as Chrome trace-event JSON, which chrome://tracing and ui.perfetto.dev open.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "kvscope/trace/schema.hpp"

namespace kvscope::cli {

struct ChromeExportSummary {
  std::size_t ranges = 0;
  std::size_t kernels = 0;
};

// The JSON document of a profile: one "X" (complete) event per range and per kernel record,
// ts/dur in microseconds; ranges under pid 1 with tid = thread, kernel records under
// pid 100 + device with tid = stream; process/thread names as "M" metadata events.
std::string chrome_trace_json(const trace::Profile& profile);

// Reads `trace_path`'s /profile and writes `json_path` atomically (temporary file + rename).
// Throws trace::TraceError for an unreadable trace, std::runtime_error for a trace without
// /profile records or an output that cannot be written.
ChromeExportSummary export_chrome_trace(const std::string& trace_path, const std::string& json_path);

// `kvcap export-chrome` (arguments after the subcommand). Returns the exit status.
int export_chrome_command(const std::vector<std::string>& args);

}  // namespace kvscope::cli
