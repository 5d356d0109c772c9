// The runner's tokenizer interface, and the word-level tokenizer of the tiny-VLM spec (vocab.json: lowercase,
// "?" and "." split off, split on whitespace, every word must be in the vocabulary).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvscope::runner {

// What the runner needs of a tokenizer: text to ids, ids back to text, and each token's text for traces.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int size() const = 0;
  // The text of one token as recorded in traces (for byte-level BPE: its bytes, possibly part of a UTF-8
  // character). Throws RunnerError(kModel) for an id outside 0 .. size()-1.
  virtual const std::string& text(int id) const = 0;
  // Throws RunnerError(kInput) for text the tokenizer cannot encode (an empty text, an unknown word).
  virtual std::vector<std::int32_t> encode(const std::string& text) const = 0;
  // The text of generated ids (special tokens included as their text).
  virtual std::string decode(const std::vector<std::int32_t>& ids) const = 0;
  // True for control tokens (<bos>, <|im_end|>, ...): labelled "special" in traces.
  virtual bool is_special(int id) const = 0;
};

class Vocabulary final : public Tokenizer {
 public:
  // Reads `path` ({"tokens": [...]}, id = index). Throws RunnerError(kModel) naming the file.
  static Vocabulary load(const std::string& path);
  explicit Vocabulary(std::vector<std::string> tokens, std::string origin = "vocab.json");

  int size() const override { return static_cast<int>(tokens_.size()); }
  const std::string& text(int id) const override;  // throws for a bad id
  int id(const std::string& word) const;           // -1 when absent
  // Splits and maps `text` to ids. Throws RunnerError(kInput) for an empty text or an unknown word
  // (naming it and the vocabulary file).
  std::vector<std::int32_t> encode(const std::string& text) const override;
  // The words joined by single spaces.
  std::string decode(const std::vector<std::int32_t>& ids) const override;
  // Words of the form <...> (the spec's <bos>, <eos>, <img>, ...).
  bool is_special(int id) const override;

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_;
  std::string origin_;
};

// The tokenizer of a model folder: tokenizer.json (Hugging Face byte-level BPE, BpeTokenizer), else
// vocab.json (the tiny VLM's Vocabulary). Throws RunnerError(kModel) naming the folder when it has neither,
// or naming the file when it cannot be read or is unsupported.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& model_dir);

// The words of `text` per the spec (lowercased, "?"/"." split off). Exposed for tests.
std::vector<std::string> split_words(const std::string& text);

}  // namespace kvscope::runner
