// Model loading, prompt layout, the vision front end and greedy generation.
#include "kvscope/runner/model.hpp"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/safetensors.hpp"

namespace kvscope::runner {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// y [n, out] = x [n, in] W^T + b, on one BLAS thread like every product of the runner
// (kernels::pin_blas_to_one_thread: with more threads some BLAS kernels round differently).
void affine(const float* x, const std::vector<float>& w, const std::vector<float>& b, int n, int out, int in,
            float* y) {
  kernels::pin_blas_to_one_thread();
  for (int i = 0; i < n; ++i) std::copy(b.begin(), b.end(), y + static_cast<std::size_t>(i) * out);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w.data(), in, 1.0f, y, out);
}

int argmax(const std::vector<float>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

}  // namespace

Model::Model(ModelConfig config, ModelWeights weights, std::shared_ptr<const Tokenizer> tokenizer,
             Device device)
    : config_(std::move(config)),
      weights_(std::make_shared<const ModelWeights>(std::move(weights))),
      tokenizer_(std::move(tokenizer)),
      device_(device) {
  backend_ =
      device == Device::kCuda ? make_cuda_backend(config_, *weights_) : make_cpu_backend(config_, weights_);
}

Model Model::load(const std::string& dir, Device device) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw RunnerError(ErrorKind::kModel, dir + ": not a model directory");
  ModelConfig config = load_config(dir);
  std::shared_ptr<const Tokenizer> tokenizer;
  std::string tokenizer_file;
  if (config.has_vision()) {
    tokenizer_file = (fs::path(dir) / "vocab.json").string();
    tokenizer = std::make_shared<const Vocabulary>(Vocabulary::load(tokenizer_file));
  } else {
    tokenizer_file = (fs::path(dir) / "tokenizer.json").string();
    tokenizer = load_tokenizer(dir);
  }
  // HF pads the embedding matrix beyond the tokenizer's ids at times; never the other way round.
  if (tokenizer->size() > config.vocab_size ||
      (config.has_vision() && tokenizer->size() != config.vocab_size)) {
    throw RunnerError(ErrorKind::kModel, tokenizer_file + ": " + std::to_string(tokenizer->size()) +
                                             " tokens, config.json has vocab_size " +
                                             std::to_string(config.vocab_size));
  }
  const SafetensorsWeights file(dir);  // model.safetensors, or the shards of model.safetensors.index.json
  ModelWeights weights = load_weights(file, config);
  Model model(std::move(config), std::move(weights), std::move(tokenizer), device);
  model.dir_ = dir;
  return model;
}

void Model::check_context(int n) const {
  if (n > config_.max_position_embeddings) {
    throw RunnerError(ErrorKind::kInput, "the prompt has " + std::to_string(n) +
                                             " tokens, more than max_position_embeddings = " +
                                             std::to_string(config_.max_position_embeddings));
  }
}

Prompt Model::build_text_prompt(const std::string& text) const {
  if (config_.has_vision()) {
    throw RunnerError(ErrorKind::kInput, "text prompts are for text models; " + config_.model_name +
                                             " is the tiny VLM (give images and a question)");
  }
  const std::vector<std::int32_t> ids = tokenizer_->encode(text);
  if (ids.empty()) throw RunnerError(ErrorKind::kInput, "the prompt is empty (no tokens)");
  return build_prompt_from_ids(ids);
}

Prompt Model::build_chat_prompt(const std::string& user_text) const {
  if (config_.has_vision()) {
    throw RunnerError(ErrorKind::kInput,
                      "chat prompts are for text models; " + config_.model_name + " is the tiny VLM");
  }
  if (dir_.empty()) throw RunnerError(ErrorKind::kModel, "no model directory to read the chat template from");
  const ChatTemplate chat = ChatTemplate::load(dir_);
  return build_text_prompt(chat.render({ChatMessage{"user", user_text}}, true));
}

Prompt Model::build_prompt_from_ids(const std::vector<std::int32_t>& ids) const {
  if (ids.empty()) throw RunnerError(ErrorKind::kInput, "the prompt is empty (no tokens)");
  check_context(static_cast<int>(ids.size()));
  Prompt p;
  p.tokens.reserve(ids.size());
  p.text.reserve(ids.size());
  for (std::int32_t id : ids) {
    if (id < 0 || id >= config_.vocab_size || id >= tokenizer_->size()) {
      throw RunnerError(ErrorKind::kInput, "token id " + std::to_string(id) + " is outside the vocabulary (" +
                                               std::to_string(config_.vocab_size) + " tokens)");
    }
    TokenInfo t;
    t.token_id = id;
    t.modality = tokenizer_->is_special(id) ? 3 : 0;
    t.segment = 0;
    t.grid_row = t.grid_col = -1;
    t.position = t.index = static_cast<std::int32_t>(p.tokens.size());
    p.tokens.push_back(t);
    p.text.push_back(tokenizer_->text(id));
  }
  return p;
}

Prompt Model::build_prompt(const std::vector<Image>& images, const std::string& question) const {
  if (!config_.has_vision()) {
    throw RunnerError(ErrorKind::kInput, "images and questions are for the tiny VLM; " + config_.model_name +
                                             " is a text model (give a text prompt)");
  }
  const std::vector<std::int32_t> words = tokenizer_->encode(question);  // throws for empty / unknown
  const VisionConfig& vc = config_.vision;
  Prompt p;
  p.images = images;
  const int n_images = static_cast<int>(images.size());
  auto push = [&](std::int32_t id, std::uint8_t modality, std::int32_t segment, int row, int col) {
    TokenInfo t;
    t.token_id = id;
    t.modality = modality;
    t.segment = segment;
    t.grid_row = row;
    t.grid_col = col;
    t.position = t.index = static_cast<std::int32_t>(p.tokens.size());
    p.tokens.push_back(t);
    p.text.push_back(id >= 0 ? tokenizer_->text(id) : std::string());
  };
  push(config_.bos_token_id, 3, 0, -1, -1);
  for (int i = 0; i < n_images; ++i) {
    const Image& img = images[static_cast<std::size_t>(i)];
    if (img.width != vc.image_size || img.height != vc.image_size ||
        img.rgb.size() != static_cast<std::size_t>(img.width) * img.height * 3) {
      throw RunnerError(ErrorKind::kInput, "image " + std::to_string(i + 1) + " is " +
                                               std::to_string(img.width) + "x" + std::to_string(img.height) +
                                               ", the model expects " + std::to_string(vc.image_size) + "x" +
                                               std::to_string(vc.image_size));
    }
    push(config_.image_start_token_id, 3, i, -1, -1);
    for (int n = 0; n < vc.num_patches(); ++n) push(-1, 1, i, n / vc.grid(), n % vc.grid());
    push(config_.image_end_token_id, 3, i, -1, -1);
  }
  for (std::int32_t id : words) push(id, 0, n_images, -1, -1);
  push(config_.sep_token_id, 3, n_images, -1, -1);
  check_context(p.size());
  return p;
}

std::vector<float> Model::embed_image(const Image& image) const {
  const VisionConfig& vc = config_.vision;
  const int ps = vc.patch_size, g = vc.grid(), np = vc.num_patches(), pd = vc.patch_dim(),
            dv = vc.hidden_size;
  const int d = config_.hidden_size;
  std::vector<float> patches(static_cast<std::size_t>(np) * pd);
  for (int n = 0; n < np; ++n) {
    const int pr = n / g, pc = n % g;
    for (int py = 0; py < ps; ++py) {
      for (int px = 0; px < ps; ++px) {
        const std::size_t src = (static_cast<std::size_t>(pr * ps + py) * image.width + pc * ps + px) * 3;
        for (int c = 0; c < 3; ++c) {
          patches[static_cast<std::size_t>(n) * pd + (py * ps + px) * 3 + c] =
              static_cast<float>(image.rgb[src + static_cast<std::size_t>(c)]) / 127.5f - 1.0f;
        }
      }
    }
  }
  const ModelWeights& w = *weights_;
  std::vector<float> vis(static_cast<std::size_t>(np) * dv), hid(static_cast<std::size_t>(np) * d);
  std::vector<float> out(static_cast<std::size_t>(np) * d);
  affine(patches.data(), w.patch_embed_w, w.patch_embed_b, np, dv, pd, vis.data());
  for (std::size_t i = 0; i < vis.size(); ++i) vis[i] += w.pos_embed[i];
  affine(vis.data(), w.proj0_w, w.proj0_b, np, d, dv, hid.data());
  for (float& x : hid) x = 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f));
  affine(hid.data(), w.proj2_w, w.proj2_b, np, d, d, out.data());
  return out;
}

std::vector<float> Model::embed(const Prompt& prompt) const {
  const int d = config_.hidden_size, np = config_.vision.num_patches();
  std::vector<float> x(static_cast<std::size_t>(prompt.size()) * d);
  std::vector<float> vision;
  int current_image = -1;
  for (int t = 0; t < prompt.size(); ++t) {
    const TokenInfo& tok = prompt.tokens[static_cast<std::size_t>(t)];
    float* dst = x.data() + static_cast<std::size_t>(t) * d;
    if (tok.modality == 1) {
      if (tok.segment != current_image) {
        vision = embed_image(prompt.images.at(static_cast<std::size_t>(tok.segment)));
        current_image = tok.segment;
      }
      const int n = tok.grid_row * config_.vision.grid() + tok.grid_col;
      if (n < 0 || n >= np) throw RunnerError(ErrorKind::kInput, "vision token with a bad grid cell");
      std::copy_n(vision.data() + static_cast<std::size_t>(n) * d, d, dst);
    } else {
      std::copy_n(weights_->embed_tokens.data() + static_cast<std::size_t>(tok.token_id) * d, d, dst);
    }
  }
  return x;
}

std::vector<float> Model::forward_logits(const Prompt& prompt) {
  KvCache cache(config_.num_layers, config_.num_kv_heads, config_.head_dim);
  const std::vector<float> x = embed(prompt);
  ForwardRequest req;
  req.x = x.data();
  req.tokens = prompt.tokens.data();
  req.num_tokens = prompt.size();
  req.all_logits = true;
  std::vector<float> logits;
  backend_->forward(req, cache, nullptr, logits);
  return logits;
}

Generation Model::generate(const Prompt& prompt, const GenerateOptions& options) {
  Generation gen;
  const int d = config_.hidden_size;
  KvCache cache(config_.num_layers, config_.num_kv_heads, config_.head_dim);
  std::vector<float> logits;
  auto t0 = Clock::now();
  {
    ScopedRange range(options.observer, "prefill");
    const std::vector<float> x = embed(prompt);
    ForwardRequest req;
    req.x = x.data();
    req.tokens = prompt.tokens.data();
    req.num_tokens = prompt.size();
    req.all_logits = options.prefill_logits != nullptr;
    backend_->forward(req, cache, options.observer, logits);
    if (options.prefill_logits) {
      *options.prefill_logits = logits;
      logits.erase(logits.begin(), logits.end() - config_.vocab_size);  // the last position's
    }
  }
  gen.prefill_ms = ms_since(t0);
  if (options.hook) options.hook->after_prefill(cache, prompt.tokens);
  t0 = Clock::now();
  // Generated tokens continue the last segment (the question's for the tiny VLM, 0 for text).
  const int n_images = static_cast<int>(prompt.images.size());
  if (!options.after_prefill.empty()) {
    if (options.hook) {
      throw RunnerError(ErrorKind::kInput,
                        "tokens fed after the prefill (after_prefill) cannot run with a cache hook");
    }
    const int n = static_cast<int>(options.after_prefill.size());
    check_context(prompt.size() + n);
    const int chunk = options.after_prefill_chunk > 0 ? options.after_prefill_chunk : n;
    std::vector<TokenInfo> toks(static_cast<std::size_t>(n));
    std::vector<float> x(static_cast<std::size_t>(n) * d);
    for (int i = 0; i < n; ++i) {
      const std::int32_t id = options.after_prefill[static_cast<std::size_t>(i)];
      if (id < 0 || id >= config_.vocab_size) {
        throw RunnerError(ErrorKind::kInput, "after_prefill token id " + std::to_string(id) +
                                                 " is outside the vocabulary (" +
                                                 std::to_string(config_.vocab_size) + " tokens)");
      }
      TokenInfo& tok = toks[static_cast<std::size_t>(i)];
      tok.token_id = id;
      tok.position = tok.index = prompt.size() + i;
      tok.modality = 0;
      tok.segment = n_images;
      std::copy_n(weights_->embed_tokens.data() + static_cast<std::size_t>(id) * d, d,
                  x.data() + static_cast<std::size_t>(i) * d);
    }
    for (int i0 = 0; i0 < n; i0 += chunk) {
      const int m = std::min(chunk, n - i0);
      const std::string name =
          "decode " + std::to_string(i0) + (m > 1 ? ".." + std::to_string(i0 + m - 1) : "");
      ScopedRange range(options.observer, name.c_str());
      if (options.observer) {
        for (int i = i0; i < i0 + m; ++i) {
          const TokenInfo& tok = toks[static_cast<std::size_t>(i)];
          options.observer->on_decode_token(i, tok.token_id, tok.position);
        }
      }
      ForwardRequest req;
      req.x = x.data() + static_cast<std::size_t>(i0) * d;
      req.tokens = &toks[static_cast<std::size_t>(i0)];
      req.num_tokens = m;
      req.decode_step = i0;
      backend_->forward(req, cache, options.observer, logits);
    }
    gen.decode_steps = gen.after_prefill_steps = n;
  }
  std::vector<std::int32_t> answer;
  while (static_cast<int>(gen.tokens.size()) < options.max_new) {
    const int next = argmax(logits);
    if (options.keep_logits) gen.logits.push_back(logits);
    gen.tokens.push_back(next);
    if (config_.is_eos(next)) break;
    answer.push_back(next);
    const int step = gen.decode_steps;
    TokenInfo tok;
    tok.token_id = next;
    tok.position = tok.index = prompt.size() + step;
    tok.modality = 0;
    tok.segment = n_images;
    if (tok.position >= config_.max_position_embeddings) break;  // no position left to feed it at
    const std::string name = "decode " + std::to_string(step);
    ScopedRange range(options.observer, name.c_str());
    if (options.observer) options.observer->on_decode_token(step, next, tok.position);
    ForwardRequest req;
    req.x = weights_->embed_tokens.data() + static_cast<std::size_t>(next) * d;
    req.tokens = &tok;
    req.num_tokens = 1;
    req.decode_step = step;
    backend_->forward(req, cache, options.observer, logits);
    ++gen.decode_steps;
    if (options.hook) options.hook->after_decode_step(cache, step, tok);
  }
  gen.decode_ms = ms_since(t0);
  gen.text = tokenizer_->decode(answer);
  return gen;
}

}  // namespace kvscope::runner
