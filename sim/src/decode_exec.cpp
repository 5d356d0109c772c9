// Decode-time mode: the cache evolves over the trace's decode steps. Each step appends
// its token, decode query s is evaluated on the cache including that token, the policy's
// statistics see the query, and every `interval` steps the cache is evicted down to the
// cap (sinks and recent window forced). docs/policies.md "Decode-time mode".
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "exec_util.hpp"
#include "evaluation.hpp"
#include "kvscope/sim/engine.hpp"
#include "stages/stage.hpp"

namespace kvscope::sim {

namespace {

using detail::check;

struct HeadState {
  std::vector<std::int32_t> tokens;  // resident token ids, ascending (context t < T, decode T + j)
  std::vector<float> k, v;           // [tokens, D] float32, as captured
  std::unique_ptr<stages::DecodeScoring> scoring;  // the scorer's state for this head
  // Merging executors only: multiplicity of each resident slot, and the resident token id holding
  // every token id (itself, the slot it was merged into, or -1: evicted or not yet appended).
  std::vector<std::int32_t> mult;   // [tokens]
  std::vector<std::int32_t> owner;  // [T + S]
  std::vector<std::int64_t> before, after;  // [S] resident bytes per step
  std::vector<std::int32_t> evicted, slots;  // [S] tokens evicted, slots after the step
  std::string error;
  bool clamped = false;
  bool clamped_protected = false;  // the forced set that exceeded the cap had protected tokens
};

}  // namespace

Bytes resident_bytes(const PolicySpec& p, int K, int D, trace::DType dtype) {
  Bytes b;
  if (p.key_quant && K > 0) {
    for (const kernels::QuantSpec* q : {&*p.key_quant, &*p.value_quant}) {
      const auto qb = kernels::quantized_bytes(*q, 1, K, D, dtype);
      b.kv += qb.codes;
      b.scales += qb.scales;
      b.zeros += qb.zeros;
      b.residual += qb.residual;
    }
  } else {
    b.kv = 2ll * K * D * static_cast<std::int64_t>(kernels::dtype_bytes(dtype));
  }
  return b;
}

LayerResult run_decode_policy_on_layer(const PolicySpec& p, double prefill_keep, double cap_keep, LayerData& L,
                                       TraceContext& ctx, std::vector<std::string>& warnings, bool record_tokens) {
  check_decode_support(p, "'" + p.name + "'");
  const auto& g = ctx.geometry;
  const int H = g.num_kv_heads, Hq = g.num_q_heads, G = g.group_size(), D = g.head_dim, T = ctx.T, S = ctx.S;
  const int layer = L.layer();
  const std::size_t N = static_cast<std::size_t>(T) + static_cast<std::size_t>(S);
  if (S <= 0) throw std::runtime_error("no evaluation queries");
  const stages::LayerView view(p, L, ctx);
  L.prepare_steps();
  L.answer_topk();  // before the parallel evaluation reads it
  // Head merging is prefill-only (check_decode_support): every kv head keeps its own resident set.
  if (layer == 0 && H > 1 && !find_stage_info(StageKind::kHeadMerge, p.stages.head_merge)->decode)
    warnings.push_back("decode mode runs the kv heads unmerged (head_merge '" + p.stages.head_merge +
                       "' merges heads in prefill mode only)");
  const auto& kall = L.k_all();
  const auto& vall = L.v_all();
  const auto& qs = L.q_steps();

  // Starting cache: the whole context, or what a prefill pass at prefill_keep kept.
  std::vector<HeadState> st(static_cast<std::size_t>(H));
  if (prefill_keep < 1.0) {
    PolicySpec pre = p;
    pre.mode = PolicyMode::kPrefill;
    pre.stages.head_merge = "none";  // decode mode runs the kv heads unmerged
    pre.key_quant.reset();
    pre.value_quant.reset();
    const LayerResult r = run_policy_on_layer(pre, prefill_keep, L, ctx, warnings, true);
    for (int h = 0; h < H; ++h) st[static_cast<std::size_t>(h)].tokens = r.token_maps[static_cast<std::size_t>(h)].slot_token;
  } else {
    for (auto& s : st) {
      s.tokens.resize(static_cast<std::size_t>(T));
      for (int t = 0; t < T; ++t) s.tokens[static_cast<std::size_t>(t)] = t;
    }
  }
  // Cap of this layer in tokens per kv head (a cap of the whole context or more never evicts).
  // A cap of the whole context or more never evicts; nor does a layer the allocator keeps whole.
  const bool unlimited = cap_keep >= 1.0 || stages::allocator_of(p).keeps_layer(view);
  int cap = T;
  if (!unlimited) {
    const double frac = stages::allocator_of(p).layer_fraction(view, cap_keep);
    cap = std::clamp(static_cast<int>(std::lround(std::clamp(frac, 0.0, 1.0) * T)), 1, T);
  }
  const int recent = std::max(p.recent, static_cast<int>(std::lround(p.recent_fraction * cap)));
  // The scorer's per-head state, made here (it may read lazily computed layer statistics).
  const stages::Scorer& scorer = stages::scorer_of(p);
  const stages::Allocator& allocator = stages::allocator_of(p);
  const stages::Executor& executor = stages::executor_of(p);
  const bool merging = executor.merges();
  // Resident bytes of K slots: a merging executor also stores an int32 multiplicity per slot.
  auto bytes_of = [&](int K) {
    Bytes b = resident_bytes(p, K, D, ctx.dtype);
    if (merging) b.multiplicity = 4ll * K;
    return b;
  };
  for (int h = 0; h < H; ++h) {
    st[static_cast<std::size_t>(h)].scoring = scorer.decode_scoring(view, h);
    if (!st[static_cast<std::size_t>(h)].scoring) throw std::logic_error("scorer '" + p.stages.scorer + "' has no decode mode");
  }

  LayerResult res;
  res.layer = layer;
  res.merged_heads = H;
  res.heads.resize(static_cast<std::size_t>(H));
#pragma omp parallel for schedule(dynamic)
  for (int h = 0; h < H; ++h) {
    HeadState& hs = st[static_cast<std::size_t>(h)];
    Quality& quality = res.heads[static_cast<std::size_t>(h)].quality;
    hs.before.assign(static_cast<std::size_t>(S), 0);
    hs.after.assign(static_cast<std::size_t>(S), 0);
    hs.evicted.assign(static_cast<std::size_t>(S), 0);
    hs.slots.assign(static_cast<std::size_t>(S), 0);
    const float* kh = &kall[static_cast<std::size_t>(h) * N * D];
    const float* vh = &vall[static_cast<std::size_t>(h) * N * D];
    for (auto t : hs.tokens) {
      hs.k.insert(hs.k.end(), kh + static_cast<std::size_t>(t) * D, kh + static_cast<std::size_t>(t + 1) * D);
      hs.v.insert(hs.v.end(), vh + static_cast<std::size_t>(t) * D, vh + static_cast<std::size_t>(t + 1) * D);
    }
    if (merging) {
      hs.owner.assign(N, -1);
      for (auto t : hs.tokens) hs.owner[static_cast<std::size_t>(t)] = t;
      hs.mult.assign(hs.tokens.size(), 1);
    }
    try {
      std::vector<float> qk, qv, scores, imp;
      std::vector<std::int32_t> t2s, idx, sn, t2, newmult;
      std::vector<std::uint8_t> smod, protect;
      for (int s = 0; s < S; ++s) {
        const int tok = T + s;
        hs.tokens.push_back(tok);
        hs.k.insert(hs.k.end(), kh + static_cast<std::size_t>(tok) * D, kh + static_cast<std::size_t>(tok + 1) * D);
        hs.v.insert(hs.v.end(), vh + static_cast<std::size_t>(tok) * D, vh + static_cast<std::size_t>(tok + 1) * D);
        if (merging) {
          hs.owner[static_cast<std::size_t>(tok)] = tok;
          hs.mult.push_back(1);
        }
        int K = static_cast<int>(hs.tokens.size());
        hs.before[static_cast<std::size_t>(s)] = bytes_of(K).total();
        // What the query attends to: the resident cache, dequantized when the policy quantizes.
        const float* ek = hs.k.data();
        const float* ev = hs.v.data();
        if (p.key_quant) {
          qk.resize(hs.k.size());
          qv.resize(hs.v.size());
          const kernels::QuantShape shape{1, K, D, kernels::DType::kF32};
          check(ctx.backend->quantize_dequantize(*p.key_quant, shape, hs.k.data(), qk.data()), "quantize keys");
          check(ctx.backend->quantize_dequantize(*p.value_quant, shape, hs.v.data(), qv.data()), "quantize values");
          ek = qk.data();
          ev = qv.data();
        }
        t2s.assign(static_cast<std::size_t>(tok) + 1, -1);
        smod.resize(static_cast<std::size_t>(K));
        for (int i = 0; i < K; ++i) {
          t2s[static_cast<std::size_t>(hs.tokens[static_cast<std::size_t>(i)])] = i;
          smod[static_cast<std::size_t>(i)] = ctx.modality_all[static_cast<std::size_t>(hs.tokens[static_cast<std::size_t>(i)])];
        }
        if (merging) {  // merged tokens are represented by the slot they joined
          for (int x = 0; x <= tok; ++x) {
            const std::int32_t o = hs.owner[static_cast<std::size_t>(x)];
            if (o >= 0 && o != x) t2s[static_cast<std::size_t>(x)] = t2s[static_cast<std::size_t>(o)];
          }
        }
        add_step_quality(L, ctx, h, s, StepCache{ek, ev, K, merging ? hs.mult.data() : nullptr, smod.data(), t2s.data()},
                         p.proportional_attention, quality);
        // Statistics of query s over the resident keys: one attention problem, G query heads.
        kernels::AttentionProblem a;
        a.q = &qs[(static_cast<std::size_t>(s) * Hq + static_cast<std::size_t>(h) * G) * D];
        a.k = ek;
        a.num_q_heads = G;
        a.num_kv_heads = 1;
        a.q_len = 1;
        a.k_len = K;
        a.head_dim = D;
        a.dtype = kernels::DType::kF32;
        a.causal = false;
        const stages::DecodeStepView step{s, h, hs.tokens, a, qs, *ctx.backend};
        hs.scoring->observe(step);
        if (s % p.interval != 0 || unlimited || K <= cap) {
          hs.after[static_cast<std::size_t>(s)] = hs.before[static_cast<std::size_t>(s)];
          hs.slots[static_cast<std::size_t>(s)] = K;
          continue;
        }
        hs.scoring->score(step, scores);
        kernels::SelectParams sel;
        sel.num_sinks = static_cast<int>(std::count_if(hs.tokens.begin(), hs.tokens.end(), [&](std::int32_t t) { return t < p.sinks; }));
        sel.recent_window = std::min(recent, K);
        // The allocator on the resident tokens: per-modality budgets (hybrid) or protected
        // tokens (vision-only) of the cap; uniform and pyramid add nothing.
        int k = cap;
        stages::TokenView resident;
        resident.count = K;
        resident.modality = smod.data();
        resident.id = hs.tokens.data();
        for (int i = 0; i < K; ++i) ++resident.per_modality[smod[static_cast<std::size_t>(i)]];
        protect.assign(static_cast<std::size_t>(K), 0);
        allocator.allocate_resident(view, resident, scores, k, sel, protect);
        const bool any_protected = std::find(protect.begin(), protect.end(), 1) != protect.end();
        auto is_forced = [&](int i) { return i < sel.num_sinks || i >= K - sel.recent_window || protect[static_cast<std::size_t>(i)]; };
        int forced = 0;
        for (int i = 0; i < K; ++i) forced += is_forced(i) ? 1 : 0;
        if (forced > k) {
          hs.clamped = true;
          hs.clamped_protected |= any_protected;
          if (sel.use_modality_budgets) {  // grow each modality's budget by the forced tokens it lacks
            PerModalityCount fm{};
            for (int i = 0; i < K; ++i)
              if (is_forced(i)) ++fm[smod[static_cast<std::size_t>(i)]];
            k = 0;
            for (int m = 0; m < kModalities; ++m) {
              sel.modality_budget[m] = std::max<int>(sel.modality_budget[m], static_cast<int>(fm[static_cast<std::size_t>(m)]));
              k += sel.modality_budget[m];
            }
          } else {
            k = forced;
          }
        }
        sel.k = k;
        if (sel.use_modality_budgets) sel.modality = smod.data();
        if (any_protected) sel.protected_mask = protect.data();
        if (sel.k >= K) {
          hs.after[static_cast<std::size_t>(s)] = hs.before[static_cast<std::size_t>(s)];
          hs.slots[static_cast<std::size_t>(s)] = K;
          continue;
        }
        idx.assign(static_cast<std::size_t>(sel.k), -1);
        std::int32_t count = 0;
        check(ctx.backend->select_topk(scores.data(), 1, K, sel, idx.data(), &count), "select");
        std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
        std::vector<float> nk(static_cast<std::size_t>(count) * D), nv(nk.size());
        for (int i = 0; i < count; ++i) tokens[static_cast<std::size_t>(i)] = hs.tokens[static_cast<std::size_t>(idx[static_cast<std::size_t>(i)])];
        if (merging) {
          // The executor folds the dropped resident tokens into the kept slots (its window counts
          // resident slots); merge weights are the scores shifted to be >= 0, times each slot's
          // multiplicity, so a slot that already holds n tokens weighs n times.
          float mn = 0;
          for (int i = 0; i < K; ++i) mn = std::min(mn, scores[static_cast<std::size_t>(i)]);
          imp.resize(static_cast<std::size_t>(K));
          for (int i = 0; i < K; ++i)
            imp[static_cast<std::size_t>(i)] = (scores[static_cast<std::size_t>(i)] - mn + 1e-6f) * static_cast<float>(hs.mult[static_cast<std::size_t>(i)]);
          sn.assign(static_cast<std::size_t>(count), 1);
          t2.assign(static_cast<std::size_t>(K), -1);
          executor.execute(view, K, hs.k.data(), hs.v.data(), idx.data(), count, imp.data(),
                           stages::SlotOutput{nk.data(), nv.data(), sn.data(), t2.data()});
          newmult.assign(static_cast<std::size_t>(count), 0);
          for (int i = 0; i < K; ++i)
            if (t2[static_cast<std::size_t>(i)] >= 0) newmult[static_cast<std::size_t>(t2[static_cast<std::size_t>(i)])] += hs.mult[static_cast<std::size_t>(i)];
          for (int x = 0; x <= tok; ++x) {  // owners move to the slot their resident token went to
            std::int32_t& o = hs.owner[static_cast<std::size_t>(x)];
            if (o < 0) continue;
            const std::int32_t to = t2[static_cast<std::size_t>(t2s[static_cast<std::size_t>(o)])];
            o = to >= 0 ? tokens[static_cast<std::size_t>(to)] : -1;
          }
          hs.mult.swap(newmult);
        }
        for (int i = 0; i < count && !merging; ++i) {
          const std::size_t from = static_cast<std::size_t>(idx[static_cast<std::size_t>(i)]);
          tokens[static_cast<std::size_t>(i)] = hs.tokens[from];
          std::copy_n(&hs.k[from * D], D, &nk[static_cast<std::size_t>(i) * D]);
          std::copy_n(&hs.v[from * D], D, &nv[static_cast<std::size_t>(i) * D]);
        }
        hs.evicted[static_cast<std::size_t>(s)] = K - count;
        hs.tokens.swap(tokens);
        hs.k.swap(nk);
        hs.v.swap(nv);
        K = count;
        hs.after[static_cast<std::size_t>(s)] = bytes_of(K).total();
        hs.slots[static_cast<std::size_t>(s)] = K;
      }
    } catch (const std::exception& e) {
      hs.error = e.what();
    }
  }
  for (const auto& hs : st)
    if (!hs.error.empty()) throw std::runtime_error(hs.error);
  for (const auto& hs : st) {
    if (hs.clamped) {
      warnings.push_back("layer " + std::to_string(layer) + ": decode cap of " + std::to_string(cap) +
                         " tokens is below the forced set (sinks + recent " + std::to_string(recent) +
                         (hs.clamped_protected ? " + protected" : "") + "); keeping the forced set");
      break;
    }
  }
  // Steps (summed over heads) and the per-head results at the end of decoding.
  res.steps.resize(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) {
    DecodeStep& d = res.steps[static_cast<std::size_t>(s)];
    d.eviction = !unlimited && s % p.interval == 0;
    for (const auto& hs : st) {
      d.bytes_before += hs.before[static_cast<std::size_t>(s)];
      d.bytes_after += hs.after[static_cast<std::size_t>(s)];
      d.evicted += hs.evicted[static_cast<std::size_t>(s)];
      d.max_slots = std::max(d.max_slots, hs.slots[static_cast<std::size_t>(s)]);
    }
  }
  const std::int64_t elem = static_cast<std::int64_t>(kernels::dtype_bytes(ctx.dtype));
  for (int h = 0; h < H; ++h) {
    const HeadState& hs = st[static_cast<std::size_t>(h)];
    HeadResult& hr = res.heads[static_cast<std::size_t>(h)];
    const int K = static_cast<int>(hs.tokens.size());
    hr.kv_head = h;
    hr.tokens = ctx.tokens;
    hr.bytes_full.kv = 2ll * T * D * elem;
    for (int m = 0; m < kModalities; ++m) hr.bytes_full_modality[static_cast<std::size_t>(m)] = ctx.tokens[static_cast<std::size_t>(m)] * 2ll * D * elem;
    PerModalityCount slots_m{};
    int context_slots = 0;
    for (auto t : hs.tokens) {
      if (t >= T) continue;
      ++slots_m[ctx.modality[static_cast<std::size_t>(t)]];
      ++context_slots;
    }
    const Bytes end = bytes_of(K);
    // The context's share of the final cache, by slot count (decode tokens hold the rest).
    const double share = K ? static_cast<double>(context_slots) / K : 0.0;
    auto part = [&](std::int64_t x) { return static_cast<std::int64_t>(std::llround(static_cast<double>(x) * share)); };
    hr.bytes_kept = Bytes{part(end.kv), part(end.scales), part(end.zeros), part(end.residual), part(end.multiplicity), 0};
    PerModalityCount merged_m{};
    if (merging)
      for (int t = 0; t < T; ++t) {
        const std::int32_t o = hs.owner[static_cast<std::size_t>(t)];
        if (o >= 0 && o != t) ++merged_m[ctx.modality[static_cast<std::size_t>(t)]];
      }
    for (int m = 0; m < kModalities; ++m) {
      const auto i = static_cast<std::size_t>(m);
      hr.kept[i] = slots_m[i];
      hr.merged[i] = merged_m[i];
      hr.evicted[i] = ctx.tokens[i] - slots_m[i] - merged_m[i];
      hr.bytes_kept_modality[i] = K ? static_cast<std::int64_t>(std::llround(static_cast<double>(end.total()) * slots_m[i] / K)) : 0;
    }
    hr.bytes_full_end = 2ll * static_cast<std::int64_t>(N) * D * elem;
    hr.bytes_end = end.total();
    hr.bytes_peak = *std::max_element(hs.before.begin(), hs.before.end());
    if (record_tokens) {
      TokenMap tm;
      tm.slot.assign(static_cast<std::size_t>(T), -1);
      for (int i = 0; i < K; ++i) {
        const auto t = hs.tokens[static_cast<std::size_t>(i)];
        if (t < T) tm.slot[static_cast<std::size_t>(t)] = i;
      }
      tm.slot_token = hs.tokens;
      tm.state.resize(static_cast<std::size_t>(T));
      for (int t = 0; t < T; ++t) tm.state[static_cast<std::size_t>(t)] = tm.slot[static_cast<std::size_t>(t)] >= 0 ? 1 : 0;
      if (merging)  // a merged token maps to the slot it joined (state 2)
        for (int t = 0; t < T; ++t) {
          const std::int32_t o = hs.owner[static_cast<std::size_t>(t)];
          if (o < 0 || o == t) continue;
          const auto at = std::find(hs.tokens.begin(), hs.tokens.end(), o);
          tm.slot[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(at - hs.tokens.begin());
          tm.state[static_cast<std::size_t>(t)] = 2;
        }
      tm.quant_bits = p.key_quant ? p.key_quant->bits : 0;
      res.token_maps.push_back(std::move(tm));
    }
  }
  return res;
}

}  // namespace kvscope::sim
