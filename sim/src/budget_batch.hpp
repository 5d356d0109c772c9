// Reuse across budgets (docs/perf.md "Evaluation reuse"): the points of one eviction policy at several
// budgets on one layer, evaluated from one pass over their kept tokens when the kept sets are nested.
#pragma once

#include <string>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/results.hpp"

namespace kvscope::sim {

// True when `p`'s points of different budgets may be evaluated together: prefill mode, it compresses
// tokens, not adaptive, the evict executor, no quantizer, no head merging (so the context slots are the
// kept tokens themselves, and evaluation reuses the full cache's attention, evaluation.hpp).
bool budget_batch_eligible(const PolicySpec& p);

// Whether the token sets *sets[order[0]], *sets[order[1]], ... (each ascending, ids in [0, num_tokens))
// are nested, each holding the ones before; if so, increments[b] = the tokens of set order[b] not in the
// sets before it, ascending.
bool nested_increments(const std::vector<const std::vector<std::int32_t>*>& sets,
                       const std::vector<std::size_t>& order, int num_tokens,
                       std::vector<std::vector<std::int32_t>>* increments);

struct BudgetBatchStats {
  int nested_heads = 0;    // kv heads evaluated in one pass for all budgets
  int fallback_heads = 0;  // kv heads whose kept sets were not nested (every budget evaluated alone)
};

// Runs `p` at each keep fraction keeps[i] on one layer; returns what run_policy_on_layer(p, keeps[i], ...)
// returns (its warnings go to *warnings[i]), up to float rounding of the quality. Per kv head, when the kept
// sets are nested as the kept count grows (each a superset of the smaller ones), the attention output of
// every budget is a running sum of p(t) v_t over the union, taken in the order in which budgets first keep
// each token (one GEMM per increment instead of one per budget over its whole set), and so are the
// survived mass, the entropy sum and the mass per modality; where they are not nested, each budget is
// evaluated on its own (evaluate_prefill_rows_cpu). Requires budget_batch_eligible(p) and L.prepare_steps().
std::vector<LayerResult> run_budgets_on_layer(const PolicySpec& p, const std::vector<double>& keeps,
                                              LayerData& L, TraceContext& ctx,
                                              const std::vector<std::vector<std::string>*>& warnings,
                                              BudgetBatchStats* stats = nullptr);

}  // namespace kvscope::sim
