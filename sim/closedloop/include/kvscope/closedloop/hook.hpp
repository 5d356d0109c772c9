// ClosedLoopHook: applies a kvsim policy to the runner's real KV cache after prefill (issue 6), through
// sim::PrefillCompressor, i.e. the same policy code and kernels as kvsim's replay. Generation then continues
// from the compressed (evicted / merged / quantized) cache, so errors compound through the layers.
//
// Use one hook per run, as both the CacheHook and the RunObserver of the run (the observer side records each
// layer's prefill queries, which the scorers need). The first answer token is chosen from the full prefill
// logits (compression follows prefill, as in deployments); every later token sees the compressed cache.
// Prefill-mode policies: decode tokens are appended exact (as kvsim's prefill mode assumes). Decode-time
// policies (NAME~decode[:N]@cap): after prefill the cache is the starting cache of the replay, and after
// every decode step the resident set is what kvsim's decode-time replay keeps at that step (its statistics
// updated from the decode queries the observer side records); quantizing policies hold the resident set
// dequantized as a whole, as the replay evaluates it. One difference is structural: the runner appends a
// step's token and attends with it in one forward pass, so that token is exact (not quantized) for its
// own query.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvscope/runner/config.hpp"
#include "kvscope/runner/kv_cache.hpp"
#include "kvscope/runner/observer.hpp"
#include "kvscope/sim/closed_loop.hpp"

namespace kvscope::closedloop {

// Bytes of a cache, total and per modality (0 text, 1 vision, 2 audio, 3 special; decode tokens are text).
struct CacheBytes {
  std::int64_t total = 0;
  std::array<std::int64_t, 4> modality{};
};

class ClosedLoopHook : public runner::CacheHook, public runner::RunObserver {
 public:
  // `dtype`: element type the bytes are accounted in (the runner computes in float32).
  ClosedLoopHook(const sim::PolicySpec& policy, const sim::Budget& budget, const runner::ModelConfig& config,
                 trace::DType dtype = trace::DType::kF32);

  void on_prefill_layer(int layer, const runner::TensorRef& q, const runner::TensorRef& k,
                        const runner::TensorRef& v) override;
  void on_decode_layer(int layer, int step, const runner::TensorRef& q, const runner::TensorRef& k,
                       const runner::TensorRef& v) override;
  void after_prefill(runner::KvCache& cache, const std::vector<runner::TokenInfo>& context) override;
  void after_decode_step(runner::KvCache& cache, int step, const runner::TokenInfo& token) override;

  bool applied() const { return applied_; }
  // Decode-time policies change the cache after every decode step (so steps must be fed one at a time);
  // prefill-mode policies only append.
  bool evicts_during_decode() const { return decoder_ != nullptr; }
  // kvsim's measurement of each layer's compressed context (bytes per head and modality, token counts).
  const std::vector<sim::LayerResult>& layer_results() const { return layers_; }
  // kvsim's predicted bytes: the compressed context (sum over layers and heads of bytes_kept, per modality
  // as kvsim apportions them) plus the decode tokens appended so far (exact, text).
  CacheBytes predicted_bytes() const;
  // The bytes the runner's cache holds, counted independently from its slots: per layer and working head
  // (heads merged by the policy share one copy) the context slots at the policy's element or quantized
  // size, int32 multiplicities when a merging executor compressed the head, the query-head map when heads
  // were merged, plus every decode slot at full precision.
  std::int64_t held_bytes(const runner::KvCache& cache) const;
  // Largest predicted_bytes().total over the run (after compression; the transient full prefill cache is
  // not counted, as in kvsim).
  std::int64_t peak_bytes() const { return peak_; }
  int decode_steps() const { return decode_steps_; }
  // Decode-time policies: the resident token ids per layer and kv head (ascending; context t < T, decode
  // step j as T + j) after the last step; empty for prefill-mode policies.
  const std::vector<std::vector<std::vector<std::int32_t>>>& resident_tokens() const { return resident_; }
  const std::vector<std::string>& warnings() const;
  double keep() const;

 private:
  sim::PolicySpec policy_;
  sim::Budget budget_;
  runner::ModelConfig config_;
  trace::DType dtype_;
  std::vector<std::vector<float>> prefill_q_;  // [L][Hq * T * D]
  std::unique_ptr<sim::PrefillCompressor> compressor_;
  std::unique_ptr<sim::DecodeCompressor> decoder_;                // decode-time policies
  std::vector<std::vector<std::vector<std::int32_t>>> resident_;  // decode-time: [L][Hkv] resident tokens
  void write_resident(runner::KvCache& cache);
  std::vector<sim::LayerResult> layers_;
  std::vector<std::vector<std::int32_t>> cluster_;  // [L][Hkv]
  std::vector<std::uint8_t> compressor_labels_;     // [T] context modalities
  int context_tokens_ = 0;
  int decode_steps_ = 0;
  bool applied_ = false;
  std::int64_t peak_ = 0;
};

}  // namespace kvscope::closedloop
