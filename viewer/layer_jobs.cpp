#include "layer_jobs.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>

#include "kvscope/sim/engine.hpp"
#include "model.hpp"

namespace kvscope::viewer {

namespace {

constexpr std::size_t kCacheSize = 24;

// Softmax of q . k / sqrt(D) over the keys with a finite bias (bias -inf = key absent).
// q [D]; keys [N, D]; out [N].
void softmax_row(const float* q, const std::vector<const float*>& keys, const std::vector<float>& bias, int D,
                 float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float max_logit = -INFINITY;
  std::vector<float> logit(keys.size(), -INFINITY);
  for (std::size_t j = 0; j < keys.size(); ++j) {
    if (!std::isfinite(bias[j])) continue;
    float dot = 0;
    for (int d = 0; d < D; ++d) dot += q[d] * keys[j][d];
    logit[j] = dot * scale + bias[j];
    max_logit = std::max(max_logit, logit[j]);
  }
  double sum = 0;
  for (std::size_t j = 0; j < keys.size(); ++j) {
    out[j] = std::isfinite(logit[j]) ? std::exp(logit[j] - max_logit) : 0.0f;
    sum += out[j];
  }
  for (std::size_t j = 0; j < keys.size(); ++j) out[j] = sum > 0 ? static_cast<float>(out[j] / sum) : 0.0f;
}

// Full and compressed attention of every query head's evaluation queries. The compressed cache is
// approximated by the representative key of each surviving slot with a log(multiplicity) bias
// (proportional attention of merged slots); quantization error is not modelled here.
void attention_maps(const trace::LayerTensors& prefill, const trace::LayerTensors& decode,
                    const sim::LayerResult& result, int group, LayerOutcome& out) {
  const int T = out.T, S = out.S, Hq = out.Hq;
  const int D = static_cast<int>(prefill.k.shape[2]);
  const std::vector<float> k = prefill.k.to_float();  // [Hkv, T, D]
  const std::vector<float> dk = decode.k.to_float();  // [Hkv, S, D]
  const std::vector<float> dq = decode.q.to_float();  // [Hq, S, D]
  const std::size_t N = static_cast<std::size_t>(T + S);
  out.attn_full.assign(static_cast<std::size_t>(Hq) * S * N, 0.0f);
  out.attn_compressed.assign(out.attn_full.size(), 0.0f);
  for (int h = 0; h < Hq; ++h) {
    const int kv = h / group;
    std::vector<const float*> keys(N);
    for (int t = 0; t < T; ++t) keys[t] = &k[(static_cast<std::size_t>(kv) * T + t) * D];
    for (int s = 0; s < S; ++s) keys[T + s] = &dk[(static_cast<std::size_t>(kv) * S + s) * D];
    std::vector<float> bias_comp(N, -INFINITY);
    if (static_cast<std::size_t>(kv) < result.token_maps.size()) {
      const sim::TokenMap& map = result.token_maps[static_cast<std::size_t>(kv)];
      std::vector<int> multiplicity(map.slot_token.size(), 0);
      for (int t = 0; t < T; ++t) {
        if (map.slot[t] >= 0) ++multiplicity[static_cast<std::size_t>(map.slot[t])];
      }
      for (std::size_t slot = 0; slot < map.slot_token.size(); ++slot) {
        const int rep = map.slot_token[slot];
        if (rep >= 0 && rep < T && multiplicity[slot] > 0)
          bias_comp[rep] = std::log(float(multiplicity[slot]));
      }
    } else {
      std::fill(bias_comp.begin(), bias_comp.begin() + T, 0.0f);
    }
    for (int s = 0; s < S; ++s) {
      std::vector<float> bias_full(N, 0.0f);
      for (int j = T + s + 1; j < T + S; ++j) bias_full[j] = -INFINITY;  // causal on decode keys
      std::vector<float> bc = bias_comp;
      for (int j = T; j < T + S; ++j) bc[j] = bias_full[j];
      const float* q = &dq[(static_cast<std::size_t>(h) * S + s) * D];
      const std::size_t row = (static_cast<std::size_t>(h) * S + s) * N;
      softmax_row(q, keys, bias_full, D, &out.attn_full[row]);
      softmax_row(q, keys, bc, D, &out.attn_compressed[row]);
    }
  }
}

// The layer's totals as the sweep aggregates them (sums of bytes and counts, mean quality over
// heads): run_policy_on_layer leaves LayerResult::total to its caller.
void aggregate_heads(sim::LayerResult& r) {
  sim::HeadResult t;
  const double n = static_cast<double>(std::max<std::size_t>(1, r.heads.size()));
  for (const sim::HeadResult& h : r.heads) {
    t.bytes_full += h.bytes_full;
    t.bytes_kept += h.bytes_kept;
    for (int m = 0; m < sim::kModalities; ++m) {
      t.tokens[m] += h.tokens[m];
      t.kept[m] += h.kept[m];
      t.merged[m] += h.merged[m];
      t.evicted[m] += h.evicted[m];
      t.bytes_full_modality[m] += h.bytes_full_modality[m];
      t.bytes_kept_modality[m] += h.bytes_kept_modality[m];
      t.quality.recall_modality[m] += h.quality.recall_modality[m] / n;
      t.quality.share_before[m] += h.quality.share_before[m] / n;
      t.quality.share_after[m] += h.quality.share_after[m] / n;
    }
    t.quality.output_error += h.quality.output_error / n;
    t.quality.attention_recall += h.quality.attention_recall / n;
    t.quality.kl += h.quality.kl / n;
    t.quality.entropy_delta += h.quality.entropy_delta / n;
  }
  r.total = t;
}

}  // namespace

std::string LayerRequest::key() const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "|%.6g|%d|", keep, layer);
  return policy.name + buf + tag;
}

LayerJobs::~LayerJobs() {
  if (running_.valid()) running_.wait();
}

LayerOutcome LayerJobs::compute(const Model& model, const LayerRequest& request) {
  LayerOutcome out;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    sim::TraceContext ctx = model.context();  // the job's own copy: lazily filled caches are not shared
    out.T = ctx.T;
    out.S = ctx.S;
    out.Hq = ctx.geometry.num_q_heads;
    auto [prefill, decode] = model.read_layer(request.layer);
    sim::LayerData layer(request.layer, prefill, decode, ctx);
    out.result = sim::run_policy_on_layer(request.policy, request.keep, layer, ctx, out.warnings, true);
    aggregate_heads(out.result);
    if (out.S > 0) attention_maps(prefill, decode, out.result, ctx.geometry.group_size(), out);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

void LayerJobs::start(const LayerRequest& request) {
  running_key_ = request.key();
  const Model& model = model_;
  running_ = std::async(std::launch::async, [&model, request] { return compute(model, request); });
}

std::shared_ptr<const LayerOutcome> LayerJobs::get(const LayerRequest& request) {
  const std::string key = request.key();
  if (auto it = cache_.find(key); it != cache_.end()) return it->second;
  if (running_.valid()) {
    if (running_key_ != key) queued_ = request;  // only the newest waiting request matters
  } else {
    start(request);
  }
  return nullptr;
}

void LayerJobs::poll() {
  if (running_.valid() && running_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    auto outcome = std::make_shared<const LayerOutcome>(running_.get());
    if (first_error_.empty()) first_error_ = outcome->error;
    cache_[running_key_] = std::move(outcome);
    order_.push_back(running_key_);
    while (order_.size() > kCacheSize) {
      cache_.erase(order_.front());
      order_.pop_front();
    }
  }
  if (!running_.valid() && queued_) {
    const LayerRequest next = *queued_;
    queued_.reset();
    if (!cache_.count(next.key())) start(next);
  }
}

}  // namespace kvscope::viewer
