#include "export_chrome_command.hpp"

#include <unistd.h>

#include <boost/program_options.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <set>
#include <stdexcept>
#include <utility>

#include "kvscope/cli/options.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace kvscope::cli {

namespace {

constexpr int kRangePid = 1;
constexpr int kKernelPidBase = 100;

// A JSON string literal. Control characters are escaped; bytes >= 0x80 pass through when
// they form valid UTF-8 and become U+FFFD otherwise, so the output always parses.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
    } else {
      const std::size_t len = c >= 0xf0 && c < 0xf8 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
      bool ok = len > 0 && i + len <= s.size();
      for (std::size_t j = 1; ok && j < len; ++j) ok = (static_cast<unsigned char>(s[i + j]) & 0xc0) == 0x80;
      if (ok) {
        out.append(s, i, len);
        i += len - 1;
      } else {
        out += "\\ufffd";
      }
    }
  }
  return out + "\"";
}

std::string micros(std::int64_t ns) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(ns) / 1000.0);
  return buf;
}

std::string triple(const std::array<std::int32_t, 3>& a) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "[%d,%d,%d]", a[0], a[1], a[2]);
  return buf;
}

std::string metadata(const char* what, int pid, const std::int64_t* tid, const std::string& name) {
  std::string e = "{\"name\":\"" + std::string(what) + "\",\"ph\":\"M\",\"pid\":" + std::to_string(pid);
  if (tid) e += ",\"tid\":" + std::to_string(*tid);
  return e + ",\"args\":{\"name\":" + json_string(name) + "}}";
}

}  // namespace

std::string chrome_trace_json(const trace::Profile& profile) {
  std::vector<std::string> events;
  std::set<std::int64_t> threads;
  std::set<std::pair<std::int32_t, std::int64_t>> streams;
  for (const auto& r : profile.ranges) {
    threads.insert(r.thread);
    events.push_back("{\"name\":" + json_string(r.name) +
                     ",\"cat\":\"range\",\"ph\":\"X\",\"ts\":" + micros(r.start_ns) +
                     ",\"dur\":" + micros(std::max<std::int64_t>(0, r.end_ns - r.start_ns)) +
                     ",\"pid\":" + std::to_string(kRangePid) + ",\"tid\":" + std::to_string(r.thread) +
                     ",\"args\":{\"depth\":" + std::to_string(r.depth) + "}}");
  }
  for (const auto& k : profile.kernels) {
    streams.insert({k.device, k.stream});
    const std::string kind = k.kind.empty() ? "kernel" : k.kind;
    events.push_back("{\"name\":" + json_string(k.name) + ",\"cat\":" + json_string(kind) +
                     ",\"ph\":\"X\",\"ts\":" + micros(k.start_ns) +
                     ",\"dur\":" + micros(std::max<std::int64_t>(0, k.end_ns - k.start_ns)) + ",\"pid\":" +
                     std::to_string(kKernelPidBase + k.device) + ",\"tid\":" + std::to_string(k.stream) +
                     ",\"args\":{\"kind\":" + json_string(kind) + ",\"stream\":" + std::to_string(k.stream) +
                     ",\"device\":" + std::to_string(k.device) + ",\"grid\":" + triple(k.grid) +
                     ",\"block\":" + triple(k.block) + ",\"bytes\":" + std::to_string(k.bytes) + "}}");
  }
  if (!profile.ranges.empty()) events.push_back(metadata("process_name", kRangePid, nullptr, "host ranges"));
  for (std::int64_t t : threads)
    events.push_back(metadata("thread_name", kRangePid, &t, "thread " + std::to_string(t)));
  std::set<std::int32_t> devices;
  for (const auto& [device, stream] : streams) {
    if (devices.insert(device).second) {
      events.push_back(
          metadata("process_name", kKernelPidBase + device, nullptr, "GPU " + std::to_string(device)));
    }
    events.push_back(
        metadata("thread_name", kKernelPidBase + device, &stream, "stream " + std::to_string(stream)));
  }
  std::string out = "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n";
  for (std::size_t i = 0; i < events.size(); ++i) out += events[i] + (i + 1 < events.size() ? ",\n" : "\n");
  return out + "]}\n";
}

ChromeExportSummary export_chrome_trace(const std::string& trace_path, const std::string& json_path) {
  trace::ReaderOptions options;
  options.require_complete = false;  // a crashed capture has no /profile: reported below
  trace::check_trace_file(trace_path);  // untrusted: parsed first in an isolated child
  const trace::TraceReader reader(trace_path, options);
  const trace::Profile profile = reader.read_profile();
  if (profile.ranges.empty() && profile.kernels.empty()) {
    throw std::runtime_error(trace_path +
                             ": no /profile records (capture with profiling on, config.profile = 1)");
  }
  const std::string json = chrome_trace_json(profile);
  const std::string tmp = json_path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error(json_path + ": cannot write: " + std::strerror(errno));
  const bool written = std::fwrite(json.data(), 1, json.size(), f) == json.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    throw std::runtime_error(json_path + ": write failed: " + std::strerror(written ? errno : err));
  }
  if (std::rename(tmp.c_str(), json_path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw std::runtime_error(json_path + ": cannot move the finished file into place: " + std::strerror(e));
  }
  return {profile.ranges.size(), profile.kernels.size()};
}

int export_chrome_command(const std::vector<std::string>& args) {
  namespace po = boost::program_options;
  po::options_description opts(
      "kvcap export-chrome FILE -o trace.json\n\n"
      "Writes the profile of a trace (/profile/ranges: NVTX or steady-clock ranges; /profile/kernels:\n"
      "CUPTI kernel and memcpy records) as Chrome trace-event JSON: one complete (\"X\") event per\n"
      "record, timestamps in microseconds, ranges under the process \"host ranges\" with one row per\n"
      "thread, kernels under \"GPU N\" with one row per stream. Open it in ui.perfetto.dev or\n"
      "chrome://tracing. The output is written to a temporary file and renamed when complete.\n"
      "Exit 0 on success, 2 on a missing or invalid trace, a trace without /profile records, or an\n"
      "unwritable output.\n\nOptions");
  opts.add_options()("help,h", "show this help")("file", po::value<std::string>(), "trace file (.h5)")(
      "output,o", po::value<std::string>(), "output JSON file (required)")("trusted-files",
                                                                           trace::kTrustedFilesHelp);
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  const std::string program = "kvcap export-chrome";
  auto fail = [&](const std::string& msg) { return cli::fail(program, msg); };
  const std::string examples = "\nExample:\n  kvcap export-chrome capture.h5 -o capture.json\n";
  if (const auto exit = cli::parse_options(program, args, opts, vm, examples, &pos)) return *exit;
  if (vm.count("trusted-files")) trace::set_trusted_files(true);
  if (!vm.count("file")) return cli::missing(program, "FILE");
  if (!vm.count("output")) return cli::missing(program, "-o/--output FILE");
  const std::string out = vm["output"].as<std::string>();
  if (out.empty()) return fail("-o/--output is empty");
  try {
    const ChromeExportSummary s = export_chrome_trace(vm["file"].as<std::string>(), out);
    std::cout << "wrote " << out << ": " << s.ranges << " ranges, " << s.kernels
              << " kernel/memcpy records\n";
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

}  // namespace kvscope::cli
