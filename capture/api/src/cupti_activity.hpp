// CUPTI Activity API recorder of a capture window: every kernel and memcpy as one record,
// with timestamps shifted onto the capture's steady clock. Built only with CUPTI
// (KVSCOPE_CAPTURE_HAVE_CUPTI); elsewhere start() says why nothing is recorded. CUPTI's
// activity buffers are process-wide, so one recorder is active at a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/trace/schema.hpp"

namespace kvscope::capture::detail {

class CuptiActivity {
 public:
  CuptiActivity() = default;
  ~CuptiActivity();
  CuptiActivity(const CuptiActivity&) = delete;
  CuptiActivity& operator=(const CuptiActivity&) = delete;

  // now_ns: the capture clock now. Returns "" when recording started, else the reason.
  std::string start(std::int64_t now_ns);
  // Synchronizes the device, flushes CUPTI's buffers, disables recording and returns the
  // records (empty if start() failed). Idempotent.
  std::vector<trace::KernelRecord> stop();

 private:
  bool active_ = false;
  std::int64_t shift_ns_ = 0;  // capture clock minus CUPTI clock
};

}  // namespace kvscope::capture::detail
