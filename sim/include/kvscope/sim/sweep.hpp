// Sweeps: every (policy, budget) point replayed over a trace, one layer at a
// time (memory bounded by one layer plus its statistics), then aggregated,
// checked for collapse modes and marked on the Pareto front.
#pragma once

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/info.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/report.hpp"
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

// Rows a sweep reports beside the policies (docs/policies.md "Bound and search rows in sweeps").
// They read the trace's own evaluation queries, so they are never on the Pareto front of the policies
// and PointResult::kind says what they are.
//
// The query-aware bound: `oracle-topk` (PolicySpec scorer kOracleTopK) at every distinct token
// budget fraction < 1 of the sweep's points; kind "bound".
struct BoundOptions {
  bool enabled = false;  // kvsim sweep turns it on (--no-bound: off)
};

// Allocation search over one scorer: per layer, the scorer is replayed at candidate allocations
// (its own allocator at every keep level, and per-modality keep fractions on a grid); for each swept
// budget the search starts from the scorer's own allocation at that budget and only accepts moves
// (one or two layers changing their allocation) that keep the summed kept bytes within the start's
// and lower the summed replayed layer error, so its output error is never above the scorer's at
// that budget. Rows `alloc-search:SCORER`, kind "search".
struct AllocSearchOptions {
  bool enabled = false;
  PolicySpec scorer;  // a token-scoring policy; its scorer, forced set, executor and quantizer are used
  std::vector<double> levels = {0.9, 0.8, 0.7, 0.6, 0.5,
                                0.4, 0.3, 0.2, 0.1, 0.05};                 // own-allocator keep levels
  std::vector<double> modality_levels = {1.0, 0.7, 0.5, 0.3, 0.15, 0.05};  // per-modality grid
};

// Name of the search rows of `scorer`: "alloc-search:" + its name.
std::string alloc_search_name(const std::string& scorer);

struct SweepOptions {
  CollapseThresholds thresholds;
  BoundOptions bound;
  AllocSearchOptions alloc_search;
  std::function<void(std::size_t done, std::size_t total)> progress;
  Backend* backend = nullptr;  // kernels to run on (select_backend); nullptr = the CPU backend
  // The question inside the compressed context (move_question_into_context): the decode steps before the
  // first answer step join the context, the answer steps are the evaluation queries.
  bool question_in_context = false;
  // Evaluate the budgets of one eviction-only policy together on the CPU backend (sim/src/budget_batch.hpp):
  // same results up to float rounding; false evaluates every point on its own.
  bool batch_budgets = true;
  // Only the bound and search rows: the requested points define their budgets but are not replayed (a
  // dataset sweep's work unit of its own, beside the units of the policy groups; kvsim sweep --dataset).
  bool extra_rows_only = false;
};

struct SweepOutput {
  std::vector<PointResult> points;
  std::vector<std::string> warnings;
  // The replay's shape (question_in_context moves steps into the context).
  int context_tokens = 0, decode_steps = 0, steps_in_context = 0;
  bool has_roles = false;                         // the trace records token roles
  // Where the prefill attention statistics came from (TraceContext::attention_statistics_summary):
  // stored /aggregates, recomputed, and why.
  std::string attention_statistics;
  std::array<int, kQuerySets> query_set_steps{};  // decode steps of each query set
};

// Sets each empty query set's metrics (query_set_steps 0) to NaN on every head, layer and point, and
// throws std::runtime_error (one line naming `source`) when a non-empty set's metric is not finite.
void finish_query_sets(SweepOutput& out, const std::string& source);

// Aggregates the fidelity proxies (Quality::proxies; docs/metrics.md "Proxies") of every point from its
// heads' values: finishes each head's weighted means, then sets every layer total and the point total by
// the proxy's own rule (max, min, pooled weighted mean, mean over layers, compounding over layers). NaN
// everywhere when the answer set has no step. Called once per sweep, after the layer totals are summed.
void finish_proxies(SweepOutput& out);

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

// The one point of `kvsim run` (and kvscope.sim.run): "NAME" or "NAME@BUDGET" from `registry`. Throws
// PolicyError when the policy needs a budget and has none; a budget the policy ignores (quantizers,
// adaptive) is dropped and its text returned in *ignored (else *ignored is emptied).
SweepPoint run_point(const PolicyRegistry& registry, const std::string& policy_at_budget,
                     std::string* ignored);
// The same with the policy and the budget given apart (budget kind kNone: none).
SweepPoint run_point(const PolicySpec& policy, Budget budget, std::string* ignored);

// The results files' meta of a sweep: the trace's (results_meta) with the replay's shape (the context and
// evaluation steps after --question-in-context, roles and query sets).
ResultsMeta sweep_results_meta(const TraceSummary& summary, const SweepOutput& out, std::string command_line);

// Adds `src` into `dst`: byte and token counts summed, quality weighted by `w`.
void accumulate(HeadResult& dst, const HeadResult& src, double w);

}  // namespace kvscope::sim
