#include "evaluation.hpp"

#include <stdexcept>
#include <vector>

namespace kvscope::sim {

void add_step_quality(LayerData& L, TraceContext& ctx, int h, int s, const StepCache& c, bool proportional,
                      Quality& q) {
  const auto& g = ctx.geometry;
  const int G = g.group_size(), Hq = g.num_q_heads, D = g.head_dim;
  kernels::EvaluateParams ep;
  ep.num_q_heads = G;
  ep.num_kv_heads = 1;
  ep.num_queries = 1;
  ep.num_tokens = ctx.T + s + 1;
  ep.head_dim = D;
  ep.dtype = kernels::DType::kF32;
  ep.proportional_attention = proportional;
  const std::int32_t offsets[2] = {0, c.slots};
  kernels::CompressedCache cache;
  cache.k = c.k;
  cache.v = c.v;
  cache.slot_offsets = offsets;
  cache.multiplicity_i32 = c.multiplicity;
  cache.slot_modality = c.slot_modality;
  cache.token_to_slot = c.token_to_slot;
  const std::size_t n = static_cast<std::size_t>(G);
  std::vector<float> err(n), rec(n), kl(n), dent(n), recm(n * 4), mfull(n * 4), mcomp(n * 4);
  kernels::EvaluateOutputs eo{err.data(), rec.data(), kl.data(), dent.data(), recm.data(), mfull.data(), mcomp.data()};
  const float* query = &L.q_steps()[(static_cast<std::size_t>(s) * Hq + static_cast<std::size_t>(h) * G) * D];
  const kernels::Status st =
      ctx.backend->evaluate_attention(ep, query, ctx.modality_all.data(), L.full_step(h, s), cache, eo);
  if (!st.ok()) throw std::runtime_error("evaluate (step " + std::to_string(s) + "): " + st.message());
  const double w = 1.0 / (static_cast<double>(G) * ctx.S);
  for (std::size_t r = 0; r < n; ++r) {
    q.output_error += err[r] * w;
    q.attention_recall += rec[r] * w;
    q.kl += kl[r] * w;
    q.entropy_delta += dent[r] * w;
    for (std::size_t m = 0; m < static_cast<std::size_t>(kModalities); ++m) {
      q.recall_modality[m] += recm[r * 4 + m] * w;
      q.share_before[m] += mfull[r * 4 + m] * w;
      q.share_after[m] += mcomp[r * 4 + m] * w;
    }
  }
}

}  // namespace kvscope::sim
