// The replay engine: applies a policy to one layer of a trace through the
// compression kernels and measures memory and quality on the evaluation
// (decode) queries. Per-layer statistics (attention scores, key norms,
// redundancy, cross-modal interaction) are computed once and shared by every
// policy of a sweep.
#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kvscope/kernels/evaluate.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/scores.hpp"
#include "kvscope/sim/backend.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/results.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::sim {

// Per-trace facts every layer needs.
struct TraceContext {
  trace::ModelGeometry geometry;
  trace::DType dtype = trace::DType::kF16;
  int T = 0;  // context tokens
  int S = 0;  // evaluation (decode) queries
  std::vector<std::uint8_t> modality;            // [T]
  std::vector<std::int32_t> position;            // [T]
  PerModalityCount tokens{};                     // per modality
  std::map<std::pair<int, int>, kernels::NeighbourTable> neighbours;  // (seq radius, grid radius) -> lists
  std::vector<std::int32_t> grid_row, grid_col, segment;
  double complexity = 0;                         // log V + log T + 2 N_align / (T + V), set after layer 0
  bool complexity_known = false;
  Backend* backend = &cpu_backend();             // kernels of the attention, evaluation, quantization, selection
  std::vector<std::uint8_t> modality_all;        // [T + S] context modalities, then 0 (text) per decode token
  // Prefill mode on the CPU backend: evaluate the S decode steps of a kv head in one batched pass
  // (two GEMMs) instead of one kernel call per step; same math, GEMM rounding may differ.
  bool batched_evaluation = true;
  std::string source;  // the trace's path, for messages (empty: a model's live cache)
  // Token roles (trace::Role codes; docs/trace-format.md): of the context tokens [T] and of the decode
  // steps [S]. Empty = no roles: every decode step is an answer step.
  std::vector<std::uint8_t> role, step_role;
  bool has_roles = false;    // the trace records roles
  int steps_in_context = 0;  // decode steps moved into the context (question_in_context)
  // Decode steps in query set `set` (QuerySet): answer steps (all S without roles), question steps.
  // Counted by count_query_sets() (from_reader and move_question_into_context call it), else on each call.
  int query_set_steps(int set) const;
  void count_query_sets();
  std::array<int, kQuerySets> query_steps{};
  int query_steps_for = -1;  // the S query_steps were counted for (-1: not counted)
  // Whether decode step s is in query set `set`.
  bool in_query_set(int set, int s) const;

  // Stored attention aggregates (trace format 1.2, /aggregates; docs/trace-format.md section 3a). The
  // definition when the trace has complete ones that fit its geometry; read_layer_data then reads each
  // layer's and LayerData uses a stored statistic where a stage's definition equals it (the same
  // window, redundancy radii, context length T), recomputing otherwise. Aggregates that are incomplete,
  // malformed or corrupt are ignored with a warning (aggregate_warnings) and recomputed.
  std::optional<trace::AggregateDefinition> aggregates;
  int aggregate_window = 0;                     // their window (kept when a bad layer resets them)
  std::string aggregates_absent;                // why none are used, e.g. "the trace has no /aggregates"
  std::vector<std::string> aggregate_warnings;  // for the run's warnings
  // Per statistic ("h2o", "snapkv window sums", ...): layers that used the stored values, layers that
  // recomputed, and why they recomputed.
  struct StatisticUse {
    int stored = 0, recomputed = 0;
    std::string reason;
  };
  std::map<std::string, StatisticUse> statistic_use;
  void note_statistic(const std::string& name, bool stored, const std::string& reason = "");
  // One line for the run's output: "stored /aggregates (window 32) for h2o, ...; recomputed: ...".
  std::string attention_statistics_summary() const;

  static TraceContext from_reader(const trace::TraceReader& reader);
  const kernels::NeighbourTable& neighbour_lists(int seq_radius, int grid_radius);
};

// The largest |x| of a layer's q, k and v (context and decode) for which every float32 dot product,
// sum of squares and attention-weighted sum over one head (tokens x head_dim terms of at most
// max|x|^2) stays below 2^124, an eighth of float32's largest value: tokens * head_dim * max|x|^2
// <= 2^124 (docs/robustness.md, "Edge traces and numerical range in kvsim").
double kernels_value_limit(int tokens, int head_dim);

// Whether a point's slots can come from per-token codes shared across points (LayerData::token_codes):
// prefill mode, K and V both quantized per token, and the slots its kept tokens (no merging executor, no
// head merge). LayerData::prepare_token_codes counts exactly these points as users and policy execution
// asks exactly these for codes, so every code set is released by its last user.
bool uses_token_codes(const PolicySpec& p);

// One layer's tensors and lazily computed statistics (all [Hkv, T] float unless noted).
class LayerData {
 public:
  // Throws std::runtime_error (one line naming the trace, layer and tensor) when the layer's values
  // are outside the range the float32 kernels compute in (kernels_value_limit).
  LayerData(int layer, trace::LayerTensors prefill, trace::LayerTensors decode, TraceContext& ctx);

  int layer() const { return layer_; }
  const trace::LayerTensors& prefill() const { return prefill_; }
  const trace::LayerTensors& decode() const { return decode_; }

  const std::vector<float>& h2o();                            // accumulated attention, summed over GQA groups
  // split_at_window: the keys before the window and the window's keys pooled separately (per query
  // head, before the GQA sum), as kvpress's SnapKVPress pools only the keys before its window.
  const std::vector<float>& snapkv(const kernels::SnapKVParams& p, bool split_at_window = false);
  const std::vector<float>& tova();
  const std::vector<float>& key_norm();
  const std::vector<float>& redundancy(int seq_radius, int grid_radius);
  const std::vector<float>& cross_received();
  const std::vector<float>& cross_given();                    // share of a token's attention on other modalities
  // Mean key cosine of pairs inside each modality (information density proxy), per modality.
  const PerModality& modality_similarity();
  // Computes every statistic `policy` reads, so that several policies can then run on this
  // layer concurrently (the lazy caches are not thread-safe to fill, only to read).
  void prepare(const PolicySpec& policy);
  // prepare() in two halves, for a caller that releases the trace tensors in between: what
  // `policy` reads from the trace's prefill tensors (attention scores, key norms, redundancy,
  // cross-modal shares, merged heads), then what it reads from the float32 copy (full-cache
  // attention of the decode steps, decode-mode key norms, modality similarity).
  void prepare_prefill_statistics(const PolicySpec& policy);
  void prepare_float_statistics(const PolicySpec& policy);
  // For a sweep: the prefill statistics of every policy, release_prefill(), then their float
  // statistics, so that the layer is never held whole in both dtypes (issue 4, docs/perf.md).
  void prepare_and_release(const std::vector<const PolicySpec*>& policies);
  // Full-cache attention of the evaluation (decode) queries, computed once per layer and
  // shared by every policy point: probabilities [Hq, S, T], outputs [Hq, S, D], entropy, mass.
  const kernels::FullAttention& full_attention(bool proportional_attention);

  // Causal evaluation (both modes): decode query s attends to the T context tokens and the decode
  // tokens 0..s. Keys / values of every token, float32 [Hkv, T + S, D] (context, then decode): the
  // layer's only float32 copy; the context of head h is rows [h * (T + S), h * (T + S) + T).
  const std::vector<float>& k_all();
  const std::vector<float>& v_all();
  // Decode queries by step, float32 [S, Hq, D]: the G query heads of kv head h at step s are
  // contiguous at ((s * Hq) + h * G) * D.
  const std::vector<float>& q_steps();
  // Full attention of kv head h's query heads at step s over tokens 0 .. T + s (G rows).
  // Requires prepare_steps() (or prepare()) first; it fills every step of the layer.
  kernels::FullAttention full_step(int kv_head, int step);
  // Full attention mass per modality of those G rows, in double, summed over tokens 0 .. T + s in
  // order (the evaluation kernel's own sum, shared by every point of the layer): [G, 4].
  const double* full_step_mass(int kv_head, int step) const;
  // p(t) log p(t) of full_step(kv_head, step).probs, same layout ([G, T + step + 1]; 0 where p = 0): the
  // entropy of a compressed cache that only evicts is a sum of these over its survivors.
  const float* full_step_plogp(int kv_head, int step) const;
  void prepare_steps() {
    if (!have_steps_) compute_full_steps();
  }
  // -||k|| of every token [Hkv, T + S] (decode-mode knorm scorer).
  const std::vector<float>& key_norm_all();
  // Query-aware oracle statistic (the oracle-topk scorer, docs/policies.md): the attention mass each
  // context token t < T receives from the trace's own evaluation queries, in the full cache and causally
  // as the evaluation sees them: sum over decode steps s and the G query heads j of kv head h of
  // p_{j,s}(t), p_{j,s} = full_step(h, s).probs of row j (softmax over tokens 0 .. T + s). [Hkv, T]
  // float (summed in double). Information no real policy has: it reads the evaluation queries.
  const std::vector<float>& decode_attention_mass();
  // The answer's top-k context tokens of each kv head (docs/metrics.md "Proxies"): with
  // A(t) = sum over the answer set's steps s and the G query heads j of p_{j,s}(t) (full attention, t < T),
  // the min(kTopK, T) tokens of largest A (ties -> lower index), ascending; and their share of the answer
  // rows' attention, sum_{t in top-k} A(t) / (G * |answer steps|) (0 without answer steps). Computed once
  // per layer; call it outside parallel regions first (the engines do, after prepare_steps()).
  // `specific`: the min(kTopK, T) tokens of largest a(t) - c(t) (ties -> lower index), ascending, with
  // a(t) = A(t) / (G * |answer steps|) the answer rows' mean attention on t and c(t) = h2o(t) / (G * (T - t))
  // the mean attention the prefill queries that see t (positions t .. T-1) give it: what the answer reads
  // more than the context itself reads it (attention sinks, read by every query, drop out).
  struct AnswerTopK {
    std::vector<std::vector<std::int32_t>> tokens;    // [Hkv][k]
    std::vector<double> mass;                         // [Hkv]
    std::vector<std::vector<std::int32_t>> specific;  // [Hkv][k]
  };
  const AnswerTopK& answer_topk();

  // Kv heads merged at a similarity threshold (kernels::cpu::merge_heads on the prefill K/V),
  // computed once per layer and threshold and shared by every point that merges heads.
  struct MergedHeads {
    int num_heads = 0;                  // Hw
    std::vector<std::int32_t> cluster;  // [Hkv] merged head of each kv head
    std::vector<int> row;               // [Hw] row of k / v holding merged head w, -1 for one member
    std::vector<int> source_head;       // [Hw] the kv head of a one-member cluster (read from k_all)
    std::vector<float> k, v;            // [clusters of several heads, T, D] float32
  };
  const MergedHeads& merged_heads(float threshold);

  // Per-token quantization of every context token of every kv head under one spec (per-token
  // granularity: a token's codes, scales and zero points depend on its own row only), for K or V.
  // A sweep quantizes each token once per layer and spec this way and every point whose slots are
  // kept tokens (no merging) dequantizes its kept tokens' codes, instead of quantizing them again at
  // every budget (kernels::cpu::quantize_dequantize = dequantize(quantize(x)) bit for bit).
  struct TokenCodes {
    kernels::QuantSpec spec;           // the points' spec with residual_tokens = 0
    std::int64_t row_bytes = 0;        // packed code bytes per token
    std::int64_t groups = 0;           // scales (and zero points) per token
    std::vector<std::uint8_t> codes;   // [Hkv, T, row_bytes]
    std::vector<float> scales, zeros;  // [Hkv, T, groups]; zeros only when asymmetric
    std::vector<std::uint8_t> exact;   // [Hkv, T] 1 where the dequantized row equals the float32 row
  };
  // Quantizes, on the CPU backend and outside parallel regions, every (per-token spec, K or V) that at
  // least two points of `policies` (one entry per point) use (uses_token_codes), and counts those points
  // as its users.
  void prepare_token_codes(const std::vector<const PolicySpec*>& policies);
  // The codes of (spec, K or V) for one user, or nullptr (not prepared, or already released). A caller
  // given codes calls token_codes_done(spec, values) once when finished with them; the codes are
  // freed when the last counted user is done (memory: see docs/perf.md "Long traces"). Thread-safe.
  std::shared_ptr<const TokenCodes> token_codes(const kernels::QuantSpec& spec, bool values);
  void token_codes_done(const kernels::QuantSpec& spec, bool values);

  // A statistic that a stage defines itself (sim/src/stages/), computed once per layer under `key`
  // by compute(*this) and shared by every point. With reads_prefill, compute reads the trace's
  // prefill tensors (prefill()), so it must first run before release_prefill(): from the stage's
  // prepare_prefill. Like the other statistics, not thread-safe to fill, only to read.
  const std::vector<float>& stage_statistic(const std::string& key, bool reads_prefill,
                                            const std::function<std::vector<float>(LayerData&)>& compute);

  // The layer's stored attention aggregates (read_layer_data sets them when ctx.aggregates fits).
  void set_stored_aggregates(trace::LayerAttentionAggregates stored,
                             const trace::AggregateDefinition& definition) {
    stored_ = std::move(stored);
    stored_definition_ = definition;
  }

  // Drops the trace's prefill tensors once every statistic the points need from them is
  // computed (prepare() or prepare_prefill_statistics()): afterwards only the float32 copy
  // (k_all / v_all, built here if it was not yet, dropping each trace tensor once converted) and
  // the cached statistics are held. A prefill statistic first asked for after this throws
  // std::logic_error.
  void release_prefill();

 private:
  kernels::AttentionProblem problem() const;
  std::vector<float> reduce(const std::vector<float>& per_q_head) const;
  int layer_;
  trace::LayerTensors prefill_, decode_;
  TraceContext& ctx_;
  std::vector<float> h2o_, tova_, knorm_, received_, given_;
  std::map<std::tuple<int, int, int, bool>, std::vector<float>> snap_;
  std::map<std::pair<int, int>, std::vector<float>> redundancy_;
  PerModality modality_similarity_{};
  std::vector<float> full_probs_, full_output_, full_entropy_, full_mass_;
  kernels::FullAttention full_{};
  bool have_full_ = false;
  void compute_full_steps();
  std::vector<float> kall_, vall_, qsteps_, knorm_all_;
  std::vector<float> decode_mass_;  // [Hkv, T] decode_attention_mass()
  AnswerTopK answer_topk_;
  bool have_answer_topk_ = false;
  std::vector<float> step_probs_, step_output_, step_entropy_, step_mass_;  // ragged by step
  std::vector<std::size_t> step_probs_offset_;                            // [S] start of step s in step_probs_
  std::vector<double> step_mass_f64_;                                     // [S, Hq, 4]
  std::vector<float> step_plogp_;                                         // as step_probs_: p log p
  bool have_steps_ = false;
  bool have_similarity_ = false;
  bool prefill_released_ = false;
  std::map<float, MergedHeads> merged_;
  std::map<std::string, std::vector<float>> stage_stats_;
  struct TokenCodesEntry {
    kernels::QuantSpec spec;  // residual_tokens = 0
    bool values = false;
    int users = 0;  // points not yet done with the codes
    std::shared_ptr<const TokenCodes> codes;
  };
  struct TokenCodesState {
    std::mutex mutex;
    std::vector<TokenCodesEntry> entries;
  };
  std::unique_ptr<TokenCodesState> token_codes_ = std::make_unique<TokenCodesState>();
  TokenCodesEntry* find_token_codes(const kernels::QuantSpec& spec, bool values);
  void require_prefill(const char* what) const;
  std::optional<trace::LayerAttentionAggregates> stored_;
  trace::AggregateDefinition stored_definition_;  // of stored_
  // Why a stored statistic does not apply ("" = it does): no stored aggregates for this layer.
  std::string stored_unusable() const;
  // Trace tensors [Hkv, T, D] and [Hkv, S, D] -> float32 [Hkv, T + S, D] (k_all's layout).
  void fill_all(const trace::Tensor& prefill, const trace::Tensor& decode, std::vector<float>& out) const;
};

// ---- roles and query sets (sim/src/roles.cpp) ----
// The question in the compressed context: moves the decode steps before the first answer step (the
// question and the template tokens around it, fed after the prefill) into the context, so that T grows by
// their number and the answer steps are the evaluation queries. Returns the number of steps moved. Throws
// std::runtime_error (one line naming the trace) when the trace has no roles, no such step, or no answer
// step after them.
int move_question_into_context(TraceContext& ctx, const trace::TraceReader& reader);
// A layer's prefill and decode tensors as the (possibly moved) context reads them: the first
// ctx.steps_in_context decode steps appended to the prefill tensors.
LayerData read_layer_data(const trace::TraceReader& reader, int layer, TraceContext& ctx);

// Bytes of one kv head's cache of K slots under `policy`'s quantizer (K and V codes, scales, zero
// points, full-precision residual; plain K and V when the policy does not quantize). The decode-time
// replay and the closed loop count resident caches with it.
Bytes resident_bytes(const PolicySpec& policy, int K, int D, trace::DType dtype);

// Decode-time mode (docs/policies.md): the cache starts with the context (all of it, or the
// tokens a prefill pass at `prefill_keep` < 1 kept), each decode step appends its token, and
// every policy.interval steps the policy evicts down to `cap_keep` of T tokens (>= 1: never).
// Records LayerResult::steps; with record_tokens, token_maps hold the cache after the last step
// (slot_token lists resident token ids: context t < T, decode step j as T + j).
LayerResult run_decode_policy_on_layer(const PolicySpec& policy, double prefill_keep, double cap_keep,
                                       LayerData& layer, TraceContext& ctx, std::vector<std::string>& warnings,
                                       bool record_tokens = false);

// The UniCache stages' parameters, typed (sim/src/stages/*/unicache.cpp read them from
// PolicySpec::params; the defaults are the declared ones).
struct UniCacheConfig {
  float w_a = 0.4f, w_c = 0.3f, w_d = 0.2f, w_r = 0.1f;  // middle layers
  float shallow_w_d = 0.3f;   // first third of the layers
  float deep_w_a = 0.5f;      // last third of the layers
  float rate_shallow = 0.75f; // compression rate (fraction removed) of layer 0
  float rate_deep = 0.45f;    // ... of the last layer, cosine curve in between
  float vision_cap = 0.80f;   // maximum vision compression rate
  float text_cap = 0.40f;     // maximum text compression rate
  float align_threshold = 0.3f;  // cross-modal attention share that makes a token an alignment token
  float align_discount = 0.5f;   // alignment tokens get this fraction of their modality's rate
  float merge_threshold = 0.8f;  // redundancy above which a dropped token is merged, not evicted
  int seq_radius = 4;         // redundancy neighbours in sequence order
  int grid_radius = 1;        // redundancy neighbours on the patch grid
  float rate_offset = 0.0f;   // added to every token rate (realtime-chat: -0.05)
};
// The UniCache parameters of a policy (its params over the declared defaults).
UniCacheConfig unicache_config(const PolicySpec& policy);

// UniCache layer schedule: compression rate (fraction removed) of a layer on a cosine
// curve from cfg.rate_shallow (layer 0) to cfg.rate_deep (last layer), plus cfg.rate_offset.
double unicache_rate(const UniCacheConfig& cfg, int layer, int num_layers);
// Adaptive fallback: complexity log V + log T + 2 N_align / (T + V) mapped linearly onto a
// rate from 0.75 (complexity <= log 64 + log 16) down to 0.40 (>= log 4608 + log 4096 + 0.3).
double adaptive_rate(double complexity);

// Target fraction of context tokens a layer keeps for a (policy, budget) pair:
// converts token and byte budgets, applies adaptive rates. Returns 1 for policies
// that do not compress tokens.
double keep_fraction(const PolicySpec& policy, const Budget& budget, const TraceContext& ctx);

// ---- closed-loop evaluation (issue 6; sim/src/closed_loop.cpp) ----
// The compressed context cache of one layer exactly as run_policy_on_layer built it: per working head
// (after head merging) the slots' keys and values as evaluated (merged, dequantized), multiplicities and
// the context token each slot started as.
struct CompressedLayer {
  struct Head {
    std::vector<float> k, v;                 // [K, D] float32
    std::vector<std::int32_t> multiplicity;  // [K]
    std::vector<std::int32_t> token;         // [K] context token index of each slot
  };
  std::vector<std::int32_t> cluster;  // [Hkv] working head of each kv head
  std::vector<Head> heads;            // [Hw]
};

// The selection half of a prefill-mode run on one layer: head merge -> scores -> budgets ->
// kept (and, for a merging executor, merge weights) per working head. Plain data, so that the
// execution half can be run on it (or on several budgets of one ranking).
struct LayerSelection {
  int working_heads = 0;                  // Hw (kv heads after head merging)
  bool head_merged = false;               // the head-merge stage ran (index bytes are counted)
  std::vector<std::int32_t> cluster;      // [Hkv] working head of each kv head
  std::vector<const float*> keys, values; // [Hw] context rows [T, D] float32 of each working head
  bool keep_all = true;                   // every context token kept (no scorer ran)
  int k = 0;                              // row stride of `kept` (the layer's budget in tokens)
  std::vector<std::int32_t> kept;         // [Hw, k] kept token ids, ascending; counts[w] valid
  std::vector<std::int32_t> counts;       // [Hw] tokens kept by each working head
  std::vector<float> scores;              // [Hw, T] the scorer's scores (empty when keep_all)
  std::vector<float> importance;          // [Hw, T] merge weights >= 0 (merging executors only)
};
LayerSelection select_on_layer(const PolicySpec& policy, double keep, LayerData& layer, TraceContext& ctx,
                               std::vector<std::string>& warnings);
// The execution half: keep / merge (executor) -> quantize (quantizer) -> bytes -> quality on the
// evaluation queries. run_policy_on_layer = select_on_layer + execute_selection.
// evaluate = false: see run_policy_on_layer.
LayerResult execute_selection(const PolicySpec& policy, const LayerSelection& selection, LayerData& layer,
                              TraceContext& ctx, bool record_tokens = false, CompressedLayer* compressed = nullptr,
                              bool evaluate = true);

// Runs `policy` with a mean keep fraction on one layer. Warnings (e.g. a budget
// clamped up to the forced set) are appended to `warnings`.
// With record_tokens, LayerResult::token_maps says what happened to every token of every kv head.
// With `compressed`, the compressed context cache is also returned (closed-loop evaluation).
// With evaluate = false, a policy that only evicts (no merging, no quantizer) stops after the selection:
// counts, bytes and token maps are filled, the quality stays 0 (sim/src/budget_batch.cpp evaluates).
LayerResult run_policy_on_layer(const PolicySpec& policy, double keep, LayerData& layer, TraceContext& ctx,
                                std::vector<std::string>& warnings, bool record_tokens = false,
                                CompressedLayer* compressed = nullptr, bool evaluate = true);

}  // namespace kvscope::sim
