// CUPTI Activity API recorder (kvscope::cupti). Records are delivered by CUPTI's
// buffer-completed callback, possibly on a CUPTI thread, into a process-wide pending
// list that flush() hands to the one active recorder. Record structs used (CUDA 13.0,
// CUPTI API 130001): CUpti_ActivityKernel10, CUpti_ActivityMemcpy6, CUpti_ActivityMemset4.
#include "kvscope/kernels/cupti_activity.hpp"

#include <cuda_runtime_api.h>
#include <cupti.h>
#include <cxxabi.h>

#include <atomic>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <utility>

namespace kvscope::kernels::cupti {

namespace {

constexpr std::size_t kBufferAlign = 8;

std::atomic<bool> g_in_use{false};        // one active recorder per process
std::atomic<std::size_t> g_buffer_bytes{8u << 20};
std::mutex g_mutex;                       // guards g_pending and g_dropped
std::vector<ActivityRecord> g_pending;    // delivered, not yet flushed to the recorder
std::uint64_t g_dropped = 0;

Status cupti_status(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return Status::Ok();
  const char* msg = nullptr;
  if (cuptiGetResultString(r, &msg) != CUPTI_SUCCESS || msg == nullptr) msg = "unknown CUPTI error";
  return Status::Cuda(std::string("cupti: ") + what + ": " + msg);
}

std::string demangle(const char* name) {
  if (name == nullptr) return "(unnamed)";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return name;
  std::string out(d);
  std::free(d);
  return out;
}

const char* memcpy_direction(std::uint8_t kind) {
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

// The fields every kept CUPTI record struct shares.
template <class Activity>
ActivityRecord common_fields(const Activity& a, ActivityKind kind, std::string name) {
  ActivityRecord r;
  r.kind = kind;
  r.name = std::move(name);
  r.start_ns = static_cast<std::int64_t>(a.start);
  r.end_ns = static_cast<std::int64_t>(a.end);
  r.stream = a.streamId;
  r.device = static_cast<std::int32_t>(a.deviceId);
  return r;
}

// Converts one CUPTI record; false for kinds the recorder does not keep.
bool to_record(const CUpti_Activity* rec, ActivityRecord* r) {
  if (rec->kind == CUPTI_ACTIVITY_KIND_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    *r = common_fields(*k, ActivityKind::kKernel, demangle(k->name));
    r->grid = {k->gridX, k->gridY, k->gridZ};
    r->block = {k->blockX, k->blockY, k->blockZ};
  } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
    const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
    *r = common_fields(*m, ActivityKind::kMemcpy, memcpy_direction(m->copyKind));
    r->bytes = static_cast<std::int64_t>(m->bytes);
  } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
    const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
    *r = common_fields(*m, ActivityKind::kMemset, "memset");
    r->bytes = static_cast<std::int64_t>(m->bytes);
  } else {
    return false;
  }
  return true;
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  const std::size_t bytes = g_buffer_bytes.load();
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlign, bytes));
  *size = *buffer ? bytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext ctx, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t /*size*/, std::size_t valid) {
  std::vector<ActivityRecord> local;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    ActivityRecord r;
    if (to_record(rec, &r)) local.push_back(std::move(r));
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

// The kinds a recorder enables: all of kKinds, or without the trailing MEMSET.
std::size_t kind_count(bool memsets) { return memsets ? std::size(kKinds) : std::size(kKinds) - 1; }

}  // namespace

ActivityRecorder::~ActivityRecorder() { (void)stop(nullptr); }

Status ActivityRecorder::start(const ActivityOptions& options) {
  if (active_) return Status::Ok();
  if (options.buffer_bytes < 1024 || options.buffer_bytes % kBufferAlign != 0)
    return Status::Invalid("cupti: buffer_bytes must be a multiple of 8 and at least 1024");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    return Status::Unsupported("cupti: no CUDA device, nothing to record");
  }
  bool expected = false;
  if (!g_in_use.compare_exchange_strong(expected, true))
    return Status::Unsupported("cupti: another recorder is active (CUPTI activity is process-wide)");
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_pending.clear();
    g_dropped = 0;
  }
  g_buffer_bytes = options.buffer_bytes;
  memsets_ = options.memsets;
  Status s = cupti_status(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
                          "cuptiActivityRegisterCallbacks");
  for (std::size_t i = 0; s.ok() && i < kind_count(memsets_); ++i)
    s = cupti_status(cuptiActivityEnable(kKinds[i]), "cuptiActivityEnable");
  std::uint64_t now = 0;
  if (s.ok()) s = cupti_status(cuptiGetTimestamp(&now), "cuptiGetTimestamp");
  if (!s.ok()) {
    for (std::size_t i = 0; i < kind_count(memsets_); ++i) (void)cuptiActivityDisable(kKinds[i]);
    g_in_use = false;
    return s;
  }
  start_timestamp_ns_ = static_cast<std::int64_t>(now);
  dropped_ = 0;
  active_ = true;
  return Status::Ok();
}

Status ActivityRecorder::flush(std::vector<ActivityRecord>* out) {
  if (!active_) return Status::Ok();
  Status s = Status::Ok();
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s = Status::Cuda(std::string("cupti: cudaDeviceSynchronize: ") + cudaGetErrorString(e));
  }
  const Status f = cupti_status(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  if (s.ok()) s = f;
  std::vector<ActivityRecord> records;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    records.swap(g_pending);
    dropped_ = g_dropped;
  }
  if (out != nullptr) {
    if (out->empty())
      out->swap(records);
    else
      out->insert(out->end(), std::make_move_iterator(records.begin()), std::make_move_iterator(records.end()));
  }
  return s;
}

Status ActivityRecorder::stop(std::vector<ActivityRecord>* out) {
  if (!active_) return Status::Ok();
  Status s = flush(out);
  for (std::size_t i = 0; i < kind_count(memsets_); ++i) {
    const Status d = cupti_status(cuptiActivityDisable(kKinds[i]), "cuptiActivityDisable");
    if (s.ok()) s = d;
  }
  active_ = false;
  g_in_use = false;
  return s;
}

}  // namespace kvscope::kernels::cupti
