// kvcap tasks: writes the long-context task prompts of kvscope::closedloop (docs/tasks.md) as JSON lines,
// for inspection and for scoring them with another runtime (scripts/task_accuracy.py runs them with HF).
#include <boost/program_options.hpp>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "eval_command.hpp"
#include "kvscope/cli/options.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/tokenizer.hpp"

namespace po = boost::program_options;

namespace kvscope::cli {

namespace {

int tasks_fail(const std::string& msg) { return fail("kvcap tasks", msg); }

}  // namespace

int tasks_command(const std::vector<std::string>& args) {
  po::options_description opts(
      "kvcap tasks --task NAME [--length N] [--samples N] [--seed S] [-o FILE]\n"
      "kvcap tasks --suite\n\n"
      "Writes long-context task prompts (docs/tasks.md) as JSON lines, one sample a line: task, length,\n"
      "seed, index, user (the user message), question, context_char and question_char (byte offsets in\n"
      "user where the haystack and the question start; docs/tasks.md \"Roles\"), answer_prefix (pre-filled\n"
      "assistant text), answer, needle_char, needle_token, depth, tokens.\nTasks: " +
      closedloop::task_names_list() +
      ".\n"
      "Lengths count tokens of --model's tokenizer (tokenizer.json), else 4.8 bytes a token (approximate).\n"
      "With --model and the same --seed the prompts are exactly those kvcap eval --task runs on it.\n"
      "--suite lists the default suite instead, one 'task length' a line: the combinations where the\n"
      "uncompressed SmolLM2-135M-Instruct reaches >= 80 % over 100 samples (docs/tasks.md).\n\nOptions");
  opts.add_options()("help,h", "show this help")("task", po::value<std::string>(), "task name")(
      "suite", "list the default suite (task length per line) and exit")(
      "length", po::value<int>()->default_value(1024), "tokens of the user message (512 .. 4096)")(
      "samples", po::value<int>()->default_value(100), "number of samples")(
      "seed", po::value<unsigned long long>()->default_value(0),
      "generator seed (the default of kvcap eval --task and kvcap run --task too)")(
      "haystack", po::value<std::vector<std::string>>(),
      "prose files or directories (repeatable; default /usr/share/common-licenses)")(
      "model", po::value<std::string>(), "model folder whose tokenizer counts the tokens")(
      "output,o", po::value<std::string>(), "JSON-lines file (default: stdout)");
  po::variables_map vm;
  const std::string examples =
      "\nExample:\n  kvcap tasks --task passkey --length 1024 --samples 100 -o passkey.jsonl\n";
  if (const auto exit = parse_options("kvcap tasks", args, opts, vm, examples)) return *exit;
  if (vm.count("suite")) {
    for (const auto& tl : closedloop::kDefaultSuite) std::cout << tl.task << " " << tl.length << "\n";
    return 0;
  }
  if (!vm.count("task")) return tasks_fail("missing --task (valid: " + closedloop::task_names_list() + ")");
  std::vector<closedloop::TaskSample> samples;
  try {
    const std::vector<std::string> paths = vm.count("haystack")
                                               ? vm["haystack"].as<std::vector<std::string>>()
                                               : closedloop::default_haystack_paths();
    const std::string task = vm["task"].as<std::string>();
    closedloop::check_task_name(task);
    const closedloop::Haystack hay = closedloop::load_haystack(paths);
    std::shared_ptr<const runner::Tokenizer> tokenizer;
    closedloop::TokenCounter count = closedloop::approx_token_count;
    if (vm.count("model")) {
      tokenizer = runner::load_tokenizer(vm["model"].as<std::string>());
      count = [&](const std::string& t) {
        return t.empty() ? 0 : static_cast<int>(tokenizer->encode(t).size());
      };
    }
    samples = closedloop::make_task_samples(task, vm["length"].as<int>(), vm["samples"].as<int>(),
                                            vm["seed"].as<unsigned long long>(), hay, count);
  } catch (const closedloop::TaskError& e) {
    return tasks_fail(e.what());
  } catch (const runner::RunnerError& e) {
    return tasks_fail(e.what());
  }
  std::ofstream file;
  if (vm.count("output")) {
    file.open(vm["output"].as<std::string>());
    if (!file) return tasks_fail(vm["output"].as<std::string>() + ": cannot be written");
  }
  std::ostream& os = vm.count("output") ? file : std::cout;
  for (const auto& s : samples) {
    const nlohmann::json j = {{"task", s.task},
                              {"length", s.length},
                              {"seed", s.seed},
                              {"index", s.index},
                              {"user", s.user},
                              {"question", s.question},
                              {"context_char", s.context_char},
                              {"question_char", s.question_char},
                              {"answer_prefix", s.answer_prefix},
                              {"answer", s.answer},
                              {"needle_char", s.needle_char},
                              {"needle_token", s.needle_token},
                              {"depth", s.depth},
                              {"tokens", s.tokens}};
    os << j.dump() << "\n";
  }
  return os ? 0 : tasks_fail("write failed");
}

}  // namespace kvscope::cli
