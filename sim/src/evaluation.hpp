// Causal evaluation of the decode steps on one kv head, shared by the prefill-mode and
// decode-mode engines: decode query s (the G query heads of kv head h) attends to the cache
// state at step s, which holds the context slots and the decode tokens 0..s still resident;
// the reference is full attention over tokens 0 .. T + s.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/results.hpp"

namespace kvscope::sim {

// The cache of one kv head at one step. Token ids: context t < T, decode step j -> T + j.
struct StepCache {
  const float* k = nullptr;  // [slots, D] float32 (dequantized)
  const float* v = nullptr;  // [slots, D]
  int slots = 0;
  const std::int32_t* multiplicity = nullptr;   // [slots] or nullptr (all 1)
  const std::uint8_t* slot_modality = nullptr;  // [slots]
  const std::int32_t* token_to_slot = nullptr;  // [T + s + 1] slot of each token or -1
};

// Adds the G query rows of step s of kv head h (per-row metrics as the batched evaluation computes them;
// recm, mfull, mcomp [G, 4]) to q exactly as add_step_quality adds a step: the all-query means, the query
// sets and the proxies' row statistics (docs/metrics.md). Used by the budget batch (budget_batch.cpp).
void add_step_rows(LayerData& layer, const TraceContext& ctx, int kv_head, int step, const float* err,
                   const float* rec, const float* kl, const float* dent, const float* recm, const float* mfull,
                   const float* mcomp, Quality& q);
// The answer top-k recall and mass of kv head h for a prefill-mode cache holding the context tokens `kept`
// (ascending ids), as add_prefill_quality adds them.
void add_topk_recall(LayerData& layer, const TraceContext& ctx, int kv_head, const std::vector<std::int32_t>& kept,
                     Quality& q);

// Evaluates step `step` of kv head `kv_head` and adds each metric / (G * S) into `q`, so that
// summing over the S steps gives the mean over the head's G * S query rows. Throws on a kernel error.
void add_step_quality(LayerData& layer, TraceContext& ctx, int kv_head, int step, const StepCache& cache,
                      bool proportional_attention, Quality& q);

// The prefill-mode cache of one kv head: K context slots, then the S decode tokens (exact), in
// one array, so that step s sees the prefix of K + s + 1 slots.
struct PrefillCache {
  const float* k = nullptr;                     // [K + S, D] float32 (dequantized context slots)
  const float* v = nullptr;                     // [K + S, D]
  int context_slots = 0;                        // K
  const std::int32_t* multiplicity = nullptr;   // [K + S] or nullptr (all 1)
  const std::uint8_t* slot_modality = nullptr;  // [K + S]
  const std::int32_t* token_to_slot = nullptr;  // [T + S] slot of each token or -1
  // The context slots are the surviving tokens themselves, in ascending token order, exact (float32
  // copies, multiplicity 1): an eviction without merging or quantization. The batched CPU evaluation
  // then reuses the full cache's attention instead of recomputing q.k (evaluate_prefill_rows_cpu).
  bool exact_context = false;
};

// Per-row metrics of the G * S query rows of one kv head, row r = s * G + j.
struct RowMetrics {
  std::vector<float> output_error, recall, kl, entropy_change;     // [R]
  std::vector<float> recall_modality, mass_full, mass_compressed;  // [R, 4]
  void resize(std::size_t rows) {
    for (auto* v : {&output_error, &recall, &kl, &entropy_change}) v->resize(rows);
    for (auto* v : {&recall_modality, &mass_full, &mass_compressed}) v->resize(rows * kModalities);
  }
};

// Working buffers of the batched evaluation, reused across heads and points by one thread.
struct EvalScratch {
  std::vector<float> q, z, e, o, log_n, slot_mass, cmax;  // [R, D], [R, K + S] x2, [R, D], [K + S] x2, [R]
  std::vector<double> csum, cent, cmass;                  // [R], [R], [R, 4]
  std::vector<int> surv_token, surv_runs, slot_runs;      // surviving token ids, run boundaries
  RowMetrics rows;
  // The compressed cache of one working head as the engines build it (policy_exec.cpp, budget_batch.cpp):
  // slot keys / values then the decode tokens [K + S, D], the quantizer's output [K, D], multiplicities,
  // token -> slot [T + S] and slot modalities. Each user sizes and writes them in full before reading.
  std::vector<float> sk, sv, qbuf;
  std::vector<std::int32_t> sn, t2s;
  std::vector<std::uint8_t> smod;
  // The kept tokens' per-token codes, scales and zero points gathered from LayerData::token_codes.
  std::vector<std::uint8_t> codes;
  std::vector<float> scales, zeros;
};

// An EvalScratch for the calling thread. While a ScratchPoolScope is open (run_sweep opens one) it comes
// from a process-wide pool and goes back to it on destruction, so that a sweep allocates its [T, D]-sized
// buffers once per thread instead of once per point (or head): kvsim maps blocks of 4 MiB and more on
// their own (cli::release_large_blocks_promptly), so every fresh buffer was page-faulted in and zeroed
// again (docs/perf.md "Long traces"). Without an open scope it is a fresh EvalScratch, freed at the end.
class PooledScratch {
 public:
  PooledScratch();
  ~PooledScratch();
  PooledScratch(const PooledScratch&) = delete;
  PooledScratch& operator=(const PooledScratch&) = delete;
  EvalScratch& operator*() { return *s_; }
  EvalScratch* operator->() { return s_.get(); }

 private:
  std::unique_ptr<EvalScratch> s_;
};

// Keeps the PooledScratch pool alive while at least one scope is open; the last one to close frees the
// idle scratches. The pool holds at most one scratch per thread that ran an engine inside the scopes.
class ScratchPoolScope {
 public:
  ScratchPoolScope();
  ~ScratchPoolScope();
  ScratchPoolScope(const ScratchPoolScope&) = delete;
  ScratchPoolScope& operator=(const ScratchPoolScope&) = delete;
};

struct PrefillProblem {
  LayerData* layer = nullptr;  // full-cache side: layer->full_step(kv_head, s), after prepare_steps()
  int kv_head = 0;
  int group = 0, steps = 0, context_tokens = 0, head_dim = 0;  // G, S, T, D
  const float* q = nullptr;  // step s's G query rows at q + s * q_step_stride, [G, D] each
  std::size_t q_step_stride = 0;
  const std::uint8_t* modality = nullptr;  // [T + S] of every token
  PrefillCache cache;
  bool proportional_attention = true;
};

// The S steps of one kv head at once on the CPU (causal_eval_cpu.cpp): the per-row math of
// kernels::cpu::evaluate_attention with the step's GEMMs batched over the steps. When
// problem.cache.exact_context, the compressed attention of each row is the full attention restricted
// to the survivors and renormalised, so it is read from the full cache (layer->full_step) instead of
// recomputed (no q.k GEMM, no exp, no log per slot); the metrics equal the recomputed ones up to float
// rounding (docs/perf.md, "Evaluation reuse"). `reuse_full_attention = false` forces the recomputation.
void evaluate_prefill_rows_cpu(const PrefillProblem& problem, EvalScratch& scratch, RowMetrics& out,
                               bool reuse_full_attention = true);

// The reuse path alone: returns false (and writes nothing) when it does not apply (not exact_context,
// or a row whose survivors hold less than 1e-20 of the full attention, where the full probabilities of
// the survivors may have underflowed in float32).
bool evaluate_prefill_rows_reuse(const PrefillProblem& problem, EvalScratch& scratch, RowMetrics& out);

// Evaluates all S steps of kv head `kv_head` on a prefill-mode cache and adds the metrics into
// `q` exactly like S calls of add_step_quality (same weights, same order of the sums): batched
// on the CPU backend when ctx.batched_evaluation, else one backend call per step.
void add_prefill_quality(LayerData& layer, TraceContext& ctx, int kv_head, const PrefillCache& cache,
                         bool proportional_attention, EvalScratch& scratch, Quality& q);

}  // namespace kvscope::sim
