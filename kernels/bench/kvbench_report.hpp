// kvbench's pure logic, header-only so that tests/kernels/test_bench_util.cpp can
// check it without Google Benchmark or a GPU: which backend and ceiling a benchmark
// belongs to, throughput and fraction of ceiling, the per-family filter regexes and
// the text/JSON formatting of the ceiling table.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace kvscope::bench {

enum class Backend { kCpu, kCuda };
// Which ceiling a benchmark is compared with: its label "mem" or "compute".
enum class Bound { kNone, kMem, kCompute };

inline const char* backend_name(Backend b) { return b == Backend::kCuda ? "cuda" : "cpu"; }
inline const char* bound_name(Bound b) {
  return b == Bound::kMem ? "mem" : b == Bound::kCompute ? "compute" : "-";
}

// Backend from a benchmark name BM_<family>_<op>/<backend>[/args...]: a path component
// "cuda" or "gpu" means CUDA, anything else CPU.
inline Backend backend_of(const std::string& name) {
  std::size_t pos = 0;
  while (pos <= name.size()) {
    std::size_t end = name.find('/', pos);
    if (end == std::string::npos) end = name.size();
    const std::string part = name.substr(pos, end - pos);
    if (part == "cuda" || part == "gpu") return Backend::kCuda;
    pos = end + 1;
  }
  return Backend::kCpu;
}

// Bound from a benchmark label: its first word, "mem" or "compute".
inline Bound bound_of(const std::string& label) {
  const std::string word = label.substr(0, label.find_first_of(" \t,;:"));
  if (word == "mem") return Bound::kMem;
  if (word == "compute") return Bound::kCompute;
  return Bound::kNone;
}

// Ceilings measured in the same run; 0 means not measured (no GPU, no BLAS, skipped).
struct Ceilings {
  int cpu_threads = 0;
  double cpu_triad_bytes_per_s = 0;  // STREAM triad a = b + s*c, 3 arrays counted
  double cpu_sgemm_flops_per_s = 0;  // cblas_sgemm, 2*n^3 FLOP
  double gpu_triad_bytes_per_s = 0;  // CUDA triad kernel, 3 arrays counted
  double gpu_sgemm_flops_per_s = 0;  // cublasSgemm (FP32, no TF32), 2*n^3 FLOP
  std::string cpu_note, gpu_note;    // how each was measured, or why it was not
};

inline double ceiling_for(const Ceilings& c, Backend backend, Bound bound) {
  if (bound == Bound::kMem)
    return backend == Backend::kCuda ? c.gpu_triad_bytes_per_s : c.cpu_triad_bytes_per_s;
  if (bound == Bound::kCompute)
    return backend == Backend::kCuda ? c.gpu_sgemm_flops_per_s : c.cpu_sgemm_flops_per_s;
  return 0;
}

// One line of the ceiling table.
struct RunRow {
  std::string name;
  Backend backend = Backend::kCpu;
  Bound bound = Bound::kNone;
  double throughput = 0;  // bytes/s (mem) or FLOP/s (compute); 0 when unknown
  double ceiling = 0;     // same unit; 0 when not measured
  double fraction = std::numeric_limits<double>::quiet_NaN();  // throughput / ceiling
  double seconds_per_iter = 0;
  std::string error;  // non-empty for skipped / failed benchmarks
};

// Builds a row from what a benchmark reported: its label, the work of one iteration
// (bytes_per_iter for "mem", flops_per_iter for "compute"; 0 when absent) and the
// wall (or manual) seconds per iteration. rate_fallback is the benchmark's own rate
// counter (bytes_per_second or FLOP/s), used only when the per-iteration work is absent.
inline RunRow make_row(const std::string& name, const std::string& label, double bytes_per_iter,
                       double flops_per_iter, double seconds_per_iter, double rate_fallback,
                       const Ceilings& c) {
  RunRow r;
  r.name = name;
  r.backend = backend_of(name);
  r.bound = bound_of(label);
  r.seconds_per_iter = seconds_per_iter;
  const double work = r.bound == Bound::kMem       ? bytes_per_iter
                      : r.bound == Bound::kCompute ? flops_per_iter
                                                   : 0;
  if (work > 0 && seconds_per_iter > 0) {
    r.throughput = work / seconds_per_iter;
  } else if (r.bound != Bound::kNone) {
    r.throughput = rate_fallback;
  }
  r.ceiling = ceiling_for(c, r.backend, r.bound);
  if (r.throughput > 0 && r.ceiling > 0) r.fraction = r.throughput / r.ceiling;
  return r;
}

// ---------------------------------------------------------------- filters
// kvbench runs one family at a time (an NVTX range around each). Every
// bench_<family>.cpp registers a marker "kvbench_family:<family>" before its own
// benchmarks (bench_util.hpp), so in registration order each benchmark belongs to the
// last marker before it. kvbench lists the benchmarks the user's --benchmark_filter
// selects and runs each family with a filter matching exactly its names: Google
// Benchmark 1.7 compiles filters as POSIX extended regexes (no lookahead).

inline constexpr const char* kFamilyMarkerPrefix = "kvbench_family:";

inline bool is_family_marker(const std::string& name) { return name.rfind(kFamilyMarkerPrefix, 0) == 0; }

// Escapes the POSIX ERE metacharacters of s (not ']' and '}', literal outside a
// bracket expression; libstdc++ rejects escaping them).
inline std::string regex_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (std::string("\\^$.|?*+()[{").find(ch) != std::string::npos) out += '\\';
    out += ch;
  }
  return out;
}

struct FamilyGroup {
  std::string family;
  std::vector<std::string> names;
};

// Groups `selected` (benchmark names, markers ignored) by family, families in order of
// registration. `all` is every registered name in registration order, markers
// included; benchmarks before any marker, or not in `all`, form the group "other" (last).
inline std::vector<FamilyGroup> group_by_family(const std::vector<std::string>& all,
                                                const std::vector<std::string>& selected) {
  std::vector<FamilyGroup> groups;
  std::vector<std::pair<std::string, std::string>> family_of;  // (name, family) in registration order
  std::string current = "other";
  for (const auto& n : all) {
    if (is_family_marker(n)) {
      current = n.substr(std::string(kFamilyMarkerPrefix).size());
    } else {
      family_of.emplace_back(n, current);
    }
  }
  auto group = [&groups](const std::string& family) -> FamilyGroup& {
    for (auto& g : groups)
      if (g.family == family) return g;
    groups.push_back({family, {}});
    return groups.back();
  };
  std::vector<std::string> others;
  for (const auto& n : selected) {
    if (is_family_marker(n)) continue;
    std::string fam = "other";
    for (const auto& [name, f] : family_of) {
      if (name == n) {
        fam = f;
        break;
      }
    }
    if (fam == "other") {
      others.push_back(n);
    } else {
      group(fam).names.push_back(n);
    }
  }
  if (!others.empty()) group("other").names = others;
  return groups;
}

// A filter that matches exactly the given benchmark names.
inline std::string exact_names_regex(const std::vector<std::string>& names) {
  std::string re = "^(";
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i) re += '|';
    re += regex_escape(names[i]);
  }
  return re + ")$";
}

// ---------------------------------------------------------------- formatting
inline std::string format_number(double v, int decimals) {
  if (!(v > 0) && v != 0) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// "12.3 GB/s" or "45.6 GFLOP/s" (decimal units) for a bound; "-" when 0.
inline std::string format_rate(double v, Bound bound) {
  if (!(v > 0)) return "-";
  return format_number(v * 1e-9, v >= 1e11 ? 0 : 1) + (bound == Bound::kCompute ? " GFLOP/s" : " GB/s");
}

inline std::string format_ceilings(const Ceilings& c) {
  std::ostringstream os;
  os << "kvbench ceilings (measured in this run, CPU threads: " << c.cpu_threads << ")\n";
  os << "  cpu  triad  " << format_rate(c.cpu_triad_bytes_per_s, Bound::kMem) << "\n";
  os << "  cpu  sgemm  " << format_rate(c.cpu_sgemm_flops_per_s, Bound::kCompute) << "\n";
  if (!c.cpu_note.empty()) os << "       (" << c.cpu_note << ")\n";
  os << "  cuda triad  " << format_rate(c.gpu_triad_bytes_per_s, Bound::kMem) << "\n";
  os << "  cuda sgemm  " << format_rate(c.gpu_sgemm_flops_per_s, Bound::kCompute) << "\n";
  if (!c.gpu_note.empty()) os << "       (" << c.gpu_note << ")\n";
  return os.str();
}

inline std::string format_table(const std::vector<RunRow>& rows) {
  std::size_t w = 9;
  for (const auto& r : rows) w = std::max(w, r.name.size());
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-*s  %-7s %-7s %16s %16s %9s\n", static_cast<int>(w), "benchmark",
                "backend", "bound", "throughput", "ceiling", "fraction");
  os << line << std::string(w + 62, '-') << "\n";
  for (const auto& r : rows) {
    if (!r.error.empty()) {
      std::snprintf(line, sizeof line, "%-*s  %-7s %-7s skipped: %s\n", static_cast<int>(w), r.name.c_str(),
                    backend_name(r.backend), bound_name(r.bound), r.error.c_str());
    } else {
      const std::string frac = std::isnan(r.fraction) ? "-" : format_number(100.0 * r.fraction, 1) + "%";
      std::snprintf(line, sizeof line, "%-*s  %-7s %-7s %16s %16s %9s\n", static_cast<int>(w), r.name.c_str(),
                    backend_name(r.backend), bound_name(r.bound), format_rate(r.throughput, r.bound).c_str(),
                    format_rate(r.ceiling, r.bound).c_str(), frac.c_str());
    }
    os << line;
  }
  return os.str();
}

inline std::string json_escape(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out;
}

// A finite number or null.
inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace kvscope::bench
