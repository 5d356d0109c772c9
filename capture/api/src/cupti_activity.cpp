#include "cupti_activity.hpp"

#if defined(KVSCOPE_CAPTURE_HAVE_CUPTI)
#include <cuda_runtime_api.h>
#include <cupti.h>
#include <cxxabi.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#endif

namespace kvscope::capture::detail {

#if !defined(KVSCOPE_CAPTURE_HAVE_CUPTI)

CuptiActivity::~CuptiActivity() = default;
std::string CuptiActivity::start(std::int64_t) {
  return "kvscope_capture was built without CUPTI: no kernel records";
}
std::vector<trace::KernelRecord> CuptiActivity::stop() { return {}; }

#else

namespace {

constexpr std::size_t kBufferBytes = 4u << 20;
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY};

std::atomic<bool> g_in_use{false};  // one recorder per process
std::mutex g_mutex;                 // guards g_records (buffers complete on CUPTI's thread)
std::vector<trace::KernelRecord> g_records;

std::string demangle(const char* name) {
  if (name == nullptr) return "(unnamed)";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return name;
  std::string out(d);
  std::free(d);
  return out;
}

const char* memcpy_kind(std::uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy_htod";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy_dtoh";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy_dtod";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "memcpy_htoh";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "memcpy_ptop";
    default:
      return "memcpy_other";
  }
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                               std::size_t valid) {
  std::vector<trace::KernelRecord> local;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    trace::KernelRecord r;
    if (rec->kind == CUPTI_ACTIVITY_KIND_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      r.name = demangle(k->name);
      r.kind = "kernel";
      r.start_ns = static_cast<std::int64_t>(k->start);
      r.end_ns = static_cast<std::int64_t>(k->end);
      r.stream = k->streamId;
      r.device = static_cast<std::int32_t>(k->deviceId);
      r.grid = {k->gridX, k->gridY, k->gridZ};
      r.block = {k->blockX, k->blockY, k->blockZ};
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      r.kind = memcpy_kind(m->copyKind);
      r.name = r.kind;
      r.start_ns = static_cast<std::int64_t>(m->start);
      r.end_ns = static_cast<std::int64_t>(m->end);
      r.stream = m->streamId;
      r.device = static_cast<std::int32_t>(m->deviceId);
      r.bytes = static_cast<std::int64_t>(m->bytes);
    } else {
      continue;
    }
    local.push_back(std::move(r));
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& r : local) g_records.push_back(std::move(r));
}

std::string cupti_error(CUptiResult r, const char* what) {
  const char* msg = nullptr;
  if (cuptiGetResultString(r, &msg) != CUPTI_SUCCESS || msg == nullptr) msg = "unknown CUPTI error";
  return std::string("CUPTI ") + what + ": " + msg;
}

}  // namespace

CuptiActivity::~CuptiActivity() { (void)stop(); }

std::string CuptiActivity::start(std::int64_t now_ns) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return "no CUDA device: no kernel records";
  }
  bool expected = false;
  if (!g_in_use.compare_exchange_strong(expected, true)) return "another capture records CUPTI activity";
  CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  for (std::size_t i = 0; r == CUPTI_SUCCESS && i < std::size(kKinds); ++i)
    r = cuptiActivityEnable(kKinds[i]);
  std::uint64_t cupti_now = 0;
  if (r == CUPTI_SUCCESS) r = cuptiGetTimestamp(&cupti_now);
  if (r != CUPTI_SUCCESS) {
    for (CUpti_ActivityKind k : kKinds) (void)cuptiActivityDisable(k);
    g_in_use = false;
    return cupti_error(r, "start");
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records.clear();
  }
  shift_ns_ = now_ns - static_cast<std::int64_t>(cupti_now);
  active_ = true;
  return "";
}

std::vector<trace::KernelRecord> CuptiActivity::stop() {
  if (!active_) return {};
  active_ = false;
  (void)cudaDeviceSynchronize();
  (void)cudaGetLastError();
  (void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  for (CUpti_ActivityKind k : kKinds) (void)cuptiActivityDisable(k);
  std::vector<trace::KernelRecord> out;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    out.swap(g_records);
  }
  g_in_use = false;
  for (auto& r : out) {
    r.start_ns += shift_ns_;
    r.end_ns += shift_ns_;
  }
  return out;
}

#endif  // KVSCOPE_CAPTURE_HAVE_CUPTI

}  // namespace kvscope::capture::detail
