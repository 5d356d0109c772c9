#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "exec_util.hpp"
#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/kernels/head_merge.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/scores.hpp"
#include "kvscope/sim/engine.hpp"
#include "kvscope/trace/aggregates.hpp"
#include "stages/stage.hpp"

namespace kvscope::sim {

namespace {
using detail::check;
}  // namespace

TraceContext TraceContext::from_reader(const trace::TraceReader& reader) {
  TraceContext c;
  c.geometry = reader.geometry();
  c.dtype = reader.header().dtype;
  c.source = reader.path();
  c.T = static_cast<int>(reader.num_tokens());
  c.S = static_cast<int>(reader.num_decode_steps());
  const auto& t = reader.tokens();
  c.modality = t.modality;
  c.position = t.position;
  c.grid_row = t.grid_row;
  c.grid_col = t.grid_col;
  c.segment = t.segment;
  for (auto m : t.modality) ++c.tokens[m];
  c.role = t.role;
  c.step_role = reader.decode_tokens().role;
  c.has_roles = reader.has_roles();
  c.modality_all = c.modality;
  c.modality_all.resize(static_cast<std::size_t>(c.T) + static_cast<std::size_t>(c.S), 0);
  c.count_query_sets();
  // Stored attention aggregates: used only when complete and made for this trace; anything wrong
  // with them is a warning, and the statistics are recomputed from the tensors.
  try {
    switch (reader.aggregate_state()) {
      case trace::AggregateState::kAbsent:
        c.aggregates_absent = "the trace has no /aggregates; kvcap aggregate stores them";
        break;
      case trace::AggregateState::kIncomplete:
        c.aggregates_absent = "/aggregates is incomplete (complete != 1: its writer stopped)";
        c.aggregate_warnings.push_back(reader.path() + ": " + c.aggregates_absent + "; ignored, recomputing");
        break;
      case trace::AggregateState::kPresent: {
        trace::AggregateDefinition d = reader.aggregate_definition();
        const std::string problem =
            trace::aggregate_definition_problem(d, c.geometry, c.dtype, reader.num_tokens());
        if (problem.empty()) {
          c.aggregate_window = d.window;
          c.aggregates = std::move(d);
        } else {
          c.aggregates_absent = "/aggregates: " + problem;
          c.aggregate_warnings.push_back(reader.path() + ": " + c.aggregates_absent +
                                         "; ignored, recomputing");
        }
        break;
      }
    }
  } catch (const trace::TraceError& e) {
    c.aggregates_absent = std::string("/aggregates unreadable: ") + e.what();
    c.aggregate_warnings.push_back(std::string(e.what()) + "; stored aggregates ignored, recomputing");
  }
  return c;
}

void TraceContext::note_statistic(const std::string& name, bool stored, const std::string& reason) {
  StatisticUse& u = statistic_use[name];
  if (stored) {
    ++u.stored;
  } else {
    ++u.recomputed;
    if (u.reason.empty()) u.reason = reason;
  }
}

std::string TraceContext::attention_statistics_summary() const {
  if (statistic_use.empty()) return "none needed";
  std::string stored, recomputed;
  bool absent = false;  // some statistic was recomputed because no stored one could be used
  for (const auto& [name, u] : statistic_use) {
    if (u.stored > 0) {
      stored += (stored.empty() ? "" : ", ") + name;
      if (u.recomputed > 0) stored += " (" + std::to_string(u.stored) + " layers)";
    }
    if (u.recomputed > 0) {
      recomputed += (recomputed.empty() ? "" : ", ") + name;
      if (u.stored > 0) recomputed += " (" + std::to_string(u.recomputed) + " layers)";
      if (!u.reason.empty() && u.reason == aggregates_absent) {
        absent = true;
      } else if (!u.reason.empty()) {
        recomputed += " [" + u.reason + "]";
      }
    }
  }
  std::string out;
  if (!stored.empty())
    out = "stored /aggregates (window " + std::to_string(aggregate_window) + ") for " + stored;
  if (!recomputed.empty()) out += (out.empty() ? "" : "; ") + std::string("recomputed: ") + recomputed;
  if (absent) out += " (" + aggregates_absent + ")";
  return out;
}

const kernels::NeighbourTable& TraceContext::neighbour_lists(int seq_radius, int grid_radius) {
  auto key = std::make_pair(seq_radius, grid_radius);
  auto it = neighbours.find(key);
  if (it != neighbours.end()) return it->second;
  kernels::TokenGrid grid{grid_row.data(), grid_col.data(), segment.data(), T};
  kernels::NeighbourTable table;
  check(kernels::cpu::build_neighbour_lists(grid, kernels::RedundancyParams{seq_radius, grid_radius}, &table),
        "neighbour lists");
  return neighbours.emplace(key, std::move(table)).first->second;
}

double kernels_value_limit(int tokens, int head_dim) {
  return std::sqrt(std::ldexp(1.0, 124) / (std::max(1.0, static_cast<double>(tokens)) * std::max(1, head_dim)));
}

namespace {
// max |x| over a trace tensor (finite values, as the reader guarantees): the magnitude bits of
// IEEE floats order like the magnitudes, so this is an integer max over the raw words.
double max_abs(const trace::Tensor& t) {
  const std::size_t n = t.numel();
  if (t.dtype == trace::DType::kF32) {
    std::uint32_t m = 0;
    const auto* w = reinterpret_cast<const std::uint32_t*>(t.data.data());
    for (std::size_t i = 0; i < n; ++i) m = std::max(m, w[i] & 0x7fffffffu);
    float f;
    std::memcpy(&f, &m, sizeof f);
    return f;
  }
  std::uint16_t m = 0;
  const auto* w = reinterpret_cast<const std::uint16_t*>(t.data.data());
  for (std::size_t i = 0; i < n; ++i) m = std::max<std::uint16_t>(m, w[i] & 0x7fffu);
  return t.dtype == trace::DType::kF16 ? kernels::half_to_float(m) : kernels::bf16_to_float(m);
}
}  // namespace

LayerData::LayerData(int layer, trace::LayerTensors prefill, trace::LayerTensors decode, TraceContext& ctx)
    : layer_(layer), prefill_(std::move(prefill)), decode_(std::move(decode)), ctx_(ctx) {
  // Range check (cheap: an integer max over the raw words, next to the float copy's conversion).
  const int tokens = ctx_.T + ctx_.S, D = ctx_.geometry.head_dim;
  const double limit = kernels_value_limit(tokens, D);
  double worst = 0;
  std::string where;
  for (int part = 0; part < 2; ++part) {
    const trace::LayerTensors& lt = part == 0 ? prefill_ : decode_;
    const std::string group = part == 0 ? trace::layer_group_name(layer) : trace::decode_layer_group_name(layer);
    for (const auto& [name, t] : {std::pair<const char*, const trace::Tensor*>{"q", &lt.q}, {"k", &lt.k}, {"v", &lt.v}}) {
      const double a = max_abs(*t);
      if (a > worst) {
        worst = a;
        where = group + "/" + name;
      }
    }
  }
  if (worst > limit) {
    // The numbers formatted apart: the file's path, of any length, goes into the string whole.
    char detail[384];
    std::snprintf(detail, sizeof detail,
                  "|x| up to %.3g is outside the range kvsim computes metrics in (max |x| <= %.3g for "
                  "%d tokens x head_dim %d: tokens x head_dim x max|x|^2 <= 2^124, so that attention logits, "
                  "norms and sums stay finite in float32); values this large are not a model's KV cache",
                  worst, limit, tokens, D);
    throw std::runtime_error((ctx_.source.empty() ? std::string("kv cache") : ctx_.source) + ": " + where + ": " +
                             detail);
  }
}

namespace {
// Elements [offset, offset + n) of a trace tensor as float32 (fp16 / bf16 widen exactly).
void convert(const trace::Tensor& t, std::size_t offset, std::size_t n, float* out) {
  if (t.dtype == trace::DType::kF32) {
    std::memcpy(out, t.data.data() + offset * sizeof(float), n * sizeof(float));
    return;
  }
  const auto* p = reinterpret_cast<const std::uint16_t*>(t.data.data()) + offset;
  if (t.dtype == trace::DType::kF16) {
    for (std::size_t i = 0; i < n; ++i) out[i] = kernels::half_to_float(p[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = kernels::bf16_to_float(p[i]);
  }
}
}  // namespace

void LayerData::require_prefill(const char* what) const {
  if (prefill_released_) {
    throw std::logic_error(std::string("layer ") + std::to_string(layer_) + ": " + what +
                           " requested after release_prefill() (prepare() the policy first)");
  }
}

void LayerData::release_prefill() {
  if (prefill_released_) return;
  // The answer's specific top-k (answer_topk) reads the context's own attention, a prefill statistic.
  if (ctx_.query_set_steps(kAnswerQueries) > 0) h2o();
  // The float32 copy cannot be built after this, so it is built here, one tensor at a time and
  // each trace tensor dropped as soon as nothing reads it any more: the queries first (only the
  // statistics read them), then K once converted, then V. The float16 layer and the float32
  // copy are thus never held whole at the same time (docs/perf.md, issue 4).
  prefill_.q = trace::Tensor{};
  if (kall_.empty()) fill_all(prefill_.k, decode_.k, kall_);
  prefill_.k = trace::Tensor{};
  if (vall_.empty()) fill_all(prefill_.v, decode_.v, vall_);
  prefill_.v = trace::Tensor{};
  prefill_released_ = true;
}

const LayerData::MergedHeads& LayerData::merged_heads(float threshold) {
  auto it = merged_.find(threshold);
  if (it != merged_.end()) return it->second;
  require_prefill("head merge");
  const auto& g = ctx_.geometry;
  const int H = g.num_kv_heads, T = ctx_.T, D = g.head_dim;
  const std::size_t TD = static_cast<std::size_t>(T) * D;
  kernels::HeadMergeParams hp;
  hp.num_kv_heads = H;
  hp.num_q_heads = g.num_q_heads;
  hp.num_tokens = T;
  hp.head_dim = D;
  hp.threshold = threshold;
  hp.dtype = ctx_.dtype;
  // The steps of kernels::cpu::merge_heads, but only clusters of several heads are materialised:
  // a one-member cluster is a copy of its head, which k_all() already holds.
  MergedHeads m;
  std::vector<float> sim(static_cast<std::size_t>(H) * H);
  m.cluster.resize(static_cast<std::size_t>(H));
  check(kernels::cpu::head_similarity(hp, prefill_.k.data.data(), prefill_.v.data.data(), sim.data()),
        "head similarity");
  check(kernels::cpu::cluster_heads(H, sim.data(), threshold, m.cluster.data(), &m.num_heads), "cluster heads");
  std::vector<std::vector<int>> members(static_cast<std::size_t>(m.num_heads));
  for (int h = 0; h < H; ++h) members[static_cast<std::size_t>(m.cluster[static_cast<std::size_t>(h)])].push_back(h);
  m.row.assign(static_cast<std::size_t>(m.num_heads), -1);
  m.source_head.assign(static_cast<std::size_t>(m.num_heads), -1);
  std::vector<int> merged_members;  // kv heads of the multi-member clusters, ascending within each
  std::vector<std::int32_t> sub_cluster;
  int rows = 0;
  for (int c = 0; c < m.num_heads; ++c) {
    const auto& mc = members[static_cast<std::size_t>(c)];
    if (mc.size() == 1) {
      m.source_head[static_cast<std::size_t>(c)] = mc[0];
      continue;
    }
    m.row[static_cast<std::size_t>(c)] = rows;
    for (int h : mc) {
      merged_members.push_back(h);
      sub_cluster.push_back(rows);
    }
    ++rows;
  }
  if (rows > 0) {
    const std::size_t eb = kernels::dtype_bytes(prefill_.k.dtype), head_bytes = TD * eb;
    std::vector<std::byte> sk(merged_members.size() * head_bytes), sv(sk.size());
    for (std::size_t i = 0; i < merged_members.size(); ++i) {
      const std::size_t from = static_cast<std::size_t>(merged_members[i]) * head_bytes;
      std::copy_n(prefill_.k.data.begin() + static_cast<std::ptrdiff_t>(from), head_bytes, sk.begin() + static_cast<std::ptrdiff_t>(i * head_bytes));
      std::copy_n(prefill_.v.data.begin() + static_cast<std::ptrdiff_t>(from), head_bytes, sv.begin() + static_cast<std::ptrdiff_t>(i * head_bytes));
    }
    kernels::HeadMergeParams sub = hp;
    sub.num_kv_heads = static_cast<int>(merged_members.size());
    sub.num_q_heads = sub.num_kv_heads;
    m.k.resize(static_cast<std::size_t>(rows) * TD);
    m.v.resize(m.k.size());
    check(kernels::cpu::apply_head_merge(sub, sk.data(), sv.data(), sub_cluster.data(), rows, nullptr, m.k.data(),
                                         m.v.data()),
          "head merge");
  }
  return merged_.emplace(threshold, std::move(m)).first->second;
}

const std::vector<float>& LayerData::stage_statistic(const std::string& key, bool reads_prefill,
                                                    const std::function<std::vector<float>(LayerData&)>& compute) {
  auto it = stage_stats_.find(key);
  if (it != stage_stats_.end()) return it->second;
  if (reads_prefill) require_prefill(key.c_str());
  return stage_stats_.emplace(key, compute(*this)).first->second;
}

kernels::AttentionProblem LayerData::problem() const {
  require_prefill("an attention statistic");
  kernels::AttentionProblem a;
  a.q = prefill_.q.data.data();
  a.k = prefill_.k.data.data();
  a.q_pos = ctx_.position.data();
  a.k_pos = ctx_.position.data();
  a.num_q_heads = ctx_.geometry.num_q_heads;
  a.num_kv_heads = ctx_.geometry.num_kv_heads;
  a.q_len = ctx_.T;
  a.k_len = ctx_.T;
  a.head_dim = ctx_.geometry.head_dim;
  a.dtype = ctx_.dtype;
  a.causal = true;
  return a;
}

std::vector<float> LayerData::reduce(const std::vector<float>& per_q) const {
  std::vector<float> out(static_cast<std::size_t>(ctx_.geometry.num_kv_heads) * static_cast<std::size_t>(ctx_.T));
  check(kernels::cpu::reduce_to_kv_heads(per_q.data(), ctx_.geometry.num_q_heads, ctx_.geometry.num_kv_heads, ctx_.T,
                                         out.data()),
        "reduce_to_kv_heads");
  return out;
}

std::string LayerData::stored_unusable() const {
  if (stored_) return "";
  if (ctx_.aggregates && ctx_.aggregates->num_tokens != ctx_.T) {
    return "stored for T = " + std::to_string(ctx_.aggregates->num_tokens) +
           ", the context has T = " + std::to_string(ctx_.T);
  }
  return ctx_.aggregates_absent.empty() ? "no stored aggregates for this layer" : ctx_.aggregates_absent;
}

const std::vector<float>& LayerData::h2o() {
  if (h2o_.empty()) {
    if (stored_) {
      h2o_ = reduce(stored_->h2o);
      ctx_.note_statistic("h2o", true);
    } else {
      std::vector<float> q(static_cast<std::size_t>(ctx_.geometry.num_q_heads) *
                           static_cast<std::size_t>(ctx_.T));
      check(ctx_.backend->accumulated_attention(problem(), kernels::QueryRange{0, -1}, q.data()),
            "H2O attention");
      h2o_ = reduce(q);
      ctx_.note_statistic("h2o", false, stored_unusable());
    }
  }
  return h2o_;
}

const std::vector<float>& LayerData::snapkv(const kernels::SnapKVParams& p, bool split_at_window) {
  kernels::SnapKVParams eff = p;
  eff.window = std::min(eff.window, ctx_.T);
  const auto key = std::make_tuple(eff.window, eff.kernel_size, static_cast<int>(eff.pool), split_at_window);
  auto it = snap_.find(key);
  if (it != snap_.end()) return it->second;
  const std::string name = "snapkv window " + std::to_string(eff.window);
  const int Hq = ctx_.geometry.num_q_heads, T = ctx_.T;
  std::vector<float> q(static_cast<std::size_t>(Hq) * static_cast<std::size_t>(T));
  // split_at_window: the unpooled window sums (kernel 1), pooled below on each side of the edge.
  kernels::SnapKVParams first = eff;
  if (split_at_window) first.kernel_size = 1;
  if (stored_ && stored_definition_.window == eff.window) {
    // The stored window sums, pooled as snapkv_scores pools its own.
    check(kernels::cpu::snapkv_pool(stored_->window_sum.data(), Hq, T, first, q.data()), "SnapKV pooling");
    ctx_.note_statistic(name, true);
  } else {
    check(ctx_.backend->snapkv_scores(problem(), first, q.data()), "SnapKV scores");
    ctx_.note_statistic(
        name, false,
        stored_ ? "stored window is " + std::to_string(stored_definition_.window) : stored_unusable());
  }
  if (split_at_window) {
    std::vector<float> pooled(q.size());
    check(kernels::cpu::snapkv_pool_split(q.data(), Hq, T, T - eff.window, eff, pooled.data()), "SnapKV pooling");
    q.swap(pooled);
  }
  return snap_.emplace(key, reduce(q)).first->second;
}

const std::vector<float>& LayerData::tova() {
  if (tova_.empty()) {
    if (stored_) {
      tova_ = reduce(stored_->last_query);
      ctx_.note_statistic("tova", true);
    } else {
      std::vector<float> q(static_cast<std::size_t>(ctx_.geometry.num_q_heads) *
                           static_cast<std::size_t>(ctx_.T));
      check(ctx_.backend->tova_scores(problem(), q.data()), "TOVA scores");
      tova_ = reduce(q);
      ctx_.note_statistic("tova", false, stored_unusable());
    }
  }
  return tova_;
}

const std::vector<float>& LayerData::key_norm() {
  if (knorm_.empty()) {
    require_prefill("key norms");
    knorm_.resize(static_cast<std::size_t>(ctx_.geometry.num_kv_heads) * static_cast<std::size_t>(ctx_.T));
    kernels::KeyTensor k{prefill_.k.data.data(), ctx_.geometry.num_kv_heads, ctx_.T, ctx_.geometry.head_dim, ctx_.dtype};
    check(kernels::cpu::key_norms(k, knorm_.data()), "key norms");
  }
  return knorm_;
}

const std::vector<float>& LayerData::redundancy(int seq_radius, int grid_radius) {
  const auto key = std::make_pair(seq_radius, grid_radius);
  auto it = redundancy_.find(key);
  if (it != redundancy_.end()) return it->second;
  const std::string name = "redundancy " + std::to_string(seq_radius) + "/" + std::to_string(grid_radius);
  if (stored_ && stored_definition_.seq_radius == seq_radius &&
      stored_definition_.grid_radius == grid_radius) {
    ctx_.note_statistic(name, true);
    return redundancy_.emplace(key, stored_->redundancy).first->second;
  }
  ctx_.note_statistic(name, false,
                      stored_ ? "stored radii are " + std::to_string(stored_definition_.seq_radius) + "/" +
                                    std::to_string(stored_definition_.grid_radius)
                              : stored_unusable());
  require_prefill("redundancy");
  std::vector<float> out(static_cast<std::size_t>(ctx_.geometry.num_kv_heads) * static_cast<std::size_t>(ctx_.T));
  kernels::KeyTensor k{prefill_.k.data.data(), ctx_.geometry.num_kv_heads, ctx_.T, ctx_.geometry.head_dim, ctx_.dtype};
  check(kernels::cpu::redundancy(k, ctx_.neighbour_lists(seq_radius, grid_radius).view(), out.data()), "redundancy");
  return redundancy_.emplace(key, std::move(out)).first->second;
}

const std::vector<float>& LayerData::cross_received() {
  if (received_.empty()) {
    if (stored_) {
      received_ = reduce(stored_->cross_received);
      given_ = reduce(stored_->cross_given);
      ctx_.note_statistic("cross-modal", true);
    } else {
      const std::size_t n =
          static_cast<std::size_t>(ctx_.geometry.num_q_heads) * static_cast<std::size_t>(ctx_.T);
      std::vector<float> rec(n), giv(n);
      check(ctx_.backend->cross_modal_interaction(problem(), ctx_.modality.data(), nullptr, rec.data(),
                                                  giv.data()),
            "cross-modal interaction");
      received_ = reduce(rec);
      given_ = reduce(giv);
      ctx_.note_statistic("cross-modal", false, stored_unusable());
    }
    // reduce() sums over the query heads of a group: turn the given share back into a mean.
    const float g = static_cast<float>(ctx_.geometry.group_size());
    for (auto& x : given_) x /= g;
  }
  return received_;
}

const std::vector<float>& LayerData::cross_given() {
  cross_received();
  return given_;
}

const kernels::FullAttention& LayerData::full_attention(bool proportional_attention) {
  if (have_full_) return full_;
  require_prefill("full attention");
  const auto& g = ctx_.geometry;
  const std::size_t rows = static_cast<std::size_t>(g.num_q_heads) * static_cast<std::size_t>(ctx_.S);
  full_probs_.resize(rows * static_cast<std::size_t>(ctx_.T));
  full_output_.resize(rows * static_cast<std::size_t>(g.head_dim));
  full_entropy_.resize(rows);
  full_mass_.resize(rows * 4);
  full_ = kernels::FullAttention{full_probs_.data(), full_output_.data(), full_entropy_.data(), full_mass_.data()};
  kernels::EvaluateParams ep;
  ep.num_q_heads = g.num_q_heads;
  ep.num_kv_heads = g.num_kv_heads;
  ep.num_queries = ctx_.S;
  ep.num_tokens = ctx_.T;
  ep.head_dim = g.head_dim;
  ep.dtype = ctx_.dtype;
  ep.proportional_attention = proportional_attention;  // does not affect the full side
  check(ctx_.backend->full_attention(ep, decode_.q.data.data(), prefill_.k.data.data(), prefill_.v.data.data(),
                                     ctx_.modality.data(), full_),
        "full attention");
  have_full_ = true;
  return full_;
}

void LayerData::fill_all(const trace::Tensor& prefill, const trace::Tensor& decode, std::vector<float>& out) const {
  // Converted straight from the trace's dtype into the [Hkv, T + S, D] layout, head by head
  // straight into place: no whole-layer float32 temporary.
  const int H = ctx_.geometry.num_kv_heads, T = ctx_.T, S = ctx_.S, D = ctx_.geometry.head_dim;
  const std::size_t N = static_cast<std::size_t>(T) + static_cast<std::size_t>(S);
  const std::size_t TD = static_cast<std::size_t>(T) * D, SD = static_cast<std::size_t>(S) * D;
  out.resize(static_cast<std::size_t>(H) * N * static_cast<std::size_t>(D));
  for (int h = 0; h < H; ++h) {
    float* o = &out[static_cast<std::size_t>(h) * N * D];
    convert(prefill, static_cast<std::size_t>(h) * TD, TD, o);
    convert(decode, static_cast<std::size_t>(h) * SD, SD, o + TD);
  }
}

const std::vector<float>& LayerData::k_all() {
  if (kall_.empty()) {
    require_prefill("the float32 K/V copy");
    // One float32 copy of the layer's K and V, shared by the prefill-mode, decode-mode and
    // full-attention code. (release_prefill() builds it without holding both dtypes whole.)
    fill_all(prefill_.k, decode_.k, kall_);
    fill_all(prefill_.v, decode_.v, vall_);
  }
  return kall_;
}

const std::vector<float>& LayerData::v_all() {
  k_all();
  return vall_;
}

const std::vector<float>& LayerData::q_steps() {
  if (qsteps_.empty()) {
    const int Hq = ctx_.geometry.num_q_heads, S = ctx_.S, D = ctx_.geometry.head_dim;
    const std::vector<float> q = decode_.q.to_float();  // [Hq, S, D]
    qsteps_.resize(q.size());
    for (int j = 0; j < Hq; ++j)
      for (int s = 0; s < S; ++s)
        std::copy_n(q.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(j) * S + s) * D), D,
                    qsteps_.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(s) * Hq + j) * D));
  }
  return qsteps_;
}

void LayerData::compute_full_steps() {
  const auto& g = ctx_.geometry;
  const int H = g.num_kv_heads, Hq = g.num_q_heads, G = g.group_size(), D = g.head_dim, T = ctx_.T, S = ctx_.S;
  const std::size_t N = static_cast<std::size_t>(T) + static_cast<std::size_t>(S);
  const auto& k = k_all();
  const auto& v = v_all();
  const auto& q = q_steps();
  step_probs_offset_.assign(static_cast<std::size_t>(S), 0);
  std::size_t total = 0;
  for (int s = 0; s < S; ++s) {
    step_probs_offset_[static_cast<std::size_t>(s)] = total;
    total += static_cast<std::size_t>(Hq) * static_cast<std::size_t>(T + s + 1);
  }
  step_probs_.resize(total);
  step_plogp_.resize(total);
  step_output_.resize(static_cast<std::size_t>(S) * Hq * D);
  step_entropy_.resize(static_cast<std::size_t>(S) * Hq);
  step_mass_.resize(static_cast<std::size_t>(S) * Hq * 4);
  step_mass_f64_.assign(static_cast<std::size_t>(S) * Hq * 4, 0.0);
  std::vector<std::string> errors(static_cast<std::size_t>(H) * S);
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int h = 0; h < H; ++h) {
    for (int s = 0; s < S; ++s) {
      kernels::EvaluateParams ep;
      ep.num_q_heads = G;
      ep.num_kv_heads = 1;
      ep.num_queries = 1;
      ep.num_tokens = T + s + 1;
      ep.head_dim = D;
      ep.dtype = kernels::DType::kF32;
      const std::size_t kv = static_cast<std::size_t>(h) * N * D;
      const kernels::Status st = ctx_.backend->full_attention(
          ep, &q[(static_cast<std::size_t>(s) * Hq + static_cast<std::size_t>(h) * G) * D], &k[kv], &v[kv],
          ctx_.modality_all.data(), full_step(h, s));
      if (!st.ok()) {
        errors[static_cast<std::size_t>(h) * S + s] = st.message();
        continue;
      }
      const std::size_t len = static_cast<std::size_t>(T + s + 1);
      const float* probs = full_step(h, s).probs;
      for (int j = 0; j < G; ++j) {
        double* mass = &step_mass_f64_[((static_cast<std::size_t>(s) * Hq) + static_cast<std::size_t>(h) * G + j) * 4];
        const float* pr = probs + static_cast<std::size_t>(j) * len;
        for (std::size_t t = 0; t < len; ++t) mass[ctx_.modality_all[t]] += pr[t];
        float* pl = &step_plogp_[step_probs_offset_[static_cast<std::size_t>(s)] +
                                 (static_cast<std::size_t>(h) * G + static_cast<std::size_t>(j)) * len];
        for (std::size_t t = 0; t < len; ++t) {
          const double x = pr[t];
          pl[t] = x > 0.0 ? static_cast<float>(x * std::log(x)) : 0.0f;
        }
      }
    }
  }
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error("full attention (decode steps): " + e);
  have_steps_ = true;
}

kernels::FullAttention LayerData::full_step(int h, int s) {
  const int Hq = ctx_.geometry.num_q_heads, G = ctx_.geometry.group_size(), D = ctx_.geometry.head_dim;
  const std::size_t row = static_cast<std::size_t>(s) * Hq + static_cast<std::size_t>(h) * G;
  const std::size_t len = static_cast<std::size_t>(ctx_.T + s + 1);
  return kernels::FullAttention{&step_probs_[step_probs_offset_[static_cast<std::size_t>(s)] + static_cast<std::size_t>(h) * G * len],
                                &step_output_[row * D], &step_entropy_[row], &step_mass_[row * 4]};
}

const float* LayerData::full_step_plogp(int h, int s) const {
  const std::size_t len = static_cast<std::size_t>(ctx_.T + s + 1);
  return &step_plogp_[step_probs_offset_[static_cast<std::size_t>(s)] +
                      static_cast<std::size_t>(h) * ctx_.geometry.group_size() * len];
}

const double* LayerData::full_step_mass(int h, int s) const {
  const std::size_t row = static_cast<std::size_t>(s) * ctx_.geometry.num_q_heads +
                          static_cast<std::size_t>(h) * ctx_.geometry.group_size();
  return &step_mass_f64_[row * 4];
}

const std::vector<float>& LayerData::key_norm_all() {
  if (knorm_all_.empty()) {
    const int H = ctx_.geometry.num_kv_heads, D = ctx_.geometry.head_dim;
    const int N = ctx_.T + ctx_.S;
    knorm_all_.resize(static_cast<std::size_t>(H) * N);
    kernels::KeyTensor k{k_all().data(), H, N, D, kernels::DType::kF32};
    check(kernels::cpu::key_norms(k, knorm_all_.data()), "key norms");
    for (auto& x : knorm_all_) x = -x;
  }
  return knorm_all_;
}

namespace {
// The policy's stages, in pipeline order (the head merge only where it runs).
std::vector<const stages::Stage*> stages_of(const PolicySpec& p) {
  return {&stages::head_merge_of(p), &stages::scorer_of(p), &stages::allocator_of(p), &stages::executor_of(p),
          &stages::quantizer_of(p)};
}
}  // namespace
const std::vector<float>& LayerData::decode_attention_mass() {
  if (!decode_mass_.empty()) return decode_mass_;
  prepare_steps();
  const int H = ctx_.geometry.num_kv_heads, G = ctx_.geometry.group_size(), T = ctx_.T, S = ctx_.S;
  std::vector<double> mass(static_cast<std::size_t>(H) * static_cast<std::size_t>(T), 0.0);  // [Hkv, T]
  for (int h = 0; h < H; ++h) {
    double* out = &mass[static_cast<std::size_t>(h) * static_cast<std::size_t>(T)];
    for (int s = 0; s < S; ++s) {
      const std::size_t len = static_cast<std::size_t>(T + s + 1);
      const float* probs = full_step(h, s).probs;  // [G, T + s + 1]
      for (int j = 0; j < G; ++j) {
        const float* pr = probs + static_cast<std::size_t>(j) * len;
        for (int t = 0; t < T; ++t) out[t] += pr[t];
      }
    }
  }
  decode_mass_.assign(mass.begin(), mass.end());
  return decode_mass_;
}

const LayerData::AnswerTopK& LayerData::answer_topk() {
  if (have_answer_topk_) return answer_topk_;
  prepare_steps();
  const int H = ctx_.geometry.num_kv_heads, G = ctx_.geometry.group_size(), T = ctx_.T, S = ctx_.S;
  const int steps = ctx_.query_set_steps(kAnswerQueries);
  const int k = std::min(kTopK, T);
  answer_topk_.tokens.assign(static_cast<std::size_t>(H), {});
  answer_topk_.mass.assign(static_cast<std::size_t>(H), 0.0);
  answer_topk_.specific.assign(static_cast<std::size_t>(H), {});
  // The context's own attention on each token (only when there is an answer to compare it with).
  const std::vector<float>* context = steps > 0 ? &h2o() : nullptr;  // [Hkv, T]
  std::vector<double> sigma(static_cast<std::size_t>(T));
  std::vector<double> a(static_cast<std::size_t>(T));
  std::vector<std::int32_t> order(static_cast<std::size_t>(T));
  for (int h = 0; h < H; ++h) {
    std::fill(a.begin(), a.end(), 0.0);
    for (int s = 0; s < S; ++s) {
      if (!ctx_.in_query_set(kAnswerQueries, s)) continue;
      const std::size_t len = static_cast<std::size_t>(T + s + 1);
      const float* probs = full_step(h, s).probs;  // [G, T + s + 1]
      for (int j = 0; j < G; ++j) {
        const float* pr = probs + static_cast<std::size_t>(j) * len;
        for (int t = 0; t < T; ++t) a[static_cast<std::size_t>(t)] += pr[t];
      }
    }
    // The k tokens of largest v (ties -> lower index), ascending.
    auto top_k = [&](const std::vector<double>& v) {
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](std::int32_t x, std::int32_t y) {
        const double vx = v[static_cast<std::size_t>(x)], vy = v[static_cast<std::size_t>(y)];
        return vx != vy ? vx > vy : x < y;
      });
      std::vector<std::int32_t> out(order.begin(), order.begin() + k);
      std::sort(out.begin(), out.end());
      return out;
    };
    std::vector<std::int32_t> top = top_k(a);
    if (context) {
      const float* c = context->data() + static_cast<std::size_t>(h) * static_cast<std::size_t>(T);
      for (int t = 0; t < T; ++t) {
        sigma[static_cast<std::size_t>(t)] =
            a[static_cast<std::size_t>(t)] / (static_cast<double>(G) * steps) -
            static_cast<double>(c[t]) / (static_cast<double>(G) * (T - t));
      }
      answer_topk_.specific[static_cast<std::size_t>(h)] = top_k(sigma);
    }
    double mass = 0;
    for (std::int32_t t : top) mass += a[static_cast<std::size_t>(t)];
    answer_topk_.mass[static_cast<std::size_t>(h)] =
        steps > 0 ? mass / (static_cast<double>(G) * steps) : 0.0;
    answer_topk_.tokens[static_cast<std::size_t>(h)] = std::move(top);
  }
  have_answer_topk_ = true;
  return answer_topk_;
}

void LayerData::prepare_prefill_statistics(const PolicySpec& p) {
  // Every statistic a stage reads is declared by the stage (Stage::prepare_prefill).
  for (const stages::Stage* s : stages_of(p)) s->prepare_prefill(*this, p, ctx_);
}

void LayerData::prepare_float_statistics(const PolicySpec& p) {
  k_all();
  if (!have_steps_) compute_full_steps();
  for (const stages::Stage* s : stages_of(p)) s->prepare_float(*this, p, ctx_);
}

void LayerData::prepare_and_release(const std::vector<const PolicySpec*>& policies) {
  for (const PolicySpec* p : policies) prepare_prefill_statistics(*p);
  release_prefill();
  for (const PolicySpec* p : policies) prepare_float_statistics(*p);
  prepare_token_codes(policies);
}

namespace {
bool same_codes(const kernels::QuantSpec& a, const kernels::QuantSpec& b) {  // residual tokens aside
  return a.bits == b.bits && a.symmetric == b.symmetric && a.granularity == b.granularity &&
         a.group_size == b.group_size;
}
}  // namespace

bool uses_token_codes(const PolicySpec& p) {
  if (p.mode != PolicyMode::kPrefill || !p.key_quant || !p.value_quant) return false;
  if (p.key_quant->granularity != kernels::Granularity::kPerToken ||
      p.value_quant->granularity != kernels::Granularity::kPerToken) {
    return false;  // e.g. KIVI: keys per channel; a point needs both sides' codes
  }
  return !p.compress_tokens || (!stages::executor_of(p).merges() && p.stages.head_merge == "none");
}

LayerData::TokenCodesEntry* LayerData::find_token_codes(const kernels::QuantSpec& spec, bool values) {
  for (TokenCodesEntry& e : token_codes_->entries)
    if (e.values == values && same_codes(e.spec, spec)) return &e;
  return nullptr;
}

void LayerData::prepare_token_codes(const std::vector<const PolicySpec*>& policies) {
  if (ctx_.backend->kind() != BackendKind::kCpu) return;
  // Points that quantize their slots per token without merging (the slots are then kept tokens).
  std::vector<TokenCodesEntry> wanted;
  for (const PolicySpec* p : policies) {
    if (!uses_token_codes(*p)) continue;
    for (int kv = 0; kv < 2; ++kv) {
      const kernels::QuantSpec& q = kv == 0 ? *p->key_quant : *p->value_quant;
      TokenCodesEntry* e = nullptr;
      for (TokenCodesEntry& w : wanted)
        if (w.values == (kv == 1) && same_codes(w.spec, q)) e = &w;
      if (!e) {
        wanted.push_back({q, kv == 1, 0, nullptr});
        wanted.back().spec.residual_tokens = 0;
        e = &wanted.back();
      }
      ++e->users;
    }
  }
  const int H = ctx_.geometry.num_kv_heads, D = ctx_.geometry.head_dim, T = ctx_.T;
  const std::size_t stride = (static_cast<std::size_t>(T) + static_cast<std::size_t>(ctx_.S)) * D;
  std::vector<float> deq;
  for (TokenCodesEntry& w : wanted) {
    if (w.users < 2 || find_token_codes(w.spec, w.values) || T <= 0) continue;
    const kernels::QuantShape qs{1, T, D, kernels::DType::kF32};
    kernels::QuantLayout lay;
    detail::check(kernels::quant_layout(w.spec, qs, &lay), "quantize (per-token codes)");
    auto c = std::make_shared<TokenCodes>();
    c->spec = w.spec;
    c->row_bytes = lay.row_bytes;
    c->groups = lay.groups_per_row;
    c->codes.resize(static_cast<std::size_t>(H) * static_cast<std::size_t>(lay.code_bytes));
    c->scales.resize(static_cast<std::size_t>(H) * static_cast<std::size_t>(lay.num_groups));
    if (!w.spec.symmetric) c->zeros.resize(c->scales.size());
    c->exact.assign(static_cast<std::size_t>(H) * static_cast<std::size_t>(T), 0);
    deq.resize(static_cast<std::size_t>(T) * D);
    const std::vector<float>& x = w.values ? v_all() : k_all();
    for (int h = 0; h < H; ++h) {
      const float* xh = x.data() + static_cast<std::size_t>(h) * stride;
      const std::size_t g0 = static_cast<std::size_t>(h) * static_cast<std::size_t>(lay.num_groups);
      kernels::QuantBuffers out;
      out.codes = c->codes.data() + static_cast<std::size_t>(h) * static_cast<std::size_t>(lay.code_bytes);
      out.scales = c->scales.data() + g0;
      out.zeros = w.spec.symmetric ? nullptr : c->zeros.data() + g0;
      detail::check(kernels::cpu::quantize(w.spec, qs, xh, out), "quantize (per-token codes)");
      detail::check(kernels::cpu::dequantize(w.spec, qs, kernels::as_const(out), deq.data()),
                    "dequantize (per-token codes)");
      for (int t = 0; t < T; ++t) {
        const std::size_t o = static_cast<std::size_t>(t) * D;
        c->exact[static_cast<std::size_t>(h) * T + static_cast<std::size_t>(t)] =
            std::equal(deq.begin() + static_cast<std::ptrdiff_t>(o), deq.begin() + static_cast<std::ptrdiff_t>(o + D),
                       xh + o)
                ? 1
                : 0;
      }
    }
    w.codes = std::move(c);
    token_codes_->entries.push_back(std::move(w));
  }
}

std::shared_ptr<const LayerData::TokenCodes> LayerData::token_codes(const kernels::QuantSpec& spec, bool values) {
  if (spec.granularity != kernels::Granularity::kPerToken) return nullptr;
  const std::lock_guard<std::mutex> lock(token_codes_->mutex);
  const TokenCodesEntry* e = find_token_codes(spec, values);
  return e ? e->codes : nullptr;
}

void LayerData::token_codes_done(const kernels::QuantSpec& spec, bool values) {
  std::shared_ptr<const TokenCodes> drop;  // freed outside the lock
  const std::lock_guard<std::mutex> lock(token_codes_->mutex);
  TokenCodesEntry* e = find_token_codes(spec, values);
  if (e && e->codes && --e->users <= 0) drop = std::move(e->codes);
}

void LayerData::prepare(const PolicySpec& p) {
  prepare_prefill_statistics(p);
  prepare_float_statistics(p);
}

const PerModality& LayerData::modality_similarity() {
  if (have_similarity_) return modality_similarity_;
  // Mean cosine over pairs of tokens of the same modality: every token with up to 8 others
  // spread evenly over that modality (deterministic), averaged over kv heads.
  const auto& k = k_all();  // head stride (T + S) * D
  const int D = ctx_.geometry.head_dim, H = ctx_.geometry.num_kv_heads, T = ctx_.T;
  const std::size_t N = static_cast<std::size_t>(T) + static_cast<std::size_t>(ctx_.S);
  std::vector<std::vector<int>> members(kModalities);
  for (int t = 0; t < T; ++t) members[ctx_.modality[static_cast<std::size_t>(t)]].push_back(t);
  for (int m = 0; m < kModalities; ++m) {
    const auto& idx = members[static_cast<std::size_t>(m)];
    const int n = static_cast<int>(idx.size());
    if (n < 2) {
      modality_similarity_[static_cast<std::size_t>(m)] = 0.0;
      continue;
    }
    // Pair cosines computed in parallel into [H, n, 8] (NaN where a pair does not exist or a key is
    // zero), then summed serially in (head, token, step) order: the same sum as a serial loop.
    const int stride = std::max(1, n / 9);
    constexpr int kPairs = 8;
    std::vector<double> term(static_cast<std::size_t>(H) * n * kPairs, std::nan(""));
    std::vector<char> counted(term.size(), 0);
#pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < H; ++h) {
      for (int a = 0; a < n; ++a) {
        for (int step = 1; step <= kPairs && step * stride < n; ++step) {
          const int b = (a + step * stride) % n;
          const float* x = &k[(static_cast<std::size_t>(h) * N + idx[static_cast<std::size_t>(a)]) * D];
          const float* y = &k[(static_cast<std::size_t>(h) * N + idx[static_cast<std::size_t>(b)]) * D];
          double xy = 0, xx = 0, yy = 0;
          for (int d = 0; d < D; ++d) {
            xy += static_cast<double>(x[d]) * y[d];
            xx += static_cast<double>(x[d]) * x[d];
            yy += static_cast<double>(y[d]) * y[d];
          }
          const std::size_t i = (static_cast<std::size_t>(h) * n + a) * kPairs + static_cast<std::size_t>(step - 1);
          counted[i] = 1;
          if (xx > 0 && yy > 0) term[i] = xy / std::sqrt(xx * yy);
        }
      }
    }
    double sum = 0;
    long cnt = 0;
    for (std::size_t i = 0; i < term.size(); ++i) {
      if (!counted[i]) continue;
      if (!std::isnan(term[i])) sum += term[i];
      ++cnt;
    }
    modality_similarity_[static_cast<std::size_t>(m)] = cnt ? sum / static_cast<double>(cnt) : 0.0;
  }
  have_similarity_ = true;
  return modality_similarity_;
}

}  // namespace kvscope::sim
