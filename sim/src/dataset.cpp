// Dataset sweeps: mean points, per-sample rows and bootstrap aggregates (docs/results-format.md
// "Dataset sweeps").
#include "kvscope/sim/dataset.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "kvscope/sim/pareto.hpp"

namespace kvscope::sim {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

double ratio(std::int64_t kept, std::int64_t full) {
  return full ? static_cast<double>(kept) / static_cast<double>(full) : 1.0;
}

// What a dataset sweep keeps of one layer total (or point total) of one sample: the bytes and the
// quality metrics of its /sample_points rows and of the bootstrap (344 bytes instead of a HeadResult's
// 584 and its layer's head rows).
struct SampleRow {
  std::array<std::int64_t, kModalities> bytes_full_modality{}, bytes_kept_modality{};
  std::int64_t bytes_full = 0, bytes_kept = 0;
  Quality quality;
  SampleRow() = default;
  explicit SampleRow(const HeadResult& r)
      : bytes_full_modality(r.bytes_full_modality),
        bytes_kept_modality(r.bytes_kept_modality),
        bytes_full(r.bytes_full.total()),
        bytes_kept(r.bytes_kept.total()),
        quality(r.quality) {}
};

// The metrics of one row (aggregate_metric_names order); m < 0 is the "all" row.
void row_metrics(const SampleRow& r, int m, bool query_sets, std::vector<double>& out) {
  const Quality& q = r.quality;
  if (m >= 0) {
    const auto i = static_cast<std::size_t>(m);
    out.push_back(ratio(r.bytes_kept_modality[i], r.bytes_full_modality[i]));
    out.push_back(q.output_error);
    out.push_back(q.recall_modality[i]);
    out.push_back(q.kl);
    out.push_back(q.entropy_delta);
    out.push_back(q.share_before[i]);
    out.push_back(q.share_after[i]);
  } else {
    double before = 0, after = 0;
    for (int k = 0; k < kModalities; ++k) {
      before += q.share_before[static_cast<std::size_t>(k)];
      after += q.share_after[static_cast<std::size_t>(k)];
    }
    out.push_back(ratio(r.bytes_kept, r.bytes_full));
    out.push_back(q.output_error);
    out.push_back(q.attention_recall);
    out.push_back(q.kl);
    out.push_back(q.entropy_delta);
    out.push_back(before);
    out.push_back(after);
  }
  if (!query_sets) return;
  for (const QuerySetQuality& s : q.query_sets) {
    out.push_back(s.output_error);
    out.push_back(s.attention_recall);
    out.push_back(s.kl);
    out.push_back(s.entropy_delta);
  }
}

// Multiplies the quality metrics that the mean points' sums weight (accumulate's and the proxies).
void scale_quality(HeadResult& r, double f) {
  Quality& q = r.quality;
  for (std::size_t i = 0; i < static_cast<std::size_t>(kModalities); ++i) {
    q.recall_modality[i] *= f;
    q.share_before[i] *= f;
    q.share_after[i] *= f;
  }
  q.output_error *= f;
  q.attention_recall *= f;
  q.kl *= f;
  q.entropy_delta *= f;
  for (QuerySetQuality& s : q.query_sets) {
    s.output_error *= f;
    s.attention_recall *= f;
    s.kl *= f;
    s.entropy_delta *= f;
  }
  for (int i = 0; i < kNumProxies; ++i) proxy_value(q.proxies, i) *= f;
}

// The mean points' proxies (results format 1.5): weighted sums over the samples, like the metrics
// accumulate() weights (it leaves the proxies alone: within one trace each has its own rule over heads
// and layers).
void accumulate_proxies(HeadResult& d, const HeadResult& s, double w) {
  for (int i = 0; i < kNumProxies; ++i)
    proxy_value(d.quality.proxies, i) += w * proxy_value(s.quality.proxies, i);
}

// The (1 - c)/2 and (1 + c)/2 quantiles of v with linear interpolation between order statistics (numpy's
// default), by selection (v is reordered): each is the k-th smallest value and, for the interpolation,
// the smallest value above it; the upper one is selected in the part above the lower one's.
void quantiles(std::vector<double>& v, double alpha, double& lo, double& hi) {
  const std::size_t n = v.size();
  auto at = [&](std::size_t from, double p) {
    const double h = p * static_cast<double>(n - 1);
    const auto k = static_cast<std::size_t>(std::floor(h));
    const auto first = v.begin() + static_cast<std::ptrdiff_t>(from);
    std::nth_element(first, v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
    const double a = v[k];
    if (k + 1 >= n || h == static_cast<double>(k)) return std::make_pair(a, k);
    const double b = *std::min_element(v.begin() + static_cast<std::ptrdiff_t>(k) + 1, v.end());
    return std::make_pair(a + (h - static_cast<double>(k)) * (b - a), k);
  };
  const auto [l, k] = at(0, alpha);
  lo = l;
  // After the first selection everything past k is >= v[k]: the upper quantile, when past k, is there.
  const auto k_hi = static_cast<std::size_t>(std::floor((1.0 - alpha) * static_cast<double>(n - 1)));
  hi = at(k_hi > k ? k + 1 : 0, 1.0 - alpha).first;
}

// Mean and bootstrap interval of every column of the n x C row-major matrix x (NaN ignored).
std::vector<Interval> bootstrap_columns(const std::vector<double>& x, std::size_t n, std::size_t C,
                                        const BootstrapOptions& o, std::uint64_t seed) {
  std::vector<Interval> out(C);
  bool all_finite = true;
  for (std::size_t c = 0; c < C; ++c) {
    double s = 0;
    std::size_t k = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double v = x[i * C + c];
      if (std::isfinite(v)) {
        s += v;
        ++k;
      } else {
        all_finite = false;
      }
    }
    out[c].mean = out[c].lo = out[c].hi = k ? s / static_cast<double>(k) : kNaN;
  }
  const auto B = static_cast<std::size_t>(std::max(0, o.resamples));
  if (B == 0 || n < 2) return out;
  std::vector<std::uint32_t> counts(n);
  std::vector<double> means(B * C), sum(C), weight(C);
  std::uint64_t state = seed;
  for (std::size_t b = 0; b < B; ++b) {
    std::fill(counts.begin(), counts.end(), 0u);
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint64_t r = splitmix64(state);
      ++counts[static_cast<std::size_t>(((r >> 32) * static_cast<std::uint64_t>(n)) >> 32)];
    }
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(weight.begin(), weight.end(), 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      if (!counts[i]) continue;
      const double w = counts[i];
      const double* row = &x[i * C];
      if (all_finite) {
        for (std::size_t c = 0; c < C; ++c) sum[c] += w * row[c];
      } else {
        for (std::size_t c = 0; c < C; ++c) {
          if (std::isfinite(row[c])) {
            sum[c] += w * row[c];
            weight[c] += w;
          }
        }
      }
    }
    for (std::size_t c = 0; c < C; ++c) {
      const double wc = all_finite ? static_cast<double>(n) : weight[c];
      means[b * C + c] = wc > 0 ? sum[c] / wc : kNaN;
    }
  }
  const double alpha = (1.0 - o.confidence) / 2.0;
  std::vector<double> v;
  v.reserve(B);
  for (std::size_t c = 0; c < C; ++c) {
    v.clear();
    double vmin = std::numeric_limits<double>::infinity(), vmax = -vmin;
    for (std::size_t b = 0; b < B; ++b) {
      const double m = means[b * C + c];
      if (!std::isfinite(m)) continue;
      v.push_back(m);
      vmin = std::min(vmin, m);
      vmax = std::max(vmax, m);
    }
    if (v.empty()) continue;
    if (vmin == vmax) {  // every resample gave the same mean (e.g. a metric constant over the samples)
      out[c].lo = out[c].hi = vmin;
      continue;
    }
    quantiles(v, alpha, out[c].lo, out[c].hi);
  }
  return out;
}

std::string point_key(const PointResult& p) {
  return p.policy + '\x1f' + p.budget + '\x1f' + p.mode + '\x1f' + p.kind;
}

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return "nan";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace

std::vector<std::string> aggregate_metric_names(bool query_sets) {
  std::vector<std::string> names = {"bytes_ratio",   "output_error", "attention_recall", "kl",
                                    "entropy_delta", "share_before", "share_after"};
  if (query_sets) {
    for (int k = 0; k < kQuerySets; ++k) {
      const std::string set = query_set_name(k);
      for (const char* m : {"output_error_", "attention_recall_", "kl_", "entropy_delta_"})
        names.push_back(m + set);
    }
  }
  return names;
}

std::string length_bucket(std::int64_t tokens) {
  if (tokens <= 0) return "0-0";
  std::int64_t lo = 1;
  while (lo <= tokens / 2) lo *= 2;
  return std::to_string(lo) + "-" + std::to_string(2 * lo - 1);
}

Interval bootstrap_interval(const std::vector<double>& values, const BootstrapOptions& options,
                            std::uint64_t seed) {
  return bootstrap_columns(values, values.size(), 1, options, seed).front();
}

void check_groupings(const trace::Dataset& dataset, const std::vector<std::string>& by) {
  for (const std::string& g : by) {
    if (g == "length" || g == "all") continue;
    if (std::find(dataset.columns.begin(), dataset.columns.end(), g) == dataset.columns.end()) {
      std::string cols;
      for (const std::string& c : dataset.columns) cols += (cols.empty() ? "" : ", ") + c;
      throw std::runtime_error("--by " + g + ": " +
                               (dataset.has_manifest
                                    ? "no such column in the manifest (columns: " + cols + ")"
                                    : std::string("a list of traces has no manifest; only "
                                                  "--by length works")));
    }
  }
}

namespace {

// One sample's share of a mean point: its layer totals and point total, and its collapse flags (mode
// and layers only: the evidence and fix text is not in /sample_points).
struct Member {
  std::size_t sample = 0;
  std::vector<SampleRow> rows;  // the sample's layers (its own count), then the point's total
  std::vector<CollapseFlag> flags;
  const SampleRow* layer(std::size_t l) const { return l + 1 < rows.size() ? &rows[l] : nullptr; }
  const SampleRow& total() const { return rows.back(); }
};

struct SampleInfo {
  bool ok = false;
  std::string error;
  std::int64_t num_tokens = 0, num_decode_steps = 0;
};

}  // namespace

struct DatasetAggregator::Impl {
  const trace::Dataset& dataset;
  std::vector<std::string> by;
  BootstrapOptions options;
  CollapseThresholds thresholds;
  std::vector<SampleInfo> samples;
  std::map<std::string, std::size_t> index;       // point key -> row of points
  std::vector<PointResult> points;                // the mean points, folding
  std::vector<std::vector<Member>> members;       // per point, in sample order
  std::vector<std::vector<std::size_t>> layer_n;  // per point and layer: samples with that layer
  ResultsMeta meta;
  bool any_ok = false, has_roles = false, finished = false;
  // Set by finish(), read by the /sample_points stream: the reported modalities, the metrics per row
  // and each mean point's layer numbers (the mean points themselves go to the results).
  std::vector<int> modalities;
  std::size_t K = 0;
  std::vector<std::vector<std::int64_t>> layer_numbers;

  Impl(const trace::Dataset& d, std::vector<std::string> b, BootstrapOptions o, CollapseThresholds t)
      : dataset(d), by(std::move(b)), options(o), thresholds(std::move(t)) {}

  // Folding weight of every sample: 1 / (samples of the dataset). A point (or layer) that only n of
  // the N samples have (failed samples, traces of other depths) is rescaled by N / n in finish().
  double weight() const { return 1.0 / static_cast<double>(dataset.samples.size()); }

  void add(SampleResult r) {
    if (finished || samples.size() >= dataset.samples.size())
      throw std::logic_error("DatasetAggregator::add: more samples than the dataset has");
    const std::size_t i = samples.size();
    SampleInfo info;
    info.ok = r.ok;
    info.error = r.error;
    info.num_tokens = r.meta.num_tokens;
    info.num_decode_steps = r.meta.num_decode_steps;
    samples.push_back(std::move(info));
    if (!r.ok) return;
    const ResultsMeta& m = r.meta;
    if (!any_ok) {
      meta = m;
      meta.num_tokens = meta.num_decode_steps = 0;
      meta.tokens_per_modality = {};
      meta.steps_in_context = 0;
      meta.query_set_steps = {};
      any_ok = true;
    }
    has_roles = has_roles || m.has_roles;
    meta.num_tokens += m.num_tokens;
    meta.num_decode_steps += m.num_decode_steps;
    meta.steps_in_context += m.steps_in_context;
    for (int k = 0; k < kModalities; ++k)
      meta.tokens_per_modality[static_cast<std::size_t>(k)] +=
          m.tokens_per_modality[static_cast<std::size_t>(k)];
    for (int k = 0; k < kQuerySets; ++k)
      meta.query_set_steps[static_cast<std::size_t>(k)] += m.query_set_steps[static_cast<std::size_t>(k)];
    meta.num_layers = std::max(meta.num_layers, m.num_layers);
    meta.num_kv_heads = std::max(meta.num_kv_heads, m.num_kv_heads);

    const double w = weight();
    for (PointResult& src : r.points) {
      const auto [it, fresh] = index.emplace(point_key(src), points.size());
      if (fresh) {
        PointResult mean;
        mean.policy = src.policy;
        mean.budget = src.budget;
        mean.mode = src.mode;
        mean.kind = src.kind;
        points.push_back(std::move(mean));
        members.emplace_back();
        layer_n.emplace_back();
      }
      const std::size_t p = it->second;
      PointResult& mean = points[p];
      mean.budget_value += w * src.budget_value;
      mean.seconds += src.seconds;
      accumulate(mean.total, src.total, w);
      accumulate_proxies(mean.total, src.total, w);
      if (mean.layers.size() < src.layers.size()) {
        mean.layers.resize(src.layers.size());
        layer_n[p].resize(src.layers.size(), 0);
      }
      Member member;
      member.sample = i;
      member.rows.reserve(src.layers.size() + 1);
      for (std::size_t l = 0; l < src.layers.size(); ++l) {
        const LayerResult& sl = src.layers[l];
        LayerResult& dl = mean.layers[l];
        ++layer_n[p][l];
        if (dl.heads.empty()) {
          dl.layer = sl.layer;
          dl.merged_heads = sl.merged_heads;
        }
        accumulate(dl.total, sl.total, w);
        accumulate_proxies(dl.total, sl.total, w);
        if (dl.heads.size() < sl.heads.size()) dl.heads.resize(sl.heads.size());
        for (std::size_t h = 0; h < sl.heads.size(); ++h) {
          dl.heads[h].kv_head = sl.heads[h].kv_head;
          accumulate(dl.heads[h], sl.heads[h], w);
          accumulate_proxies(dl.heads[h], sl.heads[h], w);
        }
        member.rows.emplace_back(sl.total);
      }
      member.rows.emplace_back(src.total);
      for (CollapseFlag& f : src.flags) {
        CollapseFlag kept;
        kept.mode = std::move(f.mode);
        kept.layers = std::move(f.layers);
        member.flags.push_back(std::move(kept));
      }
      members[p].push_back(std::move(member));
    }
  }

  // Rows of point p's table block: (layers + all) x (modalities + all).
  std::size_t rows_of(std::size_t p) const { return (layer_numbers[p].size() + 1) * (modalities.size() + 1); }

  // The metric matrix [rows x K] of one member of point p, appended to x.
  void sample_rows(std::size_t p, const Member& src, std::vector<double>& x) const {
    std::vector<double> v;
    const std::size_t L = layer_numbers[p].size();
    for (std::size_t l = 0; l <= L; ++l) {
      const SampleRow* r = l < L ? src.layer(l) : &src.total();
      for (std::size_t mi = 0; mi <= modalities.size(); ++mi) {
        v.clear();
        if (r)
          row_metrics(*r, mi < modalities.size() ? modalities[mi] : -1, has_roles, v);
        else
          v.assign(K, kNaN);
        x.insert(x.end(), v.begin(), v.end());
      }
    }
  }

  std::int64_t layer_number(std::size_t p, std::size_t l) const {
    return l < layer_numbers[p].size() ? layer_numbers[p][l] : -1;
  }
  std::string modality_name(std::size_t mi) const {
    return mi < modalities.size() ? kernels::modality_name(modalities[mi]) : "all";
  }
  static std::string flag_names(const std::vector<CollapseFlag>& flags, std::int64_t layer) {
    std::string out;
    for (const CollapseFlag& f : flags) {
      if (layer >= 0 &&
          std::find(f.layers.begin(), f.layers.end(), static_cast<int>(layer)) == f.layers.end())
        continue;
      out += (out.empty() ? "" : ";") + f.mode;
    }
    return out;
  }

  // The columns of /sample_points (no rows).
  ResultsTable sample_points_columns(const std::vector<std::string>& metrics) const {
    using T = ResultsColumn::Type;
    ResultsTable t;
    t.name = "sample_points";
    t.description = "one row per successful sample x point x layer (then all) x modality (then all)";
    t.columns.reserve(metrics.size() + kNumProxies + 8);
    t.add("sample", T::kI64, "row of /samples");
    t.add("point", T::kI64, "row of /points");
    t.add("layer", T::kI64, "model layer index, -1 for the whole point");
    t.add("modality", T::kStr, "text, vision, audio, special or all");
    t.add("bytes_full", T::kI64, "uncompressed bytes of the row (as the CSV's)");
    t.add("bytes_kept", T::kI64, "bytes after the policy (as the CSV's)");
    for (const std::string& m : metrics) t.add(m, T::kF64, "the sample's " + m + " (as the CSV's)");
    for (int i = 0; i < kNumProxies; ++i)  // results format 1.5
      t.add(proxy_name(i), T::kF64,
            std::string("the sample's fidelity proxy ") + proxy_name(i) + " (as the CSV's; not aggregated)");
    t.add("flags", T::kStr, "the sample's collapse flags of the row (';'-separated)");
    return t;
  }

  // /sample_points, one block per point: its members' rows.
  void stream_sample_points(const ResultsTable& columns,
                            const std::function<void(const ResultsTable&)>& sink) const {
    ResultsTable t = columns;
    std::vector<double> x;
    for (std::size_t p = 0; p < layer_numbers.size(); ++p) {
      const std::size_t L = layer_numbers[p].size();
      for (ResultsColumn& c : t.columns) {
        c.f64.clear();
        c.i64.clear();
        c.str.clear();
      }
      auto& c_sample = t.columns[0].i64;
      auto& c_point = t.columns[1].i64;
      auto& c_layer = t.columns[2].i64;
      auto& c_mod = t.columns[3].str;
      auto& c_full = t.columns[4].i64;
      auto& c_kept = t.columns[5].i64;
      auto& c_flags = t.columns[6 + K + kNumProxies].str;
      for (const Member& src : members[p]) {
        x.clear();
        sample_rows(p, src, x);
        std::size_t row = 0;
        for (std::size_t l = 0; l <= L; ++l) {
          const bool all = l == L;
          const SampleRow* r = all ? &src.total() : src.layer(l);
          for (std::size_t mi = 0; mi <= modalities.size(); ++mi, ++row) {
            c_sample.push_back(static_cast<std::int64_t>(src.sample));
            c_point.push_back(static_cast<std::int64_t>(p));
            c_layer.push_back(layer_number(p, l));
            c_mod.push_back(modality_name(mi));
            const bool mrow = mi < modalities.size();
            const auto mm = mrow ? static_cast<std::size_t>(modalities[mi]) : 0;
            c_full.push_back(!r ? -1 : mrow ? r->bytes_full_modality[mm] : r->bytes_full);
            c_kept.push_back(!r ? -1 : mrow ? r->bytes_kept_modality[mm] : r->bytes_kept);
            for (std::size_t k = 0; k < K; ++k) t.columns[6 + k].f64.push_back(x[row * K + k]);
            for (int k = 0; k < kNumProxies; ++k)
              t.columns[6 + K + static_cast<std::size_t>(k)].f64.push_back(
                  r ? proxy_value(r->quality.proxies, k) : kNaN);
            c_flags.push_back(flag_names(src.flags, all ? -1 : layer_number(p, l)));
          }
        }
      }
      sink(t);
    }
  }

  DatasetResults finish();
};

DatasetAggregator::DatasetAggregator(const trace::Dataset& dataset, std::vector<std::string> by,
                                     BootstrapOptions options, CollapseThresholds thresholds)
    : impl_(std::make_unique<Impl>(dataset, std::move(by), options, std::move(thresholds))) {}
DatasetAggregator::~DatasetAggregator() = default;
void DatasetAggregator::add(SampleResult result) { impl_->add(std::move(result)); }
std::size_t DatasetAggregator::added() const { return impl_->samples.size(); }
DatasetResults DatasetAggregator::finish() { return impl_->finish(); }

DatasetResults DatasetAggregator::Impl::finish() {
  if (finished) throw std::logic_error("DatasetAggregator::finish: called twice");
  if (samples.size() != dataset.samples.size())
    throw std::logic_error("DatasetAggregator::finish: " + std::to_string(samples.size()) + " of " +
                           std::to_string(dataset.samples.size()) + " samples added");
  if (!any_ok) throw std::runtime_error("no sample of the dataset could be replayed");
  finished = true;
  DatasetResults dr;
  const std::size_t N = samples.size();
  std::size_t n_ok = 0;
  for (const SampleInfo& s : samples) n_ok += s.ok ? 1 : 0;

  meta.has_roles = has_roles;
  const bool has_vision = meta.tokens_per_modality[static_cast<std::size_t>(kernels::Modality::kVision)] > 0;
  for (std::size_t p = 0; p < points.size(); ++p) {
    PointResult& m = points[p];
    // The sums were weighted by 1 / N: a point or layer of n < N samples is rescaled to its mean.
    if (members[p].size() != N) {
      const double f = static_cast<double>(N) / static_cast<double>(members[p].size());
      m.budget_value *= f;
      scale_quality(m.total, f);
    }
    for (std::size_t l = 0; l < m.layers.size(); ++l) {
      if (layer_n[p][l] == N) continue;
      const double f = static_cast<double>(N) / static_cast<double>(layer_n[p][l]);
      scale_quality(m.layers[l].total, f);
      for (HeadResult& h : m.layers[l].heads) scale_quality(h, f);
    }
    m.flags = detect_collapse(m, thresholds, has_vision);
  }
  mark_pareto(points, [](const PointResult& pt) { return pt.kind == "policy"; });

  meta.dataset = true;
  meta.dataset_source = dataset.source;
  meta.trace_path = dataset.source;
  meta.num_samples = static_cast<std::int64_t>(N);
  meta.failed_samples = static_cast<std::int64_t>(N - n_ok);
  meta.bootstrap_resamples = options.resamples;
  meta.bootstrap_seed = options.seed;
  meta.confidence = options.confidence;
  meta.group_by.clear();
  for (const std::string& g : by) meta.group_by += (meta.group_by.empty() ? "" : ",") + g;
  modalities = reported_modalities(points, meta);
  layer_numbers.resize(points.size());
  for (std::size_t p = 0; p < points.size(); ++p)
    for (const LayerResult& l : points[p].layers) layer_numbers[p].push_back(l.layer);
  const std::vector<std::string> metrics = aggregate_metric_names(has_roles);
  K = metrics.size();
  using T = ResultsColumn::Type;

  // /samples
  std::vector<std::string> bucket(N);
  {
    ResultsTable t;
    t.name = "samples";
    t.description = "one row per sample of the dataset, in manifest order";
    t.columns.reserve(dataset.columns.size() + 8);  // add() returns references into columns
    auto& c_sample = t.add("sample", T::kStr, "sample id");
    auto& c_trace = t.add("trace", T::kStr, "trace file, as listed");
    auto& c_status = t.add("status", T::kStr, "ok, or failed (--skip-bad: not in the aggregates)");
    auto& c_error = t.add("error", T::kStr, "why the sample failed (empty when ok)");
    auto& c_ctx = t.add("context_tokens", T::kI64, "context tokens of the replay (-1 when failed)");
    auto& c_dec = t.add("decode_steps", T::kI64, "evaluation queries of the replay (-1 when failed)");
    auto& c_len = t.add("length_bucket", T::kStr, "power-of-two bucket of context_tokens (--by length)");
    std::vector<std::size_t> extra;
    for (std::size_t k = 0; k < dataset.columns.size(); ++k) {
      const std::string& c = dataset.columns[k];
      if (c == "sample" || c == "trace" || c == "context_tokens" || c == "decode_steps" || t.find(c))
        continue;
      extra.push_back(k);
    }
    for (std::size_t k : extra) t.add(dataset.columns[k], T::kStr, "manifest column (docs/datasets.md)");
    for (std::size_t i = 0; i < N; ++i) {
      const trace::DatasetSample& s = dataset.samples[i];
      const SampleInfo& r = samples[i];
      c_sample.str.push_back(s.sample);
      c_trace.str.push_back(s.trace);
      c_status.str.push_back(r.ok ? "ok" : "failed");
      c_error.str.push_back(r.error);
      c_ctx.i64.push_back(r.ok ? r.num_tokens : -1);
      c_dec.i64.push_back(r.ok ? r.num_decode_steps : -1);
      bucket[i] = r.ok ? length_bucket(r.num_tokens) : "";
      c_len.str.push_back(bucket[i]);
    }
    for (std::size_t e = 0; e < extra.size(); ++e) {
      ResultsColumn& c = t.columns[7 + e];
      for (std::size_t i = 0; i < N; ++i)
        c.str.push_back(extra[e] < dataset.samples[i].values.size() ? dataset.samples[i].values[extra[e]]
                                                                    : "");
    }
    dr.tables.push_back(std::move(t));
  }

  // /sample_points: streamed from the members when written.
  {
    ResultsTable t = sample_points_columns(metrics);
    for (std::size_t p = 0; p < points.size(); ++p) t.streamed_rows += members[p].size() * rows_of(p);
    const ResultsTable columns = t;
    t.stream = [this, columns](const std::function<void(const ResultsTable&)>& sink) {
      stream_sample_points(columns, sink);
    };
    dr.tables.push_back(std::move(t));
  }

  // /aggregate: per grouping, group, point, row: n, mean, interval.
  {
    struct Task {
      std::string by, group;
      std::size_t point;
      std::vector<std::size_t> samples;  // members[point] indices in the group
      std::vector<Interval> iv;          // [rows x K]
    };
    std::vector<std::string> groupings = {"all"};
    for (const std::string& g : by)
      if (g != "all" && std::find(groupings.begin(), groupings.end(), g) == groupings.end())
        groupings.push_back(g);
    std::vector<Task> tasks;
    for (const std::string& g : groupings) {
      std::vector<std::string> value(N);
      std::set<std::string> groups;
      for (std::size_t i = 0; i < N; ++i) {
        if (!samples[i].ok) continue;
        value[i] = g == "all" ? "all" : g == "length" ? bucket[i] : dataset.value(i, g);
        groups.insert(value[i]);
      }
      // Length buckets in increasing order; other values in sorted (string) order.
      std::vector<std::string> order(groups.begin(), groups.end());
      if (g == "length") {
        std::sort(order.begin(), order.end(), [](const std::string& a, const std::string& b) {
          return std::stoll(a.substr(0, a.find('-'))) < std::stoll(b.substr(0, b.find('-')));
        });
      }
      for (const std::string& gv : order) {
        for (std::size_t p = 0; p < points.size(); ++p) {
          Task task{g, gv, p, {}, {}};
          for (std::size_t k = 0; k < members[p].size(); ++k)
            if (value[members[p][k].sample] == gv) task.samples.push_back(k);
          if (!task.samples.empty()) tasks.push_back(std::move(task));
        }
      }
    }
#pragma omp parallel for schedule(dynamic)
    for (std::size_t ti = 0; ti < tasks.size(); ++ti) {
      Task& task = tasks[ti];
      std::vector<double> x;
      for (std::size_t k : task.samples) sample_rows(task.point, members[task.point][k], x);
      const std::size_t C = rows_of(task.point) * K;
      std::uint64_t seed = options.seed ^ fnv1a(task.by + '\x1f' + task.group);
      task.iv = bootstrap_columns(x, task.samples.size(), C, options, splitmix64(seed));
    }
    ResultsTable t;
    t.name = "aggregate";
    t.columns.reserve(3 * K + 10);
    t.description =
        "mean and percentile bootstrap interval over samples, per grouping x group x point x layer "
        "(then all) x modality (then all)";
    auto& c_by = t.add("by", T::kStr, "grouping: all, length, or a manifest column (--by)");
    auto& c_group = t.add("group", T::kStr, "the group's value (all for the grouping all)");
    auto& c_point = t.add("point", T::kI64, "row of /points");
    auto& c_policy = t.add("policy", T::kStr, "the point's policy");
    auto& c_budget = t.add("budget", T::kStr, "the point's budget");
    auto& c_kind = t.add("kind", T::kStr, "policy, bound or search");
    auto& c_layer = t.add("layer", T::kI64, "model layer index, -1 for the whole point");
    auto& c_mod = t.add("modality", T::kStr, "text, vision, audio, special or all");
    auto& c_n = t.add("n", T::kI64, "samples of the group with this point");
    std::vector<ResultsColumn*> cmean, clo, chi;
    for (const std::string& m : metrics) {
      cmean.push_back(&t.add(m + "_mean", T::kF64, "mean of " + m + " over the group's samples"));
      clo.push_back(&t.add(m + "_lo", T::kF64, "lower end of the bootstrap interval of the mean"));
      chi.push_back(&t.add(m + "_hi", T::kF64, "upper end of the bootstrap interval of the mean"));
    }
    for (const Task& task : tasks) {
      const PointResult& mean = points[task.point];
      std::size_t row = 0;
      for (std::size_t l = 0; l <= mean.layers.size(); ++l) {
        for (std::size_t mi = 0; mi <= modalities.size(); ++mi, ++row) {
          c_by.str.push_back(task.by);
          c_group.str.push_back(task.group);
          c_point.i64.push_back(static_cast<std::int64_t>(task.point));
          c_policy.str.push_back(mean.policy);
          c_budget.str.push_back(mean.budget);
          c_kind.str.push_back(mean.kind);
          c_layer.i64.push_back(layer_number(task.point, l));
          c_mod.str.push_back(modality_name(mi));
          c_n.i64.push_back(static_cast<std::int64_t>(task.samples.size()));
          for (std::size_t k = 0; k < K; ++k) {
            const Interval& iv = task.iv[row * K + k];
            cmean[k]->f64.push_back(iv.mean);
            clo[k]->f64.push_back(iv.lo);
            chi[k]->f64.push_back(iv.hi);
          }
        }
      }
    }
    dr.tables.push_back(std::move(t));
  }
  dr.points = std::move(points);
  dr.meta = meta;
  dr.has_roles = has_roles;
  return dr;
}

DatasetResults aggregate_dataset(const trace::Dataset& dataset, const std::vector<SampleResult>& results,
                                 const std::vector<std::string>& by, const BootstrapOptions& options,
                                 const CollapseThresholds& thresholds) {
  if (results.size() != dataset.samples.size())
    throw std::logic_error("aggregate_dataset: " + std::to_string(results.size()) + " results for " +
                           std::to_string(dataset.samples.size()) + " samples");
  DatasetAggregator agg(dataset, by, options, thresholds);
  for (const SampleResult& r : results) agg.add(r);
  DatasetResults dr = agg.finish();
  for (ResultsTable& t : dr.tables)
    if (t.stream) t = t.materialized();
  return dr;
}

std::string format_dataset_summary(const DatasetResults& dr, int top) {
  std::ostringstream o;
  const ResultsTable* agg = nullptr;
  for (const ResultsTable& t : dr.tables)
    if (t.name == "aggregate") agg = &t;
  if (!agg) return "";
  auto col = [&](const std::string& name) -> const ResultsColumn& {
    if (const ResultsColumn* c = agg->find(name)) return *c;
    throw std::logic_error("no aggregate column " + name);
  };
  const auto &by = col("by").str, &group = col("group").str, &mod = col("modality").str;
  const auto &layer = col("layer").i64, &point = col("point").i64, &n = col("n").i64;
  const auto &err = col("output_error_mean").f64, &err_lo = col("output_error_lo").f64,
             &err_hi = col("output_error_hi").f64;
  const auto &rec = col("attention_recall_mean").f64, &rec_lo = col("attention_recall_lo").f64,
             &rec_hi = col("attention_recall_hi").f64;
  const auto& bytes = col("bytes_ratio_mean").f64;
  // A policy is ranked at a budget only when its bytes are within it: bytes ratio <= the requested
  // fraction plus half a token of the shortest context (each head keeps lround(keep * T) tokens).
  std::int64_t shortest = 0;
  for (const ResultsTable& t : dr.tables) {
    if (t.name != "samples") continue;
    const ResultsColumn *tok = t.find("context_tokens"), *status = t.find("status");
    if (!tok || !status) continue;
    for (std::size_t r = 0; r < tok->i64.size(); ++r)
      if (status->str[r] == "ok" && tok->i64[r] > 0 && (shortest == 0 || tok->i64[r] < shortest))
        shortest = tok->i64[r];
  }
  const double slack = (shortest > 0 ? 0.5 / static_cast<double>(shortest) : 0.0) + 1e-9;
  const ResultsMeta& m = dr.meta;
  const int pct = static_cast<int>(std::lround(m.confidence * 100));
  o << "dataset " << m.dataset_source << ": " << (m.num_samples - m.failed_samples) << " of " << m.num_samples
    << " samples replayed" << (m.failed_samples ? " (" + std::to_string(m.failed_samples) + " failed)" : "")
    << "; mean over samples with " << pct << " % bootstrap intervals (" << m.bootstrap_resamples
    << " resamples, seed " << m.bootstrap_seed << ")\n";
  // Rows of layer all x modality all, per (by, group) in table order.
  std::vector<std::pair<std::string, std::string>> groups;
  std::map<std::pair<std::string, std::string>, std::vector<std::size_t>> rows;
  for (std::size_t r = 0; r < agg->rows(); ++r) {
    if (layer[r] != -1 || mod[r] != "all") continue;
    const auto key = std::make_pair(by[r], group[r]);
    if (!rows.count(key)) groups.push_back(key);
    rows[key].push_back(r);
  }
  auto interval = [](double v, double lo, double hi) {
    return fixed(v, 4) + " [" + fixed(lo, 4) + ", " + fixed(hi, 4) + "]";
  };
  for (const auto& key : groups) {
    const auto& rs = rows[key];
    o << "\n"
      << (key.first == "all" ? std::string("all samples") : key.first + " = " + key.second)
      << " (n = " << n[rs.front()] << ")\n";
    char line[256];
    std::snprintf(line, sizeof line, "  %-8s %-22s %7s  %-26s  %-26s %5s\n", "budget", "policy", "bytes",
                  "output error", "attention recall", "n");
    o << line;
    std::vector<std::string> budgets;
    for (std::size_t r : rs) {
      const PointResult& p = dr.points[static_cast<std::size_t>(point[r])];
      if (p.kind == "policy" && std::find(budgets.begin(), budgets.end(), p.budget) == budgets.end())
        budgets.push_back(p.budget);
    }
    for (const std::string& b : budgets) {
      std::vector<std::size_t> pol, over, bound;
      for (std::size_t r : rs) {
        const PointResult& p = dr.points[static_cast<std::size_t>(point[r])];
        if (p.budget != b) continue;
        if (p.kind == "policy")
          (bytes[r] > p.budget_value + slack ? over : pol).push_back(r);
        else if (p.kind == "bound")
          bound.push_back(r);
      }
      std::stable_sort(pol.begin(), pol.end(), [&](std::size_t a, std::size_t c) {
        const double x = std::isnan(err[a]) ? std::numeric_limits<double>::infinity() : err[a];
        const double y = std::isnan(err[c]) ? std::numeric_limits<double>::infinity() : err[c];
        return x < y;
      });
      if (pol.size() > static_cast<std::size_t>(std::max(1, top)))
        pol.resize(static_cast<std::size_t>(std::max(1, top)));
      pol.insert(pol.end(), bound.begin(), bound.end());
      bool first = true;
      for (std::size_t r : pol) {
        const PointResult& p = dr.points[static_cast<std::size_t>(point[r])];
        const std::string name = p.kind == "bound" ? p.policy + " (bound)" : p.policy;
        std::snprintf(line, sizeof line, "  %-8s %-22s %7s  %-26s  %-26s %5lld\n", first ? b.c_str() : "",
                      name.c_str(), fixed(bytes[r], 3).c_str(),
                      interval(err[r], err_lo[r], err_hi[r]).c_str(),
                      interval(rec[r], rec_lo[r], rec_hi[r]).c_str(), static_cast<long long>(n[r]));
        o << line;
        first = false;
      }
      if (!over.empty()) {
        std::string names;
        for (std::size_t r : over) {
          const PointResult& p = dr.points[static_cast<std::size_t>(point[r])];
          names += (names.empty() ? "" : ", ") + p.policy + " " + fixed(bytes[r], 3);
        }
        std::snprintf(line, sizeof line, "  %-8s ", first ? b.c_str() : "");
        o << line << "not ranked (bytes above the budget): " << names << "\n";
      }
    }
  }
  return o.str();
}

}  // namespace kvscope::sim
