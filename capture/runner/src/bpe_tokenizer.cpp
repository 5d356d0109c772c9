// Byte-level BPE from tokenizer.json, step for step as HF tokenizers does it: added tokens split out,
// pre-tokenizer stages (Digits, the GPT-2 regex), BPE merges by rank, ByteLevel decoding.
#include "kvscope/runner/bpe_tokenizer.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>

#include "kvscope/runner/error.hpp"

namespace kvscope::runner {
namespace {

struct CodeRange {
  char32_t lo, hi;
};
#include "unicode_tables.inc"

template <std::size_t N>
bool in_table(const CodeRange (&table)[N], char32_t cp) {
  const CodeRange* end = table + N;
  const CodeRange* it =
      std::upper_bound(table, end, cp, [](char32_t c, const CodeRange& r) { return c < r.lo; });
  return it != table && cp <= (it - 1)->hi;
}

constexpr char32_t kInvalid = 0xFFFFFFFF;  // a byte that is not part of valid UTF-8

// Decodes one code point of `s` at `i` (strict UTF-8: no overlongs, surrogates or values past U+10FFFF);
// an invalid byte gives kInvalid and length 1.
char32_t decode_utf8(const std::string& s, std::size_t i, std::size_t& len) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  len = 1;
  if (c < 0x80) return c;
  std::size_t n = 0;
  char32_t cp = 0, min = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F, min = 0x80;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F, min = 0x800;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return kInvalid;
  }
  if (i + n > s.size()) return kInvalid;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  len = n;
  return cp;
}

bool is_letter(char32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return cp != kInvalid && in_table(kRegexLetter, cp);
}
bool is_number(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return cp != kInvalid && in_table(kRegexNumber, cp);
}
bool is_space(char32_t cp) { return cp != kInvalid && in_table(kRegexSpace, cp); }
bool is_numeric(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return cp != kInvalid && in_table(kDigitsNumeric, cp);
}

// GPT-2's byte -> character map (bytes_to_unicode): printable Latin-1 bytes are themselves, the other 68
// bytes map to U+0100.. in byte order.
std::vector<char32_t> byte_to_char() {
  std::vector<char32_t> map(256);
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    map[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// A byte-level spelled token back to its bytes (HF's ByteLevel decoder: a token holding any character
// outside the byte alphabet is taken as its UTF-8 text unchanged). `mapped` is false in that case.
std::string unmap_bytes(const std::string& spelled, const std::unordered_map<char32_t, int>& char_byte,
                        bool& mapped) {
  std::string out;
  mapped = true;
  for (std::size_t i = 0; i < spelled.size();) {
    std::size_t len = 1;
    const char32_t cp = decode_utf8(spelled, i, len);
    auto it = char_byte.find(cp);
    if (it == char_byte.end()) {
      mapped = false;
      return spelled;
    }
    out += static_cast<char>(it->second);
    i += len;
  }
  return out;
}

std::uint64_t pair_key(int a, int b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}

// The one Split regex we run (GPT-2's, also ByteLevel's own with use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct Piece {
  std::size_t begin, end;  // byte offsets into the text
};

// Splits text[p.begin, p.end) with the GPT-2 regex (every character falls in one alternative, so the
// matches tile the piece).
void split_gpt2(const std::string& text, Piece p, std::vector<Piece>& out) {
  // [n] code points of the piece and their byte offsets
  std::vector<char32_t> cps;
  std::vector<std::size_t> at;
  for (std::size_t i = p.begin; i < p.end;) {
    std::size_t len = 1;
    cps.push_back(decode_utf8(text, i, len));
    at.push_back(i);
    i += len;
  }
  at.push_back(p.end);
  const std::size_t n = cps.size();
  const auto other = [&](std::size_t k) {
    return !is_space(cps[k]) && !is_letter(cps[k]) && !is_number(cps[k]);
  };
  std::size_t i = 0;
  while (i < n) {
    std::size_t j = i;
    if (cps[i] == '\'' && i + 1 < n) {
      const char32_t a = cps[i + 1], b = i + 2 < n ? cps[i + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        j = i + 2;
      } else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        j = i + 3;
      }
    }
    if (j == i) {
      const std::size_t k = (cps[i] == ' ' && i + 1 < n) ? i + 1 : i;  // the optional leading space
      if (is_letter(cps[k])) {
        for (j = k + 1; j < n && is_letter(cps[j]);) ++j;
      } else if (is_number(cps[k])) {
        for (j = k + 1; j < n && is_number(cps[j]);) ++j;
      } else if (other(k)) {
        for (j = k + 1; j < n && other(j);) ++j;
      } else {
        // cps[i] is whitespace: \s+(?!\S) takes the run but its last character when a non-space follows
        // (and that leaves at least one), else \s+ takes the whole run.
        std::size_t e = i + 1;
        while (e < n && is_space(cps[e])) ++e;
        j = (e < n && e - i > 1) ? e - 1 : e;
      }
    }
    out.push_back({at[i], at[j]});
    i = j;
  }
}

// Digits: numeric characters isolated one by one (`each`) or in runs.
void split_digits(const std::string& text, Piece p, bool each, std::vector<Piece>& out) {
  std::size_t start = p.begin;
  bool run_numeric = false;
  for (std::size_t i = p.begin; i < p.end;) {
    std::size_t len = 1;
    const bool num = is_numeric(decode_utf8(text, i, len));
    if (i > start && (num != run_numeric || (num && each))) {
      out.push_back({start, i});
      start = i;
    }
    run_numeric = num;
    i += len;
  }
  if (p.end > start) out.push_back({start, p.end});
}

// Byte length of the White_Space run at the end / start of s (HF's \s*$ and ^\s* for lstrip/rstrip).
std::size_t leading_space(const std::string& s, std::size_t from, std::size_t to) {
  std::size_t i = from;
  while (i < to) {
    std::size_t len = 1;
    if (!is_space(decode_utf8(s, i, len))) break;
    i += len;
  }
  return i - from;
}
std::size_t trailing_space_start(const std::string& s, std::size_t from, std::size_t to) {
  std::size_t start = to;
  for (std::size_t i = from; i < to;) {
    std::size_t len = 1;
    const bool sp = is_space(decode_utf8(s, i, len));
    if (!sp) start = to;
    if (sp && start == to) start = i;
    i += len;
  }
  return start;
}
// HF's \w (approximated: letters, numbers, '_') at the end of s[from, to) / the start of s[from, to).
bool word_char(char32_t cp) { return cp == '_' || is_letter(cp) || is_number(cp); }
bool ends_with_word(const std::string& s, std::size_t from, std::size_t to) {
  if (to == from) return false;
  std::size_t i = to - 1;
  while (i > from && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  std::size_t len = 1;
  return word_char(decode_utf8(s, i, len));
}
bool starts_with_word(const std::string& s, std::size_t from, std::size_t to) {
  std::size_t len = 1;
  return to > from && word_char(decode_utf8(s, from, len));
}

[[noreturn]] void unsupported(const std::string& path, const std::string& what) {
  throw RunnerError(ErrorKind::kModel, path + ": unsupported tokenizer: " + what +
                                           " (supported: byte-level BPE; docs/capture.md, \"Tokenizers\")");
}

std::string dump(const nlohmann::json& j) {
  std::string s = j.dump();
  return s.size() > 120 ? s.substr(0, 117) + "..." : s;
}

}  // namespace

BpeTokenizer::BpeTokenizer(BpeTokenizer&& o) noexcept
    : origin_(std::move(o.origin_)),
      text_(std::move(o.text_)),
      special_(std::move(o.special_)),
      spelled_(std::move(o.spelled_)),
      bytes_id_(std::move(o.bytes_id_)),
      merges_(std::move(o.merges_)),
      added_(std::move(o.added_)),
      added_by_byte_(std::move(o.added_by_byte_)),
      ignore_merges_(o.ignore_merges_),
      stages_(std::move(o.stages_)),
      cache_(std::move(o.cache_)) {
  std::copy(std::begin(o.byte_id_), std::end(o.byte_id_), std::begin(byte_id_));
}

BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RunnerError(ErrorKind::kModel, path + ": cannot open tokenizer file");
  if (std::filesystem::is_directory(path)) throw RunnerError(ErrorKind::kModel, path + ": is a directory");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw RunnerError(ErrorKind::kModel, path + ": not valid JSON (" + e.what() + ")");
  }
  const auto bad = [&](const std::string& what) -> RunnerError {
    return RunnerError(ErrorKind::kModel, path + ": " + what);
  };
  if (!j.is_object()) throw bad("expected a JSON object");
  static const nlohmann::json kNull;
  const auto get = [](const nlohmann::json& obj, const char* key) -> const nlohmann::json& {
    if (!obj.is_object()) return kNull;
    const auto it = obj.find(key);
    return it == obj.end() ? kNull : *it;
  };

  BpeTokenizer tok;
  tok.origin_ = path;

  // model
  const nlohmann::json& model = get(j, "model");
  if (!model.is_object()) throw bad("no \"model\" object");
  const nlohmann::json& type = get(model, "type");
  if (type != "BPE")
    unsupported(path, "model.type " + (type.is_null() ? std::string("missing") : dump(type)));
  if (get(model, "byte_fallback") == true) unsupported(path, "model.byte_fallback true");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
    const nlohmann::json& v = get(model, key);
    if (!v.is_null() && v != "") unsupported(path, std::string("model.") + key + " " + dump(v));
  }
  tok.ignore_merges_ = get(model, "ignore_merges") == true;
  const nlohmann::json& vocab = get(model, "vocab");
  if (!vocab.is_object() || vocab.empty()) throw bad("model.vocab must be a non-empty object");

  std::vector<std::string> spelled;  // [size] tokenizer.json spelling of each id
  // ids are dense, so none can reach the number of entries (which also bounds what we allocate)
  const nlohmann::json& added_json = get(j, "added_tokens");
  const long long entries =
      static_cast<long long>(vocab.size() + (added_json.is_array() ? added_json.size() : 0));
  const auto place = [&](const std::string& s, const nlohmann::json& id_json, const char* where) {
    if (!id_json.is_number_integer() || id_json.get<long long>() < 0 || id_json.get<long long>() >= entries) {
      throw bad(std::string(where) + " \"" + s + "\": id must be an integer in 0.." +
                std::to_string(entries - 1) + " (the file has " + std::to_string(entries) + " tokens)");
    }
    const auto id = static_cast<std::size_t>(id_json.get<long long>());
    if (id >= spelled.size()) spelled.resize(id + 1);
    return id;
  };
  std::vector<char> filled;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const std::size_t id = place(it.key(), it.value(), "model.vocab token");
    filled.resize(spelled.size());
    if (filled[id]) throw bad("model.vocab: id " + std::to_string(id) + " given twice");
    filled[id] = 1;
    spelled[id] = it.key();
    tok.spelled_[it.key()] = static_cast<int>(id);
  }

  // added tokens (their ids may also be vocabulary ids)
  const nlohmann::json& added = get(j, "added_tokens");
  if (!added.is_null() && !added.is_array()) throw bad("added_tokens must be an array");
  std::vector<char> special;
  std::vector<std::pair<std::size_t, std::string>> added_text;
  for (const auto& a : added.is_array() ? added : nlohmann::json::array()) {
    if (!a.is_object() || !get(a, "content").is_string())
      throw bad("added_tokens: each needs a string content");
    AddedToken t;
    t.content = a["content"].get<std::string>();
    const std::size_t id = place(t.content, get(a, "id"), "added token");
    filled.resize(spelled.size());
    t.id = static_cast<int>(id);
    const auto flag = [&](const char* key) { return get(a, key) == true; };
    t.special = flag("special"), t.lstrip = flag("lstrip"), t.rstrip = flag("rstrip");
    t.single_word = flag("single_word"), t.normalized = flag("normalized");
    filled[id] = 1;
    spelled[id] = t.content;
    tok.spelled_[t.content] = t.id;  // HF's token_to_id looks at added tokens first
    special.resize(spelled.size());
    special[id] = t.special ? 1 : 0;
    added_text.emplace_back(id, t.content);
    if (!t.content.empty()) tok.added_.push_back(std::move(t));
  }
  for (std::size_t k = 0; k < tok.added_.size(); ++k) {
    tok.added_by_byte_[static_cast<unsigned char>(tok.added_[k].content[0])].push_back(static_cast<int>(k));
  }
  for (std::size_t id = 0; id < filled.size(); ++id) {
    if (!filled[id])
      throw bad("no token has id " + std::to_string(id) + " (ids must be 0.." +
                std::to_string(filled.size() - 1) + " without gaps)");
  }
  special.resize(spelled.size());
  tok.special_ = std::move(special);

  // the byte alphabet; HF drops a byte that has no token (no unk_token, no byte_fallback), and so do we
  const std::vector<char32_t> b2c = byte_to_char();
  std::unordered_map<char32_t, int> char_byte;
  for (int b = 0; b < 256; ++b) char_byte[b2c[static_cast<std::size_t>(b)]] = b;
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(utf8(b2c[static_cast<std::size_t>(b)]));
    tok.byte_id_[b] = it == vocab.end() ? -1 : it->get<int>();
  }
  tok.text_.resize(spelled.size());
  for (std::size_t id = 0; id < spelled.size(); ++id) {
    bool mapped = false;
    tok.text_[id] = unmap_bytes(spelled[id], char_byte, mapped);
  }
  for (const auto& [id, content] : added_text) tok.text_[id] = content;  // added tokens decode as themselves
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    bool mapped = false;
    const std::string bytes = unmap_bytes(it.key(), char_byte, mapped);
    if (mapped) tok.bytes_id_[bytes] = it.value().get<int>();
  }

  // merges: "a b" or ["a", "b"]; rank = position
  const nlohmann::json& merges = get(model, "merges");
  if (!merges.is_array()) throw bad("model.merges must be an array");
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const nlohmann::json& m = merges[r];
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const std::size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        throw bad("model.merges[" + std::to_string(r) + "] \"" + s +
                  "\" is not two tokens separated by a space");
      }
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    } else {
      throw bad("model.merges[" + std::to_string(r) + "] must be \"a b\" or [\"a\", \"b\"]");
    }
    const auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end()) {
      throw bad("model.merges[" + std::to_string(r) + "] (\"" + a + "\", \"" + b +
                "\"): a token is not in model.vocab");
    }
    tok.merges_[pair_key(ia->get<int>(), ib->get<int>())] = {static_cast<int>(r), iab->get<int>()};
  }

  // normalizer, pre-tokenizer, post-processor, decoder
  if (!get(j, "normalizer").is_null()) unsupported(path, "normalizer " + dump(get(j, "normalizer")));
  const nlohmann::json& pre = get(j, "pre_tokenizer");
  std::vector<nlohmann::json> stages;
  if (get(pre, "type") == "Sequence" && get(pre, "pretokenizers").is_array()) {
    for (const auto& p : pre["pretokenizers"]) stages.push_back(p);
  } else {
    stages.push_back(pre);
  }
  bool byte_level = false;
  for (const auto& p : stages) {
    const nlohmann::json& t = get(p, "type");
    if (byte_level) unsupported(path, "pre_tokenizer " + dump(p) + " after ByteLevel");
    if (t == "ByteLevel") {
      if (get(p, "add_prefix_space") == true)
        unsupported(path, "pre_tokenizer ByteLevel add_prefix_space true");
      if (get(p, "use_regex") != false) tok.stages_.push_back(kGpt2Regex);
      byte_level = true;
    } else if (t == "Digits") {
      tok.stages_.push_back(get(p, "individual_digits") == true ? kDigitsEach : kDigitsRuns);
    } else if (t == "Split" && get(get(p, "pattern"), "Regex") == kGpt2Pattern &&
               get(p, "behavior") == "Isolated" && get(p, "invert") != true) {
      tok.stages_.push_back(kGpt2Regex);
    } else {
      unsupported(path, "pre_tokenizer " + dump(p));
    }
  }
  if (!byte_level)
    unsupported(path, "pre_tokenizer " + dump(pre) + " (a ByteLevel pre-tokenizer is required)");
  const nlohmann::json& post = get(j, "post_processor");
  if (!post.is_null() && get(post, "type") != "ByteLevel") unsupported(path, "post_processor " + dump(post));
  const nlohmann::json& dec = get(j, "decoder");
  if (get(dec, "type") != "ByteLevel") unsupported(path, "decoder " + dump(dec));
  return tok;
}

const std::string& BpeTokenizer::text(int id) const {
  if (id < 0 || id >= size()) {
    throw RunnerError(ErrorKind::kModel, origin_ + ": token id " + std::to_string(id) + " out of range");
  }
  return text_[static_cast<std::size_t>(id)];
}

bool BpeTokenizer::is_special(int id) const {
  text(id);  // throws for a bad id
  return special_[static_cast<std::size_t>(id)] != 0;
}

int BpeTokenizer::id(const std::string& token) const {
  auto it = spelled_.find(token);
  return it == spelled_.end() ? -1 : it->second;
}

std::string BpeTokenizer::decode(const std::vector<std::int32_t>& ids) const {
  std::string out;
  for (std::int32_t i : ids) out += text(i);
  return out;
}

void BpeTokenizer::encode_word(const std::string& word, std::vector<std::int32_t>& out) const {
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::int32_t> ids;
  auto whole = ignore_merges_ ? bytes_id_.find(word) : bytes_id_.end();
  if (whole != bytes_id_.end()) {
    ids.push_back(whole->second);
  } else {
    // HF's Word::merge_all: a linked list of symbols and a queue of (rank, position) merges, lowest rank
    // first and leftmost among equals; an entry whose pair no longer yields its merged id is stale.
    struct Symbol {
      int id, prev, next;
      bool alive;
    };
    std::vector<Symbol> sym;  // [n] the word's bytes that have a token
    sym.reserve(word.size());
    for (const char c : word) {
      const int b = byte_id_[static_cast<unsigned char>(c)];
      if (b < 0) continue;
      const int i = static_cast<int>(sym.size());
      sym.push_back({b, i - 1, i + 1, true});
    }
    const int n = static_cast<int>(sym.size());
    if (n > 0) sym.back().next = -1;
    struct Merge {
      int rank, pos, new_id;
      bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Merge, std::vector<Merge>, std::greater<Merge>> queue;
    const auto push = [&](int pos) {
      const Symbol& s = sym[static_cast<std::size_t>(pos)];
      if (s.next < 0) return;
      auto it = merges_.find(pair_key(s.id, sym[static_cast<std::size_t>(s.next)].id));
      if (it != merges_.end()) queue.push({it->second.first, pos, it->second.second});
    };
    for (int i = 0; i + 1 < n; ++i) push(i);
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& s = sym[static_cast<std::size_t>(top.pos)];
      if (!s.alive || s.next < 0) continue;
      Symbol& right = sym[static_cast<std::size_t>(s.next)];
      auto it = merges_.find(pair_key(s.id, right.id));
      if (it == merges_.end() || it->second.second != top.new_id) continue;
      s.id = top.new_id;
      right.alive = false;
      s.next = right.next;
      if (s.next >= 0) sym[static_cast<std::size_t>(s.next)].prev = top.pos;
      if (s.prev >= 0) push(s.prev);
      push(top.pos);
    }
    for (int i = n > 0 ? 0 : -1; i >= 0; i = sym[static_cast<std::size_t>(i)].next)
      ids.push_back(sym[static_cast<std::size_t>(i)].id);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() > 200'000)
    cache_.clear();  // bounded: a long run of distinct words cannot grow it forever
  cache_.emplace(word, std::move(ids));
}

void BpeTokenizer::encode_plain(const std::string& text, std::vector<std::int32_t>& out) const {
  std::vector<Piece> pieces{{0, text.size()}}, next;
  for (Stage st : stages_) {
    next.clear();
    for (const Piece& p : pieces) {
      if (st == kGpt2Regex) {
        split_gpt2(text, p, next);
      } else {
        split_digits(text, p, st == kDigitsEach, next);
      }
    }
    pieces.swap(next);
  }
  for (const Piece& p : pieces) {
    if (p.end > p.begin) encode_word(text.substr(p.begin, p.end - p.begin), out);
  }
}

std::vector<std::int32_t> BpeTokenizer::encode(const std::string& text) const {
  // Added tokens split out as HF's AddedVocabulary does: first those with normalized false on the whole
  // text, then those with normalized true on what is left (no normalizer: the same text). At each
  // position the longest token wins (aho-corasick LeftmostLongest); the search resumes after the match.
  struct Part {
    std::size_t begin, end;
    int id;  // -1: plain text
  };
  std::vector<Part> parts{{0, text.size(), -1}};
  for (const bool normalized : {false, true}) {
    std::vector<Part> next;
    for (const Part& part : parts) {
      if (part.id >= 0) {
        next.push_back(part);
        continue;
      }
      std::size_t from = part.begin;  // start of the pending plain text
      std::size_t pos = part.begin;
      while (pos < part.end) {
        const AddedToken* best = nullptr;
        for (const int k : added_by_byte_[static_cast<unsigned char>(text[pos])]) {
          const AddedToken& t = added_[static_cast<std::size_t>(k)];
          if (t.normalized != normalized || t.content.size() > part.end - pos) continue;
          if ((!best || t.content.size() > best->content.size()) &&
              text.compare(pos, t.content.size(), t.content) == 0) {
            best = &t;
          }
        }
        if (!best) {
          ++pos;
          continue;
        }
        std::size_t start = pos, stop = pos + best->content.size();
        pos = stop;
        if (best->single_word &&
            (ends_with_word(text, part.begin, start) || starts_with_word(text, stop, part.end))) {
          continue;
        }
        if (best->lstrip) start = std::max(trailing_space_start(text, part.begin, start), from);
        if (best->rstrip) stop += leading_space(text, stop, part.end);
        if (from < start) next.push_back({from, start, -1});
        next.push_back({start, stop, best->id});
        from = stop;
        pos = std::max(pos, stop);
      }
      if (from < part.end) next.push_back({from, part.end, -1});
    }
    parts.swap(next);
  }
  std::vector<std::int32_t> ids;
  for (const Part& part : parts) {
    if (part.id >= 0) {
      ids.push_back(part.id);
    } else {
      encode_plain(text.substr(part.begin, part.end - part.begin), ids);
    }
  }
  return ids;
}

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path bpe = fs::path(model_dir) / "tokenizer.json";
  const fs::path words = fs::path(model_dir) / "vocab.json";
  std::error_code ec;
  if (fs::exists(bpe, ec)) return std::make_shared<const BpeTokenizer>(BpeTokenizer::load(bpe.string()));
  if (fs::exists(words, ec)) return std::make_shared<const Vocabulary>(Vocabulary::load(words.string()));
  throw RunnerError(ErrorKind::kModel, model_dir +
                                           ": no tokenizer (neither tokenizer.json, a Hugging Face "
                                           "byte-level BPE, nor vocab.json, the tiny VLM's vocabulary)");
}

}  // namespace kvscope::runner
