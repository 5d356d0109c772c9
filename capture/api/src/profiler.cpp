#include "profiler.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <utility>

#include "cupti_activity.hpp"
#include "failure.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::capture::detail {

namespace {

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#if defined(KVSCOPE_HAVE_NVTX)
void nvtx_push(const char* name, kernels::nvtx::Category category) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.category = category;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx(kernels::nvtx::domain(), &a);
}
void nvtx_pop() { nvtxDomainRangePop(kernels::nvtx::domain()); }
#define KVSCOPE_CAPTURE_NVTX_PUSH(name, category) nvtx_push(name, kernels::nvtx::category)
#define KVSCOPE_CAPTURE_NVTX_POP() nvtx_pop()
#else
#define KVSCOPE_CAPTURE_NVTX_PUSH(name, category) ((void)(name))
#define KVSCOPE_CAPTURE_NVTX_POP() ((void)0)
#endif

}  // namespace

std::int64_t current_thread_id() { return static_cast<std::int64_t>(::syscall(SYS_gettid)); }

struct Profiler::Kernels {
  CuptiActivity activity;
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
  kernels_ = std::make_unique<Kernels>();
  std::string why = kernels_->activity.start(now_ns());
  if (!why.empty()) kernels_.reset();
  return why;
}

trace::Profile Profiler::finish() {
  while (!stack_.empty()) pop();  // ranges left open end when the capture closes
  trace::Profile p;
  if (kernels_) p.kernels = kernels_->activity.stop();
  std::lock_guard<std::mutex> lock(mutex_);
  p.ranges = ranges_;
  return p;
}

}  // namespace kvscope::capture::detail
