// Long-context tasks (issue 14, docs/tasks.md): prompts built from real prose (the license texts Debian's
// base-files installs, or any text files given) with facts hidden at a random depth, and an answer checked
// by exact match. Deterministic for (task, length, seed, sample index); the only I/O is reading the haystack
// files. Lengths are in tokens of the user message as counted by the caller's tokenizer.
//
// Tasks:
//   passkey   "The pass key is 48213." hidden in the prose; asked "What is the pass key?"
//   needle    a fact about a named person ("Marta Lindqvist's favourite city is Lisbon.", "... favourite
//             animal is the owl.")
//   multikey  four "The special number for the <object> is NNNNN." facts; one object is asked
//   vartrack  "The value of variable A is NNNNN." ... later "Variable B has the same value as variable A."
//             plus one distractor variable; asked B (two hops)
//   varupdate "The value of variable A is NNNNN." ... later "Then the value of variable A is changed to
//             MMMMM."; asked A's value now (state tracking: the first value is the distractor)
// Each prompt ends with the question; the assistant turn is pre-filled with `answer_prefix` ("The pass key
// is") so the first generated tokens are the answer.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvscope::closedloop {

// Bad task input (unknown task, length out of range, missing or empty haystack): one line.
class TaskError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr std::array<const char*, 5> kTaskNames = {"passkey", "needle", "multikey", "vartrack", "varupdate"};
constexpr int kMinTaskLength = 512, kMaxTaskLength = 4096;
// "passkey, needle, multikey, vartrack, varupdate"
std::string task_names_list();

// A task at a prompt length (tokens of the user message).
struct TaskLength {
  const char* task;
  int length;
};
// The default suite: the task/length combinations where the uncompressed SmolLM2-135M-Instruct answers at
// least 80 % of 100 samples (seed 0, kvcap eval --policies full; docs/tasks.md has the measured table).
// `kvcap tasks --suite` lists it.
constexpr std::array<TaskLength, 11> kDefaultSuite = {{{"passkey", 512},
                                                       {"needle", 512},
                                                       {"multikey", 512},
                                                       {"varupdate", 512},
                                                       {"passkey", 1024},
                                                       {"needle", 1024},
                                                       {"multikey", 1024},
                                                       {"varupdate", 1024},
                                                       {"needle", 2048},
                                                       {"multikey", 2048},
                                                       {"needle", 4096}}};
// Throws TaskError "unknown task 'x' (valid: ...)" unless `name` is one of kTaskNames.
void check_task_name(const std::string& name);

// Sentences of real prose, in file order (files sorted by name; a file reached twice, e.g. through the
// symlink GPL -> GPL-3, is read once, where it is first reached).
struct Haystack {
  std::vector<std::string> sentences;
  std::vector<std::string> files;  // the files read (canonical paths)
};
// The default corpus: every regular file in /usr/share/common-licenses (Debian's base-files).
std::vector<std::string> default_haystack_paths();
// Reads files and directories (a directory: its regular files, sorted by name). Whitespace is collapsed and
// the text split into sentences at ". ", "? ", "! "; sentences under 20 or over 600 bytes are dropped.
// Throws TaskError naming the path when it is missing or when no sentences remain.
Haystack load_haystack(const std::vector<std::string>& paths);

struct TaskSample {
  std::string task;
  int length = 0;                // requested tokens of the user message
  std::uint64_t seed = 0;        // generator seed
  int index = 0;                 // sample index (0 .. samples-1)
  std::string user;              // the user message: intro, "\n\n", haystack with the facts, "\n\n", question
  std::string question;          // the question (the end of `user`)
  std::size_t context_char = 0;  // byte offset in `user` where the haystack starts (after the intro)
  std::size_t question_char = 0;  // byte offset in `user` where the question starts
  std::string answer_prefix;      // pre-filled assistant text, e.g. "The pass key is"
  std::string answer;             // expected answer, e.g. "48213"
  std::size_t needle_char = 0;    // byte offset of the answer inside `user`
  int needle_token = 0;           // tokens of user[0, needle_char)
  double depth = 0;               // needle_char / user.size()
  int tokens = 0;                 // tokens of `user`
};

// Tokens of a text (the model's tokenizer, without special tokens).
using TokenCounter = std::function<int(const std::string&)>;
// A rough counter for tests and tokenizer-less use: one token per 4.8 bytes (SmolLM2's BPE averages 4.8
// bytes a token on the license texts), rounded up.
int approx_token_count(const std::string& text);

// `samples` prompts of `task` at `length` tokens (kMinTaskLength .. kMaxTaskLength), within 3 % below the
// requested length (never above it). Sample i depends only on (task, length, seed, i) and the haystack.
// Throws TaskError for an unknown task, a length out of range, samples < 1, or a haystack too small.
std::vector<TaskSample> make_task_samples(const std::string& task, int length, int samples,
                                          std::uint64_t seed, const Haystack& haystack,
                                          const TokenCounter& count);

// Whole-word occurrences of `word` in `text` (neighbours not letters or digits).
int count_word(const std::string& text, const std::string& word);

// Exact match of a generated continuation (of the answer prefix): leading whitespace skipped, the answer
// must follow, then the end or a character that is neither a letter nor a digit.
bool answer_matches(const std::string& generated, const std::string& answer);

}  // namespace kvscope::closedloop
