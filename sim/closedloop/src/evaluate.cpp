// Closed-loop evaluation: samples, runs, per-point statistics (kvscope/closedloop/evaluate.hpp).
#include "kvscope/closedloop/evaluate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "kvscope/closedloop/tasks.hpp"
#include "kvscope/runner/image.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::closedloop {

int family_index(const std::string& family) {
  for (std::size_t i = 0; i < kFamilies.size(); ++i)
    if (family == kFamilies[i]) return static_cast<int>(i);
  return -1;
}

std::vector<HeldoutSample> load_heldout(const std::string& model_dir) {
  const std::string path = model_dir + "/heldout.json";
  std::ifstream in(path);
  if (!in) {
    throw EvalError(path + " not found (write it with: python3 -m kvscope.tinyvlm.export_samples --model " +
                    model_dir + " --count 1000)");
  }
  std::vector<HeldoutSample> out;
  try {
    const nlohmann::json doc = nlohmann::json::parse(in);
    for (const auto& s : doc.at("samples")) {
      HeldoutSample h;
      h.index = s.at("index").get<int>();
      h.family = family_index(s.at("family").get<std::string>());
      if (h.family < 0)
        throw EvalError(path + ": unknown family '" + s.at("family").get<std::string>() + "'");
      h.question = s.at("question").get<std::string>();
      h.answer = s.at("answer").get<std::string>();
      h.image_seeds = s.at("image_seeds").get<std::vector<std::uint64_t>>();
      if (h.image_seeds.empty() || h.image_seeds.size() > 2)
        throw EvalError(path + ": a sample needs 1 or 2 images");
      out.push_back(std::move(h));
    }
  } catch (const nlohmann::json::exception& e) {
    throw EvalError(path + ": malformed (" + e.what() + ")");
  }
  if (out.empty()) throw EvalError(path + ": no samples");
  return out;
}

namespace {

// A token fed after the prompt at decode step `step`: text, in the last segment.
runner::TokenInfo decode_token(const runner::Prompt& prompt, std::int32_t id, int step) {
  runner::TokenInfo tok;
  tok.token_id = id;
  tok.position = tok.index = prompt.size() + step;
  tok.modality = 0;
  tok.segment = static_cast<int>(prompt.images.size());
  return tok;
}

// Throws EvalError when the tokens fed after the prefill do not fit the model.
void check_after_prefill(const runner::ModelConfig& cfg, const runner::Prompt& prompt,
                         const std::vector<std::int32_t>& after) {
  if (prompt.size() + static_cast<int>(after.size()) > cfg.max_position_embeddings) {
    throw EvalError("the prompt (" + std::to_string(prompt.size()) + " + " + std::to_string(after.size()) +
                    " tokens) is longer than the model's " + std::to_string(cfg.max_position_embeddings) +
                    " positions");
  }
  for (const std::int32_t id : after) {
    if (id < 0 || id >= cfg.vocab_size)
      throw EvalError("token id " + std::to_string(id) + " fed after the prefill is outside the vocabulary");
  }
}

// One generation step of a run at decode step `step`: the next token (forced, else greedy from `logits`) and
// the logits it was chosen from are appended to `r`. Returns the token to feed next, or -1 when the run ends
// (<eos>, `limit` tokens, or the model's last position).
std::int32_t choose_next(const runner::ModelConfig& cfg, const runner::Prompt& prompt, int step,
                         const std::vector<float>& logits, const std::vector<std::int32_t>* forced, int limit,
                         RunResult& r) {
  const auto next = forced ? (*forced)[r.tokens.size()]
                           : static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                                       logits.begin());
  r.logits.push_back(logits);
  r.tokens.push_back(next);
  if (cfg.is_eos(next) || static_cast<int>(r.tokens.size()) == limit) return -1;
  if (prompt.size() + step >= cfg.max_position_embeddings) return -1;
  return next;
}

// The embedding rows of `ids` and their decode tokens from step `step0` on.
void embed_decode_tokens(runner::Model& model, const runner::Prompt& prompt, const std::int32_t* ids, int n,
                         int step0, std::vector<runner::TokenInfo>& toks, std::vector<float>& x) {
  const int d = model.config().hidden_size;
  toks.resize(static_cast<std::size_t>(n));
  x.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(d));
  for (int i = 0; i < n; ++i) {
    toks[static_cast<std::size_t>(i)] = decode_token(prompt, ids[i], step0 + i);
    std::copy_n(model.weights().embed_tokens.data() + static_cast<std::size_t>(ids[i]) * d, d,
                x.data() + static_cast<std::size_t>(i) * d);
  }
}

// The decode loop after prefill (shared by run_sample and run_from_prefill): first the tokens fed after the
// prefill (`after`, may be null), one decode step each, then greedy or forced generation.
void decode_loop(runner::Model& model, const runner::Prompt& prompt, runner::KvCache& cache,
                 std::vector<float>& logits, ClosedLoopHook* hook, int max_new,
                 const std::vector<std::int32_t>* forced, const std::vector<std::int32_t>* after,
                 RunResult& r) {
  const auto& cfg = model.config();
  const int limit = forced ? static_cast<int>(forced->size()) : max_new;
  int step = 0;
  std::vector<runner::TokenInfo> toks;
  std::vector<float> x;
  // Feeds ids[0 .. n-1] as decode steps step .. step+n-1 in one causal forward.
  auto feed = [&](const std::int32_t* ids, int n) {
    embed_decode_tokens(model, prompt, ids, n, step, toks, x);
    runner::ForwardRequest req;
    req.x = x.data();
    req.tokens = toks.data();
    req.num_tokens = n;
    req.decode_step = step;
    model.backend().forward(req, cache, hook, logits);
    if (hook)
      for (int i = 0; i < n; ++i) hook->after_decode_step(cache, step + i, toks[static_cast<std::size_t>(i)]);
    step += n;
  };
  if (after) {
    check_after_prefill(cfg, prompt, *after);
    if (hook && hook->evicts_during_decode()) {
      for (const std::int32_t& id : *after) feed(&id, 1);
    } else if (!after->empty()) {
      // The cache only grows: one causal forward of all the tokens is the same computation as feeding them
      // one at a time (up to float rounding), with the weights read once.
      feed(after->data(), static_cast<int>(after->size()));
    }
  }
  while (static_cast<int>(r.tokens.size()) < limit) {
    const std::int32_t next = choose_next(cfg, prompt, step, logits, forced, limit, r);
    if (next < 0) break;
    feed(&next, 1);
  }
  if (hook) r.held_bytes = hook->held_bytes(cache);
}

// Records each layer's prefill queries [Hq, T, D] contiguously.
class QueryRecorder : public runner::RunObserver {
 public:
  explicit QueryRecorder(std::vector<std::vector<float>>& q) : q_(q) {}
  void on_prefill_layer(int layer, const runner::TensorRef& q, const runner::TensorRef&,
                        const runner::TensorRef&) override {
    if (layer < 0) return;
    if (static_cast<std::size_t>(layer) >= q_.size()) q_.resize(static_cast<std::size_t>(layer) + 1);
    std::vector<float>& out = q_[static_cast<std::size_t>(layer)];
    out.resize(static_cast<std::size_t>(q.shape[0] * q.shape[1] * q.shape[2]));
    std::size_t i = 0;
    for (std::int64_t h = 0; h < q.shape[0]; ++h)
      for (std::int64_t t = 0; t < q.shape[1]; ++t)
        for (std::int64_t e = 0; e < q.shape[2]; ++e) out[i++] = q.at(h, t, e);
  }

 private:
  std::vector<std::vector<float>>& q_;
};

}  // namespace

RunResult run_sample(runner::Model& model, const runner::Prompt& prompt, ClosedLoopHook* hook, int max_new,
                     const std::vector<std::int32_t>* forced,
                     const std::vector<std::int32_t>* after_prefill) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& cfg = model.config();
  RunResult r;
  runner::KvCache cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
  std::vector<float> logits;
  {
    const std::vector<float> x = model.embed(prompt);
    runner::ForwardRequest req;
    req.x = x.data();
    req.tokens = prompt.tokens.data();
    req.num_tokens = prompt.size();
    model.backend().forward(req, cache, hook, logits);
  }
  if (hook) hook->after_prefill(cache, prompt.tokens);
  decode_loop(model, prompt, cache, logits, hook, max_new, forced, after_prefill, r);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

Prefill run_prefill(runner::Model& model, const runner::Prompt& prompt) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& cfg = model.config();
  Prefill p;
  p.cache = runner::KvCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim);
  p.q.resize(static_cast<std::size_t>(cfg.num_layers));
  QueryRecorder rec(p.q);
  const std::vector<float> x = model.embed(prompt);
  runner::ForwardRequest req;
  req.x = x.data();
  req.tokens = prompt.tokens.data();
  req.num_tokens = prompt.size();
  model.backend().forward(req, p.cache, &rec, p.logits);
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

namespace {

// Replays `prefill`'s recorded queries into `hook` (on_prefill_layer with empty k and v) and lets it
// compress `cache`, a copy of the prefill's cache.
void compress_from_prefill(const runner::ModelConfig& cfg, const runner::Prompt& prompt, const Prefill& prefill,
                           ClosedLoopHook& hook, runner::KvCache& cache) {
  const std::int64_t T = prompt.size(), D = cfg.head_dim;
  for (int l = 0; l < cfg.num_layers; ++l) {
    runner::TensorRef q, none;
    q.data = prefill.q[static_cast<std::size_t>(l)].data();
    q.shape[0] = cfg.num_q_heads;
    q.shape[1] = T;
    q.shape[2] = D;
    q.stride[0] = T * D;
    q.stride[1] = D;
    q.stride[2] = 1;
    hook.on_prefill_layer(l, q, none, none);
  }
  hook.after_prefill(cache, prompt.tokens);
}

}  // namespace

RunResult run_from_prefill(runner::Model& model, const runner::Prompt& prompt, const Prefill& prefill,
                           ClosedLoopHook* hook, int max_new, const std::vector<std::int32_t>* forced,
                           const std::vector<std::int32_t>* after_prefill) {
  const auto t0 = std::chrono::steady_clock::now();
  RunResult r;
  runner::KvCache cache = prefill.cache;
  std::vector<float> logits = prefill.logits;
  if (hook) compress_from_prefill(model.config(), prompt, prefill, *hook, cache);
  decode_loop(model, prompt, cache, logits, hook, max_new, forced, after_prefill, r);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

double next_token_kl(const std::vector<float>& ref_logits, const std::vector<float>& logits) {
  auto log_softmax = [](const std::vector<float>& x) {
    const double mx = *std::max_element(x.begin(), x.end());
    double z = 0;
    for (float v : x) z += std::exp(static_cast<double>(v) - mx);
    const double lz = mx + std::log(z);
    std::vector<double> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<double>(x[i]) - lz;
    return out;
  };
  const std::vector<double> lp = log_softmax(ref_logits), lq = log_softmax(logits);
  double kl = 0;
  for (std::size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(0.0, kl);
}

std::vector<Reference> make_references(runner::Model& model, const std::vector<HeldoutSample>& samples,
                                       int max_new) {
  std::vector<Reference> refs;
  refs.reserve(samples.size());
  for (const auto& s : samples) {
    Reference r;
    std::vector<runner::Image> images;
    for (std::uint64_t seed : s.image_seeds) images.push_back(runner::render_scene(seed).image);
    r.prompt = model.build_prompt(images, s.question);
    r.answer_ids = model.tokenizer().encode(s.answer);
    r.answer_ids.push_back(model.config().eos_token_id);
    r.family = s.family;
    if (max_new > 0) r.run = run_sample(model, r.prompt, nullptr, max_new);
    refs.push_back(std::move(r));
  }
  return refs;
}

std::string task_prompt_text(const runner::ChatTemplate& chat, const TaskSample& sample) {
  return chat.render({{"user", sample.user}}, true) + sample.answer_prefix;
}

std::vector<std::uint8_t> task_token_roles(const runner::Tokenizer& tokenizer,
                                           const std::vector<std::int32_t>& ids,
                                           const runner::ChatTemplate& chat, const TaskSample& sample) {
  const std::string head = chat.render({{"user", sample.user}}, true);
  const std::string text = head + sample.answer_prefix;
  // The user message is the last occurrence of its text in the rendered head (a system prompt precedes it).
  const std::size_t user = head.rfind(sample.user);
  if (user == std::string::npos || sample.question_char > sample.user.size() ||
      sample.context_char > sample.question_char) {
    throw TaskError("task " + sample.task + " sample " + std::to_string(sample.index) +
                    ": the user message is not in the rendered prompt");
  }
  using trace::Role;
  auto role_at = [&](std::size_t byte) {
    if (byte < user + sample.context_char) return Role::kTemplate;  // system prompt, markup, intro
    if (byte < user + sample.question_char) return Role::kContext;
    if (byte < user + sample.user.size()) return Role::kQuestion;
    if (byte < head.size()) return Role::kTemplate;  // end of the user turn, assistant header
    return Role::kAnswer;                            // the answer prefix
  };
  std::vector<std::uint8_t> roles(ids.size());
  std::size_t at = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::string& piece = tokenizer.text(ids[i]);
    if (text.compare(at, piece.size(), piece) != 0) {
      throw TaskError("task " + sample.task + " sample " + std::to_string(sample.index) + ": token " +
                      std::to_string(i) + " does not spell the prompt text at byte " + std::to_string(at) +
                      " (the tokenizer normalises the text?)");
    }
    roles[i] = static_cast<std::uint8_t>(role_at(at));
    at += piece.size();
  }
  if (at != text.size()) {
    throw TaskError("task " + sample.task + " sample " + std::to_string(sample.index) +
                    ": the tokens spell " + std::to_string(at) + " of the prompt's " +
                    std::to_string(text.size()) + " bytes");
  }
  return roles;
}

TokenCounter token_counter(const runner::Tokenizer& tokenizer) {
  return [&tokenizer](const std::string& t) {
    return t.empty() ? 0 : static_cast<int>(tokenizer.encode(t).size());
  };
}

Reference make_task_reference(runner::Model& model, const runner::Tokenizer& tokenizer,
                              const runner::ChatTemplate& chat, const TaskSample& sample,
                              QuestionSetting setting) {
  Reference r;
  std::vector<std::int32_t> ids = tokenizer.encode(task_prompt_text(chat, sample));
  if (setting == QuestionSetting::kAfterCompression) {
    const std::vector<std::uint8_t> roles = task_token_roles(tokenizer, ids, chat, sample);
    const auto split = static_cast<std::size_t>(
        std::find(roles.begin(), roles.end(), static_cast<std::uint8_t>(trace::Role::kQuestion)) -
        roles.begin());
    if (split == 0 || split == ids.size()) {
      throw TaskError("task " + sample.task + " sample " + std::to_string(sample.index) +
                      ": the prompt has no context or no question");
    }
    r.after_prefill.assign(ids.begin() + static_cast<std::ptrdiff_t>(split), ids.end());
    ids.resize(split);
  }
  r.prompt = model.build_prompt_from_ids(ids);
  r.answer_ids = tokenizer.encode(" " + sample.answer);
  r.answer_ids.push_back(model.config().eos_token_id);
  r.answer_text = sample.answer;
  r.tokenizer = &tokenizer;
  r.family = family_index("text-only");
  return r;
}

namespace {

// Running sums of one point.
struct Sums {
  std::array<int, 4> hits{};
  int total_hits = 0, agree = 0;
  double kl_sum = 0, keep_sum = 0, seconds = 0;
};

PointStats start_point(const EvalPoint& point) {
  PointStats st;
  st.policy = point.policy;
  st.budget = point.budget;
  return st;
}

// Adds one sample's run (and, when it differs from the reference, the teacher-forced run `forced_run`
// makes) to the point.
void add_sample(runner::Model& model, const Reference& ref, const ClosedLoopHook& hook, const RunResult& run,
                const std::function<RunResult()>& forced_run, PointStats& st, Sums& sums) {
  const auto& cfg = model.config();
  const std::int64_t token_bytes = 2ll * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4;
  const CacheBytes pred = hook.predicted_bytes();
  if (run.held_bytes != pred.total) st.bytes_match = false;
  st.bytes_end += static_cast<double>(pred.total);
  for (std::size_t m = 0; m < 4; ++m) st.bytes_end_modality[m] += static_cast<double>(pred.modality[m]);
  st.bytes_peak += static_cast<double>(hook.peak_bytes());
  st.bytes_full_end += static_cast<double>(token_bytes * (ref.prompt.size() + hook.decode_steps()));
  sums.keep_sum += hook.keep();
  st.warnings += hook.warnings().empty() ? 0 : 1;
  std::string text;
  bool correct = false;
  if (ref.answer_text.empty()) {
    for (const std::int32_t t : run.tokens) text += (text.empty() ? "" : " ") + model.tokenizer().text(t);
    correct = run.tokens == ref.answer_ids;
  } else {
    text = (ref.tokenizer ? *ref.tokenizer : model.tokenizer()).decode(run.tokens);
    correct = answer_matches(text, ref.answer_text);
  }
  st.generated.push_back(std::move(text));
  st.correct.push_back(correct ? 1 : 0);
  const auto fam = static_cast<std::size_t>(ref.family);
  ++st.family_samples[fam];
  if (correct) {
    ++sums.hits[fam];
    ++sums.total_hits;
  }
  // KL at the reference's positions 1 .. n-1 (position 0 is chosen from the full prefill in both runs).
  // With the question fed after compression (ref.after_prefill), position 0 too is chosen from the
  // compressed cache and counts.
  const std::vector<std::int32_t>& rt = ref.run.tokens;
  const bool same = run.tokens == rt;
  sums.agree += same ? 1 : 0;
  const std::size_t first = ref.after_prefill.empty() ? 1 : 0;
  if (rt.size() > first) {
    RunResult forced;
    if (!same) forced = forced_run();
    const RunResult& cmp = same ? run : forced;
    double kl = 0;
    for (std::size_t j = first; j < rt.size(); ++j) kl += next_token_kl(ref.run.logits[j], cmp.logits[j]);
    sums.kl_sum += kl / static_cast<double>(rt.size() - first);
  }
}

void finish_point(PointStats& st, const Sums& sums, std::size_t samples) {
  const double n = static_cast<double>(std::max<std::size_t>(1, samples));
  st.samples = static_cast<int>(samples);
  st.accuracy = sums.total_hits / n;
  for (std::size_t f = 0; f < 4; ++f) {
    st.family_accuracy[f] = st.family_samples[f] ? static_cast<double>(sums.hits[f]) / st.family_samples[f]
                                                 : std::numeric_limits<double>::quiet_NaN();
  }
  st.kl = sums.kl_sum / n;
  st.agreement = sums.agree / n;
  st.keep = sums.keep_sum / n;
  st.bytes_end /= n;
  st.bytes_peak /= n;
  st.bytes_full_end /= n;
  for (auto& b : st.bytes_end_modality) b /= n;
  st.bytes_ratio = st.bytes_full_end > 0 ? st.bytes_end / st.bytes_full_end : 1.0;
}

}  // namespace

PointStats evaluate_point(runner::Model& model, const EvalPoint& point, const std::vector<Reference>& refs,
                          int max_new, const std::function<void(int)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  PointStats st = start_point(point);
  Sums sums;
  const auto& cfg = model.config();
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const Reference& ref = refs[i];
    ClosedLoopHook hook(point.spec, point.budget_spec, cfg);
    const RunResult run = run_sample(model, ref.prompt, &hook, max_new, nullptr, &ref.after_prefill);
    add_sample(
        model, ref, hook, run,
        [&] {
          ClosedLoopHook fhook(point.spec, point.budget_spec, cfg);
          return run_sample(model, ref.prompt, &fhook, max_new, &ref.run.tokens, &ref.after_prefill);
        },
        st, sums);
    if (progress) progress(static_cast<int>(i) + 1);
  }
  finish_point(st, sums, refs.size());
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

namespace {

// One point's run on one sample in evaluate_shared, decoded in lockstep with the other points' runs.
struct Lane {
  std::size_t point = 0;
  std::unique_ptr<ClosedLoopHook> hook;  // null: the teacher-forced fork of a prefill-mode run
  runner::KvCache cache{0, 0, 0};
  std::vector<float> logits;  // what the next token is chosen from
  RunResult run;
  const std::vector<std::int32_t>* forced = nullptr;  // teacher forcing on these tokens
  int step = 0;                                       // decode steps fed
  std::int32_t next = -1;                             // the token fed in the current lockstep
  bool done = false;
  int fork = -1;        // index of its teacher-forced fork
  double seconds = 0;   // its compression, hook updates and share of the batched forwards
};

// Tokens fed to one lane in a batched forward, as consecutive decode steps.
struct Feed {
  std::size_t lane;
  const std::int32_t* ids;
  int n;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void feed_lanes(runner::Model& model, const runner::Prompt& prompt, std::vector<Lane>& lanes,
                const std::vector<Feed>& feeds) {
  if (feeds.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<runner::TokenInfo>> toks(feeds.size());
  std::vector<std::vector<float>> x(feeds.size());
  std::vector<runner::BatchedRequest> batch(feeds.size());
  for (std::size_t i = 0; i < feeds.size(); ++i) {
    Lane& lane = lanes[feeds[i].lane];
    embed_decode_tokens(model, prompt, feeds[i].ids, feeds[i].n, lane.step, toks[i], x[i]);
    runner::BatchedRequest& b = batch[i];
    b.request.x = x[i].data();
    b.request.tokens = toks[i].data();
    b.request.num_tokens = feeds[i].n;
    b.request.decode_step = lane.step;
    b.cache = &lane.cache;
    b.observer = lane.hook.get();
    b.logits = &lane.logits;
  }
  model.backend().forward_batch(batch);
  const double share = seconds_since(t0) / static_cast<double>(feeds.size());
  for (std::size_t i = 0; i < feeds.size(); ++i) {
    Lane& lane = lanes[feeds[i].lane];
    const auto t1 = std::chrono::steady_clock::now();
    if (lane.hook)
      for (int j = 0; j < feeds[i].n; ++j)
        lane.hook->after_decode_step(lane.cache, lane.step + j, toks[i][static_cast<std::size_t>(j)]);
    lane.step += feeds[i].n;
    lane.seconds += share + seconds_since(t1);
  }
}

// The runs of the points `group` on one sample, continued from its prefill and decoded together: every
// point's compression, then the tokens after the prefill (one causal forward per run whose cache only
// grows, all runs batched; one step at a time for decode-time policies), then greedy generation in
// lockstep. A prefill-mode run whose greedy token first differs from the reference's forks there into a
// teacher-forced run on the reference's tokens (the same cache and logits up to that point: the hook only
// counts decode steps after compression), so the KL needs no second compression.
std::vector<Lane> run_lanes(runner::Model& model, const Reference& ref, const Prefill& prefill,
                            const std::vector<EvalPoint>& points, const std::vector<std::size_t>& group,
                            int max_new) {
  const auto& cfg = model.config();
  const runner::Prompt& prompt = ref.prompt;
  const std::vector<std::int32_t>& rt = ref.run.tokens;
  const bool need_forced = rt.size() > (ref.after_prefill.empty() ? 1u : 0u);
  std::vector<Lane> lanes;
  lanes.reserve(2 * group.size());  // forks are appended: indices, not references, across the loop
  for (const std::size_t k : group) {
    const auto t0 = std::chrono::steady_clock::now();
    Lane lane;
    lane.point = k;
    lane.hook = std::make_unique<ClosedLoopHook>(points[k].spec, points[k].budget_spec, cfg);
    lane.cache = prefill.cache;
    lane.logits = prefill.logits;
    compress_from_prefill(cfg, prompt, prefill, *lane.hook, lane.cache);
    lane.cache.fit(static_cast<int>(ref.after_prefill.size()) + max_new);  // free the evicted slots' memory
    lane.seconds = seconds_since(t0);
    lanes.push_back(std::move(lane));
  }
  const std::vector<std::int32_t>& after = ref.after_prefill;
  if (!after.empty()) {
    check_after_prefill(cfg, prompt, after);
    const int n = static_cast<int>(after.size());
    std::vector<Feed> whole;
    for (std::size_t i = 0; i < lanes.size(); ++i)
      if (!lanes[i].hook->evicts_during_decode()) whole.push_back({i, after.data(), n});
    feed_lanes(model, prompt, lanes, whole);
    if (whole.size() < lanes.size()) {
      for (int j = 0; j < n; ++j) {
        std::vector<Feed> one;
        for (std::size_t i = 0; i < lanes.size(); ++i)
          if (lanes[i].hook->evicts_during_decode()) one.push_back({i, &after[static_cast<std::size_t>(j)], 1});
        feed_lanes(model, prompt, lanes, one);
      }
    }
  }
  for (;;) {
    const std::size_t runs = lanes.size();
    for (std::size_t i = 0; i < runs; ++i) {
      const Lane& lane = lanes[i];
      if (lane.done || lane.forced || lane.fork >= 0 || !need_forced || lane.hook->evicts_during_decode())
        continue;
      const std::size_t j = lane.run.tokens.size();
      const auto greedy = static_cast<std::int32_t>(
          std::max_element(lane.logits.begin(), lane.logits.end()) - lane.logits.begin());
      if (j >= rt.size() || greedy == rt[j]) continue;
      Lane f;
      f.point = lane.point;
      f.cache = lane.cache;
      f.cache.fit(static_cast<int>(rt.size() - j));
      f.logits = lane.logits;
      f.run = lane.run;
      f.forced = &rt;
      f.step = lane.step;
      lanes.push_back(std::move(f));
      lanes[i].fork = static_cast<int>(lanes.size() - 1);
    }
    std::vector<Feed> feeds;
    for (std::size_t i = 0; i < lanes.size(); ++i) {
      Lane& lane = lanes[i];
      const int limit = lane.forced ? static_cast<int>(rt.size()) : max_new;
      if (lane.done) continue;
      lane.next = static_cast<int>(lane.run.tokens.size()) < limit
                      ? choose_next(cfg, prompt, lane.step, lane.logits, lane.forced, limit, lane.run)
                      : -1;
      if (lane.next < 0) {
        lane.done = true;
      } else {
        feeds.push_back({i, &lane.next, 1});
      }
    }
    if (feeds.empty()) break;
    feed_lanes(model, prompt, lanes, feeds);
  }
  for (Lane& lane : lanes)
    if (lane.hook) lane.run.held_bytes = lane.hook->held_bytes(lane.cache);
  return lanes;
}

// Points decoded together by default: as many as 4 GiB hold of uncompressed caches of the prompt (each run
// holds at most one, and its teacher-forced fork another).
std::size_t default_batch(const runner::KvCache& cache) {
  const std::int64_t bytes = std::max<std::int64_t>(1, cache.total_slots() * cache.head_dim() * 2 * 4);
  return static_cast<std::size_t>(std::max<std::int64_t>(1, (std::int64_t{4} << 30) / (2 * bytes)));
}

}  // namespace

std::vector<PointStats> evaluate_shared(runner::Model& model, const std::vector<EvalPoint>& points,
                                        std::vector<Reference>& refs, int max_new,
                                        const std::function<void(std::size_t)>& progress, int max_batch) {
  std::vector<PointStats> stats;
  for (const auto& p : points) stats.push_back(start_point(p));
  std::vector<Sums> sums(points.size());
  const auto& cfg = model.config();
  std::size_t done = 0;
  // The first `full` point is the reference run itself (the uncompressed forwards, its hook observing):
  // it is not decoded a second time.
  const auto full_k = static_cast<std::size_t>(
      std::find_if(points.begin(), points.end(), [](const EvalPoint& p) { return p.spec.name == "full"; }) -
      points.begin());
  for (Reference& ref : refs) {
    const Prefill prefill = run_prefill(model, ref.prompt);
    std::unique_ptr<ClosedLoopHook> full_hook;
    if (full_k < points.size())
      full_hook = std::make_unique<ClosedLoopHook>(points[full_k].spec, points[full_k].budget_spec, cfg);
    ref.run = run_from_prefill(model, ref.prompt, prefill, full_hook.get(), max_new, nullptr, &ref.after_prefill);
    ref.run.seconds += prefill.seconds;
    if (progress) progress(++done);
    if (full_hook) {
      // The run is the reference, so the teacher-forced run add_sample asks for when they differ is never made.
      add_sample(model, ref, *full_hook, ref.run, [] { return RunResult{}; }, stats[full_k], sums[full_k]);
      stats[full_k].seconds += ref.run.seconds;
      if (progress) progress(++done);
    }
    // Any other `full` point runs on its own, so that it reproduces the uncompressed run bit for bit (the
    // same forwards); the other points in groups of `batch`.
    const std::size_t batch =
        max_batch > 0 ? static_cast<std::size_t>(max_batch) : default_batch(prefill.cache);
    std::vector<std::vector<std::size_t>> groups;
    for (std::size_t k = 0; k < points.size(); ++k) {
      if (k == full_k) continue;
      if (points[k].spec.name == "full") {
        groups.push_back({k});
      } else {
        if (groups.empty() || groups.back().size() >= batch || points[groups.back().front()].spec.name == "full")
          groups.emplace_back();
        groups.back().push_back(k);
      }
    }
    for (const std::vector<std::size_t>& group : groups) {
      std::vector<Lane> lanes = run_lanes(model, ref, prefill, points, group, max_new);
      for (std::size_t i = 0; i < group.size(); ++i) {
        Lane& lane = lanes[i];
        const EvalPoint& point = points[lane.point];
        const auto t0 = std::chrono::steady_clock::now();
        add_sample(
            model, ref, *lane.hook, lane.run,
            [&] {
              if (lane.fork >= 0) return std::move(lanes[static_cast<std::size_t>(lane.fork)].run);
              // Decode-time policies: the hook evicts during decoding, so the forced run compresses anew.
              ClosedLoopHook fhook(point.spec, point.budget_spec, cfg);
              return run_from_prefill(model, ref.prompt, prefill, &fhook, max_new, &ref.run.tokens,
                                      &ref.after_prefill);
            },
            stats[lane.point], sums[lane.point]);
        stats[lane.point].seconds += lane.seconds + seconds_since(t0) +
                                     (lane.fork >= 0 ? lanes[static_cast<std::size_t>(lane.fork)].seconds : 0);
        if (progress) progress(++done);
      }
    }
  }
  for (std::size_t k = 0; k < points.size(); ++k) {
    const double secs = stats[k].seconds;
    finish_point(stats[k], sums[k], refs.size());
    stats[k].seconds = secs;
  }
  return stats;
}

}  // namespace kvscope::closedloop
