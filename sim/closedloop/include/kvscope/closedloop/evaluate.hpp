// Closed-loop evaluation (issue 6): held-out samples, runs with a ClosedLoopHook, and per (policy, budget)
// point the exact-match accuracy (overall and per family), the next-token KL against the uncompressed run
// and the bytes the cache held. Used by `kvcap eval`.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscope/closedloop/hook.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/model.hpp"
#include "kvscope/sim/policy.hpp"

namespace kvscope::closedloop {

// Bad evaluation input (missing or malformed heldout.json, too few samples): the message names the file.
class EvalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr std::array<const char*, 4> kFamilies = {"fine-grained", "counting", "two-image", "text-only"};
int family_index(const std::string& family);  // -1 when unknown

struct HeldoutSample {
  int index = 0;
  int family = 0;  // index into kFamilies
  std::string question, answer;
  std::vector<std::uint64_t> image_seeds;
};

// Reads DIR/heldout.json (written by kvscope.tinyvlm.export_samples). Throws EvalError.
std::vector<HeldoutSample> load_heldout(const std::string& model_dir);

// One run: greedy generation (forced == nullptr) or teacher forcing on `forced` (the logits at each of its
// positions; the token fed after position i is forced[i]). `hook` (may be null: uncompressed) is used as
// cache hook and observer. Same loop and stopping rule as runner::Model::generate. `after_prefill` (may be
// null): tokens fed after the prefill (and after the hook compressed it) and before generation, one decode
// step each (decode steps 0 .. n-1; the hook sees them as decode tokens), e.g. a question arriving after the
// context was compressed; generation starts from the last one's logits.
struct RunResult {
  std::vector<std::int32_t> tokens;        // generated (or forced) ids, ending with <eos> when produced
  std::vector<std::vector<float>> logits;  // [tokens.size()][V]: the logits each token was chosen from
  double seconds = 0;
  std::int64_t held_bytes = 0;  // hook->held_bytes() of the final cache (0 without a hook)
};
RunResult run_sample(runner::Model& model, const runner::Prompt& prompt, ClosedLoopHook* hook, int max_new,
                     const std::vector<std::int32_t>* forced = nullptr,
                     const std::vector<std::int32_t>* after_prefill = nullptr);

// The uncompressed prefill of one prompt, kept to continue several runs from (sample-outer evaluation): the
// cache, the logits of the last prompt position and each layer's prefill queries (what ClosedLoopHook
// observes during prefill).
struct Prefill {
  runner::KvCache cache{0, 0, 0};
  std::vector<float> logits;          // [V]
  std::vector<std::vector<float>> q;  // [L][Hq * T * D], as the observer sees them ([Hq, T, D])
  double seconds = 0;
};
Prefill run_prefill(runner::Model& model, const runner::Prompt& prompt);
// Same as run_sample(model, prompt, hook, max_new, forced, after_prefill), continuing from a copy of
// `prefill`'s cache: the
// recorded queries are replayed into `hook` (on_prefill_layer with empty k and v) before after_prefill.
// Results are identical to run_sample's (tested); `seconds` counts the continuation only.
RunResult run_from_prefill(runner::Model& model, const runner::Prompt& prompt, const Prefill& prefill,
                           ClosedLoopHook* hook, int max_new,
                           const std::vector<std::int32_t>* forced = nullptr,
                           const std::vector<std::int32_t>* after_prefill = nullptr);

// KL(P_ref || P) of softmax(logits) in double.
double next_token_kl(const std::vector<float>& ref_logits, const std::vector<float>& logits);

struct EvalPoint {
  std::string policy, budget;  // canonical name, budget as given ("-" for none)
  sim::PolicySpec spec;
  sim::Budget budget_spec;
};

struct PointStats {
  std::string policy, budget;
  int samples = 0;
  double keep = 1;                          // mean keep fraction the policy used
  double accuracy = 0;                      // exact match of the answer tokens + <eos>
  std::array<double, 4> family_accuracy{};  // NaN when no sample of the family
  std::array<int, 4> family_samples{};
  double kl = 0;         // mean next-token KL vs the uncompressed run (see docs)
  double agreement = 0;  // share of samples whose generated tokens equal the uncompressed run's
  double bytes_end = 0, bytes_peak = 0, bytes_full_end = 0;  // means over samples
  std::array<double, 4> bytes_end_modality{};
  double bytes_ratio = 1;   // bytes_end / bytes_full_end
  bool bytes_match = true;  // runner-held bytes == kvsim's predicted bytes for every sample
  double seconds = 0;       // wall time of the point
  int warnings = 0;         // samples whose replay warned (budget clamped to the forced set)
  // Per sample: the generated answer, tokens joined by spaces ("<eos>" included when produced); for text
  // tasks the decoded continuation of the answer prefix.
  std::vector<std::string> generated;
  std::vector<std::uint8_t> correct;  // per sample: 1 when the answer matched
};

// The uncompressed reference of one sample.
struct Reference {
  runner::Prompt prompt;
  std::vector<std::int32_t> answer_ids;  // dataset answer + <eos>
  // Text tasks (docs/tasks.md): when non-empty, a run is correct when its decoded text matches this answer
  // (answer_matches) instead of answer_ids.
  std::string answer_text;
  // Decodes generated ids for answer_text (null: the model's tokenizer); not owned.
  const runner::Tokenizer* tokenizer = nullptr;
  int family = 0;  // index into kFamilies
  // Tokens fed after the prefill and its compression, before generation (run_sample's after_prefill): with
  // QuestionSetting::kAfterCompression the question, the end of the user turn and the answer prefix;
  // empty when the whole prompt is prefilled.
  std::vector<std::int32_t> after_prefill;
  RunResult run;
};

// Where a task's question is when the policy compresses (docs/tasks.md "Two settings"):
// kAfterCompression prefills the context only (the prompt up to the question's first token), compresses it,
// then feeds the rest of the prompt as decode steps (what kvcap run --task records and kvsim replays by
// default); kInContext prefills the whole prompt, question included, and compresses that
// (kvsim --question-in-context).
enum class QuestionSetting { kAfterCompression, kInContext };
// The tiny VLM's held-out samples: prompts and answers; with `run` (max_new > 0) also the uncompressed run.
std::vector<Reference> make_references(runner::Model& model, const std::vector<HeldoutSample>& samples,
                                       int max_new);

// The text a task sample is run on: the user message rendered with `chat` (its default system prompt, the
// assistant turn opened), then the answer prefix. kvcap eval --task and kvcap run --task encode it whole.
std::string task_prompt_text(const runner::ChatTemplate& chat, const TaskSample& sample);
// The role (trace::Role code) of each token of `ids`, the tokenizer's encoding of task_prompt_text(chat,
// sample) (docs/tasks.md "Roles"): the system prompt, chat markup and the task's intro line are template,
// the haystack with its facts context, the question question, the pre-filled answer prefix answer. A token
// takes the role of its first byte. Throws TaskError when the tokens' texts do not spell the prompt text.
std::vector<std::uint8_t> task_token_roles(const runner::Tokenizer& tokenizer,
                                           const std::vector<std::int32_t>& ids,
                                           const runner::ChatTemplate& chat, const TaskSample& sample);
// Token counts of the user message for make_task_samples, with the model's tokenizer.
TokenCounter token_counter(const runner::Tokenizer& tokenizer);

// A text task's sample (docs/tasks.md) as a reference of the text model: the user message rendered with
// `chat` (its default system prompt, the assistant turn opened), then the answer prefix, encoded by
// `tokenizer`; family "text-only"; answer_ids = the encoded " " + answer + EOS (for inspection).
// With kAfterCompression the prompt is split at its first question token (task_token_roles) into the
// prefilled context and after_prefill; throws TaskError when either part is empty.
Reference make_task_reference(runner::Model& model, const runner::Tokenizer& tokenizer,
                              const runner::ChatTemplate& chat, const TaskSample& sample,
                              QuestionSetting setting = QuestionSetting::kAfterCompression);

// Runs one point on every reference, each run with its own prefill. `progress(done)` is called after each
// sample.
PointStats evaluate_point(runner::Model& model, const EvalPoint& point, const std::vector<Reference>& refs,
                          int max_new, const std::function<void(int)>& progress = {});

// Sample-outer evaluation: per sample ONE uncompressed prefill (run_prefill), from which the reference run
// (filling refs[i].run) and every point's runs continue. The first `full` point is the reference run itself
// (made with its hook, not decoded twice); the others go up to `max_batch` points at a time (0: as many as
// 4 GiB of uncompressed caches of the prompt hold; another `full` alone, so that it reproduces the
// uncompressed run bit for bit) decoded together: each run compressed by its own hook,
// then every run's forward of a step batched into one (DecoderBackend::forward_batch), and a run that first
// differs from the reference forked there into its teacher-forced run (prefill-mode policies; decode-time
// policies run it anew). Results equal evaluate_point's per point up to the float rounding of the batched
// products (tested), except `seconds`: each point's compression, its hook's work and its share of the
// batched forwards. `progress(done)` is called after each run (points.size() + 1 per sample).
std::vector<PointStats> evaluate_shared(runner::Model& model, const std::vector<EvalPoint>& points,
                                        std::vector<Reference>& refs, int max_new,
                                        const std::function<void(std::size_t)>& progress = {},
                                        int max_batch = 0);

}  // namespace kvscope::closedloop
