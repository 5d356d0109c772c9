// kvbench's per-benchmark aggregation of kvscope::cupti records; the CUPTI calls (each
// checked and reported with cuptiGetResultString) are in kernels/src/cuda/cupti_activity.cpp.
#include "cupti_recorder.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <tuple>

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

void CuptiRecorder::add(const std::string& scope, const std::vector<kernels::cupti::ActivityRecord>& records) {
  std::map<std::tuple<std::string, std::string>, std::size_t> index;  // (kind, name) -> timings_ row
  for (std::size_t i = 0; i < timings_.size(); ++i) {
    if (timings_[i].scope == scope) index[{timings_[i].kind, timings_[i].name}] = i;
  }
  for (const auto& r : records) {
    const std::string kind = kernels::cupti::activity_kind_name(r.kind);
    auto [it, inserted] = index.try_emplace({kind, r.name}, timings_.size());
    if (inserted) timings_.push_back({scope, kind, r.name, 0, 0.0});
    ActivityTiming& t = timings_[it->second];
    ++t.count;
    t.total_ns += static_cast<double>(r.end_ns - r.start_ns);
  }
}

#if !defined(KVSCOPE_HAVE_CUPTI)

CuptiRecorder::~CuptiRecorder() = default;
bool CuptiRecorder::built_with_cupti() { return false; }
kernels::Status CuptiRecorder::start() {
  return kernels::Status::Unsupported(
      "cupti: kvbench was built without CUPTI (no CUDA toolkit with CUPTI at configure time)");
}
kernels::Status CuptiRecorder::collect(const std::string&) { return kernels::Status::Ok(); }
kernels::Status CuptiRecorder::stop() { return kernels::Status::Ok(); }
bool CuptiRecorder::active() const { return false; }
std::uint64_t CuptiRecorder::dropped() const { return 0; }

#else  // KVSCOPE_HAVE_CUPTI

CuptiRecorder::~CuptiRecorder() { (void)stop(); }
bool CuptiRecorder::built_with_cupti() { return true; }
kernels::Status CuptiRecorder::start() { return recorder_.start({.memsets = true}); }

kernels::Status CuptiRecorder::collect(const std::string& scope) {
  std::vector<kernels::cupti::ActivityRecord> records;
  const kernels::Status s = recorder_.flush(&records);
  add(scope, records);
  return s;
}

kernels::Status CuptiRecorder::stop() {
  std::vector<kernels::cupti::ActivityRecord> records;
  const kernels::Status s = recorder_.stop(&records);
  add("other", records);
  return s;
}

bool CuptiRecorder::active() const { return recorder_.active(); }
std::uint64_t CuptiRecorder::dropped() const { return recorder_.dropped(); }

#endif  // KVSCOPE_HAVE_CUPTI

}  // namespace kvscope::bench
