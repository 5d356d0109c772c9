// What a run reports to a capture: per layer the prefill Q/K/V, per decode step the fed token's Q/K/V,
// the fed tokens, and nested named ranges (layer, attention, MLP). The runner does not depend on the
// capture library; kvcap run implements this with the C API.
#pragma once

#include <cstdint>

namespace kvscope::runner {

// A float32 3-D tensor [heads, tokens, head_dim] seen through element strides.
struct TensorRef {
  const float* data = nullptr;
  bool device = false;  // CUDA device memory (valid until the next layer of the same stream)
  std::int64_t shape[3] = {0, 0, 0};
  std::int64_t stride[3] = {0, 0, 0};
  float at(std::int64_t h, std::int64_t t, std::int64_t d) const {  // host tensors only
    return data[h * stride[0] + t * stride[1] + d * stride[2]];
  }
};

class RunObserver {
 public:
  virtual ~RunObserver() = default;
  // q [Hq, T, D]; k, v [Hkv, T, D], k after RoPE.
  virtual void on_prefill_layer(int /*layer*/, const TensorRef& /*q*/, const TensorRef& /*k*/,
                                const TensorRef& /*v*/) {}
  // q [Hq, n, D]; k, v [Hkv, n, D] of the n tokens of one decode forward, decode steps step .. step+n-1
  // (n = 1 for a generated token; n > 1 for GenerateOptions::after_prefill fed in one forward).
  virtual void on_decode_layer(int /*layer*/, int /*step*/, const TensorRef& /*q*/, const TensorRef& /*k*/,
                               const TensorRef& /*v*/) {}
  virtual void on_decode_token(int /*step*/, std::int32_t /*token_id*/, std::int32_t /*position*/) {}
  virtual void range_push(const char* /*name*/) {}
  virtual void range_pop() {}
};

// Pushes a range for its scope (no-op without an observer).
class ScopedRange {
 public:
  ScopedRange(RunObserver* obs, const char* name) : obs_(obs) {
    if (obs_) obs_->range_push(name);
  }
  ~ScopedRange() {
    if (obs_) obs_->range_pop();
  }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;

 private:
  RunObserver* obs_;
};

}  // namespace kvscope::runner
