// libFuzzer target over kvscope's file readers (docs/robustness.md, "Fuzzing"): the trace reader,
// the validator and the results reader, fed with HDF5 file images.
//
// Each input is written to a temporary file and goes through exactly what the tools do with an
// untrusted file: kvcap validate's isolated validation, then the guards (the isolated pre-checks
// of kvscope/trace/untrusted.hpp and sim::check_results_file), then, for a file a guard accepts,
// the in-process readers. A crash, sanitizer report, leak or out-of-memory that libFuzzer reports
// is therefore one of our own process, the process a user runs; what the child processes hit is
// the clean refusal the guards turn it into.
//
// Built with -DKVSCOPE_FUZZ=ON and clang (fuzz_readers, ASan + UBSan + libFuzzer); the same source
// with a plain main() is fuzz_replay in every build (runs files through the same steps, for tests).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVSCOPE_FUZZ_HAVE_SANITIZER 1
#endif
#endif
#if !defined(KVSCOPE_FUZZ_HAVE_SANITIZER) && defined(__SANITIZE_ADDRESS__)
#define KVSCOPE_FUZZ_HAVE_SANITIZER 1
#endif
#ifndef KVSCOPE_FUZZ_HAVE_SANITIZER
#define KVSCOPE_FUZZ_HAVE_SANITIZER 0
#endif
#if KVSCOPE_FUZZ_HAVE_SANITIZER
#include <sanitizer/common_interface_defs.h>
#endif

#include "kvscope/sim/info.hpp"
#include "kvscope/sim/results_reader.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/untrusted.hpp"
#include "kvscope/trace/validate.hpp"

namespace {

namespace trace = kvscope::trace;
namespace sim = kvscope::sim;

// What kvcap validate does: the whole validation in an isolated child (a crash, hang or memory
// blow-up there is a report, not a signal of ours).
void validate_like_kvcap(const std::string& path) { (void)trace::validate_trace_isolated(path); }

// What kvsim info/run/sweep and kvview do before reading a trace in their own process: refuse a
// non-regular file, then the isolated metadata pass (trace::check_trace_file). False when refused.
bool guard_trace_file(const std::string& path) {
  try {
    trace::check_trace_file(path);
    return true;
  } catch (const trace::TraceError&) {
    return false;
  }
}

// What kvview does before reading a results file in its own process (sim::check_results_file).
bool guard_results_file(const std::string& path) {
  try {
    sim::check_results_file(path);
    return true;
  } catch (const sim::ResultsReadError&) {
    return false;
  } catch (const trace::TraceError&) {
    return false;
  }
}

// Where the input is written, one file per process: $KVSCOPE_FUZZ_SCRATCH (a folder the caller
// removes: scripts/fuzz and mutate.py set it, since a crashing run cannot clean up), else /dev/shm
// (memory-backed) or /tmp.
const std::string& scratch_path() {
  static const std::string path = [] {
    const char* env = std::getenv("KVSCOPE_FUZZ_SCRATCH");
    const std::string dir = env && *env ? env : access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return dir + "/kvscope_fuzz_" + std::to_string(getpid()) + ".h5";
  }();
  return path;
}

#if KVSCOPE_FUZZ_HAVE_SANITIZER
// A sanitizer report ends the process: remove the scratch file first, unless this is an isolated
// child of the guards (its parent still reads the file). Under libFuzzer, whose own callback
// replaces this one, scripts/fuzz removes the scratch folder instead.
const pid_t main_pid = getpid();
void remove_scratch() {
  if (getpid() == main_pid) std::remove(scratch_path().c_str());
}
[[maybe_unused]] const bool death_callback_set = (__sanitizer_set_death_callback(remove_scratch), true);
#endif

bool write_file(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

// What kvsim info and kvsim run read of a trace in their own process once the guard passed it:
// the metadata and summary, then the tensors (every slice, as validate_trace reads them).
void exercise_trace(const std::string& path) {
  try {
    trace::TraceReader reader(path);
    (void)sim::format_summary(sim::summarize(reader));
    (void)reader.decode_tokens();
    if (reader.layers_present() > 0) (void)reader.read_layer(0);
    if (reader.decode_layers_present() > 0) (void)reader.read_decode_layer(0);
    (void)reader.read_aggregates(0);
    (void)reader.read_profile();
  } catch (const trace::TraceError&) {
    // a clean refusal: what the tools print as their one line
  }
  (void)trace::validate_trace(path);  // in process: every q/k/v slice, decode layer and aggregate
}

// What kvview reads of a results file.
void exercise_results(const std::string& path) {
  try {
    sim::ResultsMeta meta;
    (void)sim::read_results_hdf5(path, &meta);
  } catch (const sim::ResultsReadError&) {
  } catch (const trace::TraceError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& path = scratch_path();
  if (!write_file(path, data, size)) return 0;
  validate_like_kvcap(path);
  if (guard_trace_file(path)) exercise_trace(path);
  if (guard_results_file(path)) exercise_results(path);
  std::remove(path.c_str());
  return 0;
}

#ifdef KVSCOPE_FUZZ_STANDALONE
// fuzz_replay FILE...: runs each file through the fuzz target once (exit 0 when none crashed).
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::cerr << "fuzz_replay: " << argv[i] << ": cannot open\n";
      return 2;
    }
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    std::cout << "fuzz_replay: " << argv[i] << ": ok\n";
  }
  return 0;
}
#endif
