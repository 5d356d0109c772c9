// One policy on one layer, in two halves: selection (head merge -> scores -> budgets ->
// kept sets, select_on_layer) and execution (keep/merge/evict -> quantize -> exact bytes ->
// quality on decode queries, execute_selection). The stages are the policy's composition
// (sim/src/stages/); this file holds only the pipeline between them.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "exec_util.hpp"
#include "kvscope/kernels/evaluate.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/select.hpp"
#include "kvscope/sim/engine.hpp"
#include "evaluation.hpp"
#include "stages/stage.hpp"

namespace kvscope::sim {

namespace {
using detail::check;
}  // namespace

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
    case Budget::Kind::kNone: {
      // An allocator with a schedule of its own (UniCache) has a default keep; others 0.5.
      return stages::allocator_of(p).default_keep(p, ctx);
    }
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

LayerSelection select_on_layer(const PolicySpec& p, double keep, LayerData& L, TraceContext& ctx,
                               std::vector<std::string>& warnings) {
  const stages::LayerView view(p, L, ctx);
  const int H = view.kv_heads, T = view.T;
  const int layer = view.layer;
  if (view.S <= 0) throw std::runtime_error("no evaluation queries");
  const stages::Allocator& allocator = stages::allocator_of(p);
  LayerSelection sel;

  // ---- 1. working heads (after optional head merging), float32 [Hw, T, D]
  const bool head_merge = p.compress_tokens && H > 1;
  stages::WorkingHeads wh = (head_merge ? stages::head_merge_of(p) : stages::no_head_merge()).merge(view);
  const int Hw = wh.count;
  sel.working_heads = Hw;
  sel.head_merged = wh.merged;
  sel.cluster = std::move(wh.cluster);
  sel.keys = std::move(wh.keys);
  sel.values = std::move(wh.values);
  std::vector<int> cluster_size(static_cast<std::size_t>(Hw), 0);
  for (int h = 0; h < H; ++h) ++cluster_size[static_cast<std::size_t>(sel.cluster[static_cast<std::size_t>(h)])];

  // ---- 2. scores per original kv head, then averaged over each cluster -> [Hw, T]
  std::vector<float>& scores = sel.scores;
  std::vector<std::uint8_t> protect(static_cast<std::size_t>(T), 0);
  bool keep_all = !p.compress_tokens || keep >= 1.0;
  if (!keep_all && allocator.keeps_layer(view)) keep_all = true;
  const stages::Executor& executor = stages::executor_of(p);

  if (!keep_all) {
    scores.assign(static_cast<std::size_t>(Hw) * static_cast<std::size_t>(T), 0.0f);
    std::vector<float> per_kv(static_cast<std::size_t>(H) * static_cast<std::size_t>(T));  // [Hkv, T]
    stages::scorer_of(p).score(view, per_kv);
    for (int h = 0; h < H; ++h) {
      const int w = sel.cluster[static_cast<std::size_t>(h)];
      const float inv = 1.0f / static_cast<float>(cluster_size[static_cast<std::size_t>(w)]);
      for (int t = 0; t < T; ++t) scores[view.index(w, t)] += inv * per_kv[view.index(h, t)];
    }
    if (executor.merges()) {
      // Merge weights: attention-like scores shifted to be non-negative.
      sel.importance = scores;
      for (int w = 0; w < Hw; ++w) {
        float mn = 0;
        for (int t = 0; t < T; ++t) mn = std::min(mn, sel.importance[view.index(w, t)]);
        for (int t = 0; t < T; ++t) sel.importance[view.index(w, t)] += -mn + 1e-6f;
      }
    }
  }

  // ---- 3. budgets
  int k = T;
  int sinks = std::min(p.sinks, T), recent = std::min(p.recent, T);
  kernels::SelectParams sp;
  if (!keep_all) {
    const double frac = std::clamp(allocator.layer_fraction(view, keep), 0.0, 1.0);
    // keep_rounding = kvpress: kvpress keeps int(T * (1 - compression_ratio)) tokens.
    const double tokens = p.floor_keep ? std::floor(T * (1.0 - (1.0 - frac))) : std::round(frac * T);
    k = std::clamp(static_cast<int>(tokens), 1, T);
    recent = std::max(recent, static_cast<int>(std::lround(p.recent_fraction * k)));
    allocator.allocate(view, scores, Hw, k, sp, protect);
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
  std::vector<std::int32_t>& kept = sel.kept;
  sel.counts.assign(static_cast<std::size_t>(Hw), k);
  if (keep_all) {
    k = T;
    kept.resize(static_cast<std::size_t>(Hw) * T);
    for (int w = 0; w < Hw; ++w)
      for (int t = 0; t < T; ++t) kept[view.index(w, t)] = t;
    sel.counts.assign(static_cast<std::size_t>(Hw), T);
  } else {
    sp.k = k;
    sp.modality = ctx.modality.data();
    sp.num_sinks = sinks;
    sp.recent_window = recent;
    sp.protected_mask = protect.data();
    kept.assign(static_cast<std::size_t>(Hw) * k, -1);
    if (p.shared_heads) {
      std::int32_t c = 0;
      std::vector<std::int32_t> one(static_cast<std::size_t>(k));
      check(ctx.backend->select_topk_shared(scores.data(), Hw, T, sp, one.data(), &c), "select (shared)");
      for (int w = 0; w < Hw; ++w) {
        std::copy(one.begin(), one.end(), kept.begin() + static_cast<std::ptrdiff_t>(w) * k);
        sel.counts[static_cast<std::size_t>(w)] = c;
      }
    } else {
      check(ctx.backend->select_topk(scores.data(), Hw, T, sp, kept.data(), sel.counts.data()), "select");
    }
  }
  sel.keep_all = keep_all;
  sel.k = k;
  if (keep_all) sel.importance.clear();
  return sel;
}

namespace {

// Slots [K, D] of kept tokens `kw` (ascending) of kv head w from their per-token codes: the first
// K - min(residual, K) dequantized, the rest copied from `rows` ([T, D] float32, the full-precision
// residual), exactly as quantize_dequantize of the gathered rows with `residual` tokens writes them.
// Returns whether every slot equals its float32 row.
bool gather_dequantize(const LayerData::TokenCodes& c, int w, int T, int D, int residual, const std::int32_t* kw,
                       int K, const float* rows, EvalScratch& scratch, float* out) {
  const int Kq = K - std::min(residual, K);
  bool exact = true;
  if (Kq > 0) {
    const std::size_t rb = static_cast<std::size_t>(c.row_bytes), g = static_cast<std::size_t>(c.groups);
    const std::size_t head = static_cast<std::size_t>(w) * static_cast<std::size_t>(T);
    scratch.codes.resize(static_cast<std::size_t>(Kq) * rb);
    scratch.scales.resize(static_cast<std::size_t>(Kq) * g);
    if (!c.zeros.empty()) scratch.zeros.resize(static_cast<std::size_t>(Kq) * g);
    for (int s = 0; s < Kq; ++s) {
      const std::size_t t = head + static_cast<std::size_t>(kw[s]);
      std::copy_n(&c.codes[t * rb], rb, &scratch.codes[static_cast<std::size_t>(s) * rb]);
      std::copy_n(&c.scales[t * g], g, &scratch.scales[static_cast<std::size_t>(s) * g]);
      if (!c.zeros.empty()) std::copy_n(&c.zeros[t * g], g, &scratch.zeros[static_cast<std::size_t>(s) * g]);
      exact = exact && c.exact[t] != 0;
    }
    kernels::QuantConstBuffers in;
    in.codes = scratch.codes.data();
    in.scales = scratch.scales.data();
    in.zeros = c.zeros.empty() ? nullptr : scratch.zeros.data();
    check(kernels::cpu::dequantize(c.spec, kernels::QuantShape{1, Kq, D, kernels::DType::kF32}, in, out),
          "dequantize");
  }
  for (int s = Kq; s < K; ++s)
    std::copy_n(rows + static_cast<std::size_t>(kw[s]) * D, D, out + static_cast<std::size_t>(s) * D);
  return exact;
}

}  // namespace

LayerResult execute_selection(const PolicySpec& p, const LayerSelection& sel, LayerData& L, TraceContext& ctx,
                              bool record_tokens, CompressedLayer* compressed, bool evaluate) {
  const stages::LayerView view(p, L, ctx);
  const auto& g = ctx.geometry;
  const int H = g.num_kv_heads, Hq = g.num_q_heads, D = g.head_dim, T = ctx.T, S = ctx.S;
  const int layer = L.layer();
  const std::int64_t elem = static_cast<std::int64_t>(kernels::dtype_bytes(ctx.dtype));
  const int Hw = sel.working_heads, k = sel.k;
  const bool keep_all = sel.keep_all;
  const std::vector<std::int32_t>& cluster = sel.cluster;
  const std::vector<std::int32_t>& kept = sel.kept;
  const std::vector<std::int32_t>& counts = sel.counts;
  const std::vector<float>& scores = sel.scores;
  const bool head_merge = sel.head_merged;
  std::vector<int> cluster_size(static_cast<std::size_t>(Hw), 0);
  for (int h = 0; h < H; ++h) ++cluster_size[static_cast<std::size_t>(cluster[static_cast<std::size_t>(h)])];
  const stages::Executor& executor = stages::executor_of(p);

  const std::vector<const float*>& kwork = sel.keys;
  const std::vector<const float*>& vwork = sel.values;
  // ---- 5-6. per working head: slots (keep / merge, float32), multiplicities, token -> slot; then
  // quantize what is kept (fake quantization: the dequantized values are evaluated); then the quality
  // of each original kv head of the working head on the evaluation queries, causally: query s sees
  // the compressed context plus the decode tokens 0..s, which prefill mode always keeps exact
  // (docs/metrics.md). One working head's slots live at a time, in per-thread buffers.
  const bool merging = !keep_all && executor.merges();
  const stages::Executor& ex = merging ? executor : stages::evict_executor();
  std::vector<std::int32_t> tok2slot(static_cast<std::size_t>(Hw) * T, -1);
  std::vector<Bytes> head_bytes(static_cast<std::size_t>(Hw));
  std::vector<std::vector<int>> members(static_cast<std::size_t>(Hw));
  for (int h = 0; h < H; ++h) members[static_cast<std::size_t>(cluster[static_cast<std::size_t>(h)])].push_back(h);
  LayerResult res;
  res.layer = layer;
  res.merged_heads = Hw;
  res.heads.resize(static_cast<std::size_t>(H));
  L.prepare_steps();
  L.answer_topk();  // before the parallel evaluation reads it
  const std::vector<float>& kall = L.k_all();
  const std::vector<float>& vall = L.v_all();
  const std::size_t SD = static_cast<std::size_t>(S) * static_cast<std::size_t>(D);
  const std::size_t stride = (static_cast<std::size_t>(T) + static_cast<std::size_t>(S)) * D;  // kall's head stride
  // Per-token codes of this layer (prepared by a sweep), asked for by exactly the points
  // LayerData::prepare_token_codes counts as users (uses_token_codes).
  std::shared_ptr<const LayerData::TokenCodes> kcodes, vcodes;
  if (uses_token_codes(p) && ctx.backend->kind() == BackendKind::kCpu) {
    kcodes = L.token_codes(*p.key_quant, false);
    vcodes = L.token_codes(*p.value_quant, true);
  }
  struct CodesDone {  // gives the codes back however this function ends
    LayerData& L;
    const PolicySpec& p;
    bool k, v;
    ~CodesDone() {
      if (k) L.token_codes_done(*p.key_quant, false);
      if (v) L.token_codes_done(*p.value_quant, true);
    }
  } codes_done{L, p, kcodes != nullptr, vcodes != nullptr};
  if (compressed) {  // closed loop (issue 6): the compressed cache is returned too
    compressed->cluster = cluster;
    compressed->heads.assign(static_cast<std::size_t>(Hw), {});
  }
  // Heads run in parallel (the kernels inside then run single-threaded: nested regions are off);
  // errors are collected per head because exceptions may not leave an OpenMP region.
  std::vector<std::string> head_errors(static_cast<std::size_t>(Hw));
#pragma omp parallel
  {
    PooledScratch pooled;  // reused across points (evaluation.hpp)
    EvalScratch& scratch = *pooled;
    std::vector<float>& sk = scratch.sk;  // [K + S, D]: context slots, then the decode tokens
    std::vector<float>& sv = scratch.sv;
    std::vector<float>& qbuf = scratch.qbuf;
    std::vector<std::int32_t>& sn = scratch.sn;
    std::vector<std::int32_t>& t2s = scratch.t2s;
    std::vector<std::uint8_t>& smod = scratch.smod;
#pragma omp for schedule(dynamic)
    for (int w = 0; w < Hw; ++w) {
      try {
        const int K = counts[static_cast<std::size_t>(w)];
        const std::size_t rows = static_cast<std::size_t>(K) + static_cast<std::size_t>(S);
        const std::int32_t* kw = &kept[static_cast<std::size_t>(w) * k];
        std::int32_t* t2 = &tok2slot[static_cast<std::size_t>(w) * T];
        if (!evaluate && !merging && !p.key_quant) {  // selection only: budget_batch.cpp evaluates
          for (int s = 0; s < K; ++s) t2[kw[s]] = s;
          head_bytes[static_cast<std::size_t>(w)].kv = 2ll * K * D * elem;
          continue;
        }
        sk.resize(rows * D);
        sv.resize(rows * D);
        sn.assign(rows, 1);
        Bytes& b = head_bytes[static_cast<std::size_t>(w)];
        bool exact = !merging;  // context slots = the kept tokens, exact (evaluation reuse, evaluation.hpp)
        // The slots are kept token rows of kv head w itself: their per-token codes, quantized once per
        // layer (LayerData::token_codes), are dequantized instead of quantizing the rows again.
        const bool from_codes = kcodes && vcodes && K > 0 &&
                                kwork[static_cast<std::size_t>(w)] == kall.data() + static_cast<std::size_t>(w) * stride &&
                                vwork[static_cast<std::size_t>(w)] == vall.data() + static_cast<std::size_t>(w) * stride;
        if (from_codes) {
          for (int s = 0; s < K; ++s) t2[kw[s]] = s;  // the evict executor's token -> slot
          for (int kv = 0; kv < 2; ++kv) {
            const kernels::QuantSpec& q = kv == 0 ? *p.key_quant : *p.value_quant;
            const LayerData::TokenCodes& c = kv == 0 ? *kcodes : *vcodes;
            std::vector<float>& data = kv == 0 ? sk : sv;
            const float* rows_w = kv == 0 ? kwork[static_cast<std::size_t>(w)] : vwork[static_cast<std::size_t>(w)];
            const bool rows_exact = gather_dequantize(c, w, T, D, q.residual_tokens, kw, K, rows_w, scratch, data.data());
            exact = exact && rows_exact;
          }
        } else {
          ex.execute(view, T, kwork[static_cast<std::size_t>(w)], vwork[static_cast<std::size_t>(w)], kw, K,
                     merging ? &sel.importance[static_cast<std::size_t>(w) * T] : nullptr,
                     stages::SlotOutput{sk.data(), sv.data(), sn.data(), t2});
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
            }
          }
        }
        b += resident_bytes(p, K, D, ctx.dtype);  // K and V codes, scales and zeros, or full precision
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


LayerResult run_policy_on_layer(const PolicySpec& p, double keep, LayerData& L, TraceContext& ctx,
                                std::vector<std::string>& warnings, bool record_tokens, CompressedLayer* compressed,
                                bool evaluate) {
  const LayerSelection sel = select_on_layer(p, keep, L, ctx, warnings);
  return execute_selection(p, sel, L, ctx, record_tokens, compressed, evaluate);
}

}  // namespace kvscope::sim
