// Long-context tasks (kvscope/closedloop/tasks.hpp, docs/tasks.md): determinism, the answer hidden exactly
// once at the stated depth, lengths, bad input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "kvscope/closedloop/evaluate.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/tokenizer.hpp"

namespace fs = std::filesystem;
using namespace kvscope::closedloop;

namespace {

const Haystack& licenses() {
  static const Haystack h = load_haystack(default_haystack_paths());
  return h;
}

bool have_licenses() { return fs::is_directory("/usr/share/common-licenses"); }

// A counter different from the approximate one: whitespace-separated words.
int word_count(const std::string& text) {
  std::istringstream in(text);
  std::string w;
  int n = 0;
  while (in >> w) ++n;
  return n;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const TaskError& e) {
    return e.what();
  }
  return "";
}

class Tasks : public testing::Test {
 protected:
  void SetUp() override {
    if (!have_licenses()) GTEST_SKIP() << "needs /usr/share/common-licenses (Debian's base-files package)";
  }
};

TEST_F(Tasks, HaystackIsRealProseFromEveryLicenseFile) {
  const Haystack& h = licenses();
  EXPECT_GE(h.files.size(), 10u);
  EXPECT_GT(h.sentences.size(), 1000u);
  std::set<std::string> distinct(h.sentences.begin(), h.sentences.end());
  EXPECT_GT(distinct.size(), h.sentences.size() / 2) << "the prose is mostly repeated";
  for (const auto& f : h.files)
    EXPECT_FALSE(fs::is_symlink(f)) << f << " (symlinks are read via their target)";
  for (const auto& s : h.sentences) {
    EXPECT_GE(s.size(), 20u);
    EXPECT_LE(s.size(), 600u);
    EXPECT_EQ(s.find('\n'), std::string::npos);
  }
}

TEST_F(Tasks, SameSeedSamePromptsDifferentSeedsDiffer) {
  for (const char* task : kTaskNames) {
    const auto a = make_task_samples(task, 1024, 5, 7, licenses(), approx_token_count);
    const auto b = make_task_samples(task, 1024, 5, 7, licenses(), approx_token_count);
    const auto c = make_task_samples(task, 1024, 5, 8, licenses(), approx_token_count);
    ASSERT_EQ(a.size(), 5u);
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].user, b[i].user) << task << " " << i;
      EXPECT_EQ(a[i].answer, b[i].answer) << task << " " << i;
      EXPECT_EQ(a[i].needle_char, b[i].needle_char) << task << " " << i;
      EXPECT_NE(a[i].user, c[i].user) << task << " " << i;
      EXPECT_EQ(a[i].task, task);
      EXPECT_EQ(a[i].seed, 7u);
      EXPECT_EQ(a[i].index, static_cast<int>(i));
    }
    EXPECT_NE(a[0].user, a[1].user) << task;
    // Sample i does not depend on how many are drawn.
    const auto one = make_task_samples(task, 1024, 3, 7, licenses(), approx_token_count);
    EXPECT_EQ(one[2].user, a[2].user) << task;
  }
}

TEST_F(Tasks, AnswerOccursOnceAtTheStatedDepth) {
  for (const char* task : kTaskNames) {
    double min_depth = 1, max_depth = 0;
    for (const auto& s : make_task_samples(task, 512, 40, 3, licenses(), approx_token_count)) {
      EXPECT_EQ(count_word(s.user, s.answer), 1) << task << " " << s.index;
      ASSERT_LT(s.needle_char + s.answer.size(), s.user.size());
      EXPECT_EQ(s.user.substr(s.needle_char, s.answer.size()), s.answer) << task << " " << s.index;
      EXPECT_DOUBLE_EQ(s.depth, static_cast<double>(s.needle_char) / static_cast<double>(s.user.size()));
      EXPECT_EQ(s.needle_token, approx_token_count(s.user.substr(0, s.needle_char)));
      EXPECT_FALSE(s.answer_prefix.empty());
      EXPECT_NE(s.answer_prefix.back(), ' ') << "the answer's tokens start with their space";
      min_depth = std::min(min_depth, s.depth);
      max_depth = std::max(max_depth, s.depth);
    }
    EXPECT_LT(min_depth, 0.25) << task << ": needles are not spread over the context";
    EXPECT_GT(max_depth, 0.75) << task << ": needles are not spread over the context";
  }
}

TEST_F(Tasks, TaskStructure) {
  for (const auto& s : make_task_samples("passkey", 512, 5, 1, licenses(), approx_token_count)) {
    EXPECT_NE(s.user.find("The pass key is " + s.answer + "."), std::string::npos);
    EXPECT_TRUE(std::regex_match(s.answer, std::regex("[1-9][0-9]{4}")));
    EXPECT_EQ(s.answer_prefix, "The pass key is");
  }
  for (const auto& s : make_task_samples("needle", 512, 5, 1, licenses(), approx_token_count)) {
    EXPECT_NE(s.user.find(s.answer_prefix + " " + s.answer + "."), std::string::npos);
    const std::string subject = s.answer_prefix.substr(0, s.answer_prefix.find(" is"));
    EXPECT_NE(s.user.find("What is " + subject + "?"), std::string::npos) << s.answer_prefix;
  }
  for (const auto& s : make_task_samples("multikey", 512, 5, 1, licenses(), approx_token_count)) {
    const std::regex fact("The special number for the [a-z]+ is ([0-9]{5})\\.");
    std::set<std::string> numbers;
    for (auto it = std::sregex_iterator(s.user.begin(), s.user.end(), fact); it != std::sregex_iterator();
         ++it)
      numbers.insert((*it)[1]);
    EXPECT_EQ(numbers.size(), 4u) << "four distinct keys";
    EXPECT_EQ(numbers.count(s.answer), 1u);
  }
  for (const auto& s : make_task_samples("vartrack", 512, 10, 1, licenses(), approx_token_count)) {
    const std::smatch m = [&] {
      std::smatch r;
      std::regex_search(s.user, r,
                        std::regex("Variable ([A-Za-z]+) has the same value as variable ([A-Za-z]+)\\."));
      return r;
    }();
    ASSERT_EQ(m.size(), 3u);
    EXPECT_EQ(s.answer_prefix, "The value of variable " + m[1].str() + " is");
    const std::string def = "The value of variable " + m[2].str() + " is " + s.answer + ".";
    const std::size_t at = s.user.find(def);
    ASSERT_NE(at, std::string::npos);
    EXPECT_LT(at, static_cast<std::size_t>(m.position(0))) << "the value is defined before the alias";
  }
  for (const auto& s : make_task_samples("varupdate", 512, 10, 1, licenses(), approx_token_count)) {
    std::smatch first, change;
    ASSERT_TRUE(
        std::regex_search(s.user, first, std::regex("The value of variable ([A-Za-z]+) is ([0-9]{5})\\.")));
    ASSERT_TRUE(std::regex_search(
        s.user, change, std::regex("Then the value of variable ([A-Za-z]+) is changed to ([0-9]{5})\\.")));
    EXPECT_EQ(first[1].str(), change[1].str()) << "one variable, changed";
    EXPECT_EQ(change[2].str(), s.answer) << "the answer is the value after the change";
    EXPECT_NE(first[2].str(), s.answer);
    EXPECT_LT(first.position(0), change.position(0)) << "the first value comes before the change";
    EXPECT_EQ(s.answer_prefix, "The value of variable " + first[1].str() + " is now");
    EXPECT_NE(s.user.find("What is the value of variable " + first[1].str() + " now?"), std::string::npos);
  }
}

TEST_F(Tasks, LengthsWithinThreePercentBelowTheRequest) {
  for (const char* task : kTaskNames) {
    for (int length : {512, 1024, 2048, 4096}) {
      for (const auto& s : make_task_samples(task, length, 3, 11, licenses(), approx_token_count)) {
        EXPECT_EQ(s.tokens, approx_token_count(s.user));
        EXPECT_LE(s.tokens, length) << task << " " << length;
        EXPECT_GE(s.tokens, length * 0.97) << task << " " << length;
      }
    }
  }
  // The caller's counter decides the length.
  for (const auto& s : make_task_samples("passkey", 1024, 3, 11, licenses(), word_count)) {
    EXPECT_LE(word_count(s.user), 1024);
    EXPECT_GE(word_count(s.user), 1000);
  }
}

TEST_F(Tasks, BadInput) {
  const std::string unknown =
      error_of([] { make_task_samples("nope", 1024, 1, 1, licenses(), approx_token_count); });
  EXPECT_NE(unknown.find("unknown task 'nope'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("passkey, needle, multikey, vartrack, varupdate"), std::string::npos) << unknown;
  for (int bad : {0, 511, 4097, 100000}) {
    const std::string e =
        error_of([&] { make_task_samples("passkey", bad, 1, 1, licenses(), approx_token_count); });
    EXPECT_NE(e.find("out of range (512 .. 4096 tokens)"), std::string::npos) << e;
  }
  const std::string few =
      error_of([] { make_task_samples("passkey", 1024, 0, 1, licenses(), approx_token_count); });
  EXPECT_NE(few.find("samples must be >= 1"), std::string::npos) << few;
  const std::string missing = error_of([] { load_haystack({"/nonexistent/licenses"}); });
  EXPECT_NE(missing.find("haystack /nonexistent/licenses not found"), std::string::npos) << missing;
  EXPECT_NE(missing.find("base-files"), std::string::npos) << missing;
  const fs::path empty = fs::temp_directory_path() / ("kvscope_tasks_empty_" + std::to_string(::getpid()));
  fs::create_directories(empty);
  std::ofstream(empty / "short.txt") << "too short.\n";
  const std::string none = error_of([&] { load_haystack({empty.string()}); });
  EXPECT_NE(none.find("no sentences of prose"), std::string::npos) << none;
  // A haystack smaller than the request.
  std::ofstream(empty / "small.txt")
      << "This is one sentence of prose for the test. And here is a second one.\n";
  const Haystack small = load_haystack({empty.string()});
  const std::string tiny =
      error_of([&] { make_task_samples("passkey", 4096, 1, 1, small, approx_token_count); });
  EXPECT_NE(tiny.find("haystack too small"), std::string::npos) << tiny;
  fs::remove_all(empty);
}

TEST_F(Tasks, OurDocsAsHaystack) {
  const fs::path docs = fs::path(KVSCOPE_TEST_SOURCE_DIR) / "docs";
  const Haystack h = load_haystack({docs.string()});
  EXPECT_GT(h.sentences.size(), 200u);
  const auto s = make_task_samples("needle", 2048, 2, 5, h, approx_token_count);
  EXPECT_EQ(count_word(s[0].user, s[0].answer), 1);
}

TEST(TaskSuite, DefaultSuiteHoldsValidDistinctCombinations) {
  std::set<std::pair<std::string, int>> seen;
  for (const auto& tl : kDefaultSuite) {
    EXPECT_NO_THROW(check_task_name(tl.task));
    EXPECT_GE(tl.length, kMinTaskLength);
    EXPECT_LE(tl.length, kMaxTaskLength);
    EXPECT_TRUE(seen.insert({tl.task, tl.length}).second) << tl.task << " " << tl.length << " twice";
  }
  // Out, as measured over 100 samples (docs/tasks.md): vartrack answers 40 % at 512 tokens, passkey 74 % at
  // 2048 and 48 % at 4096 (the misses describe "a five-digit number" instead of giving it), varupdate 71 % at
  // 2048 and 67 % at 4096, multikey 78 % at 4096.
  EXPECT_EQ(seen.count({"vartrack", 512}), 0u);
  EXPECT_EQ(seen.count({"passkey", 2048}), 0u);
  EXPECT_EQ(seen.count({"varupdate", 2048}), 0u);
  for (const char* out : {"passkey", "multikey", "varupdate"}) EXPECT_EQ(seen.count({out, 4096}), 0u) << out;
  // In: varupdate answers 84 % at 512 tokens and 92 % at 1024 (the misses give the value before the change),
  // needle 93 % at 4096.
  EXPECT_EQ(seen.count({"varupdate", 512}), 1u);
  EXPECT_EQ(seen.count({"varupdate", 1024}), 1u);
  EXPECT_EQ(seen.count({"needle", 4096}), 1u);
}

TEST(TaskMatch, AnswerMatches) {
  EXPECT_TRUE(answer_matches(" 48213.", "48213"));
  EXPECT_TRUE(answer_matches("48213", "48213"));
  EXPECT_TRUE(answer_matches(" 48213<|im_end|>", "48213"));
  EXPECT_TRUE(answer_matches(" Lisbon, of course", "Lisbon"));
  EXPECT_FALSE(answer_matches(" 482135", "48213"));
  EXPECT_FALSE(answer_matches(" 4821", "48213"));
  EXPECT_FALSE(answer_matches(" the 48213", "48213"));
  EXPECT_FALSE(answer_matches("", "48213"));
  EXPECT_EQ(count_word("red required red. bored red", "red"), 3);
  EXPECT_EQ(count_word("12345 123456 012345", "12345"), 1);
}

}  // namespace

namespace kvscope::closedloop {
namespace {

// One token per byte (its text the byte): roles are then visible byte by byte.
class ByteTokenizer final : public runner::Tokenizer {
 public:
  ByteTokenizer() {
    for (int i = 0; i < 256; ++i) bytes_.push_back(std::string(1, static_cast<char>(i)));
  }
  int size() const override { return 256; }
  const std::string& text(int id) const override { return bytes_.at(static_cast<std::size_t>(id)); }
  std::vector<std::int32_t> encode(const std::string& t) const override {
    std::vector<std::int32_t> ids;
    for (char c : t) ids.push_back(static_cast<unsigned char>(c));
    return ids;
  }
  std::string decode(const std::vector<std::int32_t>& ids) const override {
    std::string s;
    for (auto i : ids) s += bytes_.at(static_cast<std::size_t>(i));
    return s;
  }
  bool is_special(int) const override { return false; }

 private:
  std::vector<std::string> bytes_;
};

TEST(TaskRoles, RolesFollowThePromptParts) {
  if (!fs::is_directory("/usr/share/common-licenses")) GTEST_SKIP() << "needs Debian's base-files";
  const std::string smol =  // SmolLM2-135M-Instruct's chat_template.jinja
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
      "'<|im_start|>system\n"
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  const runner::ChatTemplate chat = runner::ChatTemplate::parse(smol, "chat_template.jinja");
  const Haystack hay = load_haystack(default_haystack_paths());
  const TaskSample s = make_task_samples("passkey", 512, 1, 0, hay, approx_token_count)[0];
  ASSERT_EQ(s.user.substr(s.question_char), s.question);
  EXPECT_EQ(s.question, "What is the pass key? It is a five-digit number.");
  ByteTokenizer tok;
  const std::string text = task_prompt_text(chat, s);
  const std::vector<std::int32_t> ids = tok.encode(text);
  const std::vector<std::uint8_t> roles = task_token_roles(tok, ids, chat, s);
  ASSERT_EQ(roles.size(), text.size());
  std::string by_role[4];
  for (std::size_t i = 0; i < text.size(); ++i) by_role[roles[i]] += text[i];
  EXPECT_EQ(by_role[1], s.question);       // question
  EXPECT_EQ(by_role[2], s.answer_prefix);  // answer: the pre-filled prefix
  EXPECT_EQ(by_role[0], s.user.substr(s.context_char, s.question_char - s.context_char));  // the haystack
  EXPECT_NE(by_role[0].find("The pass key is " + s.answer + "."), std::string::npos);
  EXPECT_EQ(by_role[3].rfind("<|im_start|>system\n", 0), 0u)
      << by_role[3];  // template: system, intro, markup
  EXPECT_NE(by_role[3].find("There is a pass key hidden in the text below."), std::string::npos);
  EXPECT_NE(by_role[3].find("<|im_end|>\n<|im_start|>assistant\n"), std::string::npos);
  // One contiguous run each: template, context, question, template, answer.
  int runs = 1;
  for (std::size_t i = 1; i < roles.size(); ++i) runs += roles[i] != roles[i - 1];
  EXPECT_EQ(runs, 5);
  // Tokens that do not spell the prompt are refused in one line.
  std::vector<std::int32_t> wrong = ids;
  wrong[3] = 'Z';
  try {
    task_token_roles(tok, wrong, chat, s);
    ADD_FAILURE() << "accepted";
  } catch (const TaskError& e) {
    EXPECT_NE(std::string(e.what()).find("token 3 does not spell the prompt text at byte 3"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kvscope::closedloop
