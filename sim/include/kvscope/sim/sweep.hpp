// Sweeps: every (policy, budget) point replayed over a trace, one layer at a
// time (memory bounded by one layer plus its statistics), then aggregated,
// checked for collapse modes and marked on the Pareto front.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/results.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::sim {

// Thresholds of the collapse modes (docs/metrics.md); defaults follow design.md.
struct CollapseThresholds {
  double blind_recall = 0.5;           // vision recall below this in a layer ...
  double blind_share = 0.5;            // ... or vision attention share after < this x before
  double blind_layer_fraction = 0.25;  // flag when at least this fraction of layers is blind
  double drift_ratio = 2.0;            // deep-third output error > ratio x shallow-third error ...
  double drift_min_error = 0.1;        // ... and above this absolute value
  double repetition_entropy = -1.5;    // mean entropy change (nats) below this in a layer ...
  double repetition_layer_fraction = 0.5;   // ... in at least this fraction of layers
  double overcompression_kl = 0.1;     // KL above this in one of the last layers
  int last_layers = 0;                 // how many layers count as "last" (0: max(1, L / 8))
};

std::vector<CollapseFlag> detect_collapse(const PointResult& point, const CollapseThresholds& t,
                                          bool trace_has_vision);

struct SweepPoint {
  PolicySpec policy;
  Budget budget;
};

// "0.1:0.9:0.1,512tok,64MiB" -> budgets (ranges inclusive, rounded to 1e-9).
// Most budgets a list may expand to, and most points policies x budgets may make (a replay each;
// the cap keeps a typo such as 0.1:0.9:1e-7, 8 million points, from allocating gigabytes).
inline constexpr std::size_t kMaxSweepPoints = 10000;
std::vector<Budget> parse_budget_list(const std::string& text);

// Expands policies x budgets; policies that do not compress tokens (full, int8, ...)
// appear once with budget "-".
std::vector<SweepPoint> make_sweep_points(const std::vector<PolicySpec>& policies, const std::vector<Budget>& budgets);

// Oracle allocation: per layer and modality, the error-vs-keep curve of one scorer is measured
// (that modality compressed alone in that layer); then, for each swept budget, a greedy search
// on marginal error per byte picks the per-layer x per-modality keep fractions reaching that
// memory with the least summed error, and the allocation is replayed to measure it.
struct OracleOptions {
  bool enabled = false;
  PolicySpec scorer;  // its scorer, forced sinks/recent and executor are used; quantizer ignored
  std::vector<double> levels = {0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05};
};

struct SweepOptions {
  CollapseThresholds thresholds;
  OracleOptions oracle;
  std::function<void(std::size_t done, std::size_t total)> progress;
  Backend* backend = nullptr;  // kernels to run on (select_backend); nullptr = the CPU backend
  // Evaluate the budgets of one eviction-only policy together on the CPU backend (sim/src/budget_batch.hpp):
  // same results up to float rounding; false evaluates every point on its own.
  bool batch_budgets = true;
};

struct SweepOutput {
  std::vector<PointResult> points;
  std::vector<std::string> warnings;
};

// Throws std::runtime_error with one line naming the file unless the trace can be replayed: it
// needs at least one decode step (S >= 1: the decode queries are the evaluation queries; T >= 1 is
// a rule of the format that the reader enforces). `who` names the caller in the message ("kvsim run").
void require_replayable(const trace::TraceReader& reader, const std::string& who);

// Throws std::runtime_error (e.g. a trace without decode queries, require_replayable; a metric
// that is not finite, check_finite) with a clear message.
SweepOutput run_sweep(const trace::TraceReader& reader, const std::vector<SweepPoint>& points,
                      const SweepOptions& options);

// Throws std::runtime_error, one line naming `source`, the point, the layer, the kv head and the
// metric, when any quality metric or token score of `out` is not finite (NaN or infinite): such a
// value must never reach a table or a results file. run_sweep calls it on its output.
void check_finite(const SweepOutput& out, const std::string& source);

// Adds `src` into `dst`: byte and token counts summed, quality weighted by `w`.
void accumulate(HeadResult& dst, const HeadResult& src, double w);

}  // namespace kvscope::sim
