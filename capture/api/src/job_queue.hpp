// The bounded queue between the model's thread and the writer thread. Capacity is
// counted in bytes of staged tensors: reserve() blocks while the bytes in flight plus the
// new job would exceed the bound (back-pressure), except that a job arriving at an empty
// queue always goes through, so one tensor larger than the bound still passes alone.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "device_stager.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::capture::detail {

enum class JobKind { kTokens, kPrefill, kAggregates, kDecode, kStop };

// One tensor inside a job's staging bytes: contiguous [heads, tokens, head_dim] in `dtype`.
struct StagedTensor {
  DType dtype = DType::kF32;
  std::array<std::size_t, 3> shape{};
  std::size_t offset = 0;  // bytes from the start of the staging buffer
  std::size_t numel() const { return shape[0] * shape[1] * shape[2]; }
};

struct Job {
  JobKind kind = JobKind::kStop;
  int layer = -1;
  int step = -1;
  std::array<StagedTensor, 3> tensors{};  // q, k, v
  std::vector<std::byte> host;            // staging when every tensor came from host memory
  PinnedBuffer pinned;                    // staging when a tensor came from the device
  void* ready_event = nullptr;            // cudaEvent_t completing the device copies, or null
  std::uint64_t bytes = 0;                // counted against the queue bound
  trace::Tokens tokens;                   // kTokens
  trace::LayerAggregates aggregates;      // kAggregates
  const std::byte* staging() const { return pinned.data ? pinned.data : host.data(); }
};

class JobQueue {
 public:
  explicit JobQueue(std::uint64_t bound_bytes) : bound_(bound_bytes) {}

  // Model thread: waits until `bytes` fit (see above) and counts them as in flight.
  void reserve(std::uint64_t bytes);
  // Gives back reserved bytes of a job that was never pushed.
  void unreserve(std::uint64_t bytes) { release(bytes); }
  void push(Job job);
  // Writer thread: the next job, waiting for one.
  Job pop();
  // Writer thread: a job's bytes are free again.
  void release(std::uint64_t bytes);

  std::uint64_t bound() const { return bound_; }
  std::uint64_t peak_bytes() const;
  std::uint64_t waits() const;

 private:
  const std::uint64_t bound_;
  mutable std::mutex mutex_;
  std::condition_variable space_, ready_;
  std::deque<Job> jobs_;
  std::uint64_t in_flight_ = 0, peak_ = 0, waits_ = 0;
};

}  // namespace kvscope::capture::detail
