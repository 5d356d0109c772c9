// Hand-made simulator results for the report tests and the interop sample: 2 policies x
// 2 budgets x 3 layers x 2 kv heads over 20 text + 80 vision tokens (head_dim 8, float16,
// so 32 bytes per token per kv head). Every number is derived from a few bases, so tests can
// recompute what the files must contain.
#pragma once

#include <string>
#include <vector>

#include "kvscope/sim/pareto.hpp"
#include "kvscope/sim/report.hpp"

namespace kvscope::testing {

inline constexpr int kSampleLayers = 3;
inline constexpr int kSampleHeads = 2;
inline constexpr std::int64_t kSampleText = 20, kSampleVision = 80;
inline constexpr std::int64_t kSampleBytesPerToken = 32;  // K+V, head_dim 8, 2 bytes

// Quality of one head: grows with the layer and the head so aggregates are not trivial.
inline sim::Quality sample_quality(double base, int layer, int head) {
  const double s = 1.0 + 0.1 * layer + 0.05 * head;
  sim::Quality q;
  q.output_error = base * s;
  q.kl = 0.5 * base * s;
  q.entropy_delta = -0.2 * base * s;
  q.recall_modality = {1.0 - base * s, 1.0 - 2.0 * base * s, 1.0, 1.0};
  q.share_before = {0.3, 0.7, 0.0, 0.0};
  q.share_after = {0.3 + 0.1 * base, 0.7 - 0.1 * base, 0.0, 0.0};
  q.attention_recall = 0.3 * q.recall_modality[0] + 0.7 * q.recall_modality[1];
  return q;
}

// Mean of the qualities (the engine's aggregation of heads into layers and layers into points).
inline sim::Quality mean_quality(const std::vector<const sim::Quality*>& qs) {
  sim::Quality m;
  const double n = static_cast<double>(qs.size());
  for (const sim::Quality* q : qs) {
    m.output_error += q->output_error / n;
    m.attention_recall += q->attention_recall / n;
    m.kl += q->kl / n;
    m.entropy_delta += q->entropy_delta / n;
    for (int k = 0; k < sim::kModalities; ++k) {
      m.recall_modality[k] += q->recall_modality[k] / n;
      m.share_before[k] += q->share_before[k] / n;
      m.share_after[k] += q->share_after[k] / n;
    }
  }
  return m;
}

inline void add_counts(sim::HeadResult& sum, const sim::HeadResult& r) {
  sum.bytes_full += r.bytes_full;
  sum.bytes_kept += r.bytes_kept;
  for (int k = 0; k < sim::kModalities; ++k) {
    sum.tokens[k] += r.tokens[k];
    sum.kept[k] += r.kept[k];
    sum.merged[k] += r.merged[k];
    sum.evicted[k] += r.evicted[k];
    sum.bytes_full_modality[k] += r.bytes_full_modality[k];
    sum.bytes_kept_modality[k] += r.bytes_kept_modality[k];
  }
}

// One point keeping `keep` of each modality's tokens (no merging, no quantization).
inline sim::PointResult sample_point(const std::string& policy, const std::string& budget, double keep,
                                     double error_base, std::vector<sim::CollapseFlag> flags) {
  sim::PointResult p;
  p.policy = policy;
  p.budget = budget;
  p.budget_value = keep;
  p.seconds = 0.25;
  p.flags = std::move(flags);
  const std::int64_t kept_text = static_cast<std::int64_t>(kSampleText * keep + 0.5);
  const std::int64_t kept_vision = static_cast<std::int64_t>(kSampleVision * keep + 0.5);
  std::vector<const sim::Quality*> layer_q;
  for (int l = 0; l < kSampleLayers; ++l) {
    sim::LayerResult layer;
    layer.layer = l;
    layer.merged_heads = kSampleHeads;
    std::vector<const sim::Quality*> head_q;
    for (int h = 0; h < kSampleHeads; ++h) {
      sim::HeadResult r;
      r.kv_head = h;
      r.tokens = {kSampleText, kSampleVision, 0, 0};
      r.kept = {kept_text, kept_vision, 0, 0};
      r.evicted = {kSampleText - kept_text, kSampleVision - kept_vision, 0, 0};
      r.bytes_full_modality = {kSampleText * kSampleBytesPerToken, kSampleVision * kSampleBytesPerToken, 0,
                               0};
      r.bytes_kept_modality = {kept_text * kSampleBytesPerToken, kept_vision * kSampleBytesPerToken, 0, 0};
      r.bytes_full.kv = (kSampleText + kSampleVision) * kSampleBytesPerToken;
      r.bytes_kept.kv = (kept_text + kept_vision) * kSampleBytesPerToken;
      r.quality = sample_quality(error_base, l, h);
      layer.heads.push_back(r);
    }
    for (const sim::HeadResult& r : layer.heads) {
      add_counts(layer.total, r);
      head_q.push_back(&r.quality);
    }
    layer.total.quality = mean_quality(head_q);
    p.layers.push_back(layer);
  }
  for (const sim::LayerResult& l : p.layers) {
    add_counts(p.total, l.total);
    layer_q.push_back(&l.total.quality);
  }
  p.total.quality = mean_quality(layer_q);
  return p;
}

// h2o@0.3, h2o@0.6, random@0.3, random@0.6; Pareto front marked (random@0.3 is dominated by
// h2o@0.3; h2o@0.6 and random@0.6 are identical, so both are on the front).
inline std::vector<sim::PointResult> sample_points() {
  const sim::CollapseFlag blind12{"visual_blindness",
                                  {1, 2},
                                  "vision recall 0.55 < 0.5 x full in 2 layers",
                                  "lower vision rate, stronger alignment protection"};
  const sim::CollapseFlag blind012{"visual_blindness",
                                   {0, 1, 2},
                                   "vision recall 0.45, 0.42, 0.40",
                                   "lower vision rate, stronger alignment protection"};
  const sim::CollapseFlag over2{"over_compression", {2}, "KL 0.13 > 0.1 in layer 2", "back off the rate"};
  std::vector<sim::PointResult> points = {
      sample_point("h2o", "0.3", 0.3, 0.10, {blind12}),
      sample_point("h2o", "0.6", 0.6, 0.04, {}),
      sample_point("random", "0.3", 0.3, 0.20, {blind012, over2}),
      sample_point("random", "0.6", 0.6, 0.04, {}),
  };
  sim::mark_pareto(points);
  return points;
}

inline sim::ResultsMeta sample_meta() {
  sim::ResultsMeta m;
  m.trace_path = "traces/sample.h5";
  m.model_name = "tiny";
  m.synthetic = true;
  m.num_layers = kSampleLayers;
  m.num_kv_heads = kSampleHeads;
  m.num_q_heads = 4;
  m.head_dim = 8;
  m.num_tokens = kSampleText + kSampleVision;
  m.num_decode_steps = 4;
  m.tokens_per_modality = {kSampleText, kSampleVision, 0, 0};
  m.command_line = "kvsim sweep --trace traces/sample.h5 --policies h2o,random --budgets 0.3,0.6";
  m.created = "2024-01-02T03:04:05Z";
  return m;
}

}  // namespace kvscope::testing
