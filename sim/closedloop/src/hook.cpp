// ClosedLoopHook (kvscope/closedloop/hook.hpp).
#include "kvscope/closedloop/hook.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvscope/kernels/common.hpp"
#include "kvscope/kernels/quantize.hpp"

namespace kvscope::closedloop {

namespace {

std::vector<float> copy_tensor(const runner::TensorRef& t) {
  if (t.device)
    throw std::runtime_error("closed loop: device tensors are not supported (use the CPU runner)");
  std::vector<float> out(static_cast<std::size_t>(t.shape[0] * t.shape[1] * t.shape[2]));
  std::size_t i = 0;
  for (std::int64_t h = 0; h < t.shape[0]; ++h)
    for (std::int64_t s = 0; s < t.shape[1]; ++s)
      for (std::int64_t d = 0; d < t.shape[2]; ++d) out[i++] = t.at(h, s, d);
  return out;
}

}  // namespace

ClosedLoopHook::ClosedLoopHook(const sim::PolicySpec& policy, const sim::Budget& budget,
                               const runner::ModelConfig& config, trace::DType dtype)
    : policy_(policy), budget_(budget), config_(config), dtype_(dtype) {
  if (policy_.mode == sim::PolicyMode::kDecode) sim::check_decode_support(policy_, "'" + policy_.name + "'");
  prefill_q_.resize(static_cast<std::size_t>(config.num_layers));
}

void ClosedLoopHook::on_prefill_layer(int layer, const runner::TensorRef& q, const runner::TensorRef&,
                                      const runner::TensorRef&) {
  if (layer < 0 || layer >= config_.num_layers) throw std::out_of_range("closed loop: layer out of range");
  prefill_q_[static_cast<std::size_t>(layer)] = copy_tensor(q);
}

void ClosedLoopHook::on_decode_layer(int layer, int, const runner::TensorRef& q, const runner::TensorRef& k,
                                     const runner::TensorRef& v) {
  if (!decoder_) return;  // prefill-mode policies keep decode tokens exact
  const std::vector<float> qs = copy_tensor(q), ks = copy_tensor(k), vs = copy_tensor(v);
  decoder_->add_step(layer, qs.data(), ks.data(), vs.data());
}

// Decode-time mode: the runner's cache of every layer and head becomes the replay's resident set.
void ClosedLoopHook::write_resident(runner::KvCache& cache) {
  const int L = cache.num_layers(), H = cache.num_kv_heads(), D = cache.head_dim();
  resident_.assign(static_cast<std::size_t>(L), {});
  layers_.assign(static_cast<std::size_t>(L), {});
  for (int l = 0; l < L; ++l) {
    const std::vector<sim::ResidentHead> res = decoder_->resident(l, &layers_[static_cast<std::size_t>(l)]);
    for (int h = 0; h < H; ++h) {
      const sim::ResidentHead& rh = res[static_cast<std::size_t>(h)];
      runner::HeadCache& hc = cache.head(l, h);
      std::vector<std::size_t> order(rh.token.size());
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](std::size_t a, std::size_t b) { return rh.token[a] < rh.token[b]; });
      std::vector<std::int32_t> sorted;
      for (std::size_t i : order) sorted.push_back(rh.token[i]);
      std::vector<bool> mask(static_cast<std::size_t>(hc.size()), false);
      int kept = 0;
      for (int s = 0; s < hc.size(); ++s) {
        mask[static_cast<std::size_t>(s)] =
            std::binary_search(sorted.begin(), sorted.end(), hc.info(s).token.index);
        kept += mask[static_cast<std::size_t>(s)] ? 1 : 0;
      }
      if (kept != static_cast<int>(sorted.size())) {
        throw std::logic_error("closed loop: layer " + std::to_string(l) + " head " + std::to_string(h) +
                               ": the replay keeps tokens the runner's cache does not hold");
      }
      hc.keep(mask);
      for (std::size_t j = 0; j < order.size(); ++j) {
        const std::size_t s = order[j];
        hc.set_slot(static_cast<int>(j), &rh.k[s * static_cast<std::size_t>(D)],
                    &rh.v[s * static_cast<std::size_t>(D)], 0.0f, 1);
      }
      std::vector<std::vector<std::int32_t>>& layer_res = resident_[static_cast<std::size_t>(l)];
      layer_res.push_back(std::move(sorted));
    }
  }
}

void ClosedLoopHook::after_prefill(runner::KvCache& cache, const std::vector<runner::TokenInfo>& context) {
  const int T = static_cast<int>(context.size()), L = cache.num_layers(), H = cache.num_kv_heads();
  const int D = cache.head_dim();
  sim::ContextLabels labels;
  compressor_labels_.clear();
  for (const auto& t : context) {
    compressor_labels_.push_back(t.modality);
    labels.modality.push_back(t.modality);
    labels.position.push_back(t.position);
    labels.segment.push_back(t.segment);
    labels.grid_row.push_back(t.grid_row);
    labels.grid_col.push_back(t.grid_col);
  }
  trace::ModelGeometry g;
  g.num_layers = L;
  g.num_q_heads = config_.num_q_heads;
  g.num_kv_heads = H;
  g.head_dim = D;
  g.rope_theta = config_.rope_theta;
  g.model_name = config_.model_name;
  context_tokens_ = T;
  if (policy_.mode == sim::PolicyMode::kDecode) {
    decoder_ = std::make_unique<sim::DecodeCompressor>(policy_, budget_, g, dtype_, labels);
    const std::size_t TD = static_cast<std::size_t>(T) * static_cast<std::size_t>(D);
    for (int l = 0; l < L; ++l) {
      std::vector<float> k(static_cast<std::size_t>(H) * TD), v(k.size());
      for (int h = 0; h < H; ++h) {
        const runner::HeadCache& hc = cache.head(l, h);
        std::copy_n(hc.keys(), TD, k.begin() + static_cast<std::ptrdiff_t>(h * TD));
        std::copy_n(hc.values(), TD, v.begin() + static_cast<std::ptrdiff_t>(h * TD));
      }
      decoder_->set_prefill(l, std::move(prefill_q_[static_cast<std::size_t>(l)]), std::move(k),
                            std::move(v));
    }
    cluster_.assign(static_cast<std::size_t>(L), std::vector<std::int32_t>(static_cast<std::size_t>(H)));
    for (auto& c : cluster_) std::iota(c.begin(), c.end(), 0);
    write_resident(cache);
    applied_ = true;
    decode_steps_ = 0;
    peak_ = predicted_bytes().total;
    return;
  }
  compressor_ = std::make_unique<sim::PrefillCompressor>(policy_, budget_, g, dtype_, labels);
  layers_.clear();
  cluster_.clear();
  const std::size_t TD = static_cast<std::size_t>(T) * static_cast<std::size_t>(D);
  for (int l = 0; l < L; ++l) {
    if (prefill_q_[static_cast<std::size_t>(l)].size() !=
        static_cast<std::size_t>(config_.num_q_heads) * TD) {
      throw std::logic_error("closed loop: no prefill queries of layer " + std::to_string(l) +
                             " (pass the hook as the run's observer too)");
    }
    std::vector<float> k(static_cast<std::size_t>(H) * TD), v(k.size());
    for (int h = 0; h < H; ++h) {
      const runner::HeadCache& hc = cache.head(l, h);
      if (hc.size() != T)
        throw std::logic_error("closed loop: head cache does not hold the T context tokens");
      std::copy_n(hc.keys(), TD, k.begin() + static_cast<std::ptrdiff_t>(h * TD));
      std::copy_n(hc.values(), TD, v.begin() + static_cast<std::ptrdiff_t>(h * TD));
    }
    sim::CompressedLayerResult r =
        compressor_->compress_layer(l, prefill_q_[static_cast<std::size_t>(l)], k, v);
    std::vector<float>().swap(prefill_q_[static_cast<std::size_t>(l)]);  // release: many hooks live at once
    // Write the compressed slots back, in context order (slot order does not change attention).
    for (int h = 0; h < H; ++h) {
      const auto& ch = r.cache.heads[static_cast<std::size_t>(r.cache.cluster[static_cast<std::size_t>(h)])];
      const std::size_t K = ch.token.size();
      std::vector<std::size_t> order(K);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(),
                [&](std::size_t a, std::size_t b) { return ch.token[a] < ch.token[b]; });
      std::vector<bool> mask(static_cast<std::size_t>(T), false);
      for (std::int32_t t : ch.token) mask[static_cast<std::size_t>(t)] = true;
      runner::HeadCache& hc = cache.head(l, h);
      hc.keep(mask);
      for (std::size_t j = 0; j < K; ++j) {
        const std::size_t s = order[j];
        const std::int32_t n = ch.multiplicity[s];
        const float bias = policy_.proportional_attention ? std::log(static_cast<float>(n)) : 0.0f;
        hc.set_slot(static_cast<int>(j), &ch.k[s * static_cast<std::size_t>(D)],
                    &ch.v[s * static_cast<std::size_t>(D)], bias, n);
      }
    }
    cluster_.push_back(r.cache.cluster);
    layers_.push_back(std::move(r.result));
  }
  applied_ = true;
  decode_steps_ = 0;
  peak_ = predicted_bytes().total;
}

void ClosedLoopHook::after_decode_step(runner::KvCache& cache, int step, const runner::TokenInfo&) {
  decode_steps_ = step + 1;
  if (decoder_) {
    write_resident(cache);
    std::int64_t peak = 0;  // kvsim's per-head peaks (after appending, before eviction), summed
    for (const auto& lr : layers_)
      for (const auto& hr : lr.heads) peak += hr.bytes_peak;
    peak_ = std::max(peak_, peak);
    return;
  }
  peak_ = std::max(peak_, predicted_bytes().total);
}

CacheBytes ClosedLoopHook::predicted_bytes() const {
  CacheBytes b;
  if (decoder_) {
    // kvsim's decode-time bytes_end per head, apportioned to modalities by resident slot count (decode
    // tokens are text), as kvsim apportions bytes_kept_modality.
    for (std::size_t l = 0; l < layers_.size(); ++l)
      for (std::size_t h = 0; h < layers_[l].heads.size(); ++h) {
        const std::int64_t total = layers_[l].heads[h].bytes_end;
        const auto& tokens = resident_[l][h];
        std::array<std::int64_t, 4> slots{};
        for (std::int32_t t : tokens)
          ++slots[t < context_tokens_ ? compressor_labels_[static_cast<std::size_t>(t)] : 0];
        b.total += total;
        std::int64_t given = 0;
        for (std::size_t m = 1; m < 4; ++m) {
          const std::int64_t part =
              tokens.empty() ? 0
                             : static_cast<std::int64_t>(
                                   std::llround(static_cast<double>(total) * static_cast<double>(slots[m]) /
                                                static_cast<double>(tokens.size())));
          b.modality[m] += part;
          given += part;
        }
        b.modality[0] += total - given;
      }
    return b;
  }
  for (const auto& lr : layers_)
    for (const auto& hr : lr.heads) {
      b.total += hr.bytes_kept.total();
      for (std::size_t m = 0; m < 4; ++m) b.modality[m] += hr.bytes_kept_modality[m];
    }
  const std::int64_t decode = static_cast<std::int64_t>(decode_steps_) * config_.num_layers *
                              config_.num_kv_heads * 2 * config_.head_dim *
                              static_cast<std::int64_t>(kernels::dtype_bytes(dtype_));
  b.total += decode;
  b.modality[0] += decode;
  return b;
}

std::int64_t ClosedLoopHook::held_bytes(const runner::KvCache& cache) const {
  const std::int64_t D = cache.head_dim(), elem = static_cast<std::int64_t>(kernels::dtype_bytes(dtype_));
  std::int64_t total = 0;
  if (decoder_) {  // decode-time: every resident slot under the policy's quantizer, as one set per head
    for (int l = 0; l < cache.num_layers(); ++l)
      for (int h = 0; h < cache.num_kv_heads(); ++h) {
        const int K = cache.head(l, h).size();
        if (policy_.key_quant && K > 0) {
          for (const auto& q : {*policy_.key_quant, *policy_.value_quant})
            total += kernels::quantized_bytes(q, 1, K, static_cast<int>(D), dtype_).total;
        } else {
          total += 2 * K * D * elem;
        }
      }
    return total;
  }
  for (int l = 0; l < cache.num_layers(); ++l) {
    const auto& cluster = cluster_.at(static_cast<std::size_t>(l));
    std::vector<bool> counted(cluster.size(), false);
    int working = 0;
    for (int h = 0; h < cache.num_kv_heads(); ++h) {
      const runner::HeadCache& hc = cache.head(l, h);
      std::int64_t context = 0;
      for (int s = 0; s < hc.size(); ++s) context += hc.info(s).token.index < context_tokens_ ? 1 : 0;
      total += (hc.size() - context) * 2 * D * elem;  // decode slots, exact
      const auto w = static_cast<std::size_t>(cluster[static_cast<std::size_t>(h)]);
      if (counted[w]) continue;  // a merged head's slots are shared by its members
      counted[w] = true;
      ++working;
      if (policy_.key_quant && context > 0) {
        for (const auto& q : {*policy_.key_quant, *policy_.value_quant})
          total += static_cast<std::int64_t>(
              kernels::quantized_bytes(q, 1, static_cast<int>(context), static_cast<int>(D), dtype_).total);
      } else {
        total += 2 * context * D * elem;
      }
      const bool merged = policy_.compress_tokens && policy_.stages.executor != "evict" &&
                          context < context_tokens_;
      if (merged) total += 4 * context;
    }
    if (working < cache.num_kv_heads()) total += 4ll * config_.num_q_heads;  // query-head -> merged-head map
  }
  return total;
}

const std::vector<std::string>& ClosedLoopHook::warnings() const {
  static const std::vector<std::string> kNone;
  if (decoder_) return decoder_->warnings();
  return compressor_ ? compressor_->warnings() : kNone;
}

double ClosedLoopHook::keep() const {
  if (decoder_) return decoder_->cap_keep();
  return compressor_ ? compressor_->keep() : 1.0;
}

}  // namespace kvscope::closedloop
