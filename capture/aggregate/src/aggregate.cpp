#include "kvscope/aggregate/aggregate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/trace/aggregates.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::aggregate {

namespace {
void check(const kernels::Status& s, const char* what) {
  if (!s.ok()) throw std::runtime_error(std::string(what) + ": " + s.message());
}
}  // namespace

AggregateComputer::AggregateComputer(const trace::ModelGeometry& geometry, trace::DType dtype,
                                     const trace::Tokens& tokens, int window, const std::string& creator)
    : geometry_(geometry), dtype_(dtype), modality_(tokens.modality), position_(tokens.position) {
  const int T = static_cast<int>(tokens.size());
  if (T < 1) throw std::invalid_argument("no context tokens");
  if (window < 1) throw std::invalid_argument("window " + std::to_string(window) + " must be at least 1");
  if (position_.size() != modality_.size() || tokens.grid_row.size() != modality_.size() ||
      tokens.grid_col.size() != modality_.size() || tokens.segment.size() != modality_.size()) {
    throw std::invalid_argument("token columns differ in length");
  }
  def_.num_layers = geometry.num_layers;
  def_.num_tokens = T;
  def_.num_q_heads = geometry.num_q_heads;
  def_.num_kv_heads = geometry.num_kv_heads;
  def_.gqa_group = geometry.group_size();
  def_.softmax_scale = 1.0f / std::sqrt(static_cast<float>(geometry.head_dim));
  def_.causal = true;
  def_.window = std::min(window, T);
  def_.input_dtype = kernels::dtype_name(dtype);
  def_.creator = creator;
  kernels::TokenGrid grid{tokens.grid_row.data(), tokens.grid_col.data(), tokens.segment.data(), T};
  check(kernels::cpu::build_neighbour_lists(
            grid, kernels::RedundancyParams{def_.seq_radius, def_.grid_radius}, &neighbours_),
        "neighbour lists");
}

trace::LayerAttentionAggregates AggregateComputer::compute(const void* q, const void* k) const {
  const int T = def_.num_tokens, Hq = def_.num_q_heads, Hkv = def_.num_kv_heads;
  kernels::AttentionProblem a;
  a.q = q;
  a.k = k;
  a.q_pos = position_.data();
  a.k_pos = position_.data();
  a.num_q_heads = Hq;
  a.num_kv_heads = Hkv;
  a.q_len = T;
  a.k_len = T;
  a.head_dim = geometry_.head_dim;
  a.dtype = dtype_;
  a.causal = true;
  trace::LayerAttentionAggregates out;
  const std::size_t n = static_cast<std::size_t>(Hq) * static_cast<std::size_t>(T);
  out.h2o.resize(n);
  out.cross_received.resize(n);
  out.cross_given.resize(n);
  out.window_sum.resize(n);
  out.last_query.resize(n);
  out.redundancy.resize(static_cast<std::size_t>(Hkv) * static_cast<std::size_t>(T));
  check(kernels::cpu::prefill_attention_sums(a, modality_.data(), out.h2o.data(), out.cross_received.data(),
                                             out.cross_given.data()),
        "H2O and cross-modal attention");
  check(kernels::cpu::snapkv_window_sums(a, def_.window, out.window_sum.data()), "window sums");
  check(kernels::cpu::tova_scores(a, out.last_query.data()), "last query");
  const kernels::KeyTensor keys{k, Hkv, T, geometry_.head_dim, dtype_};
  check(kernels::cpu::redundancy(keys, neighbours_.view(), out.redundancy.data()), "redundancy");
  return out;
}

double AggregateComputer::logit_flop_per_layer() const {
  // attention_block computes the logits of a block of 64 query rows up to the last key its last row
  // sees (positions 0..T-1 here): rows i0..i1-1 over min(T, i1) keys.
  const double T = def_.num_tokens;
  double pairs = 0;
  for (double i0 = 0; i0 < T; i0 += 64) {
    const double i1 = std::min(T, i0 + 64);
    pairs += (i1 - i0) * i1;
  }
  return 2.0 * geometry_.head_dim * def_.num_q_heads * pairs;
}

AggregateRun aggregate_trace(const std::string& path, int window, const std::string& creator,
                             const std::function<void(int, int)>& progress) {
  AggregateRun run;
  std::optional<trace::AggregateWriter> writer;
  {
    const trace::TraceReader reader(path);  // closed before commit() opens the trace for writing
    const AggregateComputer computer(reader.geometry(), reader.header().dtype, reader.tokens(), window,
                                     creator);
    run.layers = reader.geometry().num_layers;
    run.tokens = reader.num_tokens();
    run.window = computer.definition().window;
    run.logit_flop = computer.logit_flop_per_layer() * run.layers;
    writer.emplace(path, computer.definition());
    for (int l = 0; l < run.layers; ++l) {
      trace::LayerTensors t = reader.read_layer(l);
      t.v = trace::Tensor{};  // the statistics read q and k only
      const auto t0 = std::chrono::steady_clock::now();
      const trace::LayerAttentionAggregates a = computer.compute(t.q.data.data(), t.k.data.data());
      run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      writer->write_layer(l, a);
      if (progress) progress(l + 1, run.layers);
    }
  }
  writer->commit();
  return run;
}

}  // namespace kvscope::aggregate
