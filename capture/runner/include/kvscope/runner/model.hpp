// A model directory (the tiny VLM or a text-only HF LLaMA): loading it, building prompts (images + question
// for the tiny VLM, text or chat for a LLaMA), embedding them (vision front end on the host) and greedy
// generation through a decoder backend with an optional cache hook and capture observer.
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
  std::vector<std::string> text;  // [T] token text (vision patches: "")
  std::vector<Image> images;
  int size() const { return static_cast<int>(tokens.size()); }
};

struct GenerateOptions {
  int max_new = 16;
  CacheHook* hook = nullptr;
  RunObserver* observer = nullptr;
  bool keep_logits = false;  // record the logits used for each generated token
  // When set, receives the prefill's logits of every prompt position [T, V] (costs T x V floats).
  std::vector<float>* prefill_logits = nullptr;
  // Tokens fed after the prefill and before generation (e.g. a question arriving after the context was
  // cached), in forwards of `after_prefill_chunk` tokens each (0: all in one forward; chunked prefill).
  // They are decode steps 0 .. n-1 for the observer (on_decode_token per token, on_decode_layer per forward
  // with the forward's n tokens): a forward of several tokens is causal, token j attending to the cache
  // and to tokens 0..j of its forward, so each step's q/k/v are those of feeding the tokens one at a time.
  // Generation then starts from the last one's logits. Text tokens of this model's vocabulary; not with a
  // cache hook (throws RunnerError kInput).
  std::vector<std::int32_t> after_prefill;
  int after_prefill_chunk = 0;
};

struct Generation {
  std::vector<std::int32_t> tokens;  // generated ids, ending with an EOS id when one was generated
  std::string text;                  // the tokenizer's decoding of the answer, without the EOS
  int decode_steps = 0;              // decode steps: the after_prefill tokens, then the generated tokens fed
                                     // back (all generated tokens except <eos>)
  int after_prefill_steps = 0;       // of which the after_prefill tokens
  double prefill_ms = 0, decode_ms = 0;
  std::vector<std::vector<float>> logits;  // [generated][V] when keep_logits
};

class Model {
 public:
  // Loads config.json, model.safetensors and the tokenizer (vocab.json for the tiny VLM, tokenizer.json for
  // a LLaMA) from `dir` and creates the backend.
  // Throws RunnerError (kModel for the directory's files, kCuda for an unusable device).
  static Model load(const std::string& dir, Device device = Device::kCpu);
  Model(ModelConfig config, ModelWeights weights, std::shared_ptr<const Tokenizer> tokenizer, Device device);
  Device device() const { return device_; }

  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const ModelWeights& weights() const { return *weights_; }
  DecoderBackend& backend() { return *backend_; }

  // Tiny VLM: <bos>, per image <img> + patches + </img>, the question's words, <sep>. Throws
  // RunnerError(kInput) for an empty question, an unknown word, a wrong image size, more tokens than the
  // model supports, or a model without vision.
  Prompt build_prompt(const std::vector<Image>& images, const std::string& question) const;
  // LLaMA: the tokenizer's ids of `text` (no automatic BOS), labelled special (the tokenizer's control
  // tokens) or text, with their token text. Throws RunnerError(kInput) for an empty text, a prompt longer
  // than max_position_embeddings, or the tiny VLM.
  Prompt build_text_prompt(const std::string& text) const;
  // LLaMA chat: `user_text` as the user message rendered through the model's chat template (its default
  // system prompt, the assistant turn opened), then as build_text_prompt. Throws kModel when the model
  // has no chat template, kInput as build_text_prompt.
  Prompt build_chat_prompt(const std::string& user_text) const;
  // The same for given ids (e.g. a reference tokenizer's); throws kInput for an id outside the vocabulary.
  Prompt build_prompt_from_ids(const std::vector<std::int32_t>& ids) const;
  // Input embeddings [T, d]: embed_tokens rows for tokens, the projected patches for vision tokens.
  std::vector<float> embed(const Prompt& prompt) const;
  // Vision tokens of one image [Np, d].
  std::vector<float> embed_image(const Image& image) const;
  // Logits [T, V] of a full forward pass over the prompt (fresh cache, no hook).
  std::vector<float> forward_logits(const Prompt& prompt);
  // Greedy generation: prefill, then feed each generated token back until an EOS id, max_new tokens or
  // the last position max_position_embeddings - 1.
  Generation generate(const Prompt& prompt, const GenerateOptions& options);

 private:
  ModelConfig config_;
  std::shared_ptr<const ModelWeights> weights_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  Device device_;
  std::unique_ptr<DecoderBackend> backend_;
  std::string dir_;  // the directory load() read (chat template); empty for a constructed model

  // Throws kInput when `n` tokens do not fit the context.
  void check_context(int n) const;
};

}  // namespace kvscope::runner
