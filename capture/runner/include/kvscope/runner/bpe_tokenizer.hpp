// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (GPT-2 / SmolLM / LLaMA-3 style): the
// ids equal those of HF `tokenizers` built from the same file (docs/capture.md, "Tokenizers").
//
// Supported: model BPE (vocab, merges as "a b" strings or ["a", "b"] pairs, ignore_merges; no
// byte_fallback, dropout, continuing_subword_prefix or end_of_word_suffix), normalizer null,
// pre_tokenizer ByteLevel(add_prefix_space false) alone or after Digits and/or a Split with the GPT-2
// regex, post_processor null or ByteLevel, decoder ByteLevel, added tokens (split out of the text first,
// with their lstrip / rstrip / single_word / normalized flags). Anything else is RunnerError(kModel)
// naming the file and the value.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvscope/runner/tokenizer.hpp"

namespace kvscope::runner {

class BpeTokenizer final : public Tokenizer {
 public:
  // Throws RunnerError(kModel) naming the file for an unreadable file or an unsupported configuration.
  static BpeTokenizer load(const std::string& tokenizer_json_path);

  BpeTokenizer(BpeTokenizer&& other) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) = delete;
  ~BpeTokenizer() override;

  int size() const override { return static_cast<int>(text_.size()); }
  // The token's decoded bytes (an added token's content; a vocabulary token mapped back from the
  // byte-level alphabet). Throws RunnerError(kModel) for a bad id.
  const std::string& text(int id) const override;
  // Never fails: every byte string is encoded (an empty text gives no ids). Valid UTF-8 gives exactly
  // HF's ids; a byte that is not part of valid UTF-8 counts as one punctuation-class character and is
  // encoded as its byte (HF cannot be given such text: a Python str holds only code points). A byte
  // without a vocabulary token is dropped, as HF drops it (SmolLM2 lacks 0x04 0x06 0x13 0x14 0x16 0x1D
  // and bytes that never occur in UTF-8).
  std::vector<std::int32_t> encode(const std::string& text) const override;
  // The concatenated bytes of the tokens: decode(encode(s)) == s for every byte string s whose bytes all
  // have tokens.
  std::string decode(const std::vector<std::int32_t>& ids) const override;
  bool is_special(int id) const override;
  // The id of a token given in tokenizer.json's spelling (added-token content, else the byte-level
  // vocabulary string such as "Ġthe"); -1 when absent.
  int id(const std::string& token) const;

  struct AddedToken {
    std::string content;
    int id = -1;
    bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
  };

 private:
  BpeTokenizer() = default;
  // Appends the BPE ids of one pre-token (raw bytes).
  void encode_word(const std::string& word, std::vector<std::int32_t>& out) const;
  void encode_plain(const std::string& text, std::vector<std::int32_t>& out) const;

  std::string origin_;
  std::vector<std::string> text_;                  // [size] decoded bytes of each id
  std::vector<char> special_;                      // [size]
  std::unordered_map<std::string, int> spelled_;   // tokenizer.json spelling -> id
  std::unordered_map<std::string, int> bytes_id_;  // decoded bytes of a vocabulary token -> id
  std::unordered_map<std::uint64_t, std::pair<int, int>> merges_;  // (left id, right id) -> (rank, merged id)
  std::vector<AddedToken> added_;                                  // non-empty contents
  std::array<std::vector<int>, 256> added_by_byte_;                // first byte -> indices into added_
  bool ignore_merges_ = false;
  // Pre-tokenizer stages in order, each splitting every piece further: kDigitsEach / kDigitsRuns (Digits
  // with individual_digits true / false), kGpt2Regex (ByteLevel use_regex or a Split with that regex).
  enum Stage { kDigitsEach, kDigitsRuns, kGpt2Regex };
  std::vector<Stage> stages_;
  int byte_id_[256] = {};  // byte -> its token id, -1 when the vocabulary has none

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache_;  // pre-token -> ids
};

}  // namespace kvscope::runner
