// Allocation search over one scorer (the `alloc-search:SCORER` rows of a sweep; docs/policies.md
// "Bound and search rows in sweeps"). Internal to sim/: run_sweep drives it layer by layer.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"

namespace kvscope::sim::detail {

class AllocSearch {
 public:
  // `budgets`: the keep fractions (< 1) to search at, with their budget text as the sweep wrote it.
  AllocSearch(const AllocSearchOptions& options, const TraceContext& ctx,
              std::vector<std::pair<double, std::string>> budgets);

  // The candidate specs, for LayerData::prepare_and_release.
  std::vector<const PolicySpec*> specs() const;
  // Replays every candidate allocation on `layer` and keeps the layer results.
  void run_layer(LayerData& layer, TraceContext& ctx);
  // One point per budget, kind "search", appended to `points` (layers filled, totals not yet
  // aggregated: run_sweep aggregates every point).
  void append_points(std::vector<PointResult>& points) const;

  // The search on measured per-layer (bytes, error) tables: bytes[l][c], error[l][c]. Starts from
  // candidate `start` in every layer; accepts the move (one layer, or two layers, changing candidate)
  // that lowers the summed error most while the summed bytes stay <= the start's, until none does.
  // Returns the candidate of each layer.
  static std::vector<int> search(const std::vector<std::vector<std::int64_t>>& bytes,
                                 const std::vector<std::vector<double>>& error, int start);

 private:
  struct Candidate {
    PolicySpec spec;
    double keep = 1;  // the keep argument of run_policy_on_layer
  };
  AllocSearchOptions options_;
  std::vector<std::pair<double, std::string>> budgets_;
  std::vector<int> start_;             // [budgets] index of the scorer's own allocation at each budget
  std::vector<Candidate> candidates_;  // [C]
  std::vector<std::vector<LayerResult>> results_;  // [L][C]
  std::vector<std::vector<std::int64_t>> bytes_;   // [L][C] kept bytes of the layer
  std::vector<std::vector<double>> error_;         // [L][C] output error of the layer (mean over kv heads)
};

}  // namespace kvscope::sim::detail
