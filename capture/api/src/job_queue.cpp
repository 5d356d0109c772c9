#include "job_queue.hpp"

#include <algorithm>
#include <utility>

namespace kvscope::capture::detail {

void JobQueue::reserve(std::uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto fits = [&] { return in_flight_ == 0 || in_flight_ + bytes <= bound_; };
  if (!fits()) {
    ++waits_;
    space_.wait(lock, fits);
  }
  in_flight_ += bytes;
  peak_ = std::max(peak_, in_flight_);
}

void JobQueue::push(Job job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  ready_.notify_one();
}

Job JobQueue::pop() {
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait(lock, [&] { return !jobs_.empty(); });
  Job job = std::move(jobs_.front());
  jobs_.pop_front();
  return job;
}

void JobQueue::release(std::uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_ -= std::min(in_flight_, bytes);
  }
  space_.notify_all();
}

std::uint64_t JobQueue::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

std::uint64_t JobQueue::waits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_;
}

}  // namespace kvscope::capture::detail
