// kvbench --cupti: kernel, memcpy and memset records of kvscope::cupti (the shared CUPTI
// Activity API recorder) aggregated per (scope, kind, name), where the scope is the
// benchmark that ran since the previous collect(). Without CUPTI in the build, or
// without a GPU, start() returns a non-ok Status and nothing is recorded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/kernels/common.hpp"
#include "kvscope/kernels/cupti_activity.hpp"

namespace kvscope::bench {

struct ActivityTiming {
  std::string scope;  // benchmark name (or "ceilings", "other")
  std::string kind;   // "kernel", "memcpy", "memset"
  std::string name;   // demangled kernel name, or memcpy direction
  std::uint64_t count = 0;
  double total_ns = 0;
  double mean_ns() const { return count ? total_ns / static_cast<double>(count) : 0.0; }
};

class CuptiRecorder {
 public:
  CuptiRecorder() = default;
  ~CuptiRecorder();
  CuptiRecorder(const CuptiRecorder&) = delete;
  CuptiRecorder& operator=(const CuptiRecorder&) = delete;

  static bool built_with_cupti();

  // Enables CONCURRENT_KERNEL, MEMCPY and MEMSET activity. Only one recorder may be
  // active at a time.
  kernels::Status start();
  // Synchronizes the device, force-flushes every buffer and attributes the records
  // delivered since the last collect() to `scope`.
  kernels::Status collect(const std::string& scope);
  // collect("other"), then disables the activity kinds. Idempotent.
  kernels::Status stop();

  bool active() const;
  // Aggregates in order of first appearance.
  const std::vector<ActivityTiming>& timings() const { return timings_; }
  // Records CUPTI reported as dropped (buffers full).
  std::uint64_t dropped() const;

 private:
  void add(const std::string& scope, const std::vector<kernels::cupti::ActivityRecord>& records);

#if defined(KVSCOPE_HAVE_CUPTI)
  kernels::cupti::ActivityRecorder recorder_;
#endif
  std::vector<ActivityTiming> timings_;
};

// Text table: scope, kind, name, count, total ms, mean us. Names longer than
// name_width are shortened with "...".
std::string format_activity_table(const std::vector<ActivityTiming>& rows, std::size_t name_width = 60);

}  // namespace kvscope::bench
