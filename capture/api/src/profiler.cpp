#include "profiler.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <utility>

#include "failure.hpp"
#include "kvscope/kernels/cupti_activity.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::capture::detail {

namespace {

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#if defined(KVSCOPE_HAVE_NVTX)
#define KVSCOPE_CAPTURE_NVTX_PUSH(name, category) kernels::nvtx::range_push(name, kernels::nvtx::category)
#define KVSCOPE_CAPTURE_NVTX_POP() kernels::nvtx::range_pop()
#else
#define KVSCOPE_CAPTURE_NVTX_PUSH(name, category) ((void)(name))
#define KVSCOPE_CAPTURE_NVTX_POP() ((void)0)
#endif

#if defined(KVSCOPE_HAVE_CUPTI)
// A kvscope::cupti record as a /profile/kernels row: kind "kernel" or "memcpy_<direction>"
// (lower case, also the name of a memcpy), times shifted onto the capture clock.
trace::KernelRecord to_trace(kernels::cupti::ActivityRecord a, std::int64_t shift_ns) {
  trace::KernelRecord r;
  if (a.kind == kernels::cupti::ActivityKind::kKernel) {
    r.kind = "kernel";
    r.name = std::move(a.name);
  } else {
    r.kind = std::string(kernels::cupti::activity_kind_name(a.kind)) + "_";
    for (char c : a.name) r.kind += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    r.name = r.kind;
  }
  r.start_ns = a.start_ns + shift_ns;
  r.end_ns = a.end_ns + shift_ns;
  r.stream = a.stream;
  r.device = a.device;
  r.grid = a.grid;
  r.block = a.block;
  r.bytes = a.bytes;
  return r;
}
#endif

}  // namespace

std::int64_t current_thread_id() { return static_cast<std::int64_t>(::syscall(SYS_gettid)); }

// CUPTI kernel and memcpy records between start_kernels() and finish() (kvscope::cupti).
struct Profiler::Kernels {
#if defined(KVSCOPE_HAVE_CUPTI)
  kernels::cupti::ActivityRecorder recorder;
  std::int64_t shift_ns = 0;  // capture clock minus CUPTI clock
#endif
};

Profiler::Profiler(bool timed) : timed_(timed), origin_ns_(steady_ns()), model_thread_(current_thread_id()) {}

Profiler::~Profiler() = default;

std::int64_t Profiler::now_ns() const { return steady_ns() - origin_ns_; }

void Profiler::push(const char* name) {
  KVSCOPE_CAPTURE_NVTX_PUSH(name, kModel);
  if (timed_)
    stack_.push_back({name, now_ns()});
  else
    stack_.push_back({std::string(), 0});
}

void Profiler::pop() {
  if (stack_.empty()) fail(KVSCOPE_ERR_STATE, "kvscope_capture_range_pop: no open range (pop without push)");
  KVSCOPE_CAPTURE_NVTX_POP();
  Open top = std::move(stack_.back());
  stack_.pop_back();
  if (timed_) add(std::move(top.name), top.start, now_ns(), depth(), model_thread_);
}

void Profiler::add(std::string name, std::int64_t start, std::int64_t end, int depth, std::int64_t thread) {
  std::lock_guard<std::mutex> lock(mutex_);
  ranges_.push_back({std::move(name), start, end, depth, thread});
}

Profiler::Scope::Scope(Profiler& p, std::string name, int depth)
    : p_(p), name_(std::move(name)), depth_(depth), start_(p.timed_ ? p.now_ns() : 0) {
  KVSCOPE_CAPTURE_NVTX_PUSH(name_.c_str(), kCapture);
}

Profiler::Scope::~Scope() {
  KVSCOPE_CAPTURE_NVTX_POP();
  if (p_.timed_) p_.add(std::move(name_), start_, p_.now_ns(), depth_, current_thread_id());
}

std::string Profiler::start_kernels() {
  if (!timed_) return "profiling is off";
#if defined(KVSCOPE_HAVE_CUPTI)
  auto k = std::make_unique<Kernels>();
  const kernels::Status s = k->recorder.start({.memsets = false, .buffer_bytes = 4u << 20});
  if (!s.ok()) return s.message() + ": no kernel records";
  k->shift_ns = now_ns() - k->recorder.start_timestamp_ns();
  kernels_ = std::move(k);
  return "";
#else
  return "kvscope_capture was built without CUPTI: no kernel records";
#endif
}

trace::Profile Profiler::finish() {
  while (!stack_.empty()) pop();  // ranges left open end when the capture closes
  trace::Profile p;
#if defined(KVSCOPE_HAVE_CUPTI)
  if (kernels_) {
    std::vector<kernels::cupti::ActivityRecord> records;
    (void)kernels_->recorder.stop(&records);  // a failed sync or flush still returns what arrived
    p.kernels.reserve(records.size());
    for (auto& a : records) p.kernels.push_back(to_trace(std::move(a), kernels_->shift_ns));
    kernels_.reset();
  }
#endif
  std::lock_guard<std::mutex> lock(mutex_);
  p.ranges = ranges_;
  return p;
}

}  // namespace kvscope::capture::detail
