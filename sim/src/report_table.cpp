// The stdout results table, plus the small helpers the table and the files share.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscope/sim/report.hpp"

namespace kvscope::sim {

ResultsMeta results_meta(const TraceSummary& summary, std::string command_line) {
  ResultsMeta m;
  const trace::ModelGeometry& g = summary.header.geometry;
  m.trace_path = summary.file;
  m.model_name = g.model_name;
  m.synthetic = summary.header.synthetic;
  m.num_layers = g.num_layers;
  m.num_kv_heads = g.num_kv_heads;
  m.num_q_heads = g.num_q_heads;
  m.head_dim = g.head_dim;
  m.num_tokens = static_cast<std::int64_t>(summary.num_tokens);
  m.num_decode_steps = static_cast<std::int64_t>(summary.num_decode_steps);
  for (int i = 0; i < kModalities; ++i) {
    m.tokens_per_modality[i] = static_cast<std::int64_t>(summary.tokens_per_modality[i]);
  }
  m.command_line = std::move(command_line);
  return m;
}

std::string command_line_string(int argc, const char* const* argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    const bool plain = !a.empty() && a.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789@%+=:,./-_") == std::string::npos;
    if (i) out += ' ';
    if (plain) {
      out += a;
      continue;
    }
    out += '\'';
    for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += '\'';
  }
  return out;
}

std::vector<int> reported_modalities(const std::vector<PointResult>& points, const ResultsMeta& meta) {
  PerModalityCount counts = meta.tokens_per_modality;
  const bool meta_has_counts =
      std::any_of(counts.begin(), counts.end(), [](std::int64_t c) { return c > 0; });
  if (!meta_has_counts) {
    for (const PointResult& p : points) {
      for (int m = 0; m < kModalities; ++m) counts[m] += p.total.tokens[m];
    }
  }
  std::vector<int> out;
  for (int m = 0; m < kModalities; ++m) {
    if (counts[m] > 0) out.push_back(m);
  }
  return out;
}

std::string format_layer_ranges(std::vector<int> layers) {
  std::sort(layers.begin(), layers.end());
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  std::string out;
  for (std::size_t i = 0; i < layers.size();) {
    std::size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out.append("L").append(std::to_string(layers[i]));
    if (j > i) out.append("-L").append(std::to_string(layers[j]));
    i = j + 1;
  }
  return out;
}

std::string flag_short_name(const std::string& mode) {
  if (mode == "visual_blindness") return "blind";
  if (mode == "semantic_drift") return "drift";
  if (mode == "repetition") return "repeat";
  if (mode == "over_compression") return "overcomp";
  return mode;
}

namespace {

std::string fmt(const char* format, double v) {
  if (std::isnan(v)) return "nan";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

struct Column {
  std::string header;
  bool left = false;  // text columns are left-aligned, numbers right-aligned
  std::vector<std::string> cells;
  std::size_t width() const {
    std::size_t w = header.size();
    for (const auto& c : cells) w = std::max(w, c.size());
    return w;
  }
};

std::string flags_cell(const PointResult& p) {
  std::string out;
  for (const CollapseFlag& f : p.flags) {
    if (!out.empty()) out += ' ';
    out += flag_short_name(f.mode);
    const std::string layers = format_layer_ranges(f.layers);
    if (!layers.empty()) out += "(" + layers + ")";
  }
  return out;
}

}  // namespace

namespace {

// The header, a rule and one line per point; `decode` adds the end / peak columns.
struct RankProxy;
double rank_value(const RankProxy* rank, const Quality& q);
const char* rank_header(const RankProxy* rank);

std::string table_rows(const std::vector<const PointResult*>& rows, const TableOptions& options, bool audio,
                       bool decode, bool role_column, const RankProxy* rank = nullptr) {
  const std::vector<const PointResult*>& points = rows;

  std::vector<Column> cols = {{"policy", true, {}},  {"budget", true, {}},   {"saved%", false, {}},
                              {"ratio", false, {}},  {"error", false, {}},   {"recall", false, {}},
                              {"R_text", false, {}}, {"R_vision", false, {}}};
  if (audio) cols.push_back({"R_audio", false, {}});
  cols.push_back({"KL", false, {}});
  cols.push_back({"dH", false, {}});
  // Traces with roles: output error and recall on the answer's queries (err_a, rec_a) and the question's
  // (err_q, rec_q; "-" where the set is empty).
  if (options.query_sets) {
    for (const char* h : {"err_a", "rec_a", "err_q", "rec_q"}) cols.push_back({h, false, {}});
  }
  // Decode-mode points: resident cache after the last decode step and its peak over the steps,
  // both / the full cache after the last step (prefill-only tables leave these columns out).
  if (decode) {
    cols.push_back({"end", false, {}});
    cols.push_back({"peak", false, {}});
  }
  // The rank proxy's value (its own column unless it is already shown).
  const char* rank_col = rank_header(rank);
  if (rank_col) cols.push_back({rank_col, false, {}});
  cols.push_back({role_column ? "row" : "P", true, {}});
  std::vector<std::string> flags;  // last column, not padded

  for (const PointResult* pp : points) {
    const PointResult& p = *pp;
    const Quality& q = p.total.quality;
    const double ratio = p.bytes_ratio();
    std::size_t c = 0;
    cols[c++].cells.push_back(p.policy);
    cols[c++].cells.push_back(p.budget.empty() ? "-" : p.budget);
    cols[c++].cells.push_back(fmt("%.1f", 100.0 * (1.0 - ratio)));
    cols[c++].cells.push_back(fmt("%.3f", ratio));
    cols[c++].cells.push_back(fmt("%.4f", q.output_error));
    cols[c++].cells.push_back(fmt("%.3f", q.attention_recall));
    for (int m = 0; m < (audio ? 3 : 2); ++m) {
      // A modality without context tokens has no recall to speak of.
      cols[c++].cells.push_back(p.total.tokens[m] > 0 ? fmt("%.3f", q.recall_modality[m]) : "-");
    }
    cols[c++].cells.push_back(fmt("%.4f", q.kl));
    cols[c++].cells.push_back(fmt("%+.3f", q.entropy_delta));
    if (options.query_sets) {
      for (const QuerySetQuality& qs : q.query_sets) {
        const bool empty = std::isnan(qs.output_error);
        cols[c++].cells.push_back(empty ? "-" : fmt("%.4f", qs.output_error));
        cols[c++].cells.push_back(empty ? "-" : fmt("%.3f", qs.attention_recall));
      }
    }
    if (decode) {
      const double full_end = static_cast<double>(p.total.bytes_full_end);
      cols[c++].cells.push_back(full_end > 0 ? fmt("%.3f", static_cast<double>(p.total.bytes_end) / full_end) : "-");
      cols[c++].cells.push_back(full_end > 0 ? fmt("%.3f", static_cast<double>(p.total.bytes_peak) / full_end) : "-");
    }
    if (rank_col) {
      const double v = rank_value(rank, q);
      cols[c++].cells.push_back(std::isnan(v) ? "-" : fmt("%.3f", v));
    }
    cols[c++].cells.push_back(role_column ? p.kind : p.pareto ? "*" : "");
    flags.push_back(flags_cell(p));
  }

  auto render = [&](auto cell_of, const std::string& last) {
    std::string line;
    for (std::size_t c = 0; c < cols.size(); ++c) {
      const std::string s = cell_of(cols[c]);
      const std::size_t pad = cols[c].width() - s.size();
      if (c) line += "  ";
      line += cols[c].left ? s + std::string(pad, ' ') : std::string(pad, ' ') + s;
    }
    line += "  " + last;
    while (!line.empty() && line.back() == ' ') line.pop_back();
    const std::size_t max = static_cast<std::size_t>(std::max(options.max_width, 20));
    if (line.size() > max) line = line.substr(0, max - 3) + "...";
    return line + "\n";
  };

  std::ostringstream out;
  const std::string header = render([](const Column& c) { return c.header; }, "flags");
  out << header;
  out << std::string(std::min(header.size() - 1, static_cast<std::size_t>(options.max_width)), '-') << "\n";
  for (std::size_t r = 0; r < points.size(); ++r) {
    out << render([r](const Column& c) { return c.cells[r]; }, flags[r]);
  }
  return out.str();
}

}  // namespace

// The proxy with the best mean held-out Spearman and AUC over docs/validation.md's four real-model
// held-out tests (scripts/calibrate --heldout, "Across the held-out tests").
const char* const kDefaultRankProxy = "specific_recall";

namespace {

// A point's value of a rank proxy, oriented so that smaller is better (recalls negated); NaN when unknown.
struct RankProxy {
  const char* name;
  bool recall;  // larger is better
  double (*get)(const Quality&);
};
const std::vector<RankProxy>& rank_proxies() {
  static const std::vector<RankProxy> r = {
      {"output_error", false, [](const Quality& q) { return q.output_error; }},
      {"attention_recall", true, [](const Quality& q) { return q.attention_recall; }},
      {"output_error_answer", false,
       [](const Quality& q) { return q.query_sets[static_cast<std::size_t>(kAnswerQueries)].output_error; }},
      {"error_worst_query", false, [](const Quality& q) { return q.proxies.error_worst_query; }},
      {"error_worst_head", false, [](const Quality& q) { return q.proxies.error_worst_head; }},
      {"error_retrieval", false, [](const Quality& q) { return q.proxies.error_retrieval; }},
      {"error_propagated", false, [](const Quality& q) { return q.proxies.error_propagated; }},
      {"topk_recall", true, [](const Quality& q) { return q.proxies.topk_recall; }},
      {"topk_recall_min", true, [](const Quality& q) { return q.proxies.topk_recall_min; }},
      {"specific_recall", true, [](const Quality& q) { return q.proxies.specific_recall; }},
      {"specific_recall_min", true, [](const Quality& q) { return q.proxies.specific_recall_min; }},
      {"topk_recall_retrieval", true, [](const Quality& q) { return q.proxies.topk_recall_retrieval; }},
  };
  return r;
}

const RankProxy* find_rank_proxy(const std::string& name) {
  for (const RankProxy& r : rank_proxies())
    if (name == r.name) return &r;
  return nullptr;
}

}  // namespace

namespace {
double rank_value(const RankProxy* rank, const Quality& q) { return rank->get(q); }
const char* rank_header(const RankProxy* rank) {
  if (!rank || std::string(rank->name) == "output_error" || std::string(rank->name) == "attention_recall")
    return nullptr;
  return rank->name;
}
}  // namespace

std::string rank_proxy_names() {
  std::string out;
  for (const RankProxy& r : rank_proxies()) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

std::string format_table(const std::vector<PointResult>& points, const TableOptions& options) {
  bool audio = false;
  for (const PointResult& p : points) audio = audio || p.total.tokens[2] > 0;
  if (options.show_audio) audio = *options.show_audio;
  // The policies, then (in a table of their own) the rows that are not policies: the oracle-topk
  // bound and the alloc-search rows.
  std::vector<const PointResult*> policies, others;
  bool decode = false;
  for (const PointResult& p : points) {
    (p.kind == "policy" ? policies : others).push_back(&p);
    decode = decode || (p.kind == "policy" && p.mode == "decode");
  }
  std::ostringstream out;
  // Rank the policies by the proxy, best first (stable: ties and NaN keep the run order, NaN last).
  const std::string rank_name = options.rank_by == "default" ? kDefaultRankProxy : options.rank_by;
  const RankProxy* rank = rank_name == "none" ? nullptr : find_rank_proxy(rank_name);
  if (rank_name != "none" && !rank) {
    throw std::invalid_argument("unknown rank proxy '" + rank_name + "' (valid: " + rank_proxy_names() +
                                ", none)");
  }
  if (rank && policies.size() > 1) {
    auto bad = [&](const PointResult* p) {
      const double v = rank->get(p->total.quality);
      return std::isnan(v) ? std::numeric_limits<double>::infinity() : rank->recall ? -v : v;
    };
    std::stable_sort(policies.begin(), policies.end(),
                     [&](const PointResult* a, const PointResult* b) { return bad(a) < bad(b); });
    out << "ranked by " << rank->name << ", best first"
        << (options.rank_by == "default" ? " (the proxy that ranks held-out real-model accuracy loss best, "
                                           "docs/validation.md; --rank-by to change)"
                                         : "")
        << "\n";
  }
  if (!policies.empty() || others.empty()) out << table_rows(policies, options, audio, decode, false, rank);
  if (!others.empty()) {
    if (!policies.empty()) out << "\n";
    out << "Not policies (they read the trace's own evaluation queries; never on the Pareto front):\n"
        << table_rows(others, options, audio, false, true);
  }
  if (options.legend) {
    out << "saved% = 1 - ratio (kept/full KV bytes); error = relative attention-output error; recall, R_m = "
           "attention mass kept (total, per modality)\n"
           "KL = KL(full || compressed) on survivors; dH = entropy change; P: * = Pareto front (bytes vs "
           "error);"
           " flags: blind = visual blindness,\n"
           "drift = semantic drift, repeat = repetition, overcomp = over-compression, with their layers\n";
    if (options.query_sets) {
      out << "err_a, rec_a / err_q, rec_q = error and recall on the answer's / the question's decode queries "
             "only (docs/metrics.md \"Query sets\")\n";
    }
    if (decode) {
      out << "end, peak = cache (context + decode tokens) after the last decode step and its maximum over the "
             "steps, / the full cache then\n";
    }
    if (!others.empty()) {
      out << "row: bound = oracle-topk, the tokens with the most attention from the evaluation queries, "
             "per layer and kv head (the\n"
             "reference bound of eviction scorers at that budget); search = alloc-search:S, per-layer "
             "allocations of S searched on the\n"
             "replayed error, never above S at that budget\n";
    }
  }
  return out.str();
}

}  // namespace kvscope::sim
