// The tiny VLM: loading a model directory, building prompts, embedding them (vision front end on the host)
// and greedy generation through a decoder backend with an optional cache hook and capture observer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvscope/runner/backend.hpp"
#include "kvscope/runner/config.hpp"
#include "kvscope/runner/image.hpp"
#include "kvscope/runner/kv_cache.hpp"
#include "kvscope/runner/observer.hpp"
#include "kvscope/runner/tokenizer.hpp"
#include "kvscope/runner/weights.hpp"

namespace kvscope::runner {

// The context of a run: tokens with their labels (spec "Prompt layout") and the images they embed.
struct Prompt {
  std::vector<TokenInfo> tokens;  // [T]
  std::vector<std::string> text;  // [T] token text ("<img:r,c>" style labels for patches: "")
  std::vector<Image> images;
  int size() const { return static_cast<int>(tokens.size()); }
};

struct GenerateOptions {
  int max_new = 16;
  CacheHook* hook = nullptr;
  RunObserver* observer = nullptr;
  bool keep_logits = false;  // record the logits used for each generated token
};

struct Generation {
  std::vector<std::int32_t> tokens;  // generated ids, ending with <eos> when it was generated
  std::string text;                  // the tokenizer's decoding of the answer, without <eos>
  int decode_steps = 0;              // tokens fed back (generated tokens except <eos>)
  double prefill_ms = 0, decode_ms = 0;
  std::vector<std::vector<float>> logits;  // [generated][V] when keep_logits
};

class Model {
 public:
  // Loads config.json, model.safetensors and vocab.json from `dir` and creates the backend.
  // Throws RunnerError (kModel for the directory's files, kCuda for an unusable device).
  static Model load(const std::string& dir, Device device = Device::kCpu);
  Model(ModelConfig config, ModelWeights weights, std::shared_ptr<const Tokenizer> tokenizer, Device device);
  Device device() const { return device_; }

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const ModelWeights& weights() const { return *weights_; }
  DecoderBackend& backend() { return *backend_; }

  // <bos>, per image <img> + patches + </img>, the question's words, <sep>. Throws RunnerError(kInput)
  // for an empty question, an unknown word, a wrong image size or more tokens than the model supports.
  Prompt build_prompt(const std::vector<Image>& images, const std::string& question) const;
  // Input embeddings [T, d]: embed_tokens rows for tokens, the projected patches for vision tokens.
  std::vector<float> embed(const Prompt& prompt) const;
  // Vision tokens of one image [Np, d].
  std::vector<float> embed_image(const Image& image) const;
  // Logits [T, V] of a full forward pass over the prompt (fresh cache, no hook).
  std::vector<float> forward_logits(const Prompt& prompt);
  // Greedy generation: prefill, then feed each generated token back until <eos> or max_new tokens.
  Generation generate(const Prompt& prompt, const GenerateOptions& options);

 private:
  ModelConfig config_;
  std::shared_ptr<const ModelWeights> weights_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  Device device_;
  std::unique_ptr<DecoderBackend> backend_;
};

}  // namespace kvscope::runner
