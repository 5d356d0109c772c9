// Profiling of a capture: named ranges (NVTX domain "kvscope" on builds with NVTX, and,
// when profiling is on, steady-clock times in nanoseconds since the capture opened), plus
// CUPTI kernel and memcpy records on a GPU. Ranges are pushed and popped by the model's
// thread; capture-copy and writer ranges are added from either thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvscope/trace/schema.hpp"

namespace kvscope::capture::detail {

std::int64_t current_thread_id();  // the kernel's thread id (as Perfetto shows it)

class Profiler {
 public:
  explicit Profiler(bool timed);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  bool timed() const { return timed_; }
  std::int64_t now_ns() const;  // since the capture opened

  // User ranges (model thread). pop() throws Failure(KVSCOPE_ERR_STATE) without an open range.
  void push(const char* name);
  void pop();
  int depth() const { return static_cast<int>(stack_.size()); }

  // A range around capture work (copy, conversion, write); any thread.
  class Scope {
   public:
    Scope(Profiler& p, std::string name, int depth);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Profiler& p_;
    std::string name_;
    int depth_;
    std::int64_t start_;
  };

  // Starts CUPTI activity recording when built with CUPTI and a GPU is present. Returns an
  // empty string on success, otherwise why nothing is recorded.
  std::string start_kernels();
  // Ends open user ranges at now, stops CUPTI and returns every record.
  trace::Profile finish();

 private:
  struct Open {
    std::string name;
    std::int64_t start;
  };
  void add(std::string name, std::int64_t start, std::int64_t end, int depth, std::int64_t thread);

  bool timed_;
  std::int64_t origin_ns_;  // steady clock at construction
  std::vector<Open> stack_;
  std::int64_t model_thread_ = 0;
  std::mutex mutex_;  // guards ranges_
  std::vector<trace::RangeRecord> ranges_;
  struct Kernels;
  std::unique_ptr<Kernels> kernels_;
};

}  // namespace kvscope::capture::detail
