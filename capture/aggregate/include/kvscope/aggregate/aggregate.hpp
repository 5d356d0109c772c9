// kvscope::aggregate — the attention aggregates of trace format 1.2 (/aggregates,
// docs/trace-format.md section 3a) computed from a layer's prefill tensors on the CPU kernels:
// one blockwise pass over the causal attention rows (blocks of 64 query rows, never [T, T]) for
// H2O and the cross-modal shares, the observation-window sums and the last query's row, and the key
// redundancy. `kvcap aggregate` and the capture library (kvscope_capture_config.aggregate_window)
// both compute them here, so they are the same numbers kvsim computes when it recomputes.
#pragma once

#include <functional>
#include <string>

#include "kvscope/kernels/scores.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::aggregate {

// SnapKV's default observation window (sim/src/stages/scorers/snapkv.cpp, snap_window).
inline constexpr int kDefaultWindow = 32;

class AggregateComputer {
 public:
  // window: the W of window_sum, capped at T (min(window, T), as kvsim caps snap_window).
  // Throws std::invalid_argument on a window < 1 or tokens that do not fit the geometry.
  AggregateComputer(const trace::ModelGeometry& geometry, trace::DType dtype, const trace::Tokens& tokens,
                    int window, const std::string& creator);
  const trace::AggregateDefinition& definition() const { return def_; }
  // q [Hq, T, D] and k [Hkv, T, D] in the trace's dtype (raw elements). Throws std::runtime_error
  // when a kernel refuses its input.
  trace::LayerAttentionAggregates compute(const void* q, const void* k) const;
  // FLOP of the logits of one layer's pass (2 D per visible (query, key) pair and query head, over
  // the row blocks' key ranges): what the throughput of `kvcap aggregate` is counted in.
  double logit_flop_per_layer() const;

 private:
  trace::ModelGeometry geometry_;
  trace::DType dtype_;
  trace::AggregateDefinition def_;
  std::vector<std::uint8_t> modality_;
  std::vector<std::int32_t> position_;
  kernels::NeighbourTable neighbours_;
};

// What aggregate_trace did.
struct AggregateRun {
  int layers = 0;
  std::size_t tokens = 0;
  int window = 0;         // the stored W (min(window, T))
  double seconds = 0;     // in AggregateComputer::compute, all layers (not reading or writing)
  double logit_flop = 0;  // logit_flop_per_layer() x layers
};
// Computes the aggregates of every layer of the complete trace at `path` (one layer's q and k read at
// a time) and stores them with trace::AggregateWriter (staged, then committed into the trace).
// Throws trace::TraceError for a bad trace or a failed write, std::runtime_error / invalid_argument
// from the computation. progress(done, total) after each layer.
AggregateRun aggregate_trace(const std::string& path, int window, const std::string& creator,
                             const std::function<void(int, int)>& progress = {});

}  // namespace kvscope::aggregate
