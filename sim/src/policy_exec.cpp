// One policy on one layer: head merge -> scores -> budgets -> select ->
// keep/merge/evict -> quantize -> exact bytes -> quality on decode queries.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "exec_util.hpp"
#include "kvscope/kernels/compact.hpp"
#include "kvscope/kernels/evaluate.hpp"
#include "kvscope/kernels/head_merge.hpp"
#include "kvscope/kernels/merge.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/select.hpp"
#include "kvscope/sim/engine.hpp"
#include "evaluation.hpp"

namespace kvscope::sim {

namespace {

using detail::check;

constexpr int kVision = static_cast<int>(kernels::Modality::kVision);
constexpr int kText = static_cast<int>(kernels::Modality::kText);

// Structured spatial priority of a vision token: log2 of the coarsest stride s whose
// grid (row % s == 0 and col % s == 0) contains it, so any top-k is evenly spread.
float stride_level(int row, int col) {
  if (row < 0 || col < 0) return 0.0f;
  int level = 0;
  for (int s = 2; s <= 1 << 12; s <<= 1) {
    if (row % s != 0 || col % s != 0) break;
    ++level;
  }
  return static_cast<float>(level);
}

// Per-modality budgets that all round to zero tokens would empty the cache, and the selection
// needs them to sum to k >= 1: the modality with the largest unrounded share (ties: the one with
// more tokens, then the lower code) then keeps one token. Returns the budgets' sum, k. (A tiny or
// single-modality trace at a low keep level, e.g. the oracle's 5% of a 4-token text trace.)
int budgets_keep_one_token(int* budget, const double* share, const PerModalityCount& tokens) {
  int k = 0;
  for (int m = 0; m < kModalities; ++m) k += budget[m];
  if (k > 0) return k;
  int best = 0;
  for (int m = 1; m < kModalities; ++m) {
    const auto i = static_cast<std::size_t>(m), b = static_cast<std::size_t>(best);
    if (share[m] > share[best] || (share[m] == share[best] && tokens[i] > tokens[b])) best = m;
  }
  budget[best] = 1;
  return 1;
}

}  // namespace

double unicache_rate(const UniCacheConfig& u, int layer, int num_layers) {
  const double x = num_layers > 1 ? static_cast<double>(layer) / (num_layers - 1) : 0.0;
  return u.rate_deep + (u.rate_shallow - u.rate_deep) * 0.5 * (1.0 + std::cos(M_PI * x)) + u.rate_offset;
}

double adaptive_rate(double complexity) {
  const double lo = std::log(64.0) + std::log(16.0), hi = std::log(4608.0) + std::log(4096.0) + 0.3;
  const double x = std::clamp((complexity - lo) / (hi - lo), 0.0, 1.0);
  return 0.75 - 0.35 * x;
}

double keep_fraction(const PolicySpec& p, const Budget& b, const TraceContext& ctx) {
  if (!p.compress_tokens) return 1.0;
  if (p.adaptive) {
    const double rate = adaptive_rate(ctx.complexity);
    return 1.0 - rate;
  }
  switch (b.kind) {
    case Budget::Kind::kNone:
      if (p.allocator == AllocatorKind::kUniCache) {
        double mean = 0;
        for (int l = 0; l < ctx.geometry.num_layers; ++l) mean += 1.0 - unicache_rate(p.unicache, l, ctx.geometry.num_layers);
        return std::clamp(mean / ctx.geometry.num_layers, 0.0, 1.0);
      }
      return 0.5;
    case Budget::Kind::kFraction:
      return b.value;
    case Budget::Kind::kTokens:
      return std::min(1.0, b.value / std::max(1, ctx.T));
    case Budget::Kind::kBytes: {
      const double D = ctx.geometry.head_dim;
      const double elem = static_cast<double>(kernels::dtype_bytes(ctx.dtype));
      double per_token = 2.0 * D * elem;  // one kv head, one token, K and V
      if (p.key_quant) {
        const auto kq = kernels::quantized_bytes(*p.key_quant, 1, ctx.T, ctx.geometry.head_dim, ctx.dtype);
        const auto vq = kernels::quantized_bytes(*p.value_quant, 1, ctx.T, ctx.geometry.head_dim, ctx.dtype);
        per_token = static_cast<double>(kq.total + vq.total) / std::max(1, ctx.T);
      }
      const double full_tokens = static_cast<double>(ctx.T) * ctx.geometry.num_kv_heads * ctx.geometry.num_layers;
      return std::min(1.0, b.value / (per_token * full_tokens));
    }
  }
  return 1.0;
}

LayerResult run_policy_on_layer(const PolicySpec& p, double keep, LayerData& L, TraceContext& ctx,
                                std::vector<std::string>& warnings, bool record_tokens,
                                CompressedLayer* compressed, bool evaluate) {
  const auto& g = ctx.geometry;
  const int H = g.num_kv_heads, Hq = g.num_q_heads, D = g.head_dim, T = ctx.T, S = ctx.S;
  const int layer = L.layer();
  const std::size_t TD = static_cast<std::size_t>(T) * static_cast<std::size_t>(D);
  const std::int64_t elem = static_cast<std::int64_t>(kernels::dtype_bytes(ctx.dtype));
  if (S <= 0) throw std::runtime_error("no evaluation queries");

  // ---- 1. working heads (after optional head merging), float32 [Hw, T, D]
  int Hw = H;
  std::vector<std::int32_t> cluster(static_cast<std::size_t>(H));
  std::iota(cluster.begin(), cluster.end(), 0);
  // Context K / V rows [T, D] of each working head: head h of k_all (head stride (T + S) D), or
  // a merged head (computed once per layer and threshold, shared by every point).
  const std::size_t head_stride = (static_cast<std::size_t>(T) + static_cast<std::size_t>(S)) * D;
  std::vector<const float*> kwork(static_cast<std::size_t>(H)), vwork(static_cast<std::size_t>(H));
  for (int h = 0; h < H; ++h) {
    kwork[static_cast<std::size_t>(h)] = L.k_all().data() + static_cast<std::size_t>(h) * head_stride;
    vwork[static_cast<std::size_t>(h)] = L.v_all().data() + static_cast<std::size_t>(h) * head_stride;
  }
  const bool head_merge = p.compress_tokens && p.head_merge && H > 1;
  if (head_merge) {
    const LayerData::MergedHeads& mh = L.merged_heads(p.head_merge_threshold);
    Hw = mh.num_heads;
    cluster = mh.cluster;
    for (int w = 0; w < Hw; ++w) {
      const int row = mh.row[static_cast<std::size_t>(w)];
      if (row < 0) {
        const std::size_t src = static_cast<std::size_t>(mh.source_head[static_cast<std::size_t>(w)]);
        kwork[static_cast<std::size_t>(w)] = L.k_all().data() + src * head_stride;
        vwork[static_cast<std::size_t>(w)] = L.v_all().data() + src * head_stride;
      } else {
        kwork[static_cast<std::size_t>(w)] = mh.k.data() + static_cast<std::size_t>(row) * TD;
        vwork[static_cast<std::size_t>(w)] = mh.v.data() + static_cast<std::size_t>(row) * TD;
      }
    }
  }
  std::vector<int> cluster_size(static_cast<std::size_t>(Hw), 0);
  for (int h = 0; h < H; ++h) ++cluster_size[static_cast<std::size_t>(cluster[static_cast<std::size_t>(h)])];

  // ---- 2. scores per original kv head, then averaged over each cluster -> [Hw, T]
  std::vector<float> scores(static_cast<std::size_t>(Hw) * static_cast<std::size_t>(T), 0.0f);
  std::vector<float> importance;  // merge weights, >= 0
  std::vector<std::uint8_t> protect(static_cast<std::size_t>(T), 0);
  PerModality mod_rate{};  // UniCache compression rate per modality
  const bool vision_only = p.allocator == AllocatorKind::kVisionOnly;
  bool keep_all = !p.compress_tokens || keep >= 1.0;
  if (vision_only && layer < p.fastv_layer) keep_all = true;

  if (!keep_all) {
    std::vector<float> per_kv(static_cast<std::size_t>(H) * static_cast<std::size_t>(T));
    switch (p.scorer) {
      case ScorerKind::kNone:
      case ScorerKind::kRecency:
        for (int h = 0; h < H; ++h)
          for (int t = 0; t < T; ++t) per_kv[static_cast<std::size_t>(h) * T + t] = static_cast<float>(t);
        break;
      case ScorerKind::kH2O: per_kv = L.h2o(); break;
      case ScorerKind::kSnapKV: per_kv = L.snapkv(p.snapkv); break;
      case ScorerKind::kTOVA: per_kv = L.tova(); break;
      case ScorerKind::kKeyNorm:
        per_kv = L.key_norm();
        for (auto& x : per_kv) x = -x;
        break;
      case ScorerKind::kRandom:
        for (int h = 0; h < H; ++h)
          for (int t = 0; t < T; ++t) {
            per_kv[static_cast<std::size_t>(h) * T + t] = detail::random_token_score(p.seed, layer, h, t);
          }
        break;
      case ScorerKind::kVisionStride:
        for (int h = 0; h < H; ++h)
          for (int t = 0; t < T; ++t)
            per_kv[static_cast<std::size_t>(h) * T + t] =
                stride_level(ctx.grid_row[static_cast<std::size_t>(t)], ctx.grid_col[static_cast<std::size_t>(t)]);
        break;
      case ScorerKind::kUniCache: {
        const UniCacheConfig& u = p.unicache;
        kernels::UniCacheParams up;
        up.w_a = u.w_a;
        up.w_c = u.w_c;
        up.w_d = u.w_d;
        up.w_r = u.w_r;
        const int third = std::max(1, g.num_layers / 3);
        if (layer < third) up.w_d = u.shallow_w_d;
        if (layer >= g.num_layers - third) up.w_a = u.deep_w_a;
        kernels::UniCacheInputs in;
        in.attention = L.h2o().data();
        in.cross = L.cross_received().data();
        in.redundancy = L.redundancy(u.seq_radius, u.grid_radius).data();
        in.modality = ctx.modality.data();
        in.num_heads = H;
        in.num_tokens = T;
        check(kernels::cpu::unicache_score(in, up, per_kv.data()), "UniCache score");
        break;
      }
    }
    for (int h = 0; h < H; ++h) {
      const int w = cluster[static_cast<std::size_t>(h)];
      const float inv = 1.0f / static_cast<float>(cluster_size[static_cast<std::size_t>(w)]);
      for (int t = 0; t < T; ++t)
        scores[static_cast<std::size_t>(w) * T + t] += inv * per_kv[static_cast<std::size_t>(h) * T + t];
    }
    if (p.executor != ExecutorKind::kEvict) {
      // Merge weights: attention-like scores shifted to be non-negative.
      importance = scores;
      for (int w = 0; w < Hw; ++w) {
        float mn = 0;
        for (int t = 0; t < T; ++t) mn = std::min(mn, importance[static_cast<std::size_t>(w) * T + t]);
        for (int t = 0; t < T; ++t) importance[static_cast<std::size_t>(w) * T + t] += -mn + 1e-6f;
      }
    }
  }

  // ---- 3. budgets
  int k = T;
  int sinks = std::min(p.sinks, T), recent = std::min(p.recent, T);
  kernels::SelectParams sp;
  if (!keep_all) {
    double frac = keep;
    if (p.allocator == AllocatorKind::kPyramid && g.num_layers > 1) {
      frac = keep * (1.0 + p.pyramid_spread * (1.0 - 2.0 * layer / (g.num_layers - 1)));
    }
    if (p.allocator == AllocatorKind::kUniCache) {
      // Cosine schedule, rescaled so its mean keep fraction equals `keep`; rate_offset is
      // applied after the rescaling, so scene offsets survive a budget.
      UniCacheConfig shape = p.unicache;
      shape.rate_offset = 0.0f;
      double mean = 0;
      for (int l = 0; l < g.num_layers; ++l) mean += 1.0 - unicache_rate(shape, l, g.num_layers);
      mean /= g.num_layers;
      frac = (1.0 - unicache_rate(shape, layer, g.num_layers)) * keep / mean - p.unicache.rate_offset;
    }
    frac = std::clamp(frac, 0.0, 1.0);
    k = std::clamp(static_cast<int>(std::lround(frac * T)), 1, T);
    recent = std::max(recent, static_cast<int>(std::lround(p.recent_fraction * k)));

    const PerModalityCount& n = ctx.tokens;
    if (p.allocator == AllocatorKind::kExplicit) {
      if (static_cast<int>(p.layer_modality_keep.size()) != g.num_layers) {
        throw std::runtime_error("explicit allocation needs one entry per layer");
      }
      sp.use_modality_budgets = true;
      sp.redistribute_leftover = false;
      double share[kModalities];
      for (int m = 0; m < kModalities; ++m) {
        const double f = std::clamp(p.layer_modality_keep[static_cast<std::size_t>(layer)][static_cast<std::size_t>(m)], 0.0, 1.0);
        share[m] = f * static_cast<double>(n[static_cast<std::size_t>(m)]);
        sp.modality_budget[m] = static_cast<int>(std::lround(share[m]));
      }
      k = budgets_keep_one_token(sp.modality_budget, share, n);
    }
    if (vision_only) {
      // Every non-vision token is kept; the budget left goes to vision.
      for (int t = 0; t < T; ++t) protect[static_cast<std::size_t>(t)] = ctx.modality[static_cast<std::size_t>(t)] != kVision;
    }
    if (p.allocator == AllocatorKind::kHybrid) {
      sp.use_modality_budgets = true;
      const int k_text = static_cast<int>(std::min<std::int64_t>(n[kText], std::lround(p.hybrid_text_share * k)));
      int rest = k - k_text;
      std::int64_t others = 0;
      for (int m = 0; m < kModalities; ++m) others += m == kText ? 0 : n[static_cast<std::size_t>(m)];
      sp.modality_budget[kText] = k_text;
      int given = 0;
      for (int m = 0; m < kModalities; ++m) {
        if (m == kText) continue;
        const int km = others ? static_cast<int>(std::floor(static_cast<double>(rest) * n[static_cast<std::size_t>(m)] / others)) : 0;
        sp.modality_budget[m] = km;
        given += km;
      }
      sp.modality_budget[kVision] += rest - given;
    }
    if (p.allocator == AllocatorKind::kUniCache) {
      const UniCacheConfig& u = p.unicache;
      const double rate = 1.0 - static_cast<double>(k) / T;  // this layer's overall compression rate
      // Density: the more similar a modality's keys are to each other, the more it is compressed.
      const PerModality& sim = L.modality_similarity();
      double wsum = 0, nsum = 0;
      for (int m : {kText, kVision, 2}) {
        wsum += n[static_cast<std::size_t>(m)] * std::max(0.05, sim[static_cast<std::size_t>(m)]);
        nsum += static_cast<double>(n[static_cast<std::size_t>(m)]);
      }
      const double mean_sim = nsum > 0 ? wsum / nsum : 1.0;
      double removed_target = rate * T, removed = 0;
      for (int m : {kText, kVision, 2}) {
        const double cap = m == kText ? u.text_cap : u.vision_cap;
        const double r = rate * std::max(0.05, sim[static_cast<std::size_t>(m)]) / mean_sim;
        mod_rate[static_cast<std::size_t>(m)] = std::clamp(r, 0.0, cap);
        removed += mod_rate[static_cast<std::size_t>(m)] * n[static_cast<std::size_t>(m)];
      }
      // Overflow: what a capped modality could not remove moves to the others (up to their caps).
      for (int pass = 0; pass < 2 && removed + 0.5 < removed_target; ++pass) {
        for (int m : {kVision, 2, kText}) {
          const double cap = m == kText ? u.text_cap : u.vision_cap;
          const double nm = static_cast<double>(n[static_cast<std::size_t>(m)]);
          if (nm <= 0) continue;
          const double room = (cap - mod_rate[static_cast<std::size_t>(m)]) * nm;
          const double take = std::min(room, removed_target - removed);
          if (take > 0) {
            mod_rate[static_cast<std::size_t>(m)] += take / nm;
            removed += take;
          }
        }
      }
      sp.use_modality_budgets = true;
      double share[kModalities];
      for (int m = 0; m < kModalities; ++m) {
        share[m] = static_cast<double>(n[static_cast<std::size_t>(m)]) * (1.0 - mod_rate[static_cast<std::size_t>(m)]);
        sp.modality_budget[m] = static_cast<int>(std::lround(share[m]));
      }
      k = budgets_keep_one_token(sp.modality_budget, share, n);
      // Alignment protection: tokens whose cross-modal attention share exceeds the threshold
      // get a discounted rate: the best (1 - discount * rate) of them are always kept.
      const auto& given = L.cross_given();
      for (int m = 0; m < kModalities; ++m) {
        std::vector<std::pair<float, int>> align;
        for (int t = 0; t < T; ++t) {
          if (ctx.modality[static_cast<std::size_t>(t)] != m) continue;
          float share = 0, score = 0;
          for (int h = 0; h < H; ++h) share += given[static_cast<std::size_t>(h) * T + t];
          for (int w = 0; w < Hw; ++w) score += scores[static_cast<std::size_t>(w) * T + t];
          if (share / H > u.align_threshold) align.emplace_back(-score, t);
        }
        std::sort(align.begin(), align.end());
        const double keep_align = 1.0 - u.align_discount * mod_rate[static_cast<std::size_t>(m)];
        const std::size_t nkeep = static_cast<std::size_t>(std::ceil(keep_align * static_cast<double>(align.size())));
        for (std::size_t i = 0; i < std::min(nkeep, align.size()); ++i) protect[static_cast<std::size_t>(align[i].second)] = 1;
      }
    }
    // The forced set must fit: a budget below it is raised (with a warning), never zero tokens.
    int forced = 0;
    for (int t = 0; t < T; ++t) {
      forced += (t < sinks || t >= T - recent || protect[static_cast<std::size_t>(t)]) ? 1 : 0;
    }
    if (forced > k) {
      warnings.push_back("layer " + std::to_string(layer) + ": budget of " + std::to_string(k) +
                         " tokens is below the forced set (" + std::to_string(forced) +
                         " sinks/recent/protected tokens); keeping " + std::to_string(forced));
      if (sp.use_modality_budgets) {
        // Grow the per-modality budgets by the forced tokens they lack.
        PerModalityCount fm{};
        for (int t = 0; t < T; ++t)
          if (t < sinks || t >= T - recent || protect[static_cast<std::size_t>(t)]) ++fm[ctx.modality[static_cast<std::size_t>(t)]];
        k = 0;
        for (int m = 0; m < kModalities; ++m) {
          sp.modality_budget[m] = std::max<int>(sp.modality_budget[m], static_cast<int>(fm[static_cast<std::size_t>(m)]));
          k += sp.modality_budget[m];
        }
      } else {
        k = forced;
      }
    }
    if (k >= T) keep_all = true;
  }

  // ---- 4. selection -> kept [Hw, k]
  std::vector<std::int32_t> kept;
  std::vector<std::int32_t> counts(static_cast<std::size_t>(Hw), k);
  if (keep_all) {
    k = T;
    kept.resize(static_cast<std::size_t>(Hw) * T);
    for (int w = 0; w < Hw; ++w)
      for (int t = 0; t < T; ++t) kept[static_cast<std::size_t>(w) * T + t] = t;
    counts.assign(static_cast<std::size_t>(Hw), T);
  } else {
    sp.k = k;
    sp.modality = ctx.modality.data();
    sp.num_sinks = sinks;
    sp.recent_window = recent;
    sp.protected_mask = protect.data();
    sp.redistribute_leftover = p.allocator != AllocatorKind::kExplicit;
    kept.assign(static_cast<std::size_t>(Hw) * k, -1);
    if (p.shared_heads) {
      std::int32_t c = 0;
      std::vector<std::int32_t> one(static_cast<std::size_t>(k));
      check(ctx.backend->select_topk_shared(scores.data(), Hw, T, sp, one.data(), &c), "select (shared)");
      for (int w = 0; w < Hw; ++w) {
        std::copy(one.begin(), one.end(), kept.begin() + static_cast<std::ptrdiff_t>(w) * k);
        counts[static_cast<std::size_t>(w)] = c;
      }
    } else {
      check(ctx.backend->select_topk(scores.data(), Hw, T, sp, kept.data(), counts.data()), "select");
    }
  }

  // ---- 5-6. per working head: slots (keep / merge, float32), multiplicities, token -> slot; then
  // quantize what is kept (fake quantization: the dequantized values are evaluated); then the quality
  // of each original kv head of the working head on the evaluation queries, causally: query s sees
  // the compressed context plus the decode tokens 0..s, which prefill mode always keeps exact
  // (docs/metrics.md). One working head's slots live at a time, in per-thread buffers.
  const bool merging = !keep_all && p.executor != ExecutorKind::kEvict;
  std::vector<std::int32_t> tok2slot(static_cast<std::size_t>(Hw) * T, -1);
  std::vector<Bytes> head_bytes(static_cast<std::size_t>(Hw));
  std::vector<std::vector<int>> members(static_cast<std::size_t>(Hw));
  for (int h = 0; h < H; ++h) members[static_cast<std::size_t>(cluster[static_cast<std::size_t>(h)])].push_back(h);
  LayerResult res;
  res.layer = layer;
  res.merged_heads = Hw;
  res.heads.resize(static_cast<std::size_t>(H));
  L.prepare_steps();
  const std::vector<float>& kall = L.k_all();
  const std::vector<float>& vall = L.v_all();
  const std::size_t SD = static_cast<std::size_t>(S) * static_cast<std::size_t>(D);
  if (compressed) {  // closed loop (issue 6): the compressed cache is returned too
    compressed->cluster = cluster;
    compressed->heads.assign(static_cast<std::size_t>(Hw), {});
  }
  // Heads run in parallel (the kernels inside then run single-threaded: nested regions are off);
  // errors are collected per head because exceptions may not leave an OpenMP region.
  std::vector<std::string> head_errors(static_cast<std::size_t>(Hw));
#pragma omp parallel
  {
    std::vector<float> sk, sv, qbuf;  // [K + S, D]: context slots, then the decode tokens
    std::vector<std::int32_t> sn, t2s;
    std::vector<std::uint8_t> smod;
    EvalScratch scratch;
#pragma omp for schedule(dynamic)
    for (int w = 0; w < Hw; ++w) {
      try {
        const int K = counts[static_cast<std::size_t>(w)];
        const std::size_t rows = static_cast<std::size_t>(K) + static_cast<std::size_t>(S);
        const std::int32_t* kw = &kept[static_cast<std::size_t>(w) * k];
        sk.resize(rows * D);
        sv.resize(rows * D);
        sn.assign(rows, 1);
        std::int32_t* t2 = &tok2slot[static_cast<std::size_t>(w) * T];
        const float* kh = kwork[static_cast<std::size_t>(w)];
        const float* vh = vwork[static_cast<std::size_t>(w)];
        if (!evaluate && !merging && !p.key_quant) {  // selection only: budget_batch.cpp evaluates
          for (int s = 0; s < K; ++s) t2[kw[s]] = s;
          head_bytes[static_cast<std::size_t>(w)].kv = 2ll * K * D * elem;
          continue;
        }
        if (merging) {
          kernels::MergeParams mp;
          mp.num_heads = 1;
          mp.num_tokens = T;
          mp.head_dim = D;
          mp.num_kept = K;
          mp.window = p.merge_window;
          mp.threshold = p.executor == ExecutorKind::kUniCache ? p.unicache.merge_threshold : p.merge_threshold;
          mp.dtype = kernels::DType::kF32;
          check(kernels::cpu::merge_tokens(mp, kh, vh, kw, &importance[static_cast<std::size_t>(w) * T], sk.data(),
                                           sv.data(), sn.data(), t2),
                "merge");
        } else {
          kernels::CompactShape cs{1, T, D, kernels::DType::kF32};
          kernels::KeptIndices ki{kw, nullptr, K};
          kernels::CompactInputs ci;
          ci.keys = kh;
          ci.values = vh;
          kernels::CompactOutputs co;
          co.keys = sk.data();
          co.values = sv.data();
          check(kernels::cpu::compact(cs, ki, ci, co), "compact");
          for (int s = 0; s < K; ++s) t2[kw[s]] = s;
        }
        Bytes& b = head_bytes[static_cast<std::size_t>(w)];
        bool exact = !merging;  // context slots = the kept tokens, exact (evaluation reuse, evaluation.hpp)
        if (p.key_quant && K > 0) {
          const std::size_t KD = static_cast<std::size_t>(K) * D;
          qbuf.resize(KD);
          for (int kv = 0; kv < 2; ++kv) {
            const kernels::QuantSpec& q = kv == 0 ? *p.key_quant : *p.value_quant;
            std::vector<float>& data = kv == 0 ? sk : sv;
            const kernels::QuantShape qs{1, K, D, kernels::DType::kF32};
            check(ctx.backend->quantize_dequantize(q, qs, data.data(), qbuf.data()), "quantize");
            exact = exact && std::equal(qbuf.begin(), qbuf.begin() + static_cast<std::ptrdiff_t>(KD),
                                        data.begin());
            std::copy_n(qbuf.begin(), KD, data.begin());
            const auto qb = kernels::quantized_bytes(q, 1, K, D, ctx.dtype);
            b.kv += qb.codes;
            b.scales += qb.scales;
            b.zeros += qb.zeros;
            b.residual += qb.residual;
          }
        } else {
          b.kv = 2ll * K * D * elem;
        }
        if (merging) b.multiplicity = 4ll * K;
        if (compressed) {  // closed loop: the slots as evaluated (before the decode tokens are appended)
          CompressedLayer::Head& ch = compressed->heads[static_cast<std::size_t>(w)];
          ch.k.assign(sk.begin(), sk.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(K) * D));
          ch.v.assign(sv.begin(), sv.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(K) * D));
          ch.multiplicity.assign(sn.begin(), sn.begin() + K);
          ch.token.assign(kw, kw + K);
        }
        smod.assign(rows, 0);  // decode tokens: text
        for (int s = 0; s < K; ++s) smod[static_cast<std::size_t>(s)] = ctx.modality[static_cast<std::size_t>(kw[s])];
        t2s.resize(static_cast<std::size_t>(T) + static_cast<std::size_t>(S));
        std::copy_n(t2, T, t2s.begin());
        for (int j = 0; j < S; ++j) t2s[static_cast<std::size_t>(T + j)] = K + j;
        for (int h : members[static_cast<std::size_t>(w)]) {
          // Decode tokens of kv head h (exact) after the shared context slots.
          const std::size_t all = (static_cast<std::size_t>(h) * (static_cast<std::size_t>(T) + S) + T) * D;
          std::copy_n(kall.begin() + static_cast<std::ptrdiff_t>(all), SD,
                      sk.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(K) * D));
          std::copy_n(vall.begin() + static_cast<std::ptrdiff_t>(all), SD,
                      sv.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(K) * D));
          const PrefillCache c{sk.data(), sv.data(), K, sn.data(), smod.data(), t2s.data(), exact};
          add_prefill_quality(L, ctx, h, c, p.proportional_attention, scratch,
                              res.heads[static_cast<std::size_t>(h)].quality);
        }
      } catch (const std::exception& e) {
        head_errors[static_cast<std::size_t>(w)] = e.what();
      }
    }
  }
  for (const auto& e : head_errors)
    if (!e.empty()) throw std::runtime_error(e);
  if (head_merge && Hw < H) head_bytes[0].index += 4ll * Hq;  // query-head -> merged-head map

  // ---- 7. per original kv head: counts and bytes (a merged head's bytes are shared by its members)
  for (int h = 0; h < H; ++h) {
    const int w = cluster[static_cast<std::size_t>(h)];
    const int K = counts[static_cast<std::size_t>(w)];
    const double share = 1.0 / cluster_size[static_cast<std::size_t>(w)];
    HeadResult& hr = res.heads[static_cast<std::size_t>(h)];
    hr.kv_head = h;
    hr.tokens = ctx.tokens;
    hr.bytes_full.kv = 2ll * T * D * elem;
    const Bytes& wb = head_bytes[static_cast<std::size_t>(w)];
    hr.bytes_kept.kv = static_cast<std::int64_t>(std::llround(wb.kv * share));
    hr.bytes_kept.scales = static_cast<std::int64_t>(std::llround(wb.scales * share));
    hr.bytes_kept.zeros = static_cast<std::int64_t>(std::llround(wb.zeros * share));
    hr.bytes_kept.residual = static_cast<std::int64_t>(std::llround(wb.residual * share));
    hr.bytes_kept.multiplicity = static_cast<std::int64_t>(std::llround(wb.multiplicity * share));
    hr.bytes_kept.index = h == 0 ? head_bytes[0].index : 0;
    const std::int32_t* t2s = &tok2slot[static_cast<std::size_t>(w) * T];
    std::vector<char> is_kept(static_cast<std::size_t>(T), 0);
    for (int s = 0; s < K; ++s) is_kept[static_cast<std::size_t>(kept[static_cast<std::size_t>(w) * k + s])] = 1;
    PerModalityCount slots_m{};
    for (int t = 0; t < T; ++t) {
      const auto m = ctx.modality[static_cast<std::size_t>(t)];
      if (is_kept[static_cast<std::size_t>(t)]) {
        ++hr.kept[m];
        ++slots_m[m];
      } else if (t2s[t] >= 0) {
        ++hr.merged[m];
      } else {
        ++hr.evicted[m];
      }
      hr.bytes_full_modality[m] += 2ll * D * elem;
    }
    if (record_tokens) {
      TokenMap tm;
      tm.slot.assign(t2s, t2s + T);
      tm.slot_token.assign(kept.begin() + static_cast<std::ptrdiff_t>(w) * k,
                           kept.begin() + static_cast<std::ptrdiff_t>(w) * k + K);
      tm.state.resize(static_cast<std::size_t>(T));
      for (int t = 0; t < T; ++t)
        tm.state[static_cast<std::size_t>(t)] = is_kept[static_cast<std::size_t>(t)] ? 1 : (t2s[t] >= 0 ? 2 : 0);
      if (!keep_all) tm.score.assign(scores.begin() + static_cast<std::ptrdiff_t>(w) * T, scores.begin() + static_cast<std::ptrdiff_t>(w + 1) * T);
      tm.quant_bits = p.key_quant ? p.key_quant->bits : 0;
      res.token_maps.push_back(std::move(tm));
    }
    const std::int64_t kept_total = hr.bytes_kept.total();
    for (int m = 0; m < kModalities; ++m)
      hr.bytes_kept_modality[static_cast<std::size_t>(m)] =
          K ? static_cast<std::int64_t>(std::llround(static_cast<double>(kept_total) * slots_m[static_cast<std::size_t>(m)] / K)) : 0;
  }

  const std::int64_t decode_token_bytes = 2ll * D * elem;
  for (auto& hr : res.heads) {
    hr.bytes_full_end = hr.bytes_full.total() + S * decode_token_bytes;
    hr.bytes_end = hr.bytes_kept.total() + S * decode_token_bytes;
    hr.bytes_peak = hr.bytes_end;  // the cache only grows during the decode steps
  }
  std::int64_t kept_bytes = 0;
  std::int32_t max_slots = 0;
  for (int h = 0; h < H; ++h) {
    kept_bytes += res.heads[static_cast<std::size_t>(h)].bytes_kept.total();
    max_slots = std::max(max_slots, counts[static_cast<std::size_t>(cluster[static_cast<std::size_t>(h)])]);
  }
  res.steps.resize(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) {
    DecodeStep& st = res.steps[static_cast<std::size_t>(s)];
    st.max_slots = max_slots + s + 1;
    st.bytes_before = st.bytes_after = kept_bytes + static_cast<std::int64_t>(H) * (s + 1) * decode_token_bytes;
  }
  return res;
}

}  // namespace kvscope::sim
