// NVTX ranges in the `kvscope` domain. Compiles to nothing without NVTX3
// (KVSCOPE_HAVE_NVTX undefined), so CPU-only builds pay nothing.
#pragma once

#if defined(KVSCOPE_HAVE_NVTX)
#include <nvtx3/nvToolsExt.h>

namespace kvscope::kernels::nvtx {

struct DomainTag {
  static constexpr const char* name{"kvscope"};
};

// Categories group ranges per primitive family in Nsight Systems.
enum Category : unsigned {
  kQuantize = 1, kAttentionStats, kScores, kSelect, kCompact, kMerge, kHeadMerge, kEvaluate, kCapture, kModel
};

nvtxDomainHandle_t domain();

// A range opened and closed by hand (push and pop on the same thread); ScopedRange does both.
inline void range_push(const char* name, Category category) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.category = category;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx(domain(), &a);
}
inline void range_pop() { nvtxDomainRangePop(domain()); }

class ScopedRange {
 public:
  ScopedRange(const char* name, Category category) { range_push(name, category); }
  ~ScopedRange() { range_pop(); }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;
};

}  // namespace kvscope::kernels::nvtx

#define KVSCOPE_NVTX_CAT2(a, b) a##b
#define KVSCOPE_NVTX_CAT(a, b) KVSCOPE_NVTX_CAT2(a, b)
#define KVSCOPE_NVTX_RANGE(name, category) \
  ::kvscope::kernels::nvtx::ScopedRange KVSCOPE_NVTX_CAT(_kvscope_range_, __LINE__)(name, ::kvscope::kernels::nvtx::category)
#else
#define KVSCOPE_NVTX_RANGE(name, category) ((void)0)
#endif
