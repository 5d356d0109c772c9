// The model's weights in float32, checked against the config (the tiny-VLM spec's names and shapes; a LLaMA
// has the same decoder names and no vision tensors).
#pragma once

#include <string>
#include <vector>

#include "kvscope/runner/config.hpp"

namespace kvscope::runner {

class SafetensorsWeights;

struct LayerWeights {
  std::vector<float> input_norm;    // [d]
  std::vector<float> wq;            // [Hq*Dh, d]
  std::vector<float> wk, wv;        // [Hkv*Dh, d]
  std::vector<float> wo;            // [d, Hq*Dh]
  std::vector<float> post_norm;     // [d]
  std::vector<float> w_gate, w_up;  // [I, d]
  std::vector<float> w_down;        // [d, I]
};

struct ModelWeights {
  // Vision tower and projector: tiny VLM only (empty for a LLaMA).
  std::vector<float> patch_embed_w;  // [Dv, C*P*P]
  std::vector<float> patch_embed_b;  // [Dv]
  std::vector<float> pos_embed;      // [Np, Dv]
  std::vector<float> proj0_w;        // [d, Dv]
  std::vector<float> proj0_b;        // [d]
  std::vector<float> proj2_w;        // [d, d]
  std::vector<float> proj2_b;        // [d]
  std::vector<float> embed_tokens;   // [V, d]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [d]
  std::vector<float> lm_head;     // [V, d]; empty with tie_word_embeddings (output() is embed_tokens)

  // The output projection [V, d]: lm_head, or embed_tokens when the embeddings are tied (not copied).
  const std::vector<float>& output() const { return lm_head.empty() ? embed_tokens : lm_head; }
};

// Reads every weight the config needs from `file` (one file or shards) (lm_head.weight only without
// tie_word_embeddings). Throws RunnerError(kModel) naming the tensor and the expected and actual shapes for a
// missing or mismatched tensor.
ModelWeights load_weights(const SafetensorsWeights& file, const ModelConfig& config);

}  // namespace kvscope::runner
