// BpeTokenizer on small tokenizer.json files written by the tests (merges by rank, the GPT-2 regex,
// Digits, added tokens and their flags, bytes without tokens, every unsupported configuration) and, when
// scripts/setup has imported it, on the real SmolLM2 tokenizer (ids checked against HF tokenizers 0.22.2).
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <random>

#include "kvscope/runner/bpe_tokenizer.hpp"
#include "kvscope/runner/error.hpp"
#include "runner_test_util.hpp"
#include "scratch.hpp"

namespace kvscope::runner {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// This test's folder in the process's scratch directory (removed when the process exits).
struct TempDir {
  fs::path path =
      kvscope::testing::scratch_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
};

// GPT-2's byte -> character map, spelled in UTF-8.
std::string byte_char(int b) {
  int next = 256;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
    const int cp = printable ? x : next++;
    if (x == b) {
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      return s;
    }
  }
  return "";
}

// Spelled form of raw bytes ("Ġw" for " w").
std::string spell(const std::string& bytes) {
  std::string s;
  for (char c : bytes) s += byte_char(static_cast<unsigned char>(c));
  return s;
}

// A byte-level tokenizer.json: ids 0..255 the bytes (less `missing`), then one token per merge (given as
// raw bytes), then the added tokens.
json make_config(const std::vector<std::pair<std::string, std::string>>& merges,
                 const json& added = json::array(), const std::vector<int>& missing = {}) {
  json vocab = json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    if (std::find(missing.begin(), missing.end(), b) == missing.end()) vocab[byte_char(b)] = next++;
  }
  json m = json::array();
  for (const auto& [a, b] : merges) {
    m.push_back(json::array({spell(a), spell(b)}));
    if (!vocab.contains(spell(a + b))) vocab[spell(a + b)] = next++;
  }
  json added_tokens = json::array();
  for (json a : added) {
    a["id"] = next++;
    for (const char* k : {"single_word", "lstrip", "rstrip", "normalized", "special"}) {
      if (!a.contains(k)) a[k] = false;
    }
    added_tokens.push_back(a);
  }
  return {{"version", "1.0"},
          {"added_tokens", added_tokens},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                           {{"type", "ByteLevel"},
                                            {"add_prefix_space", false},
                                            {"trim_offsets", true},
                                            {"use_regex", true}}})}}},
          {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", m}}}};
}

BpeTokenizer load_config(const TempDir& dir, const json& config, const std::string& name = "tokenizer.json") {
  const fs::path p = dir.path / name;
  std::ofstream(p) << config.dump();
  return BpeTokenizer::load(p.string());
}

// The tokens of `text` as their bytes.
std::vector<std::string> pieces(const BpeTokenizer& tok, const std::string& text) {
  std::vector<std::string> out;
  for (std::int32_t id : tok.encode(text)) out.push_back(tok.text(id));
  return out;
}

using Strings = std::vector<std::string>;

const std::vector<std::pair<std::string, std::string>> kMerges = {{"l", "l"},    {"h", "e"}, {"he", "ll"},
                                                                  {"hell", "o"}, {" ", "w"}, {"a", "a"},
                                                                  {"1", "2"},    {"'", "s"}, {" ", " "}};

TEST(BpeTokenizer, MergesByRankLeftmostFirst) {
  TempDir dir;
  const BpeTokenizer tok = load_config(dir, make_config(kMerges));
  EXPECT_EQ(pieces(tok, "hello world"), (Strings{"hello", " w", "o", "r", "l", "d"}));
  EXPECT_EQ(pieces(tok, "aaa"), (Strings{"aa", "a"}));  // the leftmost of two equal-rank pairs
  EXPECT_EQ(pieces(tok, "aaaa"), (Strings{"aa", "aa"}));
  EXPECT_EQ(pieces(tok, "hell"), (Strings{"hell"}));
  EXPECT_EQ(tok.size(), 256 + static_cast<int>(kMerges.size()));
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(BpeTokenizer, MergesGivenAsStringsEqualPairs) {
  TempDir dir;
  json config = make_config(kMerges);
  json as_strings = json::array();
  for (const auto& m : config["model"]["merges"])
    as_strings.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  config["model"]["merges"] = as_strings;
  EXPECT_EQ(pieces(load_config(dir, config), "hello world"), (Strings{"hello", " w", "o", "r", "l", "d"}));
}

TEST(BpeTokenizer, IgnoreMergesTakesWholeVocabularyWords) {
  TempDir dir;
  // the merges make "h" "ello" of "hello"; ignore_merges takes the vocabulary word "hello" whole
  json config = make_config({{"e", "l"}, {"el", "l"}, {"ell", "o"}, {"h", "e"}});
  config["model"]["vocab"]["hello"] = config["model"]["vocab"].size();
  EXPECT_EQ(pieces(load_config(dir, config), "hello"), (Strings{"h", "ello"}));
  config["model"]["ignore_merges"] = true;
  EXPECT_EQ(pieces(load_config(dir, config), "hello"), (Strings{"hello"}));
}

TEST(BpeTokenizer, Gpt2RegexSplits) {
  TempDir dir;
  const BpeTokenizer tok = load_config(dir, make_config(kMerges));
  // a whitespace run before a word leaves its last space to the word; at the end it stays whole
  EXPECT_EQ(pieces(tok, "a   w"), (Strings{"a", "  ", " w"}));
  EXPECT_EQ(pieces(tok, "a  "), (Strings{"a", "  "}));
  EXPECT_EQ(pieces(tok, "a\n\n w"), (Strings{"a", "\n", "\n", " w"}));
  // contractions (lowercase only), punctuation runs with their leading space
  EXPECT_EQ(pieces(tok, "it's"), (Strings{"i", "t", "'s"}));
  EXPECT_EQ(pieces(tok, "IT'S"), (Strings{"I", "T", "'", "S"}));
  EXPECT_EQ(pieces(tok, "a ?!"), (Strings{"a", " ", "?", "!"}));
  // letters: a combining mark is not \p{L}, so it splits "é" spelled e + U+0301
  EXPECT_EQ(pieces(tok, "e\xCC\x81"), (Strings{"e", "\xCC", "\x81"}));
  // decoding the bytes back
  EXPECT_EQ(tok.decode(tok.encode("e\xCC\x81 caf\xC3\xA9")), "e\xCC\x81 caf\xC3\xA9");
}

TEST(BpeTokenizer, DigitsIndividuallyOrInRuns) {
  TempDir dir;
  json config = make_config(kMerges);
  // individual digits: "12" never merges
  EXPECT_EQ(pieces(load_config(dir, config), "a123"), (Strings{"a", "1", "2", "3"}));
  EXPECT_EQ(pieces(load_config(dir, config), " 12"), (Strings{" ", "1", "2"}));
  config["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = false;
  EXPECT_EQ(pieces(load_config(dir, config), "a123"), (Strings{"a", "12", "3"}));
  // without Digits the regex keeps " 12" together
  config["pre_tokenizer"] = config["pre_tokenizer"]["pretokenizers"][1];
  EXPECT_EQ(pieces(load_config(dir, config), " 123"), (Strings{" ", "12", "3"}));
  // a Split with the GPT-2 regex then a ByteLevel without regex is the same
  json split = {
      {"type", "Split"},
      {"pattern",
       {{"Regex", R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}}},
      {"behavior", "Isolated"},
      {"invert", false}};
  config["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({split, {{"type", "ByteLevel"}, {"use_regex", false}}})}};
  EXPECT_EQ(pieces(load_config(dir, config), "a   w 123"), (Strings{"a", "  ", " w", " ", "12", "3"}));
}

TEST(BpeTokenizer, SplitsAddedTokensFirst) {
  TempDir dir;
  const json added = json::array({{{"content", "<|im_start|>"}, {"special", true}},
                                  {{"content", "<|im_end|>"}, {"special", true}},
                                  {{"content", "<|im"}, {"special", true}},  // shorter: the longest wins
                                  {{"content", "ll"}, {"normalized", true}}});
  const BpeTokenizer tok = load_config(dir, make_config(kMerges, added));
  const int start = tok.id("<|im_start|>"), end = tok.id("<|im_end|>");
  ASSERT_GE(start, 0);
  EXPECT_EQ(tok.encode("<|im_start|>user\nhi<|im_end|>"),
            (std::vector<std::int32_t>{start, tok.id("u"), tok.id("s"), tok.id("e"), tok.id("r"), tok.id("Ċ"),
                                       tok.id("h"), tok.id("i"), end}));
  EXPECT_EQ(pieces(tok, "x<|imy"), (Strings{"x", "<|im", "y"}));
  // a non-special added token is matched too, inside a word, and its text is its content
  EXPECT_EQ(pieces(tok, "hello"), (Strings{"he", "ll", "o"}));
  EXPECT_TRUE(tok.is_special(start));
  EXPECT_FALSE(tok.is_special(tok.id("ll")));
  EXPECT_FALSE(tok.is_special(tok.id("a")));
  EXPECT_EQ(tok.text(start), "<|im_start|>");
  EXPECT_EQ(tok.decode(tok.encode(" <|im_start|> x")), " <|im_start|> x");
}

TEST(BpeTokenizer, AddedTokenFlags) {
  TempDir dir;
  const json added = json::array({{{"content", "<L>"}, {"lstrip", true}},
                                  {{"content", "<R>"}, {"rstrip", true}},
                                  {{"content", "word"}, {"single_word", true}}});
  const BpeTokenizer tok = load_config(dir, make_config(kMerges, added));
  const int l = tok.id("<L>"), r = tok.id("<R>"), w = tok.id("word");
  EXPECT_EQ(tok.encode("a  <L>"), (std::vector<std::int32_t>{tok.id("a"), l}));  // the spaces go with <L>
  EXPECT_EQ(tok.encode("<R>  a"), (std::vector<std::int32_t>{r, tok.id("a")}));
  EXPECT_EQ(tok.encode("a word"), (std::vector<std::int32_t>{tok.id("a"), tok.id("Ġ"), w}));
  EXPECT_EQ(tok.encode("swords").size(), 6u);  // inside a word: not the added token
}

TEST(BpeTokenizer, EveryByteStringRoundTrips) {
  TempDir dir;
  const BpeTokenizer tok = load_config(dir, make_config(kMerges));
  std::string all;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    EXPECT_EQ(tok.decode(tok.encode(one)), one) << b;
    all += one;
  }
  EXPECT_EQ(tok.decode(tok.encode(all)), all);
  std::mt19937 rng(14);
  for (int i = 0; i < 500; ++i) {
    std::string s(rng() % 40, '\0');
    for (char& c : s)
      c = "a '1\n\xC3\xA9\xE6\xBC\xA2\xF0\x9F\x91\x8D\xFF\x80"[rng() % 15];  // valid and invalid UTF-8
    ASSERT_EQ(tok.decode(tok.encode(s)), s);
  }
}

TEST(BpeTokenizer, DropsBytesWithoutTokensAsHfDoes) {
  TempDir dir;
  // SmolLM2's vocabulary has no token for byte 0x04; HF drops it (no unk token, no byte fallback)
  const BpeTokenizer tok = load_config(dir, make_config({{"a", "a"}}, json::array(), {0x04}));
  EXPECT_EQ(pieces(tok,
                   "a\x04"
                   "a"),
            (Strings{"a", "a"}));
  EXPECT_EQ(pieces(tok, "!\x04!"), (Strings{"!", "!"}));
  EXPECT_EQ(tok.decode(tok.encode("x\x04")), "x");
}

TEST(BpeTokenizer, TokenLookups) {
  TempDir dir;
  const BpeTokenizer tok = load_config(dir, make_config(kMerges));
  EXPECT_EQ(tok.text(tok.id("Ġw")), " w");
  EXPECT_EQ(tok.id("nope"), -1);
  EXPECT_THROW(tok.text(-1), RunnerError);
  EXPECT_THROW(tok.text(tok.size()), RunnerError);
  EXPECT_THROW(tok.decode({tok.size()}), RunnerError);
}

TEST(BpeTokenizer, EncodesLongTextFast) {
  TempDir dir;
  const BpeTokenizer tok = load_config(dir, make_config(kMerges));
  std::mt19937 rng(3);
  std::string text;
  while (text.size() < 100'000) {
    for (int k = 0; k < 1 + static_cast<int>(rng() % 9); ++k) text += static_cast<char>('a' + rng() % 26);
    text += " .,\n1"[rng() % 5];
  }
  text += std::string(20'000, ' ') + std::string(20'000, '-');  // long single pre-tokens
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_LT(s, 1.0) << text.size() << " bytes";
}

// Every unsupported configuration: RunnerError(kModel) naming the file and the value.
TEST(BpeTokenizer, RefusesUnsupportedConfigurations) {
  TempDir dir;
  const json good = make_config(kMerges);
  struct Case {
    std::string what;  // expected in the message
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"model.type \"WordPiece\"", [](json& j) { j["model"]["type"] = "WordPiece"; }},
      {"model.type \"Unigram\"", [](json& j) { j["model"]["type"] = "Unigram"; }},
      {"model.type missing", [](json& j) { j["model"].erase("type"); }},
      {"model.byte_fallback true", [](json& j) { j["model"]["byte_fallback"] = true; }},
      {"model.continuing_subword_prefix \"##\"",
       [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }},
      {"model.end_of_word_suffix \"</w>\"", [](json& j) { j["model"]["end_of_word_suffix"] = "</w>"; }},
      {"model.dropout 0.1", [](json& j) { j["model"]["dropout"] = 0.1; }},
      {"normalizer {\"type\":\"NFC\"}",
       [](json& j) {
         j["normalizer"] = {{"type", "NFC"}};
       }},
      {"pre_tokenizer {\"type\":\"Whitespace\"}",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Whitespace"}};
       }},
      {"Metaspace",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
       }},
      {"ByteLevel add_prefix_space true",
       [](json& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; }},
      {"\"type\":\"Split\"",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"},
                                                   {"pattern", {{"Regex", "\\s+"}}},
                                                   {"behavior", "Isolated"},
                                                   {"invert", false}};
       }},
      {"after ByteLevel",
       [](json& j) {
         j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "Digits"}, {"individual_digits", true}});
       }},
      {"a ByteLevel pre-tokenizer is required",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Digits"}};
       }},
      {"pre_tokenizer null", [](json& j) { j["pre_tokenizer"] = nullptr; }},
      {"post_processor {\"type\":\"TemplateProcessing\"}",
       [](json& j) {
         j["post_processor"] = {{"type", "TemplateProcessing"}};
       }},
      {"decoder {\"type\":\"WordPiece\"}",
       [](json& j) {
         j["decoder"] = {{"type", "WordPiece"}};
       }},
      {"decoder null", [](json& j) { j["decoder"] = nullptr; }},
      {"is not in model.vocab",
       [](json& j) {
         j["model"]["merges"].push_back(json::array({"q", "zz"}));
       }},
      {"not two tokens", [](json& j) { j["model"]["merges"].push_back("abc"); }},
      {"no token has id 265",
       [](json& j) {  // an added token may share a vocabulary id; then 265 is left out
         j["added_tokens"].push_back({{"content", "<a>"}, {"id", 5}});
         j["added_tokens"].push_back({{"content", "<b>"}, {"id", 266}});
       }},
      {"id must be an integer in 0..265", [](json& j) { j["model"]["vocab"]["zz"] = 4'000'000'000LL; }},
      {"id must be an integer in 0..265", [](json& j) { j["model"]["vocab"]["zz"] = -1; }},
      {"id must be an integer in 0..265", [](json& j) { j["model"]["vocab"]["zz"] = "7"; }},
      {"given twice", [](json& j) { j["model"]["vocab"]["zz"] = 0; }},
      {"needs a string content",
       [](json& j) {
         j["added_tokens"].push_back({{"id", 5}});
       }},
      {"no \"model\" object", [](json& j) { j.erase("model"); }},
  };
  for (const Case& c : cases) {
    json j = good;
    c.edit(j);
    const fs::path p = dir.path / "bad.json";
    std::ofstream(p) << j.dump();
    try {
      BpeTokenizer::load(p.string());
      ADD_FAILURE() << "accepted: " << c.what;
    } catch (const RunnerError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kModel);
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.what), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  std::ofstream(dir.path / "broken.json") << "{\"model\": ";
  EXPECT_THROW(BpeTokenizer::load((dir.path / "broken.json").string()), RunnerError);
  EXPECT_THROW(BpeTokenizer::load((dir.path / "missing.json").string()), RunnerError);
  EXPECT_THROW(BpeTokenizer::load(dir.path.string()), RunnerError);
}

TEST(BpeTokenizer, LoadTokenizerPicksTheFolderFormat) {
  TempDir dir;
  fs::create_directories(dir.path / "bpe");
  fs::create_directories(dir.path / "words");
  fs::create_directories(dir.path / "none");
  std::ofstream(dir.path / "bpe" / "tokenizer.json") << make_config(kMerges).dump();
  std::ofstream(dir.path / "words" / "vocab.json") << R"({"tokens": ["<bos>", "red"]})";
  EXPECT_NE(dynamic_cast<const BpeTokenizer*>(load_tokenizer((dir.path / "bpe").string()).get()), nullptr);
  const auto words = load_tokenizer((dir.path / "words").string());
  ASSERT_NE(dynamic_cast<const Vocabulary*>(words.get()), nullptr);
  EXPECT_EQ(words->size(), 2);
  try {
    load_tokenizer((dir.path / "none").string());
    ADD_FAILURE() << "a folder without a tokenizer was accepted";
  } catch (const RunnerError& e) {
    EXPECT_NE(std::string(e.what()).find((dir.path / "none").string()), std::string::npos) << e.what();
  }
}

// The real model's tokenizer (scripts/setup imports it); the ids are HF tokenizers 0.22.2's.

TEST(BpeTokenizer, RealModelMatchesHf) {
  const fs::path dir = testing::smollm2_dir();
  if (!fs::exists(dir / "tokenizer.json")) GTEST_SKIP() << "no model at " << dir << " (run scripts/setup)";
  const auto tok = load_tokenizer(dir.string());
  EXPECT_EQ(tok->size(), 49152);
  const std::string text =
      "Hello world! It's 2024, 12345 apples.\n\n  <|im_start|>user\nHi  there\t\tok<|im_end|>\n";
  // Tokenizer.from_file(".../tokenizer.json").encode(text).ids
  EXPECT_EQ(tok->encode(text),
            (std::vector<std::int32_t>{19556, 905,   17,  657, 506, 216, 34,    32, 34,    36, 28,
                                       216,   33,    34,  35,  36,  37,  13855, 30, 39892, 1,  4093,
                                       198,   26843, 216, 665, 197, 197, 2231,  2,  198}));
  EXPECT_EQ(tok->decode(tok->encode(text)), text);
  // invalid UTF-8 (HF cannot be given it) still encodes and decodes, but for the bytes without a token
  const std::string invalid =
      "a\x80"
      "b\xE2\x82 \xED\xA0\x80";
  EXPECT_EQ(tok->decode(tok->encode(invalid)), invalid);
  EXPECT_TRUE(tok->encode("\xFF\xC0").empty());
  for (int id = 0; id < 17; ++id) EXPECT_TRUE(tok->is_special(id)) << id;
  EXPECT_FALSE(tok->is_special(17));
  // 100 KB of the repo's docs in well under a second
  std::string docs;
  for (const auto& e : fs::directory_iterator(testing::source_dir() / "docs")) {
    if (!e.is_regular_file() || e.path().extension() != ".md") continue;
    std::ifstream in(e.path(), std::ios::binary);
    docs += std::string(std::istreambuf_iterator<char>(in), {});
  }
  while (docs.size() < 100'000) docs += docs;
  docs.resize(100'000);
  const BpeTokenizer fresh = BpeTokenizer::load((dir / "tokenizer.json").string());  // empty cache
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = fresh.encode(docs);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 0.5) << ids.size() << " ids";
  EXPECT_EQ(fresh.decode(ids), docs);
}

}  // namespace
}  // namespace kvscope::runner
