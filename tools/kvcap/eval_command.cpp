// kvcap eval: runs held-out samples of the tiny VLM with each policy x budget applied to the runner's real
// KV cache (closed loop, kvscope::closedloop) and reports accuracy, KL against the uncompressed run and
// bytes.
#include "eval_command.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <iostream>
#include <numeric>
#include <set>

#include "kvscope/cli/options.hpp"
#include "kvscope/cli/progress.hpp"
#include "kvscope/closedloop/evaluate.hpp"
#include "kvscope/closedloop/report.hpp"
#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/tokenizer.hpp"
#include "kvscope/sim/closed_loop.hpp"
#include "kvscope/sim/sweep.hpp"

namespace po = boost::program_options;

namespace kvscope::cli {

namespace {

int fail(const std::string& msg) { return cli::fail("kvcap eval", msg); }

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    if (end > start) out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

po::options_description make_options() {
  po::options_description opts(
      "kvcap eval --model DIR --policies a,b,... [--budgets LIST] [--samples N] [options]\n\n"
      "Closed-loop evaluation: for every policy x budget, runs N held-out samples (DIR/heldout.json, written "
      "by\n"
      "python3 -m kvscope.tinyvlm.export_samples) through the reference runner with the policy applied to\n"
      "its real KV cache after prefill by kvsim's own policy code, and generates from the compressed cache.\n"
      "Reports exact-match accuracy (overall and per family), the mean next-token KL against the\n"
      "uncompressed run (teacher-forced on its answer), and the bytes the cache held (per modality).\n"
      "'full' is always evaluated as the reference; quantization-only policies run once (budget '-').\n"
      "Decode-time policies (NAME~decode[:N]) evict during decoding with kvsim's decode-time rule.\n"
      "Method: docs/results-format.md, section \"Closed-loop results (kvcap eval)\".\n"
      "Text models (LlamaForCausalLM folders): --task NAME runs N long-context task prompts (docs/tasks.md)\n"
      "instead of heldout.json, the answer prefix pre-filled, scored by exact match of the answer. By\n"
      "default the question arrives after compression: the context (system prompt, intro, haystack) is\n"
      "prefilled and compressed, then the question, the end of the user turn and the answer prefix are fed\n"
      "one decode step each (what kvcap run --task records and kvsim replays by default) and the answer is\n"
      "generated; --question-in-context prefills and compresses the whole prompt instead.\n"
      "Each sample's uncompressed prefill runs once and every point continues from a copy of it; the points'\n"
      "runs are decoded together (one batched forward per step, the weights read once for all of them).\n\n"
      "Options");
  opts.add_options()("help,h", "show this help")(
      "model", po::value<std::string>(),
      "model directory: the tiny VLM (config.json, model.safetensors, vocab.json, heldout.json) or, with "
      "--task, a text LLaMA (config.json, model.safetensors, tokenizer.json, chat template)")(
      "policies", po::value<std::string>(), "comma-separated kvsim policy names (presets, compositions a+b)")(
      "budgets", po::value<std::string>()->default_value("0.5"),
      "kvsim budget list: fractions, ranges a:b:step, NNtok, byte sizes (e.g. 0.1:0.5:0.1,64KiB)")(
      "samples", po::value<int>()->default_value(200),
      "samples per point (heldout.json samples; with --task, task prompts)")(
      "task", po::value<std::string>(),
      ("text model: long-context task (" + closedloop::task_names_list() + "; docs/tasks.md)").c_str())(
      "length", po::value<int>()->default_value(1024),
      "with --task: tokens of the user message (512 .. 4096)")(
      "haystack", po::value<std::vector<std::string>>(),
      "with --task: prose files or directories (repeatable; default /usr/share/common-licenses)")(
      "first", po::value<int>()->default_value(0),
      "with --task: index of the first sample (samples FIRST .. FIRST+N-1; sample i depends only on task, "
      "length, seed and i)")(
      "question-in-context",
      "with --task: prefill the whole prompt (question included) and compress it, as kvsim "
      "--question-in-context replays; default: compress the context, then feed the question")(
      "seed", po::value<unsigned long long>()->default_value(0),
      "0: samples 0..N-1 of heldout.json; else a random N-subset drawn with this seed; with --task the "
      "task generator's seed")("max-new", po::value<int>()->default_value(10),
                               "answer tokens generated at most (answers are 3-8 + <eos>)")(
      "policy-file", po::value<std::string>(), "INI file with extra [policy NAME] sections (kvsim syntax)")(
      "output,o", po::value<std::string>(), "HDF5 results file (group /closed_loop)")(
      "csv", po::value<std::string>(), "CSV results file (one row per point)")(
      "answers", po::value<std::string>(),
      "CSV of the generated answers, one row per point x sample: sample, family, policy, budget, "
      "generated, expected, correct")(
      "per-point-prefill",
      "run the uncompressed prefill again for every point (slower; the default runs it once per sample and "
      "continues every point from a copy, with identical results)")(
      "max-batch", po::value<int>()->default_value(0),
      "points decoded together per sample (0: as many as 4 GiB of uncompressed caches of the prompt hold; "
      "1: one run at a time)")(
      "threads", po::value<int>()->default_value(1),
      "OpenMP threads of the runner and kernels (0 = OpenMP default; at most 4 x the hardware threads, "
      "1024); a sample is a few ms of "
      "work, so 1 is fastest on a shared machine")("quiet,q", "no progress bar");
  return opts;
}

}  // namespace

int eval_command(const std::vector<std::string>& args) {
  kernels::keep_freed_memory();  // the decoder's buffers and KV caches, sample after sample
  const po::options_description opts = make_options();
  po::variables_map vm;
  const std::string examples =
      "\nExample:\n"
      "  kvcap eval --model traces/models/tiny-shapes --policies h2o,snapkv,int8 \\\n"
      "      --budgets 0.1,0.3,0.5 --samples 200 -o closed.h5 --csv closed.csv\n"
      "  kvcap eval --model ~/.cache/kvscope/models/smollm2-135m-instruct --task passkey \\\n"
      "      --length 512 --samples 20 --policies snapkv,streamingllm --budgets 0.05,0.2\n";
  if (const auto exit = parse_options("kvcap eval", args, opts, vm, examples)) return *exit;
  for (const char* required : {"model", "policies"})
    if (!vm.count(required)) return missing("kvcap eval", std::string("--") + required);
  const std::string model_dir = vm["model"].as<std::string>();
  const int n = vm["samples"].as<int>(), max_new = vm["max-new"].as<int>(), threads = vm["threads"].as<int>();
  const unsigned long long seed = vm["seed"].as<unsigned long long>();
  if (n < 1) return fail("--samples must be >= 1");
  if (max_new < 1 || max_new > 64) return fail("--max-new must be in 1..64");
  if (const std::string bad = cli::check_threads(threads); !bad.empty()) return fail(bad);
  const int max_batch = vm["max-batch"].as<int>();
  if (max_batch < 0 || max_batch > 100000) return fail("--max-batch must be in 0..100000");
  if (vm.count("per-point-prefill") && !vm["max-batch"].defaulted())
    return fail("--max-batch needs the shared prefill (not --per-point-prefill)");

  // Points: policies x budgets in kvsim's syntax, `full` first.
  std::vector<sim::SweepPoint> points;
  try {
    sim::PolicyRegistry registry;
    if (vm.count("policy-file")) registry.load_ini(vm["policy-file"].as<std::string>());
    std::vector<sim::PolicySpec> specs{registry.get("full")};
    std::set<std::string> seen{"full"};
    for (const auto& name : split_commas(vm["policies"].as<std::string>())) {
      sim::PolicySpec p = registry.get(name);
      sim::check_closed_loop_support(p);  // before any sample runs: one line, no progress bar
      if (seen.insert(p.name).second) specs.push_back(std::move(p));
    }
    points = sim::make_sweep_points(specs, sim::parse_budget_list(vm["budgets"].as<std::string>()));
  } catch (const std::exception& e) {
    return fail(e.what());
  }

  const bool text_task = vm.count("task") > 0;
  const int first = vm["first"].as<int>();
  if (first < 0 || first > 99999) return fail("--first must be in 0..99999");
  if (!text_task && !vm["first"].defaulted()) return fail("--first needs --task");
  if (!text_task && vm.count("question-in-context"))
    return fail("--question-in-context needs --task (the tiny VLM prefills its whole prompt)");
  const closedloop::QuestionSetting setting = vm.count("question-in-context")
                                                  ? closedloop::QuestionSetting::kInContext
                                                  : closedloop::QuestionSetting::kAfterCompression;
  const int length = vm["length"].as<int>();
  std::vector<closedloop::HeldoutSample> samples;
  closedloop::Haystack haystack;
  if (text_task) {
    try {
      closedloop::check_task_name(vm["task"].as<std::string>());
      if (length < closedloop::kMinTaskLength || length > closedloop::kMaxTaskLength) {
        return fail("--length " + std::to_string(length) + " out of range (" +
                    std::to_string(closedloop::kMinTaskLength) + " .. " +
                    std::to_string(closedloop::kMaxTaskLength) + " tokens)");
      }
      haystack =
          closedloop::load_haystack(vm.count("haystack") ? vm["haystack"].as<std::vector<std::string>>()
                                                         : closedloop::default_haystack_paths());
    } catch (const closedloop::TaskError& e) {
      return fail(e.what());
    }
  } else {
    try {
      samples = closedloop::load_heldout(model_dir);
    } catch (const closedloop::EvalError& e) {
      return fail(e.what());
    }
    if (static_cast<std::size_t>(n) > samples.size()) {
      return fail("--samples " + std::to_string(n) + " but " + model_dir + "/heldout.json has only " +
                  std::to_string(samples.size()) +
                  " (export more with kvscope.tinyvlm.export_samples --count)");
    }
    if (seed != 0) {  // seeded subset: Fisher-Yates prefix with splitmix64
      runner::SplitMix64 rng(seed);
      for (int i = 0; i < n; ++i) {
        const std::size_t j =
            static_cast<std::size_t>(i) + rng.uniform(samples.size() - static_cast<std::size_t>(i));
        std::swap(samples[static_cast<std::size_t>(i)], samples[j]);
      }
    }
    samples.resize(static_cast<std::size_t>(n));
  }
  closedloop::set_threads(threads);

  try {
    runner::Model model = runner::Model::load(model_dir);
    // Text tasks: the model folder's tokenizer and chat template build the prompts.
    std::shared_ptr<const runner::Tokenizer> tokenizer;
    std::vector<closedloop::Reference> task_refs;
    if (text_task) {
      if (model.config().has_vision()) {
        return fail("--task needs a text model (LlamaForCausalLM); " + model_dir +
                    " is the tiny VLM (drop --task to use its heldout.json)");
      }
      tokenizer = runner::load_tokenizer(model_dir);
      const runner::ChatTemplate chat = runner::ChatTemplate::load(model_dir);
      const closedloop::TokenCounter count = closedloop::token_counter(*tokenizer);
      std::vector<closedloop::TaskSample> task_samples = closedloop::make_task_samples(
          vm["task"].as<std::string>(), length, first + n, seed, haystack, count);
      task_samples.erase(task_samples.begin(), task_samples.begin() + first);
      for (const auto& ts : task_samples) {
        task_refs.push_back(closedloop::make_task_reference(model, *tokenizer, chat, ts, setting));
        closedloop::HeldoutSample h;  // for the answers CSV
        h.index = ts.index;
        h.family = closedloop::family_index("text-only");
        h.question = ts.user;
        h.answer = ts.answer;
        samples.push_back(std::move(h));
      }
    }
    const std::size_t total = (points.size() + 1) * samples.size();
    ProgressBar bar("eval", total, !vm.count("quiet"));
    std::vector<closedloop::EvalPoint> eval_points;
    for (const auto& sp : points) {
      closedloop::EvalPoint ep;
      ep.spec = sp.policy;
      ep.policy = sp.policy.name;
      ep.budget_spec = sp.budget;
      ep.budget = sp.budget.text.empty() ? "-" : sp.budget.text;
      eval_points.push_back(std::move(ep));
    }
    closedloop::EvalRunInfo info;
    info.model = model_dir;
    info.samples = n;
    info.max_new = max_new;
    info.seed = seed;
    if (text_task) {
      info.task = vm["task"].as<std::string>();
      info.length = length;
      info.question_in_context = setting == closedloop::QuestionSetting::kInContext;
    }
    std::vector<closedloop::PointStats> stats;
    const auto t0 = std::chrono::steady_clock::now();
    if (vm.count("per-point-prefill")) {
      std::vector<closedloop::Reference> refs =
          text_task ? task_refs : closedloop::make_references(model, samples, 0);
      for (auto& r : refs) r.run = closedloop::run_sample(model, r.prompt, nullptr, max_new);
      info.reference_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::size_t done = samples.size();
      bar.update(done);
      for (const auto& ep : eval_points) {
        stats.push_back(closedloop::evaluate_point(
            model, ep, refs, max_new, [&](int k) { bar.update(done + static_cast<std::size_t>(k)); }));
        done += samples.size();
      }
    } else {
      std::vector<closedloop::Reference> refs =
          text_task ? std::move(task_refs) : closedloop::make_references(model, samples, 0);
      stats = closedloop::evaluate_shared(model, eval_points, refs, max_new,
                                          [&](std::size_t k) { bar.update(k); }, max_batch);
      for (const auto& r : refs) info.reference_seconds += r.run.seconds;
    }
    const double total_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bar.finish();
    closedloop::write_table(std::cout, stats);
    std::cout << "reference (uncompressed) runs: " << samples.size() << " samples in "
              << format_seconds(info.reference_seconds) << "; all runs " << format_seconds(total_seconds)
              << (vm.count("per-point-prefill") ? " (a prefill per run)" : " (one prefill per sample)")
              << "\n";
    if (text_task) {
      std::cout << (setting == closedloop::QuestionSetting::kInContext
                        ? "setting: question in the compressed context (the whole prompt prefilled)\n"
                        : "setting: question after compression (the context prefilled and compressed, the "
                          "question fed as decode steps)\n");
    }
    if (vm.count("csv")) closedloop::write_csv(vm["csv"].as<std::string>(), stats);
    if (vm.count("answers")) closedloop::write_answers(vm["answers"].as<std::string>(), samples, stats);
    if (vm.count("output")) closedloop::write_hdf5(vm["output"].as<std::string>(), info, stats);
  } catch (const runner::RunnerError& e) {
    return fail(e.what());
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return 0;
}

}  // namespace kvscope::cli
