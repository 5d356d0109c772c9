#include "kvscope/sim/sweep.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "alloc_search.hpp"
#include "budget_batch.hpp"
#include "evaluation.hpp"

namespace kvscope::sim {

void accumulate(HeadResult& d, const HeadResult& s, double w) {
  d.bytes_full += s.bytes_full;
  d.bytes_kept += s.bytes_kept;
  for (int m = 0; m < kModalities; ++m) {
    const auto i = static_cast<std::size_t>(m);
    d.tokens[i] += s.tokens[i];
    d.kept[i] += s.kept[i];
    d.merged[i] += s.merged[i];
    d.evicted[i] += s.evicted[i];
    d.bytes_full_modality[i] += s.bytes_full_modality[i];
    d.bytes_kept_modality[i] += s.bytes_kept_modality[i];
    d.quality.recall_modality[i] += w * s.quality.recall_modality[i];
    d.quality.share_before[i] += w * s.quality.share_before[i];
    d.quality.share_after[i] += w * s.quality.share_after[i];
  }
  d.bytes_full_end += s.bytes_full_end;
  d.bytes_end += s.bytes_end;
  d.bytes_peak += s.bytes_peak;  // callers replace sums of peaks by the peak of the sum (steps)
  d.quality.output_error += w * s.quality.output_error;
  d.quality.attention_recall += w * s.quality.attention_recall;
  d.quality.kl += w * s.quality.kl;
  d.quality.entropy_delta += w * s.quality.entropy_delta;
  for (std::size_t k = 0; k < static_cast<std::size_t>(kQuerySets); ++k) {
    QuerySetQuality& a = d.quality.query_sets[k];
    const QuerySetQuality& b = s.quality.query_sets[k];
    a.output_error += w * b.output_error;
    a.attention_recall += w * b.attention_recall;
    a.kl += w * b.kl;
    a.entropy_delta += w * b.entropy_delta;
  }
}

std::vector<Budget> parse_budget_list(const std::string& text) {
  std::vector<Budget> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.find_first_not_of(" \t") == std::string::npos) throw PolicyError("empty item in budget list '" + text + "'");
    if (item.find(':') != std::string::npos) {
      double a = 0, b = 0, step = 0;
      char c1 = 0, c2 = 0;
      std::istringstream is(item);
      if (!(is >> a >> c1 >> b >> c2 >> step) || c1 != ':' || c2 != ':' || !is.eof() || step <= 0 || a <= 0 ||
          b > 1 || a > b) {
        throw PolicyError("malformed budget range '" + item + "' (use START:STOP:STEP with 0 < START <= STOP <= 1)");
      }
      // Counted before any is made: 0.1:0.9:1e-7 would be 8 million points.
      const double count = std::floor((b - a) / step + 1e-9) + 1;
      if (count + static_cast<double>(out.size()) > static_cast<double>(kMaxSweepPoints)) {
        std::ostringstream os;
        os << "budget range '" << item << "' asks for " << std::llround(std::min(count, 1e18))
           << " budgets; at most " << kMaxSweepPoints << " in all";
        throw PolicyError(os.str());
      }
      for (int i = 0;; ++i) {
        const double x = std::round((a + i * step) * 1e9) / 1e9;
        if (x > b + 1e-9) break;
        std::ostringstream os;
        os << x;
        out.push_back(parse_budget(os.str()));
      }
    } else {
      out.push_back(parse_budget(item));
    }
    if (out.size() > kMaxSweepPoints) {
      throw PolicyError("budget list asks for more than " + std::to_string(kMaxSweepPoints) + " budgets");
    }
  }
  if (out.empty()) throw PolicyError("empty budget list");
  return out;
}

std::vector<SweepPoint> make_sweep_points(const std::vector<PolicySpec>& policies, const std::vector<Budget>& budgets) {
  std::vector<SweepPoint> pts;
  for (const auto& p : policies) {
    if (!p.compress_tokens || p.adaptive) {
      Budget none;
      none.text = "-";
      pts.push_back({p, none});
      continue;
    }
    if (pts.size() + budgets.size() > kMaxSweepPoints) {
      throw PolicyError(std::to_string(policies.size()) + " policies x " + std::to_string(budgets.size()) +
                        " budgets is more than " + std::to_string(kMaxSweepPoints) + " sweep points");
    }
    for (const auto& b : budgets) pts.push_back({p, b});
  }
  return pts;
}

namespace {
std::string layer_list(const std::vector<int>& layers) {
  std::string s;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    std::size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(layers[i]);
    if (j > i) s += "-" + std::to_string(layers[j]);
    i = j;
  }
  return s;
}
std::string fmt(double x) {
  std::ostringstream o;
  o.precision(3);
  o << x;
  return o.str();
}
}  // namespace

std::vector<CollapseFlag> detect_collapse(const PointResult& pt, const CollapseThresholds& th, bool has_vision) {
  std::vector<CollapseFlag> flags;
  const int L = static_cast<int>(pt.layers.size());
  if (L == 0) return flags;
  constexpr std::size_t V = static_cast<std::size_t>(kernels::Modality::kVision);
  if (has_vision) {
    std::vector<int> blind;
    double worst_recall = 1, worst_ratio = 1;
    for (const auto& l : pt.layers) {
      const Quality& q = l.total.quality;
      const double ratio = q.share_before[V] > 1e-9 ? q.share_after[V] / q.share_before[V] : 1.0;
      if (q.recall_modality[V] < th.blind_recall || ratio < th.blind_share) blind.push_back(l.layer);
      worst_recall = std::min(worst_recall, q.recall_modality[V]);
      worst_ratio = std::min(worst_ratio, ratio);
    }
    if (!blind.empty() && static_cast<double>(blind.size()) >= th.blind_layer_fraction * L) {
      flags.push_back({"visual_blindness", blind,
                       std::to_string(blind.size()) + "/" + std::to_string(L) + " layers with vision recall < " +
                           fmt(th.blind_recall) + " or vision share < " + fmt(th.blind_share) +
                           "x full; worst vision recall " + fmt(worst_recall) + ", worst share ratio " + fmt(worst_ratio),
                       "lower the vision compression rate; protect alignment tokens more strongly"});
    }
  }
  if (L >= 3) {
    const int third = L / 3;
    double shallow = 0, deep = 0;
    std::vector<int> deep_layers;
    for (int l = 0; l < third; ++l) shallow += pt.layers[static_cast<std::size_t>(l)].total.quality.output_error / third;
    for (int l = L - third; l < L; ++l) {
      deep += pt.layers[static_cast<std::size_t>(l)].total.quality.output_error / third;
      deep_layers.push_back(l);
    }
    if (deep > th.drift_min_error && deep > th.drift_ratio * shallow) {
      flags.push_back({"semantic_drift", deep_layers,
                       "deep-third output error " + fmt(deep) + " vs shallow-third " + fmt(shallow) + " (> " +
                           fmt(th.drift_ratio) + "x and > " + fmt(th.drift_min_error) + ")",
                       "lower the deep layers' rates; quantize-only in deep layers"});
    }
  }
  std::int64_t merged_tokens = 0;
  for (int m = 0; m < kModalities; ++m) merged_tokens += pt.total.merged[static_cast<std::size_t>(m)];
  if (merged_tokens > 0) {  // repetition is a failure of merging: policies that only evict cannot cause it
    std::vector<int> rep;
    double worst = 0;
    for (const auto& l : pt.layers) {
      if (l.total.quality.entropy_delta < th.repetition_entropy) rep.push_back(l.layer);
      worst = std::min(worst, l.total.quality.entropy_delta);
    }
    if (!rep.empty() && static_cast<double>(rep.size()) >= th.repetition_layer_fraction * L) {
      flags.push_back({"repetition", rep,
                       std::to_string(rep.size()) + "/" + std::to_string(L) + " layers with entropy change < " +
                           fmt(th.repetition_entropy) + " nats (worst " + fmt(worst) + ")",
                       "raise the merge threshold (fewer merges)"});
    }
  }
  {
    const int last = th.last_layers > 0 ? std::min(th.last_layers, L) : std::max(1, L / 8);
    std::vector<int> over;
    double worst = 0;
    for (int l = L - last; l < L; ++l) {
      // KL including the evicted mass: KL on survivors - log R (R = attention recall).
      const Quality& q = pt.layers[static_cast<std::size_t>(l)].total.quality;
      const double kl = q.kl - std::log(std::max(q.attention_recall, 1e-12));
      if (kl > th.overcompression_kl) over.push_back(l);
      worst = std::max(worst, kl);
    }
    if (!over.empty()) {
      flags.push_back({"over_compression", over,
                       "KL incl. evicted mass " + fmt(worst) + " > " + fmt(th.overcompression_kl) + " in the last " + std::to_string(last) +
                           " layers (" + layer_list(over) + ")",
                       "back off the compression rate"});
    }
  }
  return flags;
}

namespace {
// The first metric of `q` that is not finite, or nullptr.
const char* non_finite_metric(const Quality& q) {
  if (!std::isfinite(q.output_error)) return "output error";
  if (!std::isfinite(q.attention_recall)) return "attention recall";
  if (!std::isfinite(q.kl)) return "KL";
  if (!std::isfinite(q.entropy_delta)) return "entropy change";
  for (int m = 0; m < kModalities; ++m) {
    const auto i = static_cast<std::size_t>(m);
    if (!std::isfinite(q.recall_modality[i])) return "recall per modality";
    if (!std::isfinite(q.share_before[i])) return "modality share before";
    if (!std::isfinite(q.share_after[i])) return "modality share after";
  }
  return nullptr;
}
}  // namespace

void check_finite(const SweepOutput& out, const std::string& source) {
  for (const auto& pt : out.points) {
    const std::string head = source + ": " + pt.policy + "@" + pt.budget + ": ";
    for (const auto& l : pt.layers) {
      const std::string at = head + "layer " + std::to_string(l.layer);
      for (const auto& h : l.heads) {
        if (const char* m = non_finite_metric(h.quality)) {
          throw std::runtime_error(at + ", kv head " + std::to_string(h.kv_head) + ": the " + m +
                                   " is not finite; no results are written");
        }
      }
      for (std::size_t h = 0; h < l.token_maps.size(); ++h) {
        for (float x : l.token_maps[h].score) {
          if (!std::isfinite(x)) {
            throw std::runtime_error(at + ", kv head " + std::to_string(h) +
                                     ": a token score is not finite; no results are written");
          }
        }
      }
      if (const char* m = non_finite_metric(l.total.quality))
        throw std::runtime_error(at + ": the " + std::string(m) + " is not finite; no results are written");
    }
    if (const char* m = non_finite_metric(pt.total.quality))
      throw std::runtime_error(head + "the " + std::string(m) + " is not finite; no results are written");
  }
}

void require_replayable(const trace::TraceReader& reader, const std::string& who) {
  if (reader.num_decode_steps() == 0) {
    throw std::runtime_error(reader.path() + ": the trace has S = 0 decode steps; " + who +
                             " needs at least one (the decode queries are the evaluation queries): capture "
                             "with kvcap run --max-new N or kvcap synth --decode N");
  }
}

SweepOutput run_sweep(const trace::TraceReader& reader, const std::vector<SweepPoint>& requested,
                      const SweepOptions& options) {
  SweepOutput out;
  const ScratchPoolScope scratch_pool;  // the points' buffers are reused, not reallocated (evaluation.hpp)
  TraceContext ctx = TraceContext::from_reader(reader);
  if (options.backend) ctx.backend = options.backend;
  require_replayable(reader, "replaying a trace");
  if (options.question_in_context) move_question_into_context(ctx, reader);
  out.context_tokens = ctx.T;
  out.decode_steps = ctx.S;
  out.steps_in_context = ctx.steps_in_context;
  out.has_roles = ctx.has_roles;
  for (int k = 0; k < kQuerySets; ++k)
    out.query_set_steps[static_cast<std::size_t>(k)] = ctx.query_set_steps(k);
  const int L = ctx.geometry.num_layers;
  // The bound and search rows (docs/policies.md "Bound and search rows in sweeps"): one per distinct
  // token budget fraction < 1 of the requested points (with the budget text of its first point), in
  // increasing order. Fraction, token and byte budgets need no layer statistic; adaptive points have none.
  std::vector<std::pair<double, std::string>> targets;
  for (const auto& pt : requested) {
    if (pt.budget.kind == Budget::Kind::kNone || !pt.policy.compress_tokens || pt.policy.adaptive) continue;
    const double f = keep_fraction(pt.policy, pt.budget, ctx);
    if (f >= 1.0) continue;
    bool seen = false;
    for (const auto& t : targets) seen |= std::fabs(t.first - f) < 1e-9;
    if (seen) continue;
    // A byte budget of a quantizing policy is more tokens than the same bytes unquantized: the rows
    // then name the token fraction itself.
    std::ostringstream text;
    text << std::round(f * 1e4) / 1e4;
    targets.emplace_back(f, pt.budget.kind == Budget::Kind::kBytes && pt.policy.key_quant ? text.str() : pt.budget.text);
  }
  std::sort(targets.begin(), targets.end());
  // The bound's points run with the policies' (after them, so the policies' rows keep their order).
  std::vector<SweepPoint> points;
  if (!options.extra_rows_only) points = requested;
  const std::size_t replayed = points.size();
  if (options.bound.enabled) {
    const PolicySpec bound = PolicyRegistry().get("oracle-topk");
    for (const auto& [f, text] : targets) {
      // Not twice where the requested points already have the bound at this fraction.
      bool listed = false;
      for (const auto& pt : requested)
        listed |= pt.policy.name == bound.name && std::fabs(keep_fraction(pt.policy, pt.budget, ctx) - f) < 1e-9;
      if (listed) continue;
      Budget b;
      b.kind = Budget::Kind::kFraction;
      b.value = f;
      b.text = text;
      points.push_back({bound, b});
    }
  }
  std::optional<detail::AllocSearch> search;
  if (options.alloc_search.enabled && !targets.empty()) search.emplace(options.alloc_search, ctx, targets);
  out.points.resize(points.size());
  std::vector<double> keep(points.size(), 1.0), cap(points.size(), 1.0);
  std::vector<std::vector<std::string>> warn(points.size());
  const std::size_t total = points.size() * static_cast<std::size_t>(L);
  std::size_t done = 0;
  for (std::size_t i = 0; i < points.size(); ++i) {
    out.points[i].policy = points[i].policy.name;
    out.points[i].budget = points[i].budget.text.empty() ? "-" : points[i].budget.text;
    out.points[i].mode = points[i].policy.mode == PolicyMode::kDecode ? "decode" : "prefill";
    if (i >= replayed || points[i].policy.stages.scorer == "oracle-topk") out.points[i].kind = "bound";
  }
  for (int l = 0; l < L; ++l) {
    LayerData layer = read_layer_data(reader, l, ctx);
    if (l == 0) {
      // Adaptive complexity from the original input: log V + log T_text + 2 N_align / (T_text + V),
      // alignment tokens being those whose layer-0 cross-modal attention share exceeds 0.3.
      const auto& given = layer.cross_given();
      int n_align = 0;
      for (int t = 0; t < ctx.T; ++t) {
        double s = 0;
        for (int h = 0; h < ctx.geometry.num_kv_heads; ++h) s += given[static_cast<std::size_t>(h) * ctx.T + t];
        if (s / ctx.geometry.num_kv_heads > 0.3) ++n_align;
      }
      const double V = static_cast<double>(std::max<std::int64_t>(1, ctx.tokens[1]));
      const double Tt = static_cast<double>(std::max<std::int64_t>(1, ctx.tokens[0]));
      ctx.complexity = std::log(V) + std::log(Tt) + 2.0 * n_align / (Tt + V);
      ctx.complexity_known = true;
      for (std::size_t i = 0; i < points.size(); ++i) {
        const PolicySpec& ps = points[i].policy;
        const bool has_budget = points[i].budget.kind != Budget::Kind::kNone;
        keep[i] = keep_fraction(ps, points[i].budget, ctx);
        out.points[i].budget_value = keep[i];
        if (ps.mode == PolicyMode::kDecode) {
          // A fixed cap leaves the point's budget (if any) to a prefill pass; otherwise the budget is the cap.
          if (ps.cap.kind != Budget::Kind::kNone) {
            cap[i] = keep_fraction(ps, ps.cap, ctx);
            keep[i] = has_budget ? keep[i] : 1.0;
            out.points[i].budget_value = keep[i];
          } else {
            // (no budget: an allocator with a schedule of its own caps at its default keep)
            cap[i] = has_budget || !policy_needs_budget(ps) ? keep[i] : 1.0;
            keep[i] = 1.0;
            out.points[i].budget_value = cap[i];
          }
        }
      }
    }
    // Statistics first (serially, each kernel parallel inside), then the points of this layer
    // in parallel: each point only reads the layer's caches (the float32 copy and the statistics
    // after prepare_and_release) and writes its own result.
    std::vector<const PolicySpec*> policies;
    for (const auto& pt : points) policies.push_back(&pt.policy);
    if (search)
      for (const PolicySpec* s : search->specs()) policies.push_back(s);
    layer.prepare_and_release(policies);
    layer.answer_topk();  // read by every point's evaluation (docs/metrics.md "Proxies")
    // Tasks: one point, or the consecutive points of one eviction-only policy at several budgets,
    // evaluated together (budget_batch.hpp).
    const bool batching =
        options.batch_budgets && ctx.batched_evaluation && ctx.backend->kind() == BackendKind::kCpu;
    std::vector<std::vector<std::size_t>> tasks;
    for (std::size_t i = 0; i < points.size(); ++i) {
      const PolicySpec& ps = points[i].policy;
      const bool batch = batching && budget_batch_eligible(ps);
      if (batch && !tasks.empty()) {
        const PolicySpec& prev = points[tasks.back().front()].policy;
        if (budget_batch_eligible(prev) && prev.name == ps.name) {
          tasks.back().push_back(i);
          continue;
        }
      }
      tasks.push_back({i});
    }
    std::vector<std::string> errors(points.size());
#pragma omp parallel for schedule(dynamic)
    for (std::size_t ti = 0; ti < tasks.size(); ++ti) {
      const std::vector<std::size_t>& task = tasks[ti];
      const std::size_t i = task.front();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        if (task.size() > 1) {
          std::vector<double> keeps;
          std::vector<std::vector<std::string>*> warns;
          for (std::size_t j : task) {
            keeps.push_back(keep[j]);
            warns.push_back(&warn[j]);
          }
          std::vector<LayerResult> rs = run_budgets_on_layer(points[i].policy, keeps, layer, ctx, warns);
          for (std::size_t n = 0; n < task.size(); ++n) out.points[task[n]].layers.push_back(std::move(rs[n]));
        } else if (points[i].policy.mode == PolicyMode::kDecode) {
          out.points[i].layers.push_back(
              run_decode_policy_on_layer(points[i].policy, keep[i], cap[i], layer, ctx, warn[i]));
        } else {
          out.points[i].layers.push_back(run_policy_on_layer(points[i].policy, keep[i], layer, ctx, warn[i]));
        }
      } catch (const std::exception& e) {
        errors[i] = out.points[i].policy + "@" + out.points[i].budget + ": " + e.what();
      }
      // A task's time is shared equally by its points.
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (std::size_t j : task) out.points[j].seconds += dt / static_cast<double>(task.size());
#pragma omp critical(kvscope_sweep_progress)
      {
        done += task.size();
        if (options.progress) options.progress(done, total);
      }
    }
    for (const auto& e : errors)
      if (!e.empty()) throw std::runtime_error(e);
    if (search) search->run_layer(layer, ctx);
  }
  if (search) search->append_points(out.points);
  out.attention_statistics = ctx.attention_statistics_summary();
  for (const std::string& w : ctx.aggregate_warnings) out.warnings.push_back(w);
  const bool has_vision = ctx.tokens[static_cast<std::size_t>(kernels::Modality::kVision)] > 0;
  for (std::size_t i = 0; i < out.points.size(); ++i) {
    PointResult& pt = out.points[i];
    std::vector<std::int64_t> resident;  // [S] resident bytes of the point after appending each step
    for (auto& lr : pt.layers) {
      const double w = 1.0 / static_cast<double>(lr.heads.size());
      for (const auto& h : lr.heads) accumulate(lr.total, h, w);
      resident.resize(std::max(resident.size(), lr.steps.size()), 0);
      std::int64_t peak = 0;
      for (std::size_t s = 0; s < lr.steps.size(); ++s) {
        peak = std::max(peak, lr.steps[s].bytes_before);
        resident[s] += lr.steps[s].bytes_before;
      }
      if (!lr.steps.empty()) lr.total.bytes_peak = peak;
      accumulate(pt.total, lr.total, 1.0 / L);
    }
    if (!resident.empty()) pt.total.bytes_peak = *std::max_element(resident.begin(), resident.end());
    pt.flags = detect_collapse(pt, options.thresholds, has_vision);
    if (i >= warn.size() || warn[i].empty()) continue;
    // One line per point: the first clamp, and how many more layers had one; a notice that names no
    // layer (decode mode's unmerged heads) gets a line of its own.
    std::vector<std::string> layered;
    for (const std::string& w : warn[i]) {
      if (w.rfind("layer ", 0) == 0) layered.push_back(w);
      else out.warnings.push_back(pt.policy + "@" + pt.budget + ": " + w);
    }
    if (layered.empty()) continue;
    std::string line = pt.policy + "@" + pt.budget + ": " + layered[0];
    if (layered.size() > 1) line += " (and " + std::to_string(layered.size() - 1) + " more layers)";
    out.warnings.push_back(line);
  }
  finish_proxies(out);
  finish_query_sets(out, reader.path());
  check_finite(out, reader.path());
  return out;
}

SweepPoint run_point(const PolicySpec& policy, Budget budget, std::string* ignored) {
  ignored->clear();
  const bool uses_budget = policy.compress_tokens && !policy.adaptive;
  if (budget.kind == Budget::Kind::kNone && policy_needs_budget(policy)) {
    const std::string& n = policy.name;
    throw PolicyError("'" + n + "' needs a budget, e.g. " + n + "@0.3 (fraction kept), " + n + "@512tok or " +
                      n + "@64MiB");
  }
  if (budget.kind != Budget::Kind::kNone && !uses_budget) {
    *ignored = budget.text;
    budget = Budget{};
  }
  if (budget.kind == Budget::Kind::kNone) budget.text = "-";
  return {policy, budget};
}

SweepPoint run_point(const PolicyRegistry& registry, const std::string& policy_at_budget,
                     std::string* ignored) {
  auto [name, budget] = split_policy_budget(policy_at_budget);
  return run_point(registry.get(name), budget, ignored);
}

ResultsMeta sweep_results_meta(const TraceSummary& summary, const SweepOutput& out,
                               std::string command_line) {
  ResultsMeta meta = results_meta(summary, std::move(command_line));
  meta.has_roles = out.has_roles;
  meta.steps_in_context = out.steps_in_context;
  meta.num_tokens = out.context_tokens;
  meta.num_decode_steps = out.decode_steps;
  meta.attention_statistics = out.attention_statistics;
  meta.tokens_per_modality[static_cast<std::size_t>(kernels::Modality::kText)] += out.steps_in_context;
  for (int k = 0; k < kQuerySets; ++k)
    meta.query_set_steps[static_cast<std::size_t>(k)] = out.query_set_steps[static_cast<std::size_t>(k)];
  return meta;
}

}  // namespace kvscope::sim
