// The decoder backends (CPU: OpenBLAS + OpenMP; CUDA: cuBLAS + our kernels), one API.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvscope/runner/config.hpp"
#include "kvscope/runner/kv_cache.hpp"
#include "kvscope/runner/observer.hpp"
#include "kvscope/runner/weights.hpp"

namespace kvscope::runner {

enum class Device { kCpu, kCuda };

struct ForwardRequest {
  const float* x = nullptr;           // [T, d] input embeddings of the new tokens
  const TokenInfo* tokens = nullptr;  // [T] their metadata (positions for RoPE, slot labels)
  int num_tokens = 0;                 // T
  int decode_step = -1;               // -1: prefill (observer gets on_prefill_layer), else the step
  bool all_logits = false;            // logits of every new token, else only of the last
};

// One request of a batched forward: its own cache, observer (may be null) and logits.
struct BatchedRequest {
  ForwardRequest request;
  KvCache* cache = nullptr;
  RunObserver* observer = nullptr;
  std::vector<float>* logits = nullptr;
};

class DecoderBackend {
 public:
  virtual ~DecoderBackend() = default;
  // Runs the decoder over the new tokens: each layer appends their K/V to `cache` as plain slots, then each
  // new token attends over its head's slots up to and including itself (existing slots + causal). Writes
  // logits [all_logits ? T : 1, V] into `logits`.
  virtual void forward(const ForwardRequest& request, KvCache& cache, RunObserver* observer,
                       std::vector<float>& logits) = 0;
  // Independent requests, each over its own cache, as one forward: the CPU backend runs the projections,
  // the MLP and the output head of all their tokens as one matrix (the weights read once for the batch)
  // and attention per request. Each request's result equals its own forward() up to float rounding (the
  // BLAS may sum a product with more rows in another order). Observers get their request's tensors but no
  // ranges. This default runs forward() per request.
  virtual void forward_batch(const std::vector<BatchedRequest>& batch) {
    for (const BatchedRequest& b : batch) forward(b.request, *b.cache, b.observer, *b.logits);
  }
  virtual std::string device_name() const = 0;
};

// True when this build has the CUDA backend and a CUDA device is usable; else `why` says why not.
bool cuda_backend_available(std::string* why);

// Both throw RunnerError: kCuda for the CUDA backend without a GPU (or built without CUDA).
// The CPU backend shares the weights; the CUDA backend uploads them once.
std::unique_ptr<DecoderBackend> make_cpu_backend(const ModelConfig& config,
                                                 std::shared_ptr<const ModelWeights> weights);
std::unique_ptr<DecoderBackend> make_cuda_backend(const ModelConfig& config, const ModelWeights& weights);

}  // namespace kvscope::runner
