// The model's HF-style config.json (see the tiny-VLM spec): geometry, RoPE scaling, special token ids and
// the vision tower. Everything the runner needs comes from here.
#pragma once

#include <string>

namespace kvscope::runner {

enum class RopeScaling { kNone, kLinear, kNtk };

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
  int bos_token_id = 1, eos_token_id = 2, image_start_token_id = 3, image_end_token_id = 4, sep_token_id = 5;
  VisionConfig vision;
  std::string model_name;  // the model directory's base name

  // RoPE base after NTK scaling (rope_theta for none/linear).
  double rope_base() const;
  // Position divisor: the linear scaling factor, else 1.
  double rope_position_scale() const;
};

// Parses `dir`/config.json. Throws RunnerError(kModel) naming the file and the field for missing or
// invalid fields, and an unsupported `architectures` / `model_type` by name.
ModelConfig load_config(const std::string& dir);
// Same from a JSON string (`origin` names the source in messages).
ModelConfig parse_config(const std::string& json_text, const std::string& origin);

}  // namespace kvscope::runner
