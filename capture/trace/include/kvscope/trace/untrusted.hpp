// Untrusted input files: every trace or results file a tool is given is first parsed in a
// forked child process with a time and a memory limit, so that a crash, an endless loop or a
// memory blow-up inside the HDF5 library (Debian's libhdf5 1.10.8 has all three on corrupt files)
// becomes one TraceError naming the file and the object being read, never a signal or a hang of
// the tool itself. docs/robustness.md, "Untrusted files: the isolated pre-check".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "kvscope/trace/error.hpp"
#include "kvscope/trace/validate.hpp"

namespace kvscope::trace {

struct IsolationLimits {
  // Wall-clock limit, in seconds, on reading any one object: the child is killed when this long
  // passes without it starting to read a new object (note_object_being_read). A metadata pass of
  // a shipped trace reads each object in well under 10 ms; a full validation reads one head slice
  // per object. 10 s keeps every hang (killed after 10 s, reported at once) under the 20 s that
  // any bad input may take (issue 13), with three orders of magnitude of headroom for slow disks.
  double seconds = 10.0;
  // Memory the check may add to the child (a fork of the caller: its own mappings do not count).
  // Enforced with RLIMIT_AS (an allocation beyond it fails at once, std::bad_alloc) and, as a
  // backstop and in AddressSanitizer builds where RLIMIT_AS would break the shadow map, by the
  // parent polling the child's resident memory. The metadata pass of a shipped trace adds a few
  // MiB; 1 GiB is the memory any bad input may take (issue 13).
  std::uint64_t memory_bytes = 1ull << 30;
};

// Throws TraceError(kIo) unless `path` names an existing regular file (a symbolic link to one is
// fine). Uses stat() only: a FIFO, device, socket or directory is refused without being opened
// (opening a FIFO for reading blocks until a writer appears).
void require_regular_file(const std::string& path);

// Runs `check` in a forked child process and returns when it succeeded; rethrows its TraceError
// (kind, object, message) in the caller. The child has stdin/stdout/stderr on /dev/null (stderr
// kept with KVSCOPE_ISOLATED_STDERR=1), default crash signal handlers (so a sanitizer runtime does
// not turn a crash into an exit status), no core dumps, dies with its parent, silences the
// HDF5 error stack, and _exit()s without destructors or atexit handlers (HDF5's atexit close can
// itself crash on a corrupt file). A signal, a timeout, or the memory limit becomes a
// TraceError(kCorrupt) naming `path` and the object the child was reading, e.g.
//   t.h5: /tokens/text: the HDF5 library crashed reading this object (signal 11): the file is corrupt
// An error the check raised before it crashed (the crash came while cleaning up) is reported as
// that error. Other exceptions of `check` become TraceError(kCorrupt) with their what().
void run_isolated(const std::string& path, const std::function<void()>& check,
                  const IsolationLimits& limits = {});

// Readers call this before reading each object ("/tokens/text", "/@version", ...): inside
// run_isolated's child it records what is being read (for the messages above) and restarts the
// per-object time limit; elsewhere it does nothing (one branch).
void note_object_being_read(const std::string& object);
// Readers call this just before throwing: inside run_isolated's child it keeps the error, so that
// when the child then dies in the cleanup (HDF5 closing a corrupt file can abort) the caller still
// gets this error rather than "crashed". Cleared by the next note_object_being_read.
void note_failure(ErrorKind kind, const std::string& file, const std::string& object,
                  const std::string& message);
// Inside run_isolated's child, records the progress of a long check (validate_trace's slices).
void note_progress(std::size_t done, std::size_t total);

// The pre-check of a trace: require_regular_file, then (unless trusted_files()) run_isolated of
// the metadata pass: TraceReader's open (root attributes, /tokens including text, /decode/tokens,
// every dataset's shape and dtype), read_profile and every layer's read_aggregates, without bulk
// q/k/v tensors. full = true runs validate_trace's whole scan in the child instead (and throws
// when it finds the file invalid; an incomplete trace passes). Throws TraceError.
void check_trace_file(const std::string& path, bool full = false);

// validate_trace run in an isolated child (unless trusted_files()), for kvcap validate: the same
// report, progress forwarded from the child; a crash, hang or memory blow-up becomes a report
// with ok = false, kind kCorrupt and the one-line message above. A non-regular file is refused.
ValidationReport validate_trace_isolated(const std::string& path,
                                         const std::function<void(std::size_t, std::size_t)>& progress = {});

// The trusted-file switch: when on, the checks above skip the child (require_regular_file still
// runs). Off by default; on with a tool's --trusted-files flag or the environment variable
// KVSCOPE_TRUSTED_FILES=1 (read on first use).
bool trusted_files();
void set_trusted_files(bool trusted);
// The --help line of the flag, shared by kvcap, kvsim and kvview.
inline constexpr const char* kTrustedFilesHelp =
    "skip the isolated pre-check of input files (parsed first in a child process with a 10 s per-object "
    "and 1 GiB limit, so a corrupt file cannot crash or hang this process); also KVSCOPE_TRUSTED_FILES=1";

}  // namespace kvscope::trace
