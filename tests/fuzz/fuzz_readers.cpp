// libFuzzer target over kvscope's file readers (docs/robustness.md, "Fuzzing"): the trace reader,
// the validator and the results reader, fed with HDF5 file images.
//
// Each input is written to a temporary file and goes through exactly what the tools do with an
// untrusted file: first the guard (guard_untrusted_file below), then, when the guard accepts it,
// the in-process readers. A crash, sanitizer report, leak or out-of-memory that libFuzzer reports
// is therefore one of our own process, the process a user runs.
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
#include "kvscope/trace/validate.hpp"

namespace {

namespace trace = kvscope::trace;
namespace sim = kvscope::sim;

enum class FileUse { kTrace, kResults };

// The check the tools run on a file before any in-process reader touches it. The tools of this
// tree open files directly, so this accepts every file; it is the one place to call the isolated
// pre-check (a metadata pass in a child process with time and memory limits) once the tools do.
bool guard_untrusted_file(const std::string& /*path*/, FileUse /*use*/) { return true; }

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
// A sanitizer report ends the process: remove the scratch file first.
void remove_scratch() { std::remove(scratch_path().c_str()); }
[[maybe_unused]] const bool death_callback_set = (__sanitizer_set_death_callback(remove_scratch), true);
#endif

bool write_file(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

// What kvcap validate, kvsim info and kvsim run read of a trace (kvsim run then reads layers).
void exercise_trace(const std::string& path) {
  (void)trace::validate_trace(path);
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
  if (guard_untrusted_file(path, FileUse::kTrace)) exercise_trace(path);
  if (guard_untrusted_file(path, FileUse::kResults)) exercise_results(path);
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
