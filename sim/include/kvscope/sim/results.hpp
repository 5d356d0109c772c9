// Results of replaying a trace through policies: one PointResult per
// (policy, budget), holding per-layer x per-kv-head x per-modality memory and
// quality, their aggregates, collapse flags and Pareto membership.
// docs/results-format.md describes the files written from these structures.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/kernels/common.hpp"

namespace kvscope::sim {

constexpr int kModalities = kernels::kNumModalities;  // 0 text, 1 vision, 2 audio, 3 special
using PerModality = std::array<double, kModalities>;
using PerModalityCount = std::array<std::int64_t, kModalities>;

// Exact byte accounting of one cache (a head, a layer or a whole point).
struct Bytes {
  std::int64_t kv = 0;            // K and V payload: codes if quantized, else full-precision elements
  std::int64_t scales = 0;        // quantization scales
  std::int64_t zeros = 0;         // quantization zero points
  std::int64_t residual = 0;      // full-precision residual tokens of a quantizer (KIVI)
  std::int64_t multiplicity = 0;  // merge multiplicities (int32 per slot whenever a merging executor ran)
  std::int64_t index = 0;         // index tables (query-head -> merged-head map when heads merged)
  std::int64_t total() const { return kv + scales + zeros + residual + multiplicity + index; }
  Bytes& operator+=(const Bytes& o) {
    kv += o.kv; scales += o.scales; zeros += o.zeros; residual += o.residual;
    multiplicity += o.multiplicity; index += o.index;
    return *this;
  }
};

// Query sets: subsets of the evaluation (decode) queries by the role of their step (docs/metrics.md
// "Query sets"): the answer's queries (steps with role answer) and the question's (role question).
enum QuerySet : int { kAnswerQueries = 0, kQuestionQueries = 1 };
constexpr int kQuerySets = 2;
const char* query_set_name(int set);  // "answer", "question"

// Quality on one query set: the same means as Quality's, over that set's queries only. NaN when the
// set is empty (no decode step has its role).
struct QuerySetQuality {
  double output_error = 0;
  double attention_recall = 0;
  double kl = 0;
  double entropy_delta = 0;
};

// Fidelity proxies beyond the means (results format 1.3; docs/metrics.md "Proxies"). All are measured on the
// answer's queries (the answer query set; every decode step of a trace without roles). Each has its own
// aggregation over heads and layers, applied by finish_proxies() once a point's layers are measured; the
// evaluation only fills the per-head values (and the sums behind the weighted ones).
constexpr int kTopK = 8;  // tokens of the answer's top-k set per kv head
struct Proxies {
  double error_worst_query = 0;  // max over answer rows; layer: max over heads; point: mean over layers
  double error_worst_head = 0;   // head: its answer error; layer: max over heads; point: mean over layers
  double error_retrieval = 0;    // answer error weighted by the rows' attention concentration
  double concentration = 0;      // mean concentration 1 - H(p) / ln(n) of the answer rows (the weight)
  double error_propagated = 0;   // layer l: 1 - prod_{l' <= l} (1 - min(err_answer, 1)); point: last layer
  double topk_recall = 0;        // share of the answer's top-k context tokens that survive
  double topk_recall_min = 0;    // head: = topk_recall; layer: min over heads; point: mean over layers
  double topk_recall_retrieval = 0;  // topk_recall weighted by topk_mass
  double topk_mass = 0;              // share of the answer rows' full attention on their top-k tokens
  // Format 1.5: the answer's specific top-k tokens (what the answer reads more than the context reads it).
  double specific_recall = 0;        // share that survives; layer: mean over heads; point: mean over layers
  double specific_recall_min = 0;    // head: = specific_recall; layer: min over heads; point: mean over layers
};

// The proxies' names (CSV columns, HDF5 datasets) in Proxies' member order, and their values in that order.
constexpr int kNumProxies = 11;
constexpr int kProxiesBefore15 = 9;  // the proxies of results formats 1.3 and 1.4
const char* proxy_name(int i);
double& proxy_value(Proxies& p, int i);
inline double proxy_value(const Proxies& p, int i) { return proxy_value(const_cast<Proxies&>(p), i); }

// Quality on the evaluation queries, averaged over queries (and heads / layers when aggregated).
struct Quality {
  double output_error = 0;     // ||o~ - o|| / ||o||
  double attention_recall = 0; // sum of full attention on surviving tokens
  double kl = 0;               // KL(P || p~) on survivors
  double entropy_delta = 0;    // H(p~) - H(p)
  PerModality recall_modality{};   // R_m (1 where the modality has no attention mass)
  PerModality share_before{};      // sum_{t in m} p(t)
  PerModality share_after{};       // sum_{s in m} p~(s)
  std::array<QuerySetQuality, kQuerySets> query_sets{};  // the same on the answer's / question's queries
  Proxies proxies;
};

// One kv head of one layer.
struct HeadResult {
  int kv_head = 0;
  Bytes bytes_full;                   // uncompressed
  Bytes bytes_kept;                   // after the policy
  PerModalityCount tokens{};          // context tokens per modality
  PerModalityCount kept{};            // kept as their own slot
  PerModalityCount merged{};          // folded into another slot
  PerModalityCount evicted{};         // dropped
  std::array<std::int64_t, kModalities> bytes_full_modality{};
  std::array<std::int64_t, kModalities> bytes_kept_modality{};  // overheads apportioned by slot count
  Quality quality;                    // mean over the query heads of this kv head and the queries
  // The cache over the decode steps (context + appended decode tokens, all components):
  std::int64_t bytes_full_end = 0;    // uncompressed cache after the last step, T + S tokens
  std::int64_t bytes_end = 0;         // resident cache after the last step (after its eviction)
  std::int64_t bytes_peak = 0;        // largest resident cache over the steps (after appending, before eviction)
};

// One decode step s of one layer (summed over its kv heads).
struct DecodeStep {
  bool eviction = false;            // decode mode: the policy ran at this step (s % interval == 0)
  std::int32_t evicted = 0;         // tokens the policy evicted at this step, summed over kv heads
  std::int32_t max_slots = 0;       // slots of the largest kv head after the step
  std::int64_t bytes_before = 0;    // resident bytes after appending step s's token, before eviction
  std::int64_t bytes_after = 0;     // resident bytes after the step's eviction
};

// What happened to each context token in one kv head (filled only on request, e.g. for kvview).
struct TokenMap {
  std::vector<std::int32_t> slot;       // [T] slot index of the token, -1 if evicted
  std::vector<std::int32_t> slot_token; // [slots] token index that represents each slot (kept token)
  std::vector<std::uint8_t> state;      // [T] 0 evicted, 1 kept (own slot), 2 merged into another slot
  std::vector<float> score;             // [T] the score the selection used (empty when nothing was selected)
  int quant_bits = 0;                   // bits of the key quantizer, 0 = not quantized
};

struct LayerResult {
  int layer = 0;
  std::vector<HeadResult> heads;  // [num_kv_heads]
  std::vector<TokenMap> token_maps;  // [num_kv_heads] when requested, else empty
  HeadResult total;               // sums over heads (bytes, counts), means (quality)
  int merged_heads = 0;           // kv heads after head merging (== num_kv_heads without it)
  std::vector<DecodeStep> steps;  // [S] the cache at every decode step
};

// Collapse-mode flag (design.md "Collapse modes").
struct CollapseFlag {
  std::string mode;           // visual_blindness, semantic_drift, repetition, over_compression
  std::vector<int> layers;    // the layers that triggered it
  std::string evidence;       // the numbers behind it, one line
  std::string suggested_fix;  // the seed's suggestion
};

struct PointResult {
  std::string policy;      // canonical policy name, e.g. "h2o+int8"
  std::string budget;      // as given: "0.3", "512tok", "64MiB", or "-" for budget-free policies
  std::string mode = "prefill";  // "prefill" or "decode" (docs/policies.md "Decode-time mode")
  // "policy"; "bound" (oracle-topk: reads the evaluation queries, the bound of eviction scorers) or
  // "search" (alloc-search:SCORER, an allocation search on measured errors): neither is a policy, and
  // neither is ever on the Pareto front (docs/policies.md "Bound and search rows in sweeps").
  std::string kind = "policy";
  double budget_value = 0; // fraction of tokens kept requested (after converting tok/bytes), 1 for "-"
  std::vector<LayerResult> layers;
  HeadResult total;        // all layers
  double bytes_ratio() const {
    return total.bytes_full.total() ? static_cast<double>(total.bytes_kept.total()) / total.bytes_full.total() : 1.0;
  }
  std::vector<CollapseFlag> flags;
  bool pareto = false;     // on the memory vs output-error Pareto front of its sweep
  double seconds = 0;      // wall time spent on this point
};

}  // namespace kvscope::sim
