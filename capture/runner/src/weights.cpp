// Weight loading with the spec's names and shapes.
#include "kvscope/runner/weights.hpp"

#include "kvscope/runner/safetensors.hpp"

namespace kvscope::runner {

ModelWeights load_weights(const SafetensorsWeights& f, const ModelConfig& c) {
  using S = std::vector<std::int64_t>;
  const std::int64_t d = c.hidden_size, inter = c.intermediate_size, dh = c.head_dim;
  const std::int64_t hq = c.num_q_heads, hkv = c.num_kv_heads, v = c.vocab_size;
  const std::int64_t dv = c.vision.hidden_size, np = c.vision.num_patches(), pd = c.vision.patch_dim();
  ModelWeights w;
  if (c.has_vision()) {
    w.patch_embed_w = f.to_f32("vision.patch_embed.weight", S{dv, pd});
    w.patch_embed_b = f.to_f32("vision.patch_embed.bias", S{dv});
    w.pos_embed = f.to_f32("vision.pos_embed", S{np, dv});
    w.proj0_w = f.to_f32("mm_projector.0.weight", S{d, dv});
    w.proj0_b = f.to_f32("mm_projector.0.bias", S{d});
    w.proj2_w = f.to_f32("mm_projector.2.weight", S{d, d});
    w.proj2_b = f.to_f32("mm_projector.2.bias", S{d});
  }
  w.embed_tokens = f.to_f32("model.embed_tokens.weight", S{v, d});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights l;
    l.input_norm = f.to_f32(p + "input_layernorm.weight", S{d});
    l.wq = f.to_f32(p + "self_attn.q_proj.weight", S{hq * dh, d});
    l.wk = f.to_f32(p + "self_attn.k_proj.weight", S{hkv * dh, d});
    l.wv = f.to_f32(p + "self_attn.v_proj.weight", S{hkv * dh, d});
    l.wo = f.to_f32(p + "self_attn.o_proj.weight", S{d, hq * dh});
    l.post_norm = f.to_f32(p + "post_attention_layernorm.weight", S{d});
    l.w_gate = f.to_f32(p + "mlp.gate_proj.weight", S{inter, d});
    l.w_up = f.to_f32(p + "mlp.up_proj.weight", S{inter, d});
    l.w_down = f.to_f32(p + "mlp.down_proj.weight", S{d, inter});
    w.layers.push_back(std::move(l));
  }
  w.final_norm = f.to_f32("model.norm.weight", S{d});
  // Tied: HF ignores a stored lm_head.weight and uses embed_tokens; so does output().
  if (!c.tie_word_embeddings) w.lm_head = f.to_f32("lm_head.weight", S{v, d});
  return w;
}

}  // namespace kvscope::runner
