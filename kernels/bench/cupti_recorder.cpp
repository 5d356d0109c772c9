// CUPTI Activity API recorder. Every CUPTI call is checked and reported with
// cuptiGetResultString; nothing here exits the process.
#include "cupti_recorder.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <utility>

#if defined(KVBENCH_HAVE_CUPTI)
#include <cuda_runtime_api.h>
#include <cupti.h>
#include <cxxabi.h>
#endif

namespace kvscope::bench {

std::string format_activity_table(const std::vector<ActivityTiming>& rows, std::size_t name_width) {
  std::size_t scope_w = 5;
  for (const auto& r : rows) scope_w = std::max(scope_w, r.scope.size());
  std::ostringstream os;
  char line[1024];
  std::snprintf(line, sizeof line, "%-*s  %-7s %-*s %8s %12s %12s\n", static_cast<int>(scope_w), "scope",
                "kind", static_cast<int>(name_width), "name", "count", "total ms", "mean us");
  os << line << std::string(scope_w + name_width + 45, '-') << "\n";
  for (const auto& r : rows) {
    std::string name = r.name;
    if (name.size() > name_width && name_width > 3) name = name.substr(0, name_width - 3) + "...";
    std::snprintf(line, sizeof line, "%-*s  %-7s %-*s %8llu %12.3f %12.2f\n", static_cast<int>(scope_w),
                  r.scope.c_str(), r.kind.c_str(), static_cast<int>(name_width), name.c_str(),
                  static_cast<unsigned long long>(r.count), r.total_ns * 1e-6, r.mean_ns() * 1e-3);
    os << line;
  }
  return os.str();
}

#if !defined(KVBENCH_HAVE_CUPTI)

CuptiRecorder::~CuptiRecorder() = default;
bool CuptiRecorder::built_with_cupti() { return false; }
kernels::Status CuptiRecorder::start() {
  return kernels::Status::Unsupported(
      "cupti: kvbench was built without CUPTI (no CUDA toolkit with CUPTI at configure time)");
}
kernels::Status CuptiRecorder::collect(const std::string&) { return kernels::Status::Ok(); }
kernels::Status CuptiRecorder::stop() { return kernels::Status::Ok(); }

#else  // KVBENCH_HAVE_CUPTI

namespace {

struct Record {
  std::string kind, name;
  double ns;
};

// Records delivered by CUPTI's buffer-completed callback (possibly on a CUPTI thread)
// and not yet attributed to a scope.
std::mutex g_mutex;
std::vector<Record> g_pending;
std::uint64_t g_dropped = 0;

constexpr std::size_t kBufferBytes = 8u << 20;
constexpr std::size_t kBufferAlign = 8;

kernels::Status cupti_status(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return kernels::Status::Ok();
  const char* msg = nullptr;
  if (cuptiGetResultString(r, &msg) != CUPTI_SUCCESS || msg == nullptr) msg = "unknown CUPTI error";
  return kernels::Status::Cuda(std::string("cupti: ") + what + ": " + msg);
}

#define KVBENCH_CUPTI_TRY(call) KVSCOPE_RETURN_IF_ERROR(cupti_status((call), #call))

std::string demangle(const char* name) {
  if (name == nullptr) return "(unnamed)";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return name;
  std::string out(d);
  std::free(d);
  return out;
}

const char* memcpy_kind_name(std::uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "PtoP";
    default:
      return "other";
  }
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext ctx, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t /*size*/, std::size_t valid) {
  std::vector<Record> local;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        local.push_back({"kernel", demangle(k->name), static_cast<double>(k->end - k->start)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        local.push_back({"memcpy", memcpy_kind_name(m->copyKind), static_cast<double>(m->end - m->start)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        local.push_back({"memset", "memset", static_cast<double>(m->end - m->start)});
        break;
      }
      default:
        break;
    }
  }
  std::size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) != CUPTI_SUCCESS) dropped = 0;
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_dropped += dropped;
  for (auto& r : local) g_pending.push_back(std::move(r));
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};

}  // namespace

CuptiRecorder::~CuptiRecorder() { (void)stop(); }

bool CuptiRecorder::built_with_cupti() { return true; }

kernels::Status CuptiRecorder::start() {
  if (active_) return kernels::Status::Ok();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return kernels::Status::Unsupported("cupti: no CUDA device, nothing to record");
  }
  KVBENCH_CUPTI_TRY(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  for (CUpti_ActivityKind k : kKinds) KVBENCH_CUPTI_TRY(cuptiActivityEnable(k));
  active_ = true;
  return kernels::Status::Ok();
}

kernels::Status CuptiRecorder::collect(const std::string& scope) {
  if (!active_) return kernels::Status::Ok();
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess)
    return kernels::Status::Cuda(std::string("cupti: cudaDeviceSynchronize: ") + cudaGetErrorString(e));
  KVBENCH_CUPTI_TRY(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  std::vector<Record> records;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    records.swap(g_pending);
    dropped_ = g_dropped;
  }
  std::map<std::tuple<std::string, std::string>, std::size_t> index;  // (kind, name) -> timings_ row
  for (std::size_t i = 0; i < timings_.size(); ++i) {
    if (timings_[i].scope == scope) index[{timings_[i].kind, timings_[i].name}] = i;
  }
  for (auto& r : records) {
    auto [it, inserted] = index.try_emplace({r.kind, r.name}, timings_.size());
    if (inserted) timings_.push_back({scope, r.kind, r.name, 0, 0.0});
    ActivityTiming& t = timings_[it->second];
    ++t.count;
    t.total_ns += r.ns;
  }
  return kernels::Status::Ok();
}

kernels::Status CuptiRecorder::stop() {
  if (!active_) return kernels::Status::Ok();
  kernels::Status s = collect("other");
  for (CUpti_ActivityKind k : kKinds) {
    kernels::Status d = cupti_status(cuptiActivityDisable(k), "cuptiActivityDisable");
    if (s.ok() && !d.ok()) s = d;
  }
  active_ = false;
  return s;
}

#endif  // KVBENCH_HAVE_CUPTI

}  // namespace kvscope::bench
