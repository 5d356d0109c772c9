// Closed-loop evaluation (issue 6): the runner generating from a cache compressed by kvsim's own policy
// code. `full` must reproduce the uncompressed run bit for bit; the bytes the runner holds must equal
// kvsim's prediction, both in-process and replaying a trace of the same sample captured with kvcap run.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "kvscope/closedloop/evaluate.hpp"
#include "kvscope/closedloop/hook.hpp"
#include "kvscope/closedloop/report.hpp"
#include "kvscope/runner/tokenizer.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/trace/reader.hpp"

namespace fs = std::filesystem;
using namespace kvscope;

namespace {

fs::path source_dir() { return fs::path(KVSCOPE_TEST_SOURCE_DIR); }
fs::path binary_dir() { return fs::path(KVSCOPE_TEST_BINARY_DIR); }
fs::path random_model() { return source_dir() / "tests/data/tinyvlm-random-none"; }

std::vector<runner::Image> scene_images(const closedloop::HeldoutSample& s) {
  std::vector<runner::Image> images;
  for (auto seed : s.image_seeds) images.push_back(runner::render_scene(seed).image);
  return images;
}

std::string seed_list(const closedloop::HeldoutSample& s) {
  std::string out;
  for (auto seed : s.image_seeds) {
    if (!out.empty()) out.push_back(',');
    out.append(std::to_string(seed));
  }
  return out;
}

// kvcap run of a held-out sample into a float32 trace.
bool capture_trace(const closedloop::HeldoutSample& s, int max_new, const fs::path& out) {
  std::ostringstream cmd;
  cmd << std::quoted((binary_dir() / "bin" / "kvcap").string(), '\'') << " run --model "
      << std::quoted(random_model().string(), '\'') << " --scene " << seed_list(s) << " --question "
      << std::quoted(s.question, '\'') << " --max-new " << max_new << " --dtype float32 -o "
      << std::quoted(out.string(), '\'') << " >/dev/null 2>&1";
  const int raw = std::system(cmd.str().c_str());
  return WIFEXITED(raw) && WEXITSTATUS(raw) == 0;
}

closedloop::EvalPoint point(const std::string& text) {
  static const sim::PolicyRegistry registry;
  auto [name, budget] = sim::split_policy_budget(text);
  closedloop::EvalPoint p;
  p.spec = registry.get(name);
  p.policy = p.spec.name;
  p.budget_spec = budget;
  p.budget = budget.text.empty() ? "-" : budget.text;
  return p;
}

class ClosedLoop : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    closedloop::set_threads(1);  // tiny per-sample work: threads only add contention
    model_ = new runner::Model(runner::Model::load(random_model().string()));
    samples_ = new std::vector<closedloop::HeldoutSample>(closedloop::load_heldout(random_model().string()));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete samples_;
  }
  static runner::Model* model_;
  static std::vector<closedloop::HeldoutSample>* samples_;
};
runner::Model* ClosedLoop::model_ = nullptr;
std::vector<closedloop::HeldoutSample>* ClosedLoop::samples_ = nullptr;

TEST_F(ClosedLoop, FullEqualsUncompressedRunBitForBit) {
  const closedloop::EvalPoint full = point("full");
  for (int i = 0; i < 8; ++i) {  // covers one- and two-image samples of every family
    const auto& s = (*samples_)[static_cast<std::size_t>(i)];
    const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
    runner::GenerateOptions o;
    o.max_new = 8;
    o.keep_logits = true;
    const runner::Generation ref = model_->generate(prompt, o);
    closedloop::ClosedLoopHook hook(full.spec, full.budget_spec, model_->config());
    const closedloop::RunResult run = closedloop::run_sample(*model_, prompt, &hook, 8);
    EXPECT_TRUE(hook.applied());
    ASSERT_EQ(run.tokens, ref.tokens) << "sample " << i;
    ASSERT_EQ(run.logits.size(), ref.logits.size());
    for (std::size_t j = 0; j < ref.logits.size(); ++j) {
      ASSERT_EQ(run.logits[j].size(), ref.logits[j].size());
      EXPECT_EQ(std::memcmp(run.logits[j].data(), ref.logits[j].data(), ref.logits[j].size() * sizeof(float)),
                0)
          << "sample " << i << " position " << j << ": logits differ";
    }
  }
}

TEST_F(ClosedLoop, CompressionChangesTheCacheAndTheLogits) {
  // The hook really acts: a 10% budget leaves few slots and changes the logits after the first token.
  const auto& s = (*samples_)[0];
  const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
  const closedloop::RunResult ref = closedloop::run_sample(*model_, prompt, nullptr, 6);
  const closedloop::EvalPoint p = point("h2o@0.1");
  closedloop::ClosedLoopHook hook(p.spec, p.budget_spec, model_->config());
  const closedloop::RunResult forced = closedloop::run_sample(*model_, prompt, &hook, 6, &ref.tokens);
  ASSERT_EQ(forced.tokens, ref.tokens);
  ASSERT_GE(ref.tokens.size(), 2u);
  EXPECT_EQ(std::memcmp(forced.logits[0].data(), ref.logits[0].data(), ref.logits[0].size() * sizeof(float)),
            0)
      << "the first token must come from the full prefill";
  EXPECT_GT(closedloop::next_token_kl(ref.logits[1], forced.logits[1]), 0.0);
  for (const auto& lr : hook.layer_results())
    for (const auto& hr : lr.heads) {
      std::int64_t kept = 0, all = 0;
      for (int m = 0; m < 4; ++m)
        kept += hr.kept[static_cast<std::size_t>(m)], all += hr.tokens[static_cast<std::size_t>(m)];
      EXPECT_LT(kept, all / 2) << "layer " << lr.layer;
    }
}

TEST_F(ClosedLoop, StopsOnEveryEosIdLikeGenerate) {
  // A config with a second EOS id (HF's eos_token_id lists, e.g. Llama 3's): the closed loop must stop on
  // it exactly where Model::generate does, not only on eos_token_id.
  const auto& s = (*samples_)[0];
  const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
  const closedloop::RunResult plain = closedloop::run_sample(*model_, prompt, nullptr, 8);
  // The first generated id becomes the second EOS id: without it the sample generates more tokens.
  ASSERT_GE(plain.tokens.size(), 2u);
  const int stop = plain.tokens[0];
  ASSERT_NE(stop, model_->config().eos_token_id);
  runner::ModelConfig config = model_->config();
  config.eos_token_ids = {config.eos_token_id, stop};
  runner::Model two_eos(config, model_->weights(),
                        std::make_shared<const runner::Vocabulary>(
                            runner::Vocabulary::load((random_model() / "vocab.json").string())),
                        runner::Device::kCpu);
  const closedloop::RunResult run = closedloop::run_sample(two_eos, prompt, nullptr, 8);
  runner::GenerateOptions o;
  o.max_new = 8;
  const runner::Generation ref = two_eos.generate(prompt, o);
  EXPECT_EQ(run.tokens, std::vector<std::int32_t>{stop});
  EXPECT_EQ(run.tokens, ref.tokens);
}

// The two task settings (QuestionSetting, kvcap eval --question-in-context), on a tiny-VLM prompt split the
// way make_task_reference splits a task prompt: the prefill ends before the question's words, which are fed
// after compression as decode steps.
TEST_F(ClosedLoop, QuestionAfterCompressionHidesTheQuestionFromThePolicy) {
  const auto& s = (*samples_)[0];
  const runner::Prompt whole = model_->build_prompt(scene_images(s), s.question);
  std::size_t split = 0;  // after the last vision token and its </img>
  for (std::size_t i = 0; i < whole.tokens.size(); ++i)
    if (whole.tokens[i].modality == 1) split = i + 2;
  ASSERT_GT(split, 0u);
  ASSERT_LT(split, whole.tokens.size());
  runner::Prompt context = whole;
  context.tokens.resize(split);
  context.text.resize(split);
  std::vector<std::int32_t> question;
  for (std::size_t i = split; i < whole.tokens.size(); ++i) question.push_back(whole.tokens[i].token_id);

  // Uncompressed, both settings are the same computation: same tokens, logits equal up to float rounding.
  const closedloop::RunResult in = closedloop::run_sample(*model_, whole, nullptr, 6);
  const closedloop::RunResult after =
      closedloop::run_sample(*model_, context, nullptr, 6, nullptr, &question);
  ASSERT_EQ(after.tokens, in.tokens);
  for (std::size_t j = 0; j < in.logits.size(); ++j)
    for (std::size_t v = 0; v < in.logits[j].size(); ++v)
      ASSERT_NEAR(after.logits[j][v], in.logits[j][v], 1e-3) << "position " << j;

  // Compressed: the policy sees only the context's tokens and queries; the question arrives as decode steps
  // and the first answer token is chosen from the compressed cache.
  const closedloop::EvalPoint p = point("snapkv@0.3");
  closedloop::ClosedLoopHook hin(p.spec, p.budget_spec, model_->config());
  closedloop::ClosedLoopHook hafter(p.spec, p.budget_spec, model_->config());
  const closedloop::RunResult cin = closedloop::run_sample(*model_, whole, &hin, 6, &in.tokens);
  const closedloop::RunResult cafter =
      closedloop::run_sample(*model_, context, &hafter, 6, &in.tokens, &question);
  auto context_tokens = [](const closedloop::ClosedLoopHook& h) {
    std::int64_t n = 0;
    for (int m = 0; m < 4; ++m) n += h.layer_results()[0].heads[0].tokens[static_cast<std::size_t>(m)];
    return n;
  };
  EXPECT_EQ(context_tokens(hin), static_cast<std::int64_t>(whole.tokens.size()));
  EXPECT_EQ(context_tokens(hafter), static_cast<std::int64_t>(split));
  EXPECT_EQ(hin.decode_steps(), static_cast<int>(in.tokens.size()) - 1);
  EXPECT_EQ(hafter.decode_steps(), static_cast<int>(question.size() + in.tokens.size()) - 1);
  EXPECT_EQ(std::memcmp(cin.logits[0].data(), in.logits[0].data(), in.logits[0].size() * sizeof(float)), 0)
      << "question in context: the first token comes from the full prefill";
  EXPECT_GT(closedloop::next_token_kl(in.logits[0], cafter.logits[0]), 0.0)
      << "question after compression: the first token sees the compressed cache";
}

TEST_F(ClosedLoop, HeldBytesEqualPredictedBytes) {
  for (const char* text : {"full", "h2o@0.3", "snapkv@0.5", "look-m@0.4", "int4", "kivi2", "h2o+int8@0.5",
                           "unicache@0.5", "streamingllm@0.25", "hybridkv@0.3", "fastv@0.2", "adaptive"}) {
    const closedloop::EvalPoint p = point(text);
    for (int i = 0; i < 3; ++i) {
      const auto& s = (*samples_)[static_cast<std::size_t>(i)];
      const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
      closedloop::ClosedLoopHook hook(p.spec, p.budget_spec, model_->config());
      const closedloop::RunResult run = closedloop::run_sample(*model_, prompt, &hook, 6);
      EXPECT_EQ(run.held_bytes, hook.predicted_bytes().total) << text << " sample " << i;
    }
  }
}

// Captures sample 2 (two images) with kvcap run (float32 trace), replays it with kvsim's sweep and compares
// the compressed context bytes per layer with what the closed-loop runner holds.
TEST_F(ClosedLoop, RunnerBytesEqualKvsimOnACapturedTrace) {
  const auto& s = (*samples_)[2];
  const fs::path dir = binary_dir() / "test_closed_loop_trace";
  fs::create_directories(dir);
  const fs::path trace_path = dir / "sample.h5";
  ASSERT_TRUE(capture_trace(s, 4, trace_path)) << "kvcap run failed";
  const trace::TraceReader reader(trace_path.string());
  const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
  for (const char* text : {"h2o@0.3", "snapkv@0.25", "look-m@0.4", "h2o+int8@0.5", "unicache@0.5", "kivi2"}) {
    const closedloop::EvalPoint p = point(text);
    const sim::SweepOutput out = sim::run_sweep(reader, {{p.spec, p.budget_spec}}, {});
    ASSERT_EQ(out.points.size(), 1u);
    closedloop::ClosedLoopHook hook(p.spec, p.budget_spec, model_->config());
    const closedloop::RunResult run = closedloop::run_sample(*model_, prompt, &hook, 1);  // no decode token
    ASSERT_EQ(hook.decode_steps(), 0);
    std::int64_t kvsim_bytes = 0;
    const auto& layers = out.points[0].layers;
    ASSERT_EQ(layers.size(), hook.layer_results().size());
    for (std::size_t l = 0; l < layers.size(); ++l) {
      std::int64_t a = 0, b = 0;
      for (const auto& hr : layers[l].heads) a += hr.bytes_kept.total();
      for (const auto& hr : hook.layer_results()[l].heads) b += hr.bytes_kept.total();
      EXPECT_EQ(a, b) << text << " layer " << l;
      for (std::size_t h = 0; h < layers[l].heads.size(); ++h)
        EXPECT_EQ(layers[l].heads[h].kept, hook.layer_results()[l].heads[h].kept) << text << " layer " << l;
      kvsim_bytes += a;
    }
    EXPECT_EQ(run.held_bytes, kvsim_bytes) << text;
  }
  fs::remove_all(dir);
}

TEST_F(ClosedLoop, DecodeTimeHeldBytesEqualPredictedAndCapHolds) {
  for (const char* text : {"h2o~decode@0.3", "tova~decode:2@0.5", "snapkv~decode@0.4", "window~decode@0.25",
                           "h2o+int8~decode@0.5", "knorm+kivi2~decode@0.3"}) {
    const closedloop::EvalPoint p = point(text);
    for (int i = 0; i < 3; ++i) {
      const auto& s = (*samples_)[static_cast<std::size_t>(i)];
      const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
      closedloop::ClosedLoopHook hook(p.spec, p.budget_spec, model_->config());
      const closedloop::RunResult run = closedloop::run_sample(*model_, prompt, &hook, 6);
      EXPECT_EQ(run.held_bytes, hook.predicted_bytes().total) << text << " sample " << i;
      ASSERT_GT(hook.decode_steps(), 0) << text;
      // Every head holds at most the cap (or the forced sinks + recent window when larger) plus the tokens
      // appended since the last eviction step, and always fewer than the T + steps tokens it was fed.
      const int T = prompt.size();
      const int cap = static_cast<int>(std::lround(p.budget_spec.value * T));
      const int recent = std::max(p.spec.recent, static_cast<int>(std::lround(p.spec.recent_fraction * cap)));
      const int bound = std::max(cap, p.spec.sinks + recent) + p.spec.interval;
      for (const auto& layer : hook.resident_tokens())
        for (const auto& head : layer) {
          EXPECT_LE(static_cast<int>(head.size()), bound) << text;
          EXPECT_LT(static_cast<int>(head.size()), T) << text;
        }
    }
  }
}

// Decode-time rule = kvsim's: teacher-forced on the decode tokens of a captured trace, layer 0 (whose
// decode q/k/v depend only on the fed tokens) keeps exactly the tokens kvsim's decode replay keeps.
TEST_F(ClosedLoop, DecodeTimeResidentSetsEqualKvsimReplay) {
  const auto& s = (*samples_)[1];
  const fs::path dir = binary_dir() / "test_closed_loop_decode";
  fs::create_directories(dir);
  const fs::path trace_path = dir / "sample.h5";
  ASSERT_TRUE(capture_trace(s, 6, trace_path)) << "kvcap run failed";
  const trace::TraceReader reader(trace_path.string());
  const int S = static_cast<int>(reader.num_decode_steps());
  ASSERT_GE(S, 3);
  std::vector<std::int32_t> forced = reader.decode_tokens().token_id;
  forced.push_back(model_->config().eos_token_id);  // so that all S trace tokens are fed
  const runner::Prompt prompt = model_->build_prompt(scene_images(s), s.question);
  for (const char* text :
       {"h2o~decode@0.3", "tova~decode:2@0.5", "snapkv~decode@0.4", "h2o+int8~decode@0.5"}) {
    const closedloop::EvalPoint p = point(text);
    closedloop::ClosedLoopHook hook(p.spec, p.budget_spec, model_->config());
    closedloop::run_sample(*model_, prompt, &hook, 16, &forced);
    ASSERT_EQ(hook.decode_steps(), S) << text;
    sim::TraceContext ctx = sim::TraceContext::from_reader(reader);
    sim::LayerData layer(0, reader.read_layer(0), reader.read_decode_layer(0), ctx);
    std::vector<std::string> warnings;
    const sim::LayerResult r =
        sim::run_decode_policy_on_layer(p.spec, 1.0, p.budget_spec.value, layer, ctx, warnings, true);
    for (std::size_t h = 0; h < r.token_maps.size(); ++h) {
      std::vector<std::int32_t> want = r.token_maps[h].slot_token;
      std::sort(want.begin(), want.end());
      EXPECT_EQ(hook.resident_tokens()[0][h], want) << text << " head " << h;
      EXPECT_EQ(hook.layer_results()[0].heads[h].bytes_end, r.heads[h].bytes_end) << text << " head " << h;
    }
  }
  fs::remove_all(dir);
}

TEST_F(ClosedLoop, VisionEvictionHurtsVisionQuestionsMoreThanTextOnly) {
  const fs::path trained = source_dir() / "traces/models/tiny-shapes";
  if (!fs::exists(trained / "model.safetensors") || !fs::exists(trained / "heldout.json")) {
    GTEST_SKIP() << "needs the trained model with heldout.json in " << trained
                 << " (python3 -m kvscope.tinyvlm.export_samples --model " << trained << ")";
  }
  runner::Model model = runner::Model::load(trained.string());
  auto samples = closedloop::load_heldout(trained.string());
  samples.resize(std::min<std::size_t>(samples.size(), 120));
  const auto refs = closedloop::make_references(model, samples, 10);
  // vision-stride at 1%: text and special tokens are protected, every vision token is evicted in every layer.
  const closedloop::EvalPoint p = point("vision-stride@0.01");
  const closedloop::PointStats full = closedloop::evaluate_point(model, point("full"), refs, 10);
  const closedloop::PointStats blind = closedloop::evaluate_point(model, p, refs, 10);
  const double vision_drop =
      (full.family_accuracy[0] + full.family_accuracy[1] + full.family_accuracy[2]) / 3 -
      (blind.family_accuracy[0] + blind.family_accuracy[1] + blind.family_accuracy[2]) / 3;
  const double text_drop = full.family_accuracy[3] - blind.family_accuracy[3];
  std::cout << "full accuracy per family:";
  for (double a : full.family_accuracy) std::cout << " " << a;
  std::cout << "\nall vision evicted:      ";
  for (double a : blind.family_accuracy) std::cout << " " << a;
  std::cout << "\n";
  EXPECT_GT(vision_drop, text_drop + 0.2)
      << "vision drop " << vision_drop << ", text-only drop " << text_drop;
}

}  // namespace

// Sample-outer evaluation (one uncompressed prefill per sample, reused by every point, the points' runs
// decoded together in batched forwards and teacher-forced by forking at the first differing token) gives the
// results of a prefill and two separate runs per point: accuracy, agreement, bytes and the generated
// answers exactly, the KL up to the float rounding of the batched products; for prefill-mode, merging,
// quantizing and decode-time policies, with every point in one batch and with batches of 2.
TEST_F(ClosedLoop, SharedPrefillEqualsPerPointPrefill) {
  std::vector<closedloop::HeldoutSample> samples(
      samples_->begin(), samples_->begin() + std::min<std::size_t>(8, samples_->size()));
  const std::vector<closedloop::Reference> refs = closedloop::make_references(*model_, samples, 6);
  std::vector<closedloop::Reference> shared_refs = closedloop::make_references(*model_, samples, 0);
  std::vector<closedloop::EvalPoint> points;
  for (const char* p : {"full", "h2o@0.3", "snapkv@0.2", "int4", "tova~decode:2@0.5", "streamingllm@0.1"})
    points.push_back(point(p));
  std::size_t calls = 0;
  const std::vector<closedloop::PointStats> shared =
      closedloop::evaluate_shared(*model_, points, shared_refs, 6, [&](std::size_t) { ++calls; });
  EXPECT_EQ(calls, samples.size() * (points.size() + 1));
  ASSERT_EQ(shared.size(), points.size());
  std::vector<closedloop::Reference> pair_refs = closedloop::make_references(*model_, samples, 0);
  const std::vector<closedloop::PointStats> pairs =
      closedloop::evaluate_shared(*model_, points, pair_refs, 6, {}, 2);
  ASSERT_EQ(pairs.size(), points.size());
  for (std::size_t i = 0; i < refs.size(); ++i) {
    EXPECT_EQ(shared_refs[i].run.tokens, refs[i].run.tokens) << "sample " << i;
    EXPECT_EQ(shared_refs[i].run.logits, refs[i].run.logits) << "sample " << i;
  }
  bool any_differs = false;
  for (std::size_t k = 0; k < points.size(); ++k) {
    const closedloop::PointStats per = closedloop::evaluate_point(*model_, points[k], refs, 6);
    for (const closedloop::PointStats* sh : {&shared[k], &pairs[k]}) {
      const std::string what = points[k].policy + "@" + points[k].budget + (sh == &pairs[k] ? " (batches of 2)" : "");
      EXPECT_EQ(sh->accuracy, per.accuracy) << what;
      EXPECT_NEAR(sh->kl, per.kl, 1e-4 + 1e-3 * per.kl) << what;
      EXPECT_EQ(sh->agreement, per.agreement) << what;
      EXPECT_EQ(sh->keep, per.keep) << what;
      EXPECT_EQ(sh->bytes_end, per.bytes_end) << what;
      EXPECT_EQ(sh->bytes_peak, per.bytes_peak) << what;
      EXPECT_EQ(sh->bytes_end_modality, per.bytes_end_modality) << what;
      EXPECT_EQ(sh->bytes_match, per.bytes_match) << what;
      EXPECT_EQ(sh->family_samples, per.family_samples) << what;
      EXPECT_EQ(sh->generated, per.generated) << what;
    }
    any_differs = any_differs || per.agreement < 1.0 || per.kl > 0;
  }
  EXPECT_TRUE(any_differs) << "no point changed the answers: the comparison proves nothing";
}

TEST(ClosedLoopPolicies, RefusesTheOracleTopKBound) {
  // The bound reads the evaluation queries; a closed loop has them only after decoding.
  sim::ContextLabels labels;
  labels.modality = {0, 0, 0};
  labels.position = {0, 1, 2};
  labels.segment = labels.grid_row = labels.grid_col = {0, 0, 0};
  trace::ModelGeometry g;
  g.num_layers = 1;
  g.num_q_heads = g.num_kv_heads = 1;
  g.head_dim = 4;
  try {
    sim::PrefillCompressor c(sim::PolicyRegistry().get("oracle-topk"), sim::parse_budget("0.5"), g,
                             trace::DType::kF32, labels);
    FAIL() << "oracle-topk accepted by the closed loop";
  } catch (const sim::PolicyError& e) {
    EXPECT_NE(std::string(e.what()).find("not a policy"), std::string::npos) << e.what();
  }
}
