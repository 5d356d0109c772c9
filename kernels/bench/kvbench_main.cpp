// kvbench: runs every registered kernel benchmark (kernels/bench/bench_<family>.cpp)
// for each backend, next to machine ceilings measured in the same run, and prints
// each benchmark's throughput as a fraction of the ceiling of its backend. Families
// run one at a time under an NVTX range; --cupti adds per-benchmark kernel timings.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "ceilings.hpp"
#include "cupti_recorder.hpp"
#include "kvbench_report.hpp"
#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/kernels/device.hpp"

#if defined(KVSCOPE_HAVE_NVTX)
#include "kvscope/kernels/nvtx.hpp"
#endif

namespace kvscope::bench {
namespace {

// NVTX range in the kvscope domain around a benchmark family or the ceilings;
// nothing without NVTX.
class BenchRange {
 public:
  explicit BenchRange(const std::string& name) {
#if defined(KVSCOPE_HAVE_NVTX)
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name.c_str();
    nvtxDomainRangePushEx(kernels::nvtx::domain(), &a);
#else
    (void)name;
#endif
  }
  ~BenchRange() {
#if defined(KVSCOPE_HAVE_NVTX)
    nvtxDomainRangePop(kernels::nvtx::domain());
#endif
  }
  BenchRange(const BenchRange&) = delete;
  BenchRange& operator=(const BenchRange&) = delete;
};

struct Options {
  int threads = 0;  // 0: all cores
  bool cupti = false;
  bool skip_ceilings = false;
  bool quick_ceilings = false;
  bool list_only = false;
  std::string json_path;
  std::string bench_out, bench_out_format = "json";  // --benchmark_out, handled by kvbench
  std::vector<char*> benchmark_args;                 // passed on to benchmark::Initialize
};

void print_help(const char* argv0) {
  std::printf(
      "Usage: %s [kvbench options] [--benchmark_* options]\n"
      "\n"
      "Runs every kvscope kernel benchmark (CPU, and CUDA when built with it; CUDA\n"
      "benchmarks are skipped with \"no GPU\" when there is none), after measuring the\n"
      "machine's ceilings in the same run: CPU STREAM triad (GB/s) and OpenBLAS sgemm\n"
      "(GFLOP/s) with the benchmarks' thread count, and on a GPU a CUDA triad kernel and\n"
      "cuBLAS FP32 sgemm. After Google Benchmark's output it prints, per benchmark, the\n"
      "throughput and its fraction of the ceiling of its backend: label \"mem\" is\n"
      "compared with the triad, \"compute\" with sgemm.\n"
      "\n"
      "kvbench options:\n"
      "  --threads N        CPU threads for the kernels and the CPU ceilings (default: all\n"
      "                     cores, %d here; at most 4 x that, 1024)\n"
      "  --json FILE        also write ceilings, throughputs, fractions (and CUPTI timings)\n"
      "                     as JSON to FILE\n"
      "  --cupti            record kernel/memcpy/memset durations with the CUPTI Activity\n"
      "                     API and print them per benchmark (GPU builds on a GPU only;\n"
      "                     otherwise says so and continues)\n"
      "  --skip-ceilings    do not measure ceilings (fractions are then not shown)\n"
      "  --quick-ceilings   small ceiling sizes, for smoke tests (not real ceilings)\n"
      "  -h, --help         this text\n"
      "\n"
      "Google Benchmark options pass through, e.g. --benchmark_filter=REGEX,\n"
      "--benchmark_min_time=SECONDS (a plain number in Google Benchmark 1.7, e.g. 0.05),\n"
      "--benchmark_repetitions=N, --benchmark_format=console|json|csv,\n"
      "--benchmark_out=FILE with --benchmark_out_format=json|console (written once for\n"
      "the whole run), --benchmark_list_tests.\n"
      "Google Benchmark's own help follows.\n\n",
      argv0, omp_get_num_procs());
  benchmark::PrintDefaultHelp();
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Parses kvbench's own options; returns false (after a message) on a bad one.
// `exit_now` is set for --help.
bool parse_options(int argc, char** argv, Options* o, bool* exit_now) {
  o->benchmark_args.push_back(argv[0]);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name, std::string* out) -> bool {
      const std::string eq = std::string(name) + "=";
      if (a == name) {
        if (i + 1 >= argc) {
          std::fprintf(stderr, "kvbench: %s needs a value\n", name);
          return false;
        }
        *out = argv[++i];
        return true;
      }
      if (starts_with(a, eq.c_str())) {
        *out = a.substr(eq.size());
        return true;
      }
      return false;
    };
    std::string v;
    if (a == "-h" || a == "--help") {
      print_help(argv[0]);
      *exit_now = true;
      return true;
    } else if (a == "--threads" || starts_with(a, "--threads=")) {
      if (!value("--threads", &v)) return false;
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n <= 0) {
        std::fprintf(stderr, "kvbench: --threads needs a positive integer, got '%s'\n", v.c_str());
        return false;
      }
      // Same cap as kvsim and kvcap: 4 x the hardware threads, at most 1024 (docs/robustness.md).
      const long max = std::min(4L * std::max(1, omp_get_num_procs()), 1024L);
      if (n > max) {
        std::fprintf(stderr,
                     "kvbench: --threads %ld is more than the maximum of %ld (4 x the hardware threads, at "
                     "most 1024)\n",
                     n, max);
        return false;
      }
      o->threads = static_cast<int>(n);
    } else if (a == "--json" || starts_with(a, "--json=")) {
      if (!value("--json", &v)) return false;
      o->json_path = v;
    } else if (a == "--cupti") {
      o->cupti = true;
    } else if (a == "--skip-ceilings") {
      o->skip_ceilings = true;
    } else if (a == "--quick-ceilings") {
      o->quick_ceilings = true;
    } else if (starts_with(a, "--benchmark_out=")) {
      o->bench_out = a.substr(std::strlen("--benchmark_out="));
    } else if (starts_with(a, "--benchmark_out_format=")) {
      o->bench_out_format = a.substr(std::strlen("--benchmark_out_format="));
    } else {
      if (a == "--benchmark_list_tests" || a == "--benchmark_list_tests=true" ||
          a == "--benchmark_list_tests=1") {
        o->list_only = true;
      }
      o->benchmark_args.push_back(argv[i]);
    }
  }
  if (o->threads == 0) o->threads = omp_get_num_procs();
  return true;
}

class NullBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
};

// Display reporter for kvbench: forwards to Google Benchmark's default display
// reporter (respecting --benchmark_format) and to an optional file reporter
// (--benchmark_out), across the several RunSpecifiedBenchmarks calls (one per
// family), and keeps every run for the ceiling table and CUPTI attribution.
class KvbenchReporter : public benchmark::BenchmarkReporter {
 public:
  KvbenchReporter(benchmark::BenchmarkReporter* display, benchmark::BenchmarkReporter* file,
                  const Ceilings* ceilings, CuptiRecorder* cupti)
      : display_(display),
        file_(file),
        ceilings_(ceilings),
        cupti_(cupti),
        display_is_console_(dynamic_cast<benchmark::ConsoleReporter*>(display) != nullptr),
        null_stream_(&null_buffer_) {}

  bool ReportContext(const Context& context) override {
    if (!context_seen_) {
      context_seen_ = true;
      if (file_) file_->ReportContext(context);
      return display_->ReportContext(context);
    }
    // Later families: reset the console's column widths and header, without
    // printing the machine context again. (JSON/CSV output takes the context once.)
    if (!display_is_console_) return true;
    std::ostream& err = display_->GetErrorStream();
    display_->SetErrorStream(&null_stream_);
    const bool ok = display_->ReportContext(context);
    display_->SetErrorStream(&err);
    return ok;
  }

  void ReportRuns(const std::vector<Run>& runs) override {
    display_->ReportRuns(runs);
    if (file_) file_->ReportRuns(runs);
    if (cupti_ && cupti_->active() && !runs.empty()) {
      const kernels::Status s = cupti_->collect(runs.front().benchmark_name());
      if (!s.ok()) std::fprintf(stderr, "kvbench: %s\n", s.message().c_str());
    }
    for (const Run& r : runs) {
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "mean" && r.aggregate_name != "median")
        continue;
      if (r.report_big_o || r.report_rms) continue;
      rows_.push_back(to_row(r));
    }
  }

  // Google Benchmark calls Finalize at the end of every RunSpecifiedBenchmarks call;
  // the wrapped reporters are finalized once, by finish().
  void Finalize() override {}
  void finish() {
    display_->Finalize();
    if (file_) file_->Finalize();
  }

  const std::vector<RunRow>& rows() const { return rows_; }

 private:
  RunRow to_row(const Run& r) const {
    auto counter = [&r](const char* name) {
      const auto it = r.counters.find(name);
      return it == r.counters.end() ? 0.0 : static_cast<double>(it->second.value);
    };
    const double iters = static_cast<double>(r.iterations);
    const double sec = iters > 0 ? r.real_accumulated_time / iters : 0.0;
    const Bound bound = bound_of(r.report_label);
    const double fallback = counter(bound == Bound::kCompute ? "FLOP/s" : "bytes_per_second");
    RunRow row = make_row(r.benchmark_name(), r.report_label, counter(kBytesCounter), counter(kFlopsCounter),
                          sec, fallback, *ceilings_);
    if (r.error_occurred) row.error = r.error_message.empty() ? "error" : r.error_message;
    return row;
  }

  benchmark::BenchmarkReporter* display_;
  benchmark::BenchmarkReporter* file_;
  const Ceilings* ceilings_;
  CuptiRecorder* cupti_;
  bool display_is_console_;
  NullBuffer null_buffer_;
  std::ostream null_stream_;
  bool context_seen_ = false;
  std::vector<RunRow> rows_;
};

// Reporter for the listing pass: Google Benchmark writes the selected names to its
// output stream, one per line.
class ListReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// Names of the registered benchmarks that `spec` selects (the user's
// --benchmark_filter when empty), in registration order, family markers included.
// Runs Google Benchmark's listing (--benchmark_list_tests=true), then resets the flag.
std::vector<std::string> list_benchmarks(std::vector<char*> args, const std::string& spec) {
  static char list_on[] = "--benchmark_list_tests=true";
  static char list_off[] = "--benchmark_list_tests=false";
  std::vector<char*> on = args, off = args;
  on.push_back(list_on);
  off.push_back(list_off);
  int argc_on = static_cast<int>(on.size());
  on.push_back(nullptr);
  benchmark::Initialize(&argc_on, on.data());
  ListReporter lister;
  std::ostringstream names, err;
  lister.SetOutputStream(&names);
  lister.SetErrorStream(&err);
  if (spec.empty()) {
    benchmark::RunSpecifiedBenchmarks(&lister);
  } else {
    benchmark::RunSpecifiedBenchmarks(&lister, spec);
  }
  // Regex errors and the like; "Failed to match" is reported by the caller.
  std::istringstream err_lines(err.str());
  std::string line;
  while (std::getline(err_lines, line)) {
    if (!starts_with(line, "Failed to match any benchmarks")) std::cerr << "kvbench: " << line << "\n";
  }
  int argc_off = static_cast<int>(off.size());
  off.push_back(nullptr);
  benchmark::Initialize(&argc_off, off.data());
  std::vector<std::string> out;
  std::istringstream lines(names.str());
  while (std::getline(lines, line)) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string to_json(const Options& o, const Ceilings& c, const std::vector<RunRow>& rows,
                    const std::vector<ActivityTiming>& cupti, int argc, char** argv) {
  std::ostringstream js;
  std::string cmd;
  for (int i = 0; i < argc; ++i) {
    if (i) cmd += ' ';
    cmd += argv[i];
  }
  js << "{\n  \"tool\": \"kvbench\",\n  \"date\": \"" << utc_now() << "\",\n  \"command\": \""
     << json_escape(cmd) << "\",\n  \"cpu_threads\": " << o.threads << ",\n  \"device\": \""
     << json_escape(kernels::cuda_device_description()) << "\",\n";
  js << "  \"ceilings\": {\"cpu_triad_bytes_per_s\": " << json_number(c.cpu_triad_bytes_per_s)
     << ", \"cpu_sgemm_flops_per_s\": " << json_number(c.cpu_sgemm_flops_per_s)
     << ", \"gpu_triad_bytes_per_s\": " << json_number(c.gpu_triad_bytes_per_s)
     << ", \"gpu_sgemm_flops_per_s\": " << json_number(c.gpu_sgemm_flops_per_s) << ", \"cpu_note\": \""
     << json_escape(c.cpu_note) << "\", \"gpu_note\": \"" << json_escape(c.gpu_note) << "\"},\n";
  js << "  \"benchmarks\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const RunRow& r = rows[i];
    js << (i ? ",\n" : "\n") << "    {\"name\": \"" << json_escape(r.name) << "\", \"backend\": \""
       << backend_name(r.backend) << "\", \"bound\": \"" << bound_name(r.bound)
       << "\", \"seconds_per_iter\": " << json_number(r.seconds_per_iter)
       << ", \"throughput\": " << json_number(r.throughput) << ", \"unit\": \""
       << (r.bound == Bound::kCompute ? "FLOP/s" : "B/s") << "\", \"ceiling\": " << json_number(r.ceiling)
       << ", \"fraction\": " << json_number(r.fraction) << ", \"error\": \"" << json_escape(r.error) << "\"}";
  }
  js << "\n  ],\n  \"cupti\": [";
  for (std::size_t i = 0; i < cupti.size(); ++i) {
    const ActivityTiming& t = cupti[i];
    js << (i ? ",\n" : "\n") << "    {\"scope\": \"" << json_escape(t.scope) << "\", \"kind\": \"" << t.kind
       << "\", \"name\": \"" << json_escape(t.name) << "\", \"count\": " << t.count
       << ", \"total_ns\": " << json_number(t.total_ns) << "}";
  }
  js << "\n  ]\n}\n";
  return js.str();
}

int run(int argc, char** argv) {
  Options opt;
  bool exit_now = false;
  if (!parse_options(argc, argv, &opt, &exit_now)) return 1;
  if (exit_now) return 0;
  if (!opt.skip_ceilings && !opt.list_only) {
    // Spinning OpenMP waits are kept: the ceilings and kernels are timed back to back.
    kernels::use_fast_blas_runtime(argv, {.passive_omp_wait = false, .announce_as = "kvbench"});
  }
  kernels::set_cpu_threads(opt.threads);

  {
    std::vector<char*> args = opt.benchmark_args;
    int bench_argc = static_cast<int>(args.size());
    args.push_back(nullptr);
    benchmark::Initialize(&bench_argc, args.data());
    if (benchmark::ReportUnrecognizedArguments(bench_argc, args.data())) return 1;
  }
  const std::string user_filter = benchmark::GetBenchmarkFilter();
  const std::vector<FamilyGroup> groups =
      group_by_family(list_benchmarks(opt.benchmark_args, "."), list_benchmarks(opt.benchmark_args, ""));
  if (opt.list_only) {
    for (const auto& g : groups)
      for (const auto& n : g.names) std::cout << n << "\n";
    return 0;
  }
  if (groups.empty()) {
    std::fprintf(stderr, "kvbench: no benchmark matches --benchmark_filter=%s\n", user_filter.c_str());
    return 1;
  }

  std::unique_ptr<benchmark::BenchmarkReporter> display(benchmark::CreateDefaultDisplayReporter());
  // Our tables go where the console output goes; beside json/csv output on stdout, to stderr.
  const bool console = dynamic_cast<benchmark::ConsoleReporter*>(display.get()) != nullptr;
  std::ostream& out = console ? std::cout : std::cerr;

  std::unique_ptr<benchmark::BenchmarkReporter> file;
  std::ofstream file_stream;
  if (!opt.bench_out.empty()) {
    file_stream.open(opt.bench_out);
    if (!file_stream) {
      std::fprintf(stderr, "kvbench: cannot open --benchmark_out file '%s'\n", opt.bench_out.c_str());
      return 1;
    }
    if (opt.bench_out_format == "json") {
      file.reset(new benchmark::JSONReporter());
    } else if (opt.bench_out_format == "console") {
      file.reset(new benchmark::ConsoleReporter(benchmark::ConsoleReporter::OO_None));
    } else {
      std::fprintf(stderr, "kvbench: --benchmark_out_format '%s': kvbench writes json or console\n",
                   opt.bench_out_format.c_str());
      return 1;
    }
    file->SetOutputStream(&file_stream);
    file->SetErrorStream(&std::cerr);
  }

  Ceilings ceilings;
  ceilings.cpu_threads = opt.threads;
  if (!opt.skip_ceilings) {
    BenchRange range("kvbench/ceilings");
    ceilings = measure_ceilings(opt.threads, opt.quick_ceilings);
    out << format_ceilings(ceilings) << std::endl;
  }

  CuptiRecorder cupti;
  bool cupti_started = false;
  if (opt.cupti) {
    const kernels::Status s = cupti.start();
    cupti_started = s.ok();
    if (!s.ok()) out << "kvbench: --cupti: " << s.message() << "; continuing without CUPTI\n" << std::endl;
  }

  KvbenchReporter reporter(display.get(), file.get(), &ceilings, &cupti);
  // One RunSpecifiedBenchmarks call per family (bench_<family>.cpp), in registration
  // order, each under its NVTX range.
  for (const FamilyGroup& g : groups) {
    BenchRange range("kvbench/" + g.family);
    benchmark::RunSpecifiedBenchmarks(&reporter, exact_names_regex(g.names));
  }
  reporter.finish();
  const kernels::Status cs = cupti.stop();
  if (!cs.ok()) std::fprintf(stderr, "kvbench: %s\n", cs.message().c_str());

  out << "\nkvbench: throughput vs in-run ceilings (mem: bytes read+written / triad; compute: FLOP / sgemm)\n"
      << format_table(reporter.rows());
  if (cupti_started) {
    out << "\nkvbench: CUPTI activity per benchmark (all launches incl. warm-up and L2 flushes)\n"
        << format_activity_table(cupti.timings());
    if (cupti.dropped() > 0) out << "CUPTI dropped " << cupti.dropped() << " records (buffers full)\n";
  }
  out.flush();

  if (!opt.json_path.empty()) {
    std::ofstream js(opt.json_path);
    js << to_json(opt, ceilings, reporter.rows(), cupti.timings(), argc, argv);
    if (!js) {
      std::fprintf(stderr, "kvbench: cannot write --json file '%s'\n", opt.json_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvscope::bench

int main(int argc, char** argv) { return kvscope::bench::run(argc, argv); }
