// Word-level tokeniser of the tiny-VLM spec.
#include "kvscope/runner/tokenizer.hpp"

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvscope/runner/error.hpp"

namespace kvscope::runner {

std::vector<std::string> split_words(const std::string& text) {
  std::vector<std::string> words;
  std::string cur;
  auto flush = [&] {
    if (!cur.empty()) words.push_back(std::move(cur));
    cur.clear();
  };
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (std::isspace(c)) {
      flush();
    } else if (c == '?' || c == '.') {
      flush();
      words.emplace_back(1, static_cast<char>(c));
    } else {
      cur.push_back(static_cast<char>(std::tolower(c)));
    }
  }
  flush();
  return words;
}

Vocabulary::Vocabulary(std::vector<std::string> tokens, std::string origin)
    : tokens_(std::move(tokens)), origin_(std::move(origin)) {
  for (std::size_t i = 0; i < tokens_.size(); ++i) ids_.emplace(tokens_[i], static_cast<int>(i));
}

Vocabulary Vocabulary::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw RunnerError(ErrorKind::kModel, path + ": cannot open vocabulary");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw RunnerError(ErrorKind::kModel, path + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array()) {
    throw RunnerError(ErrorKind::kModel, path + ": expected {\"tokens\": [...]}");
  }
  std::vector<std::string> tokens;
  for (const auto& t : j["tokens"]) {
    if (!t.is_string()) throw RunnerError(ErrorKind::kModel, path + ": every token must be a string");
    tokens.push_back(t.get<std::string>());
  }
  return Vocabulary(std::move(tokens), path);
}

const std::string& Vocabulary::text(int id) const {
  if (id < 0 || id >= size()) {
    throw RunnerError(ErrorKind::kModel, origin_ + ": token id " + std::to_string(id) + " out of range");
  }
  return tokens_[static_cast<std::size_t>(id)];
}

std::string Vocabulary::decode(const std::vector<std::int32_t>& ids) const {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + text(ids[i]);
  return out;
}

bool Vocabulary::is_special(int id) const {
  const std::string& w = text(id);
  return w.size() > 1 && w.front() == '<' && w.back() == '>';
}

int Vocabulary::id(const std::string& word) const {
  auto it = ids_.find(word);
  return it == ids_.end() ? -1 : it->second;
}

std::vector<std::int32_t> Vocabulary::encode(const std::string& text) const {
  const std::vector<std::string> words = split_words(text);
  if (words.empty()) throw RunnerError(ErrorKind::kInput, "the question is empty");
  std::vector<std::int32_t> ids;
  ids.reserve(words.size());
  for (const auto& w : words) {
    const int i = id(w);
    // Special tokens are structure, not words a user may type.
    if (i < 0 || (w.size() > 1 && w.front() == '<' && w.back() == '>')) {
      throw RunnerError(ErrorKind::kInput, "unknown word '" + w + "' (not in the vocabulary " + origin_ +
                                               "; the model only knows the words listed there)");
    }
    ids.push_back(i);
  }
  return ids;
}

}  // namespace kvscope::runner
