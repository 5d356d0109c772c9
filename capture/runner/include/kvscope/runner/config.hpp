// The model's HF-style config.json: the tiny VLM of the spec (geometry, RoPE scaling, special token ids and
// the vision tower) or a text-only HF LLaMA (LlamaForCausalLM / model_type "llama": SiLU MLP, no biases,
// default or linear RoPE, optionally tied embeddings). Everything the runner needs comes from here.
#pragma once

#include <string>
#include <vector>

namespace kvscope::runner {

enum class RopeScaling { kNone, kLinear, kNtk };

// Which family the directory holds: the prompt layout and the weights to read depend on it.
enum class ModelKind {
  kTinyVlm,  // KvscopeTinyVlm: vision tower + projector, word-level vocab.json
  kLlama,    // LlamaForCausalLM, text only, tokenizer.json (byte-level BPE)
};

struct VisionConfig {
  int image_size = 64;
  int patch_size = 8;
  int num_channels = 3;
  int hidden_size = 128;                                // Dv
  int grid() const { return image_size / patch_size; }  // patches per side
  int num_patches() const { return grid() * grid(); }   // Np
  int patch_dim() const { return num_channels * patch_size * patch_size; }
};

struct ModelConfig {
  ModelKind kind = ModelKind::kTinyVlm;
  int hidden_size = 0;        // d
  int intermediate_size = 0;  // I
  int num_layers = 0;
  int num_q_heads = 0;   // Hq
  int num_kv_heads = 0;  // Hkv
  int head_dim = 0;      // Dh
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 1.0;
  int max_position_embeddings = 0;
  int vocab_size = 0;
  // The tiny VLM has all five; a LLaMA has no image/sep tokens (-1) and may have no bos (-1).
  int bos_token_id = 1, eos_token_id = 2, image_start_token_id = 3, image_end_token_id = 4, sep_token_id = 5;
  std::vector<int>
      eos_token_ids;  // every id that ends generation (eos_token_id first; empty: eos_token_id alone)
  bool tie_word_embeddings = false;  // lm_head is embed_tokens (LLaMA only)
  VisionConfig vision;               // tiny VLM only
  std::string model_name;            // the model directory's base name

  bool has_vision() const { return kind == ModelKind::kTinyVlm; }
  bool is_eos(int id) const;
  // RoPE base after NTK scaling (rope_theta for none/linear).
  double rope_base() const;
  // Position divisor: the linear scaling factor, else 1.
  double rope_position_scale() const;
};

// Parses `dir`/config.json. Throws RunnerError(kModel) naming the file and the field for missing or
// invalid fields, an unsupported `architectures` / `model_type` by name, and LLaMA features the runner
// does not implement (rope types other than default/linear, attention/MLP biases, activations other than
// SiLU, a vision_config) by name.
ModelConfig load_config(const std::string& dir);
// Same from a JSON string (`origin` names the source in messages).
ModelConfig parse_config(const std::string& json_text, const std::string& origin);

}  // namespace kvscope::runner
