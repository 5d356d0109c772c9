// Closed-loop evaluation: samples, runs, per-point statistics (kvscope/closedloop/evaluate.hpp).
#include "kvscope/closedloop/evaluate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "kvscope/runner/image.hpp"

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

RunResult run_sample(runner::Model& model, const runner::Prompt& prompt, ClosedLoopHook* hook, int max_new,
                     const std::vector<std::int32_t>* forced) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& cfg = model.config();
  const int d = cfg.hidden_size;
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
  const int n_images = static_cast<int>(prompt.images.size());
  const int limit = forced ? static_cast<int>(forced->size()) : max_new;
  int step = 0;
  while (static_cast<int>(r.tokens.size()) < limit) {
    const int next = forced
                         ? (*forced)[r.tokens.size()]
                         : static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    r.logits.push_back(logits);
    r.tokens.push_back(next);
    if (next == cfg.eos_token_id || static_cast<int>(r.tokens.size()) == limit) break;
    runner::TokenInfo tok;
    tok.token_id = next;
    tok.position = tok.index = prompt.size() + step;
    tok.modality = 0;
    tok.segment = n_images;
    if (tok.position >= cfg.max_position_embeddings) break;
    runner::ForwardRequest req;
    req.x = model.weights().embed_tokens.data() + static_cast<std::size_t>(next) * d;
    req.tokens = &tok;
    req.num_tokens = 1;
    req.decode_step = step;
    model.backend().forward(req, cache, hook, logits);
    if (hook) hook->after_decode_step(cache, step, tok);
    ++step;
  }
  if (hook) r.held_bytes = hook->held_bytes(cache);
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
    r.run = run_sample(model, r.prompt, nullptr, max_new);
    refs.push_back(std::move(r));
  }
  return refs;
}

PointStats evaluate_point(runner::Model& model, const EvalPoint& point,
                          const std::vector<HeldoutSample>& samples, const std::vector<Reference>& refs,
                          int max_new, const std::function<void(int)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  PointStats st;
  st.policy = point.policy;
  st.budget = point.budget;
  std::array<int, 4> hits{};
  int total_hits = 0, agree = 0;
  double kl_sum = 0, keep_sum = 0;
  const auto& cfg = model.config();
  const std::int64_t token_bytes = 2ll * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4;
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const Reference& ref = refs[i];
    ClosedLoopHook hook(point.spec, point.budget_spec, cfg);
    RunResult run = run_sample(model, ref.prompt, &hook, max_new);
    const CacheBytes pred = hook.predicted_bytes();
    if (run.held_bytes != pred.total) st.bytes_match = false;
    st.bytes_end += static_cast<double>(pred.total);
    for (std::size_t m = 0; m < 4; ++m) st.bytes_end_modality[m] += static_cast<double>(pred.modality[m]);
    st.bytes_peak += static_cast<double>(hook.peak_bytes());
    st.bytes_full_end += static_cast<double>(token_bytes * (ref.prompt.size() + hook.decode_steps()));
    keep_sum += hook.keep();
    st.warnings += hook.warnings().empty() ? 0 : 1;
    std::string text;
    for (const std::int32_t t : run.tokens) text += (text.empty() ? "" : " ") + model.tokenizer().text(t);
    st.generated.push_back(std::move(text));
    const int fam = samples[i].family;
    ++st.family_samples[static_cast<std::size_t>(fam)];
    if (run.tokens == ref.answer_ids) {
      ++hits[static_cast<std::size_t>(fam)];
      ++total_hits;
    }
    // KL at the reference's positions 1 .. n-1 (position 0 is chosen from the full prefill in both runs).
    const std::vector<std::int32_t>& rt = ref.run.tokens;
    const bool same = run.tokens == rt;
    agree += same ? 1 : 0;
    if (rt.size() > 1) {
      RunResult forced;
      if (!same) {
        ClosedLoopHook fhook(point.spec, point.budget_spec, cfg);
        forced = run_sample(model, ref.prompt, &fhook, max_new, &rt);
      }
      const RunResult& cmp = same ? run : forced;
      double kl = 0;
      for (std::size_t j = 1; j < rt.size(); ++j) kl += next_token_kl(ref.run.logits[j], cmp.logits[j]);
      kl_sum += kl / static_cast<double>(rt.size() - 1);
    }
    if (progress) progress(static_cast<int>(i) + 1);
  }
  const double n = static_cast<double>(std::max<std::size_t>(1, refs.size()));
  st.samples = static_cast<int>(refs.size());
  st.accuracy = total_hits / n;
  for (std::size_t f = 0; f < 4; ++f) {
    st.family_accuracy[f] = st.family_samples[f] ? static_cast<double>(hits[f]) / st.family_samples[f]
                                                 : std::numeric_limits<double>::quiet_NaN();
  }
  st.kl = kl_sum / n;
  st.agreement = agree / n;
  st.keep = keep_sum / n;
  st.bytes_end /= n;
  st.bytes_peak /= n;
  st.bytes_full_end /= n;
  for (auto& b : st.bytes_end_modality) b /= n;
  st.bytes_ratio = st.bytes_full_end > 0 ? st.bytes_end / st.bytes_full_end : 1.0;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace kvscope::closedloop
