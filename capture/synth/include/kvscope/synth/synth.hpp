// Synthetic traces: deterministic for a seed, with the real geometry of known
// models and the structure that compression policies react to (attention
// sinks, recency, spatially smooth vision keys, alignment text queries that
// attend to specific patches, heads specialised on vision or text, shallow
// layers more redundant than deep ones). docs/synthetic-traces.md explains
// how each property is generated.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::synth {

struct SynthPreset {
  std::string name;
  trace::ModelGeometry geometry;
  int images = 1;        // default number of images
  int image_tokens = 0;  // tokens per image (a near-square patch grid)
  int text = 0;          // default text tokens
  int decode = 0;        // default decode steps
  std::string description;
};

const std::vector<SynthPreset>& synth_presets();
const SynthPreset* find_preset(const std::string& name);  // nullptr if unknown

struct SynthOptions {
  std::string preset = "tiny";
  int images = -1;        // -1 = preset default
  int image_tokens = -1;  // -1 = preset default
  int text = -1;          // -1 = preset default
  int audio = 0;          // audio tokens (one clip), 0 = none
  int decode = -1;        // -1 = preset default
  int layers = -1;        // -1 = preset default; fewer layers keep the preset's heads and head_dim
  std::uint64_t seed = 0;
  trace::DType dtype = trace::DType::kF16;
  int deflate = 0;        // gzip level for tensors (0 = none)
};

// Role of a KV head (and the query heads of its GQA group).
enum class HeadRole { kVision, kText, kMixed };
const char* head_role_name(HeadRole r);

class SynthGenerator {
 public:
  // Throws std::invalid_argument naming the bad option.
  explicit SynthGenerator(SynthOptions options);

  const trace::TraceHeader& header() const { return header_; }
  const trace::Tokens& tokens() const { return tokens_; }
  const trace::DecodeTokens& decode_tokens() const { return decode_tokens_; }
  std::size_t num_tokens() const { return tokens_.size(); }
  std::size_t num_decode_steps() const { return decode_tokens_.token_id.size(); }

  struct Layer {
    std::vector<float> q;  // [Hq, N, D]
    std::vector<float> k;  // [Hkv, N, D]
    std::vector<float> v;  // [Hkv, N, D]
  };
  // Prefill tensors of a layer (N = T) and decode tensors (N = S), float32.
  Layer prefill_layer(int layer) const;
  Layer decode_layer(int layer) const;

  // Ground truth of the generated structure, for tests and docs.
  int num_sinks() const { return num_sinks_; }
  HeadRole head_role(int layer, int kv_head) const;
  const std::vector<int>& alignment_tokens() const { return align_tokens_; }   // prefill text tokens
  const std::vector<int>& alignment_targets() const { return align_targets_; } // patch each one attends to
  const std::vector<int>& decode_targets() const { return decode_targets_; }   // patch per decode step or -1

 private:
  struct HeadBasis;
  HeadBasis basis(int layer, int kv_head) const;
  void key_content(int layer, int kv_head, const HeadBasis& b, std::vector<float>& content) const;

  SynthOptions options_;
  trace::TraceHeader header_;
  trace::Tokens tokens_;
  trace::DecodeTokens decode_tokens_;
  int num_sinks_ = 4;
  std::vector<int> align_tokens_, align_targets_, decode_targets_;
  std::vector<int> image_first_token_;  // first token index of each image
  int grid_rows_ = 0, grid_cols_ = 0;
};

// Generates and writes a complete trace; progress(layers_done, num_layers) after each layer.
void write_synthetic_trace(const SynthOptions& options, const std::string& path,
                           const std::function<void(int, int)>& progress = {});

}  // namespace kvscope::synth
