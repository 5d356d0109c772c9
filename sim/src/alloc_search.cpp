#include "alloc_search.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvscope::sim {

std::string alloc_search_name(const std::string& scorer) { return "alloc-search:" + scorer; }

namespace detail {

namespace {
constexpr int kSpecial = static_cast<int>(kernels::Modality::kSpecial);
}  // namespace

AllocSearch::AllocSearch(const AllocSearchOptions& o, const TraceContext& ctx,
                         std::vector<std::pair<double, std::string>> budgets)
    : options_(o), budgets_(std::move(budgets)) {
  const int L = ctx.geometry.num_layers;
  // (a) The scorer with its own allocator at every level and every searched budget: the start
  // allocation of a budget is exactly the scorer's point at that budget.
  std::vector<double> levels = o.levels;
  for (const auto& b : budgets_) levels.push_back(b.first);
  std::sort(levels.begin(), levels.end(), std::greater<>());
  std::vector<double> uniq;
  for (double x : levels) {
    if (x <= 0 || x >= 1) continue;
    if (uniq.empty() || std::fabs(uniq.back() - x) > 1e-12) uniq.push_back(x);
  }
  for (double x : uniq) candidates_.push_back({o.scorer, x});
  for (const auto& b : budgets_) {
    int at = -1;
    for (std::size_t c = 0; c < candidates_.size(); ++c)
      if (std::fabs(candidates_[c].keep - b.first) <= 1e-12) at = static_cast<int>(c);
    start_.push_back(at);
  }
  // (b) Per-modality keep fractions (explicit allocator), on a grid over the modalities with at least
  // two tokens (special tokens stay full); with more than two such modalities, one modality cut at a
  // time. The same fractions in every layer's entry: a candidate runs on one layer at a time.
  std::vector<int> mods;
  for (int m = 0; m < kModalities; ++m)
    if (m != kSpecial && ctx.tokens[static_cast<std::size_t>(m)] >= 2) mods.push_back(m);
  std::vector<std::array<double, 4>> grid;
  const auto& lv = o.modality_levels;
  if (mods.size() <= 2) {
    std::array<double, 4> f{1.0, 1.0, 1.0, 1.0};
    const std::size_t n = mods.size();
    std::vector<std::size_t> idx(n, 0);
    while (n > 0) {
      for (std::size_t i = 0; i < n; ++i) f[static_cast<std::size_t>(mods[i])] = lv[idx[i]];
      if (std::any_of(mods.begin(), mods.end(), [&](int m) { return f[static_cast<std::size_t>(m)] < 1.0; }))
        grid.push_back(f);
      std::size_t i = 0;
      while (i < n && ++idx[i] == lv.size()) idx[i++] = 0;
      if (i == n) break;
    }
  } else {
    for (int m : mods)
      for (double x : lv) {
        if (x >= 1.0) continue;
        std::array<double, 4> f{1.0, 1.0, 1.0, 1.0};
        f[static_cast<std::size_t>(m)] = x;
        grid.push_back(f);
      }
  }
  for (const auto& f : grid) {
    Candidate c{o.scorer, 1.0};
    c.spec.stages.allocator = "explicit";
    c.spec.layer_modality_keep.assign(static_cast<std::size_t>(L), f);
    double kept = 0;
    for (int m = 0; m < kModalities; ++m)
      kept += f[static_cast<std::size_t>(m)] * static_cast<double>(ctx.tokens[static_cast<std::size_t>(m)]);
    // The overall keep fraction: what a budget-proportional recent window (H2O) is taken of.
    c.keep = std::clamp(kept / std::max(1, ctx.T), 1e-9, 0.999999);
    candidates_.push_back(std::move(c));
  }
  results_.resize(static_cast<std::size_t>(L));
  bytes_.resize(static_cast<std::size_t>(L));
  error_.resize(static_cast<std::size_t>(L));
}

std::vector<const PolicySpec*> AllocSearch::specs() const {
  std::vector<const PolicySpec*> out;
  for (const auto& c : candidates_) out.push_back(&c.spec);
  return out;
}

void AllocSearch::run_layer(LayerData& layer, TraceContext& ctx) {
  const auto l = static_cast<std::size_t>(layer.layer());
  const std::size_t C = candidates_.size();
  results_[l].assign(C, LayerResult{});
  bytes_[l].assign(C, 0);
  error_[l].assign(C, 0.0);
  std::vector<std::string> errors(C);
#pragma omp parallel for schedule(dynamic)
  for (std::size_t c = 0; c < C; ++c) {
    try {
      std::vector<std::string> ignored;  // budgets raised to the forced set: measured as they are
      results_[l][c] = run_policy_on_layer(candidates_[c].spec, candidates_[c].keep, layer, ctx, ignored);
      // The layer's total exactly as run_sweep aggregates it.
      HeadResult t;
      const LayerResult& r = results_[l][c];
      for (const auto& h : r.heads) accumulate(t, h, 1.0 / static_cast<double>(r.heads.size()));
      bytes_[l][c] = t.bytes_kept.total();
      error_[l][c] = t.quality.output_error;
    } catch (const std::exception& e) {
      errors[c] = e.what();
    }
  }
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error(alloc_search_name(options_.scorer.name) + ": " + e);
}

std::vector<int> AllocSearch::search(const std::vector<std::vector<std::int64_t>>& bytes,
                                     const std::vector<std::vector<double>>& error, int start) {
  const std::size_t L = bytes.size();
  std::vector<int> cur(L, start);
  if (L == 0) return cur;
  const std::size_t C = bytes[0].size();
  // Per layer, candidates by bytes with the running argmin of the error: the best candidate within
  // a byte allowance is one binary search away.
  std::vector<std::vector<int>> order(L);
  std::vector<std::vector<int>> best_upto(L);
  for (std::size_t l = 0; l < L; ++l) {
    auto& o = order[l];
    o.resize(C);
    for (std::size_t c = 0; c < C; ++c) o[c] = static_cast<int>(c);
    std::stable_sort(o.begin(), o.end(), [&](int a, int b) {
      return bytes[l][static_cast<std::size_t>(a)] < bytes[l][static_cast<std::size_t>(b)];
    });
    auto& bu = best_upto[l];
    bu.resize(C);
    for (std::size_t i = 0; i < C; ++i) {
      const int c = o[i];
      bu[i] =
          (i == 0 || error[l][static_cast<std::size_t>(c)] < error[l][static_cast<std::size_t>(bu[i - 1])])
              ? c
              : bu[i - 1];
    }
  }
  // Best candidate of layer l with bytes <= allowance, or -1.
  auto best_within = [&](std::size_t l, std::int64_t allowance) {
    const auto& o = order[l];
    const auto it = std::upper_bound(o.begin(), o.end(), allowance, [&](std::int64_t a, int c) {
      return a < bytes[l][static_cast<std::size_t>(c)];
    });
    if (it == o.begin()) return -1;
    return best_upto[l][static_cast<std::size_t>(it - o.begin()) - 1];
  };
  std::int64_t B = 0;
  double E = 0;
  for (std::size_t l = 0; l < L; ++l) {
    B += bytes[l][static_cast<std::size_t>(start)];
    E += error[l][static_cast<std::size_t>(start)];
  }
  const std::int64_t Bmax = B;
  for (std::size_t iter = 0; iter < 64 * L * C; ++iter) {
    // A move must lower the summed error by more than rounding could: the reported error (the mean of
    // the same layer errors) is then lower too, never equal-but-different.
    const double tol = 1e-12 * std::max(1.0, E);
    double best = -tol;
    std::size_t l1 = L, l2 = L;
    int c1 = -1, c2 = -1;
    for (std::size_t a = 0; a < L; ++a) {
      const auto ca = static_cast<std::size_t>(cur[a]);
      for (std::size_t c = 0; c < C; ++c) {
        if (static_cast<int>(c) == cur[a]) continue;
        const std::int64_t nb = B - bytes[a][ca] + bytes[a][c];
        const double da = error[a][c] - error[a][ca];
        if (nb <= Bmax) {
          if (da < best) {
            best = da;
            l1 = a, c1 = static_cast<int>(c), l2 = L, c2 = -1;
          }
          continue;
        }
        // Layer a spends bytes another layer must free.
        for (std::size_t b = 0; b < L; ++b) {
          if (b == a) continue;
          const auto cb = static_cast<std::size_t>(cur[b]);
          const int nc = best_within(b, bytes[b][cb] - (nb - Bmax));
          if (nc < 0 || nc == cur[b]) continue;
          const double d = da + error[b][static_cast<std::size_t>(nc)] - error[b][cb];
          if (d < best) {
            best = d;
            l1 = a, c1 = static_cast<int>(c), l2 = b, c2 = nc;
          }
        }
      }
    }
    if (l1 == L) break;
    B += bytes[l1][static_cast<std::size_t>(c1)] - bytes[l1][static_cast<std::size_t>(cur[l1])];
    E += error[l1][static_cast<std::size_t>(c1)] - error[l1][static_cast<std::size_t>(cur[l1])];
    cur[l1] = c1;
    if (l2 < L) {
      B += bytes[l2][static_cast<std::size_t>(c2)] - bytes[l2][static_cast<std::size_t>(cur[l2])];
      E += error[l2][static_cast<std::size_t>(c2)] - error[l2][static_cast<std::size_t>(cur[l2])];
      cur[l2] = c2;
    }
  }
  return cur;
}

void AllocSearch::append_points(std::vector<PointResult>& points) const {
  for (std::size_t b = 0; b < budgets_.size(); ++b) {
    PointResult pt;
    pt.policy = alloc_search_name(options_.scorer.name);
    pt.budget = budgets_[b].second;
    pt.budget_value = budgets_[b].first;
    pt.kind = "search";
    const std::vector<int> pick = search(bytes_, error_, start_[b]);
    for (std::size_t l = 0; l < results_.size(); ++l)
      pt.layers.push_back(results_[l][static_cast<std::size_t>(pick[l])]);
    points.push_back(std::move(pt));
  }
}

}  // namespace detail
}  // namespace kvscope::sim
