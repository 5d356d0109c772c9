// Run-time scorers (kvscope/sim/custom_stages.hpp): a callback scores every context token of a layer
// once, from the layer's prefill tensors in float32; the result is a per-layer statistic shared by every
// point, like the built-in scorers' statistics.
#include "../custom.hpp"

#include <stdexcept>

namespace kvscope::sim::stages {
namespace {

class Callback final : public Scorer {
 public:
  Callback(StageInfo info, CustomScoreFn fn) : Scorer(std::move(info)), fn_(std::move(fn)) {}
  void prepare_prefill(LayerData& d, const PolicySpec&, const TraceContext& ctx) const override {
    statistic(d, ctx);
  }
  void score(const LayerView& v, std::vector<float>& out) const override { out = statistic(v.data, v.ctx); }

 private:
  const std::vector<float>& statistic(LayerData& d, const TraceContext& ctx) const {
    return d.stage_statistic("custom scorer " + info().name, true, [&](LayerData& l) {
      CustomLayer in = custom_layer(l, ctx);
      const std::vector<float> q = l.prefill().q.to_float(), k = l.prefill().k.to_float(),
                               v = l.prefill().v.to_float();
      in.q = q.data();
      in.k = k.data();
      in.v = v.data();
      std::vector<float> s = fn_(in);
      const std::size_t n = static_cast<std::size_t>(in.num_kv_heads) * static_cast<std::size_t>(in.T);
      if (s.size() != n) {
        throw std::runtime_error("custom scorer '" + info().name + "' returned " + std::to_string(s.size()) +
                                 " scores for layer " + std::to_string(in.layer) + ", expected [" +
                                 std::to_string(in.num_kv_heads) + ", " + std::to_string(in.T) + "]");
      }
      return s;
    });
  }
  CustomScoreFn fn_;
};

}  // namespace

CustomLayer custom_layer(const LayerData& d, const TraceContext& ctx) {
  CustomLayer in;
  in.layer = d.layer();
  in.num_layers = ctx.geometry.num_layers;
  in.num_q_heads = ctx.geometry.num_q_heads;
  in.num_kv_heads = ctx.geometry.num_kv_heads;
  in.head_dim = ctx.geometry.head_dim;
  in.T = ctx.T;
  in.modality = ctx.modality.data();
  in.position = ctx.position.data();
  in.role = ctx.has_roles && ctx.role.size() == static_cast<std::size_t>(ctx.T) ? ctx.role.data() : nullptr;
  for (std::size_t m = 0; m < in.tokens.size(); ++m) in.tokens[m] = ctx.tokens[m];
  return in;
}

void put_custom_stage(std::unique_ptr<Stage> stage) {
  const std::string& name = stage->info().name;
  const bool ok = !name.empty() && name.find_first_not_of(
                                       "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                       "0123456789_.-") == std::string::npos;
  if (!ok) {
    throw PolicyError("bad stage name '" + name +
                      "': use letters, digits and _ . - (it appears in policy names "
                      "and INI files)");
  }
  put_runtime_stage(std::move(stage));
}

}  // namespace kvscope::sim::stages

namespace kvscope::sim {

void register_custom_scorer(const std::string& name, const std::string& meaning, CustomScoreFn score,
                            bool preset) {
  StageInfo info{StageKind::kScorer,  name,  meaning.empty() ? "custom scorer" : meaning,
                 "custom (run time)", false, {}};
  info.preset = preset;
  stages::put_custom_stage(std::make_unique<stages::Callback>(std::move(info), std::move(score)));
}

bool is_custom_stage(StageKind kind, const std::string& name) { return stages::is_runtime_stage(kind, name); }

}  // namespace kvscope::sim
