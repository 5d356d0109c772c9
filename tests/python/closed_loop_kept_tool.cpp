// Test tool for python.hf_closed_loop: runs kvscope's C++ closed loop (the functions kvcap eval --task runs:
// make_task_reference, run_prefill, run_from_prefill with a ClosedLoopHook) on task samples of a text model
// and prints, per sample and policy point, the generated ids, whether the answer matched, kvsim's predicted
// bytes, the bytes the runner's cache held, and the token ids each layer's kv heads hold at the end.
//
//   closed_loop_kept_tool MODEL_DIR TASK LENGTH SEED SAMPLES MAX_NEW POLICY:BUDGET [POLICY:BUDGET ...]
//
// A point is POLICY:BUDGET, or POLICY@BUDGET when the policy's name has a colon itself (a decode-time
// policy with an eviction interval: h2o~decode:4@0.3); POLICY alone runs without a budget.
//
// Output: one JSON object per line ({"sample", "policy", "budget", "generated", "correct",
// "predicted_bytes", "held_bytes", "kept": [layer][kv head][ids]}).
#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvscope/closedloop/evaluate.hpp"
#include "kvscope/closedloop/report.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/tokenizer.hpp"
#include "kvscope/sim/closed_loop.hpp"

using namespace kvscope;

namespace {

// The closed loop's hook, also keeping the token index of every slot the runner's cache holds after each
// step (the cache itself is local to run_from_prefill).
class RecordingHook : public closedloop::ClosedLoopHook {
 public:
  using ClosedLoopHook::ClosedLoopHook;
  void after_prefill(runner::KvCache& cache, const std::vector<runner::TokenInfo>& context) override {
    ClosedLoopHook::after_prefill(cache, context);
    snapshot(cache);
  }
  void after_decode_step(runner::KvCache& cache, int step, const runner::TokenInfo& token) override {
    ClosedLoopHook::after_decode_step(cache, step, token);
    snapshot(cache);
  }
  // [layer][kv head] token indices held (context t < T, decode step j as T + j), ascending.
  std::vector<std::vector<std::vector<std::int32_t>>> held;

 private:
  void snapshot(const runner::KvCache& cache) {
    held.assign(static_cast<std::size_t>(cache.num_layers()), {});
    for (int l = 0; l < cache.num_layers(); ++l)
      for (int h = 0; h < cache.num_kv_heads(); ++h) {
        std::vector<std::int32_t> ids;
        const runner::HeadCache& hc = cache.head(l, h);
        for (int s = 0; s < hc.size(); ++s) ids.push_back(hc.info(s).token.index);
        std::sort(ids.begin(), ids.end());
        held[static_cast<std::size_t>(l)].push_back(std::move(ids));
      }
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::cerr << "usage: closed_loop_kept_tool MODEL_DIR TASK LENGTH SEED SAMPLES MAX_NEW POLICY:BUDGET...\n";
    return 2;
  }
  try {
    const std::string model_dir = argv[1], task = argv[2];
    const int length = std::stoi(argv[3]), samples = std::stoi(argv[5]), max_new = std::stoi(argv[6]);
    const std::uint64_t seed = std::stoull(argv[4]);
    closedloop::set_threads(1);
    runner::Model model = runner::Model::load(model_dir);
    const auto tokenizer = runner::load_tokenizer(model_dir);
    const runner::ChatTemplate chat = runner::ChatTemplate::load(model_dir);
    const closedloop::Haystack haystack = closedloop::load_haystack(closedloop::default_haystack_paths());
    const auto task_samples = closedloop::make_task_samples(task, length, samples, seed, haystack,
                                                            closedloop::token_counter(*tokenizer));
    sim::PolicyRegistry registry;
    for (const auto& ts : task_samples) {
      const closedloop::Reference ref = closedloop::make_task_reference(
          model, *tokenizer, chat, ts, closedloop::QuestionSetting::kInContext);  // as kvscope.hf compresses
      const closedloop::Prefill prefill = closedloop::run_prefill(model, ref.prompt);
      for (int a = 7; a < argc; ++a) {
        const std::string point = argv[a];
        const std::size_t at = point.find('@');
        const std::size_t split = at != std::string::npos ? at : point.find(':');
        const std::string name = point.substr(0, split);
        const std::string budget = split == std::string::npos ? "" : point.substr(split + 1);
        const sim::PolicySpec spec = registry.get(name);
        sim::check_closed_loop_support(spec);
        const sim::Budget b = budget.empty() ? sim::Budget{} : sim::parse_budget(budget);
        RecordingHook hook(spec, b, model.config());
        const closedloop::RunResult run =
            closedloop::run_from_prefill(model, ref.prompt, prefill, &hook, max_new);
        nlohmann::json out;
        out["sample"] = ts.index;
        out["policy"] = name;
        out["budget"] = budget;
        out["generated"] = run.tokens;
        const std::string text = tokenizer->decode(run.tokens);
        out["text"] = text;
        out["correct"] = closedloop::answer_matches(text, ref.answer_text);
        out["predicted_bytes"] = hook.predicted_bytes().total;
        out["held_bytes"] = run.held_bytes;
        out["kept"] = hook.held;
        std::cout << out.dump() << "\n" << std::flush;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "closed_loop_kept_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
