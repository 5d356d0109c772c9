// Causal evaluation of one decode step on one kv head, shared by the prefill-mode
// and decode-mode engines: decode query s (the G query heads of kv head h) attends
// to the cache state at step s, which holds the context slots and the decode tokens
// 0..s still resident; the reference is full attention over tokens 0 .. T + s.
#pragma once

#include <cstdint>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/results.hpp"

namespace kvscope::sim {

// The cache of one kv head at one step. Token ids: context t < T, decode step j -> T + j.
struct StepCache {
  const float* k = nullptr;                     // [slots, D] float32 (dequantized)
  const float* v = nullptr;                     // [slots, D]
  int slots = 0;
  const std::int32_t* multiplicity = nullptr;   // [slots] or nullptr (all 1)
  const std::uint8_t* slot_modality = nullptr;  // [slots]
  const std::int32_t* token_to_slot = nullptr;  // [T + s + 1] slot of each token or -1
};

// Evaluates step `step` of kv head `kv_head` and adds each metric / (G * S) into `q`, so that
// summing over the S steps gives the mean over the head's G * S query rows. Throws on a kernel error.
void add_step_quality(LayerData& layer, TraceContext& ctx, int kv_head, int step, const StepCache& cache,
                      bool proportional_attention, Quality& q);

}  // namespace kvscope::sim
