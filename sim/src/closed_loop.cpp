// PrefillCompressor: the replay of one policy on a live run's prefill K/V (sim/closed_loop.hpp).
#include "kvscope/sim/closed_loop.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "kvscope/kernels/quantize.hpp"

namespace kvscope::sim {

namespace {

trace::Tensor f32_tensor(const float* data, std::size_t heads, std::size_t tokens, std::size_t dim) {
  trace::Tensor t;
  t.dtype = trace::DType::kF32;
  t.shape = {heads, tokens, dim};
  t.data.resize(heads * tokens * dim * sizeof(float));
  std::memcpy(t.data.data(), data, t.data.size());
  return t;
}

// Rows [heads, T, D] -> token T-1 of each head as [heads, 1, D].
trace::Tensor last_token(const std::vector<float>& x, std::size_t heads, std::size_t T, std::size_t D) {
  std::vector<float> out(heads * D);
  for (std::size_t h = 0; h < heads; ++h)
    std::memcpy(&out[h * D], &x[(h * T + T - 1) * D], D * sizeof(float));
  return f32_tensor(out.data(), heads, 1, D);
}

}  // namespace

void check_closed_loop_support(const PolicySpec& p) {
  if (p.stages.scorer == "oracle-topk") {
    throw PolicyError("closed loop: '" + p.name +
                      "' is the query-aware bound of sweeps, not a policy: it reads the evaluation queries, which a "
                      "closed loop only has after decoding");
  }
  if (p.mode != PolicyMode::kDecode) return;
  check_decode_support(p, "'" + p.name + "'");
  // The live cache is rebuilt from the resident token ids, which cannot carry merged slots.
  if (p.stages.executor != "evict")
    throw PolicyError("closed loop: '" + p.name + "': decode mode with the merging executor '" + p.stages.executor +
                      "' is not supported in the closed loop (kvsim replays it)");
}

PrefillCompressor::PrefillCompressor(PolicySpec policy, Budget budget, const trace::ModelGeometry& geometry,
                                     trace::DType dtype, const ContextLabels& labels)
    : policy_(std::move(policy)), budget_(std::move(budget)) {
  if (policy_.mode == PolicyMode::kDecode) {
    throw PolicyError("closed loop: decode-time policy '" + policy_.name +
                      "' is not supported yet (prefill-mode policies only)");
  }
  check_closed_loop_support(policy_);
  const int T = labels.size();
  if (T < 1) throw std::invalid_argument("closed loop: empty context");
  if (labels.position.size() != static_cast<std::size_t>(T) ||
      labels.segment.size() != static_cast<std::size_t>(T) ||
      labels.grid_row.size() != static_cast<std::size_t>(T) ||
      labels.grid_col.size() != static_cast<std::size_t>(T)) {
    throw std::invalid_argument("closed loop: context labels of different lengths");
  }
  ctx_.geometry = geometry;
  ctx_.dtype = dtype;
  ctx_.T = T;
  // One evaluation query (a copy of the last context token) satisfies the replay's measurement step;
  // the compression itself reads prefill statistics only, so it does not change the cache.
  ctx_.S = 1;
  ctx_.modality = labels.modality;
  ctx_.position = labels.position;
  ctx_.grid_row = labels.grid_row;
  ctx_.grid_col = labels.grid_col;
  ctx_.segment = labels.segment;
  for (auto m : labels.modality) {
    if (m >= kModalities)
      throw std::invalid_argument("closed loop: modality " + std::to_string(m) + " out of range");
    ++ctx_.tokens[m];
  }
  ctx_.modality_all = ctx_.modality;
  ctx_.modality_all.resize(static_cast<std::size_t>(T) + 1, 0);
}

CompressedLayerResult PrefillCompressor::compress_layer(int layer, const std::vector<float>& q,
                                                        const std::vector<float>& k,
                                                        const std::vector<float>& v) {
  const auto& g = ctx_.geometry;
  if (layer != next_layer_) {
    throw std::invalid_argument("closed loop: layer " + std::to_string(layer) + " given, expected " +
                                std::to_string(next_layer_));
  }
  const std::size_t T = static_cast<std::size_t>(ctx_.T), D = static_cast<std::size_t>(g.head_dim);
  const std::size_t Hq = static_cast<std::size_t>(g.num_q_heads),
                    H = static_cast<std::size_t>(g.num_kv_heads);
  if (q.size() != Hq * T * D || k.size() != H * T * D || v.size() != H * T * D) {
    throw std::invalid_argument("closed loop: layer " + std::to_string(layer) +
                                " q/k/v sizes do not match [" + std::to_string(Hq) + "|" + std::to_string(H) +
                                ", " + std::to_string(T) + ", " + std::to_string(D) + "]");
  }
  trace::LayerTensors prefill{f32_tensor(q.data(), Hq, T, D), f32_tensor(k.data(), H, T, D),
                              f32_tensor(v.data(), H, T, D)};
  trace::LayerTensors decode{last_token(q, Hq, T, D), last_token(k, H, T, D), last_token(v, H, T, D)};
  LayerData data(layer, std::move(prefill), std::move(decode), ctx_);
  if (layer == 0) {
    // Input complexity as kvsim's sweep computes it (alignment tokens: layer-0 cross-modal share > 0.3).
    const auto& given = data.cross_given();
    int n_align = 0;
    for (std::size_t t = 0; t < T; ++t) {
      double s = 0;
      for (std::size_t h = 0; h < H; ++h) s += given[h * T + t];
      if (s / static_cast<double>(H) > 0.3) ++n_align;
    }
    const double nv = static_cast<double>(std::max<std::int64_t>(1, ctx_.tokens[1]));
    const double nt = static_cast<double>(std::max<std::int64_t>(1, ctx_.tokens[0]));
    ctx_.complexity = std::log(nv) + std::log(nt) + 2.0 * n_align / (nt + nv);
    ctx_.complexity_known = true;
    keep_ = keep_fraction(policy_, budget_, ctx_);
  }
  data.prepare(policy_);
  CompressedLayerResult out;
  out.result = run_policy_on_layer(policy_, keep_, data, ctx_, warnings_, false, &out.cache);
  ++next_layer_;
  return out;
}

}  // namespace kvscope::sim

// ---- decode-time mode ----
namespace kvscope::sim {

namespace {

// [S][heads][D] step rows -> [heads, S, D] tensor.
trace::Tensor steps_tensor(const std::vector<float>& rows, std::size_t heads, std::size_t S, std::size_t D) {
  std::vector<float> out(heads * S * D);
  for (std::size_t s = 0; s < S; ++s)
    for (std::size_t h = 0; h < heads; ++h)
      std::memcpy(&out[(h * S + s) * D], &rows[(s * heads + h) * D], D * sizeof(float));
  return f32_tensor(out.data(), heads, S, D);
}

}  // namespace

DecodeCompressor::DecodeCompressor(PolicySpec policy, Budget budget, const trace::ModelGeometry& geometry,
                                   trace::DType dtype, const ContextLabels& labels)
    : policy_(std::move(policy)) {
  if (policy_.mode != PolicyMode::kDecode)
    throw PolicyError("closed loop: '" + policy_.name + "' is not decode-time");
  check_closed_loop_support(policy_);
  // Reuse the prefill compressor's label checks and context.
  PolicySpec pre = policy_;
  pre.mode = PolicyMode::kPrefill;
  base_ = PrefillCompressor(pre, budget, geometry, dtype, labels).context();
  // Budgets as kvsim's sweep sets them: a fixed cap leaves the point's budget to a prefill pass.
  const bool has_budget = budget.kind != Budget::Kind::kNone;
  const double keep = keep_fraction(policy_, budget, base_);
  if (policy_.cap.kind != Budget::Kind::kNone) {
    cap_keep_ = keep_fraction(policy_, policy_.cap, base_);
    prefill_keep_ = has_budget ? keep : 1.0;
  } else {
    cap_keep_ = has_budget || !policy_needs_budget(policy_) ? keep : 1.0;
    prefill_keep_ = 1.0;
  }
  layers_.resize(static_cast<std::size_t>(geometry.num_layers));
}

void DecodeCompressor::set_prefill(int layer, std::vector<float> q, std::vector<float> k,
                                   std::vector<float> v) {
  const auto& g = base_.geometry;
  const std::size_t TD = static_cast<std::size_t>(base_.T) * static_cast<std::size_t>(g.head_dim);
  if (q.size() != TD * static_cast<std::size_t>(g.num_q_heads) ||
      k.size() != TD * static_cast<std::size_t>(g.num_kv_heads) || v.size() != k.size()) {
    throw std::invalid_argument("closed loop: layer " + std::to_string(layer) +
                                " prefill q/k/v sizes do not match");
  }
  Layer& l = layers_.at(static_cast<std::size_t>(layer));
  l = Layer{std::move(q), std::move(k), std::move(v), {}, {}, {}, 0};
}

void DecodeCompressor::add_step(int layer, const float* q, const float* k, const float* v) {
  const auto& g = base_.geometry;
  const std::size_t D = static_cast<std::size_t>(g.head_dim);
  Layer& l = layers_.at(static_cast<std::size_t>(layer));
  l.dq.insert(l.dq.end(), q, q + static_cast<std::size_t>(g.num_q_heads) * D);
  l.dk.insert(l.dk.end(), k, k + static_cast<std::size_t>(g.num_kv_heads) * D);
  l.dv.insert(l.dv.end(), v, v + static_cast<std::size_t>(g.num_kv_heads) * D);
  ++l.steps;
}

int DecodeCompressor::steps(int layer) const { return layers_.at(static_cast<std::size_t>(layer)).steps; }

std::vector<ResidentHead> DecodeCompressor::resident(int layer, LayerResult* result) {
  const auto& g = base_.geometry;
  const Layer& l = layers_.at(static_cast<std::size_t>(layer));
  const std::size_t T = static_cast<std::size_t>(base_.T), D = static_cast<std::size_t>(g.head_dim);
  const std::size_t Hq = static_cast<std::size_t>(g.num_q_heads),
                    H = static_cast<std::size_t>(g.num_kv_heads);
  if (l.k.empty())
    throw std::logic_error("closed loop: no prefill tensors of layer " + std::to_string(layer));
  TraceContext ctx = base_;
  std::vector<std::vector<std::int32_t>> tokens(H);
  LayerResult r;
  if (l.steps == 0) {
    // The starting cache: everything, or what the prefill pass keeps (without the quantizer, as the replay).
    if (prefill_keep_ < 1.0) {
      PolicySpec pre = policy_;
      pre.mode = PolicyMode::kPrefill;
      pre.key_quant.reset();
      pre.value_quant.reset();
      trace::LayerTensors prefill{f32_tensor(l.q.data(), Hq, T, D), f32_tensor(l.k.data(), H, T, D),
                                  f32_tensor(l.v.data(), H, T, D)};
      trace::LayerTensors decode{last_token(l.q, Hq, T, D), last_token(l.k, H, T, D),
                                 last_token(l.v, H, T, D)};
      LayerData data(layer, std::move(prefill), std::move(decode), ctx);
      const LayerResult pr = run_policy_on_layer(pre, prefill_keep_, data, ctx, warnings_, true);
      for (std::size_t h = 0; h < H; ++h) tokens[h] = pr.token_maps[h].slot_token;
    } else {
      for (auto& t : tokens) {
        t.resize(T);
        for (std::size_t i = 0; i < T; ++i) t[i] = static_cast<std::int32_t>(i);
      }
    }
    r.layer = layer;
    r.heads.resize(H);
    for (std::size_t h = 0; h < H; ++h) {
      const std::int64_t b =
          resident_bytes(policy_, static_cast<int>(tokens[h].size()), g.head_dim, ctx.dtype).total();
      r.heads[h].kv_head = static_cast<int>(h);
      r.heads[h].bytes_end = r.heads[h].bytes_peak = b;
    }
  } else {
    const std::size_t S = static_cast<std::size_t>(l.steps);
    ctx.S = l.steps;
    ctx.modality_all.resize(T + S, 0);
    trace::LayerTensors prefill{f32_tensor(l.q.data(), Hq, T, D), f32_tensor(l.k.data(), H, T, D),
                                f32_tensor(l.v.data(), H, T, D)};
    trace::LayerTensors decode{steps_tensor(l.dq, Hq, S, D), steps_tensor(l.dk, H, S, D),
                               steps_tensor(l.dv, H, S, D)};
    LayerData data(layer, std::move(prefill), std::move(decode), ctx);
    std::vector<std::string> warnings;
    r = run_decode_policy_on_layer(policy_, prefill_keep_, cap_keep_, data, ctx, warnings, true);
    for (const auto& w : warnings)
      if (std::find(warnings_.begin(), warnings_.end(), w) == warnings_.end()) warnings_.push_back(w);
    for (std::size_t h = 0; h < H; ++h) tokens[h] = r.token_maps[h].slot_token;
  }
  std::vector<ResidentHead> out(H);
  for (std::size_t h = 0; h < H; ++h) {
    ResidentHead& rh = out[h];
    rh.token = tokens[h];
    const std::size_t K = rh.token.size();
    rh.k.resize(K * D);
    rh.v.resize(K * D);
    for (std::size_t i = 0; i < K; ++i) {
      const std::size_t t = static_cast<std::size_t>(rh.token[i]);
      const float* ks = t < T ? &l.k[(h * T + t) * D] : &l.dk[((t - T) * H + h) * D];
      const float* vs = t < T ? &l.v[(h * T + t) * D] : &l.dv[((t - T) * H + h) * D];
      std::memcpy(&rh.k[i * D], ks, D * sizeof(float));
      std::memcpy(&rh.v[i * D], vs, D * sizeof(float));
    }
    if (policy_.key_quant && K > 0) {
      std::vector<float> tmp(K * D);
      const kernels::QuantShape shape{1, static_cast<int>(K), g.head_dim, kernels::DType::kF32};
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<float>& x = kv == 0 ? rh.k : rh.v;
        const kernels::Status st = ctx.backend->quantize_dequantize(
            kv == 0 ? *policy_.key_quant : *policy_.value_quant, shape, x.data(), tmp.data());
        if (!st.ok()) throw std::runtime_error("closed loop: quantize: " + st.message());
        x.swap(tmp);
        tmp.resize(K * D);
      }
    }
  }
  if (result) *result = std::move(r);
  return out;
}

}  // namespace kvscope::sim
