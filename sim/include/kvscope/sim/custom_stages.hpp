// Stages defined at run time by a host program (the Python package's custom scorers and allocators,
// docs/python.md): a callback registered under a name joins the stage registry like a built-in method, so
// policy names, INI files (`scorer = NAME`, `allocator = NAME`) and every replay (kvsim's engine, sweeps,
// the closed loop's compressors) use it; selection, merging, quantization and the metrics stay the
// built-in C++ stages. Register before a replay starts, never while one runs.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvscope/sim/stages.hpp"

namespace kvscope::sim {

// What a run-time stage sees of one layer: geometry, token labels [T] and, for scorers, the layer's
// prefill tensors as float32 (q [Hq, T, D] after RoPE, k and v [Hkv, T, D]; nullptr for allocators).
struct CustomLayer {
  int layer = 0, num_layers = 1;
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int T = 0;  // context tokens
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const std::uint8_t* modality = nullptr;  // [T] 0 text, 1 vision, 2 audio, 3 special
  const std::int32_t* position = nullptr;  // [T]
  const std::uint8_t* role = nullptr;      // [T] trace::Role codes; nullptr when the input has no roles
  std::array<std::int64_t, 4> tokens{};    // context tokens per modality
};

// A scorer: a score for every context token of every kv head, [Hkv * T] (higher = keep). Called once per
// layer (the statistic is shared by every point of a sweep). Throw std::runtime_error to fail the replay.
using CustomScoreFn = std::function<std::vector<float>(const CustomLayer&)>;

// An allocator's decision for a layer at a mean keep fraction `keep`: the layer's keep fraction or, with
// per_modality, the fraction of each modality's tokens kept (as the explicit allocator, no leftover
// redistribution).
struct CustomAllocation {
  double layer_keep = 1.0;
  bool per_modality = false;
  std::array<double, 4> modality_keep{};
};
using CustomAllocateFn = std::function<CustomAllocation(const CustomLayer&, double keep)>;

// Registers (or replaces an earlier run-time stage of the same name). Names: letters, digits and
// "_.-", not a built-in stage's name. `preset`: also a policy of that name (scorer, uniform allocator,
// evict executor). Throws PolicyError for a bad or built-in name.
void register_custom_scorer(const std::string& name, const std::string& meaning, CustomScoreFn score,
                            bool preset = true);
void register_custom_allocator(const std::string& name, const std::string& meaning,
                               CustomAllocateFn allocate);
// True for a stage registered at run time.
bool is_custom_stage(StageKind kind, const std::string& name);

}  // namespace kvscope::sim
