// vocab.json and the word-level tokeniser of the tiny-VLM spec: lowercase, "?" and "." split off, split on
// whitespace, every word must be in the vocabulary.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvscope::runner {

class Vocabulary {
 public:
  // Reads `path` ({"tokens": [...]}, id = index). Throws RunnerError(kModel) naming the file.
  static Vocabulary load(const std::string& path);
  explicit Vocabulary(std::vector<std::string> tokens, std::string origin = "vocab.json");

  int size() const { return static_cast<int>(tokens_.size()); }
  const std::string& text(int id) const;  // "<unk:ID>" style text never happens: throws for a bad id
  int id(const std::string& word) const;  // -1 when absent
  // Splits and maps `text` to ids. Throws RunnerError(kInput) for an empty text or an unknown word
  // (naming it and the vocabulary file).
  std::vector<std::int32_t> encode(const std::string& text) const;

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_;
  std::string origin_;
};

// The words of `text` per the spec (lowercased, "?"/"." split off). Exposed for tests.
std::vector<std::string> split_words(const std::string& text);

}  // namespace kvscope::runner
