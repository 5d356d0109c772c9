// Closed-loop evaluation, simulator side (issue 6): runs a policy on the prefill K/V of a real run
// exactly as kvsim's replay does (same statistics, allocator, selection, merging, head merging,
// quantization) and returns the compressed cache itself plus the bytes kvsim reports for it, so a model
// runner can keep generating from it. No dependency on the runner: inputs are plain float32 arrays.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/results.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::sim {

// Labels of the T context tokens (trace /tokens semantics).
struct ContextLabels {
  std::vector<std::uint8_t> modality;  // [T] 0 text, 1 vision, 2 audio, 3 special
  std::vector<std::int32_t> position, segment, grid_row, grid_col;  // [T]
  int size() const { return static_cast<int>(modality.size()); }
};

// One layer's result: the compressed cache and kvsim's measurement of it (bytes per head and modality).
struct CompressedLayerResult {
  CompressedLayer cache;
  LayerResult result;  // heads[h].bytes_kept, bytes_kept_modality, kept / merged / evicted counts
};

// Throws PolicyError (one line naming the policy) when the closed loop cannot run `policy`: the
// oracle-topk bound (it reads the evaluation queries), a decode-mode stage decode mode does not support,
// or decode mode with a merging executor (the live cache is rebuilt from resident token ids).
void check_closed_loop_support(const PolicySpec& policy);

// Compresses the prefill cache of one run, layer by layer in order 0 .. L-1 (layer 0 fixes the input
// complexity the adaptive policies read, as in kvsim). Prefill-mode policies only: a decode-time
// policy (~decode) throws PolicyError. `dtype` is the element type the bytes are accounted in (the
// runner holds float32; a trace captured with kvcap run --dtype float32 replays with the same bytes).
class PrefillCompressor {
 public:
  PrefillCompressor(PolicySpec policy, Budget budget, const trace::ModelGeometry& geometry,
                    trace::DType dtype, const ContextLabels& labels);

  // q [Hq, T, D], k and v [Hkv, T, D] float32 (k after RoPE). Throws std::invalid_argument for wrong
  // sizes or a layer out of order, std::runtime_error for kernel failures.
  CompressedLayerResult compress_layer(int layer, const std::vector<float>& q, const std::vector<float>& k,
                                       const std::vector<float>& v);

  const PolicySpec& policy() const { return policy_; }
  double keep() const { return keep_; }  // mean keep fraction (after layer 0 for adaptive policies)
  const std::vector<std::string>& warnings() const { return warnings_; }
  const TraceContext& context() const { return ctx_; }

 private:
  PolicySpec policy_;
  Budget budget_;
  TraceContext ctx_;
  double keep_ = 1.0;
  int next_layer_ = 0;
  std::vector<std::string> warnings_;
};

// One kv head's resident cache in decode-time mode: token ids ascending (context t < T, decode step j as
// T + j) and their keys / values as the next query attends to them (dequantized when the policy quantizes).
struct ResidentHead {
  std::vector<std::int32_t> token;
  std::vector<float> k, v;  // [tokens, D]
};

// Decode-time policies (NAME~decode[:N]@cap, docs/policies.md "Decode-time mode") on a live run: the
// resident cache after each decode step is what run_decode_policy_on_layer decides when replaying the
// context and the steps so far (its decisions at step s only read steps 0..s, so replaying a prefix gives
// the same cache as the full replay at that step). Keys and values are kept exact here and quantized as a
// whole resident set, as the replay does.
class DecodeCompressor {
 public:
  DecodeCompressor(PolicySpec policy, Budget budget, const trace::ModelGeometry& geometry, trace::DType dtype,
                   const ContextLabels& labels);
  // A layer's prefill tensors (q [Hq, T, D], k and v [Hkv, T, D] float32, k after RoPE).
  void set_prefill(int layer, std::vector<float> q, std::vector<float> k, std::vector<float> v);
  // Appends the next decode step of a layer: q [Hq, D], k and v [Hkv, D].
  void add_step(int layer, const float* q, const float* k, const float* v);
  int steps(int layer) const;
  // The resident cache of a layer after the steps added so far (none: the starting cache, i.e. the whole
  // context or what a prefill pass at the point's budget kept when the policy has a fixed cap), per kv head.
  // With `result`: kvsim's LayerResult of the replay (bytes_end, bytes_peak per head; zeroed-steps result
  // with bytes_end = bytes of the starting cache before any step).
  std::vector<ResidentHead> resident(int layer, LayerResult* result);

  const PolicySpec& policy() const { return policy_; }
  double prefill_keep() const { return prefill_keep_; }
  double cap_keep() const { return cap_keep_; }
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  struct Layer {
    std::vector<float> q, k, v;     // prefill
    std::vector<float> dq, dk, dv;  // decode steps [S][Hq | Hkv][D]
    int steps = 0;
  };
  PolicySpec policy_;
  TraceContext base_;
  double prefill_keep_ = 1.0, cap_keep_ = 1.0;
  std::vector<Layer> layers_;
  std::vector<std::string> warnings_;
};


}  // namespace kvscope::sim
