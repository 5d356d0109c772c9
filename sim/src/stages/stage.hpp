// Stage interfaces. A policy is a composition of one stage of each kind:
//   head merge -> scorer -> budget allocator -> (selection, forced set) -> executor -> quantizer.
// Each method of a kind is one file under sim/src/stages/<kind>/ that declares its parameters
// (StageInfo, kvscope/sim/stages.hpp) and is listed once in registry.cpp. Stages read a layer
// through LayerView (typed tensors, lazily computed statistics shared by every point of a sweep,
// token metadata) and the policy's parameters (PolicySpec::params, declared defaults).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/kernels/select.hpp"
#include "kvscope/sim/backend.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/stages.hpp"

namespace kvscope::sim::stages {

// Context token metadata (all [T]).
struct TokenView {
  int count = 0;                           // T
  const std::uint8_t* modality = nullptr;  // [T] kernels::Modality codes
  const std::int32_t* position = nullptr;  // [T] RoPE position
  const std::int32_t* grid_row = nullptr;  // [T] patch row, -1 off any grid
  const std::int32_t* grid_col = nullptr;  // [T] patch column, -1 off any grid
  const std::int32_t* id = nullptr;        // [K] resident token ids (decode mode's resident view only)
  PerModalityCount per_modality{};         // tokens of each modality
  int modality_of(int t) const { return modality[t]; }
  bool is_vision(int t) const { return modality[t] == static_cast<std::uint8_t>(kernels::Modality::kVision); }
};

// Row-major float32 matrix view.
struct Rows {
  const float* data = nullptr;
  int rows = 0, cols = 0;
  const float* row(int r) const {
    return data + static_cast<std::size_t>(r) * static_cast<std::size_t>(cols);
  }
};

// What a stage sees of one layer.
struct LayerView {
  const PolicySpec& policy;
  LayerData& data;  // tensors and lazily computed statistics (engine.hpp), e.g. data.h2o() [Hkv, T]
  TraceContext& ctx;
  int layer = 0, num_layers = 1;
  int kv_heads = 0, q_heads = 0, group = 1, head_dim = 0;  // Hkv, Hq, G = Hq / Hkv, D
  int T = 0, S = 0;                                        // context tokens, evaluation queries
  TokenView tokens;

  LayerView(const PolicySpec& p, LayerData& d, TraceContext& c);
  // Context keys / values of kv head h as captured, float32 [T, D] (rows of data.k_all()).
  Rows context_keys(int h) const;
  Rows context_values(int h) const;
  std::size_t index(int h, int t) const {
    return static_cast<std::size_t>(h) * static_cast<std::size_t>(T) + static_cast<std::size_t>(t);
  }
};

class Stage {
 public:
  explicit Stage(StageInfo info) : info_(std::move(info)) {}
  virtual ~Stage() = default;
  const StageInfo& info() const { return info_; }
  // Statistics read from the trace's prefill tensors / from the float32 copy, computed before the
  // points of a layer run (LayerData::prepare_prefill_statistics / prepare_float_statistics).
  virtual void prepare_prefill(LayerData&, const PolicySpec&, const TraceContext&) const {}
  virtual void prepare_float(LayerData&, const PolicySpec&, const TraceContext&) const {}

 private:
  StageInfo info_;
};

// ---- head merge
struct WorkingHeads {
  int count = 0;                           // Hw
  bool merged = false;                     // a merge ran (its index table is counted)
  std::vector<std::int32_t> cluster;       // [Hkv] working head of each kv head
  std::vector<const float*> keys, values;  // [Hw] -> [T, D] float32 context rows
};
class HeadMerge : public Stage {
 public:
  using Stage::Stage;
  virtual WorkingHeads merge(const LayerView& view) const = 0;
};

// ---- scorer
// One kv head in decode mode at step s: the resident cache and the step's queries.
struct DecodeStepView {
  int step = 0, kv_head = 0;
  const std::vector<std::int32_t>& tokens;  // [K] resident token ids, ascending (context t < T, decode T + j)
  const kernels::AttentionProblem& query;   // the G query heads of step s over the resident keys [K, D]
  const std::vector<float>& q_steps;        // [S, Hq, D] decode queries by step
  Backend& backend;
};
class DecodeScoring {
 public:
  virtual ~DecodeScoring() = default;
  // Called at every step, before a possible eviction (e.g. H2O accumulates the step's attention).
  virtual void observe(const DecodeStepView&) {}
  // Scores [K] of the resident tokens at an eviction (higher = keep).
  virtual void score(const DecodeStepView& step, std::vector<float>& out) = 0;
};
class Scorer : public Stage {
 public:
  using Stage::Stage;
  // Prefill: a score for every context token of every kv head, out [Hkv, T] (higher = keep).
  virtual void score(const LayerView& view, std::vector<float>& out) const = 0;
  // Decode mode (only when info().decode): the scoring state of one kv head.
  virtual std::unique_ptr<DecodeScoring> decode_scoring(const LayerView&, int /*kv_head*/) const {
    return nullptr;
  }
};

// Score = token id (newest first), in prefill and decode mode: the recency scorer
// (scorers/recency.cpp), which the `none` scorer also ranks by.
std::unique_ptr<Stage> newest_first_scorer(StageInfo info);

// ---- budget allocator
class Allocator : public Stage {
 public:
  using Stage::Stage;
  // Layers this allocator leaves uncompressed (FastV's first layers).
  virtual bool keeps_layer(const LayerView&) const { return false; }
  // This layer's keep fraction for a mean keep fraction (clamped to [0, 1] by the caller).
  virtual double layer_fraction(const LayerView&, double keep) const { return keep; }
  // Per-modality budgets (sp.use_modality_budgets, sp.modality_budget, sp.redistribute_leftover)
  // and protected tokens for a layer budget of k tokens; may change k. scores: [Hw, T].
  virtual void allocate(const LayerView&, const std::vector<float>& /*scores*/, int /*working_heads*/,
                        int& /*k*/, kernels::SelectParams& /*sp*/,
                        std::vector<std::uint8_t>& /*protect*/) const {}
  // Decode mode (only when info().decode): per-modality budgets and protected tokens among the K
  // resident tokens (resident.modality, resident.id [K]; decode tokens are text) for a cap of k
  // tokens. scores: [K] the scorer's scores of the resident tokens.
  virtual void allocate_resident(const LayerView&, const TokenView& /*resident*/,
                                 const std::vector<float>& /*scores*/, int& /*k*/, kernels::SelectParams& /*sp*/,
                                 std::vector<std::uint8_t>& /*protect*/) const {}
  // A schedule of its own: a point without a budget keeps default_keep() (else 0.5, and
  // `kvsim run` asks for a budget).
  virtual bool own_schedule() const { return false; }
  virtual double default_keep(const PolicySpec&, const TraceContext&) const { return 0.5; }
};

// ---- executor
struct SlotOutput {
  float* keys = nullptr;                  // [K, D]
  float* values = nullptr;                // [K, D]
  std::int32_t* multiplicity = nullptr;   // [K], preset to 1
  std::int32_t* token_to_slot = nullptr;  // [T], preset to -1
};
class Executor : public Stage {
 public:
  using Stage::Stage;
  virtual bool merges() const = 0;  // dropped tokens may fold into slots (multiplicities are stored)
  // Builds the K slots of one working head from n tokens (the context, n = T, in prefill mode; the
  // resident cache in decode mode): keys / values [n, D], kept [K] ascending indices into them,
  // importance [n] (merge weights, merging executors only); out.token_to_slot is [n].
  virtual void execute(const LayerView& view, int n, const float* keys, const float* values,
                       const std::int32_t* kept, int K, const float* importance, SlotOutput out) const = 0;
};

// The merge kernel on one working head: every dropped token within `window` positions of a kept one
// whose key cosine exceeds `threshold` folds into the most similar kept slot (executors/merge_evicted.cpp;
// the merging executors merge-evicted and unicache differ only in their threshold parameter).
void merge_into_kept(const LayerView& v, int n, const float* keys, const float* values, const std::int32_t* kept,
                     int K, const float* importance, int window, float threshold, SlotOutput out);

// ---- quantizer
class Quantizer : public Stage {
 public:
  using Stage::Stage;
  // The (key, value) specs; false: no quantization.
  virtual bool specs(kernels::QuantSpec* key, kernels::QuantSpec* value) const = 0;
};

// A quantizer that is one fixed (key, value) pair of specs, as every built-in one is.
class FixedQuantizer final : public Quantizer {
 public:
  FixedQuantizer(StageInfo info, const kernels::QuantSpec& key, const kernels::QuantSpec& value)
      : Quantizer(std::move(info)), key_(key), value_(value) {}
  bool specs(kernels::QuantSpec* key, kernels::QuantSpec* value) const override {
    *key = key_;
    *value = value_;
    return true;
  }

 private:
  kernels::QuantSpec key_, value_;
};

// ---- registry (registry.cpp lists every built-in stage)
class Registry {
 public:
  void add(std::unique_ptr<Stage> stage);
  const Stage* find(StageKind kind, const std::string& name) const;
  std::vector<const Stage*> all(StageKind kind) const;

 private:
  std::vector<std::unique_ptr<Stage>> stages_[5];
};
const Registry& registry();

// The policy's stage of each kind (names are validated when set; an unknown one is a logic error).
const HeadMerge& head_merge_of(const PolicySpec& p);
const Scorer& scorer_of(const PolicySpec& p);
const Allocator& allocator_of(const PolicySpec& p);
const Executor& executor_of(const PolicySpec& p);
const Quantizer& quantizer_of(const PolicySpec& p);
const Executor& evict_executor();
const HeadMerge& no_head_merge();

// Per-modality budgets that all round to zero: the modality with the largest unrounded share keeps
// one token (allocators/explicit.cpp). Returns the budgets' sum.
int budgets_keep_one_token(int* budget, const double* share, const PerModalityCount& tokens);

// Parameter helpers for declarations.
ParamDecl int_param(std::string name, std::string def, double lo, double hi, std::string meaning,
                    std::string source);
ParamDecl float_param(std::string name, std::string def, double lo, double hi, std::string meaning,
                      std::string source);
ParamDecl bool_param(std::string name, std::string def, std::string meaning, std::string source);
ParamDecl choice_param(std::string name, std::string def, std::vector<std::string> choices,
                       std::string meaning, std::string source);

}  // namespace kvscope::sim::stages
