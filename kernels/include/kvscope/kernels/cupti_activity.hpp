// CUPTI Activity API recorder shared by kvbench (--cupti) and the capture library: every
// kernel, memcpy and (optionally) memset the process runs while recording is on, as one
// neutral record with CUPTI's timestamps. No aggregation, no I/O: callers turn records
// into their own tables or trace rows.
//
// Target kvscope::cupti (library kvscope_cupti) exists only when CMake found CUPTI
// (KVSCOPE_HAVE_CUPTI); linking it defines KVSCOPE_HAVE_CUPTI for the consumer, which
// guards its calls with that macro. CUPTI's activity buffers are process-wide, so one
// ActivityRecorder records at a time; every CUPTI call is checked and reported through
// Status (cuptiGetResultString), nothing exits.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels::cupti {

enum class ActivityKind : std::uint8_t { kKernel = 0, kMemcpy, kMemset };

constexpr const char* activity_kind_name(ActivityKind kind) {
  return kind == ActivityKind::kKernel ? "kernel" : (kind == ActivityKind::kMemcpy ? "memcpy" : "memset");
}

struct ActivityRecord {
  ActivityKind kind = ActivityKind::kKernel;
  // Kernels: the demangled name. Memcpys: the direction "HtoD", "DtoH", "DtoD", "HtoH",
  // "PtoP" or "other". Memsets: "memset".
  std::string name;
  std::int64_t start_ns = 0, end_ns = 0;  // CUPTI clock (see ActivityRecorder::start_timestamp_ns)
  std::int64_t stream = 0;
  std::int32_t device = 0;
  std::array<std::int32_t, 3> grid{0, 0, 0}, block{0, 0, 0};  // kernels only
  std::int64_t bytes = 0;                                       // memcpys and memsets
};

struct ActivityOptions {
  bool memsets = true;                   // also record CUPTI_ACTIVITY_KIND_MEMSET
  std::size_t buffer_bytes = 8u << 20;  // size of each activity buffer handed to CUPTI
};

class ActivityRecorder {
 public:
  ActivityRecorder() = default;
  ~ActivityRecorder();  // stop(), discarding the records
  ActivityRecorder(const ActivityRecorder&) = delete;
  ActivityRecorder& operator=(const ActivityRecorder&) = delete;

  // Enables CONCURRENT_KERNEL and MEMCPY (and MEMSET) activity. Unsupported without a CUDA
  // device or while another recorder is active; Cuda when a CUPTI call fails. Ok (and
  // nothing changes) when this recorder is already active.
  Status start(const ActivityOptions& options = {});
  // Synchronizes the device, force-flushes CUPTI's buffers and appends the records
  // delivered since start() or the previous flush() to *out. Ok and nothing appended
  // when not active. A failed synchronization is reported after the flush.
  Status flush(std::vector<ActivityRecord>* out);
  // flush(out), then disables the activity kinds. Idempotent; out may be null to discard.
  Status stop(std::vector<ActivityRecord>* out);

  bool active() const { return active_; }
  // CUPTI's clock when start() enabled recording (cuptiGetTimestamp), to shift records
  // onto another clock.
  std::int64_t start_timestamp_ns() const { return start_timestamp_ns_; }
  // Records CUPTI reported as dropped (buffers full) since start().
  std::uint64_t dropped() const { return dropped_; }

 private:
  bool active_ = false;
  bool memsets_ = false;
  std::int64_t start_timestamp_ns_ = 0;
  std::uint64_t dropped_ = 0;
};

}  // namespace kvscope::kernels::cupti
