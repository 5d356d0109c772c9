// Aggregation of the fidelity proxies (kvscope/sim/sweep.hpp finish_proxies; docs/metrics.md "Proxies").
#include <algorithm>
#include <cmath>
#include <limits>

#include "kvscope/sim/sweep.hpp"

namespace kvscope::sim {

const char* proxy_name(int i) {
  static const char* const names[kNumProxies] = {
      "error_worst_query", "error_worst_head", "error_retrieval",       "concentration", "error_propagated",
      "topk_recall",       "topk_recall_min",  "topk_recall_retrieval", "topk_mass",     "specific_recall",
      "specific_recall_min"};
  return i >= 0 && i < kNumProxies ? names[i] : "";
}

double& proxy_value(Proxies& p, int i) {
  double* const v[kNumProxies] = {&p.error_worst_query, &p.error_worst_head,      &p.error_retrieval,
                                  &p.concentration,     &p.error_propagated,      &p.topk_recall,
                                  &p.topk_recall_min,   &p.topk_recall_retrieval, &p.topk_mass,
                                  &p.specific_recall,   &p.specific_recall_min};
  return *v[i >= 0 && i < kNumProxies ? i : 0];
}

namespace {

double answer_error(const Quality& q) {
  return q.query_sets[static_cast<std::size_t>(kAnswerQueries)].output_error;
}

// Pooled weighted mean sum(w * x) / sum(w), `fallback` when the weights sum to 0.
struct Pool {
  double num = 0, den = 0;
  void add(double x, double w) {
    num += w * x;
    den += w;
  }
  double value(double fallback) const { return den > 0 ? num / den : fallback; }
};

}  // namespace

void finish_proxies(SweepOutput& out) {
  const bool none = out.query_set_steps[static_cast<std::size_t>(kAnswerQueries)] == 0;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (PointResult& pt : out.points) {
    if (pt.layers.empty()) continue;
    Pool err_all, topk_all;
    double worst_query = 0, worst_head = 0, conc = 0, topk = 0, topk_min = 0, mass = 0, propagated = 0;
    double specific = 0, specific_min = 0;
    for (LayerResult& l : pt.layers) {
      if (l.heads.empty()) continue;
      Pool err_l, topk_l;
      Proxies& t = l.total.quality.proxies;
      t = Proxies{};
      t.topk_recall_min = 1;
      t.specific_recall_min = 1;
      const double keep_before = 1 - propagated;
      const double n = static_cast<double>(l.heads.size());
      for (HeadResult& h : l.heads) {
        Proxies& x = h.quality.proxies;
        const double e = answer_error(h.quality);
        err_l.add(x.concentration > 0 ? x.error_retrieval / x.concentration : e, x.concentration);
        err_all.add(x.concentration > 0 ? x.error_retrieval / x.concentration : e, x.concentration);
        x.error_retrieval = x.concentration > 0 ? x.error_retrieval / x.concentration : e;
        x.error_worst_head = e;
        x.error_propagated = 1 - keep_before * (1 - std::min(e, 1.0));
        x.topk_recall_min = x.topk_recall;
        x.topk_recall_retrieval = x.topk_recall;
        x.specific_recall_min = x.specific_recall;
        t.specific_recall += x.specific_recall / n;
        t.specific_recall_min = std::min(t.specific_recall_min, x.specific_recall);
        topk_l.add(x.topk_recall, x.topk_mass);
        topk_all.add(x.topk_recall, x.topk_mass);
        t.error_worst_query = std::max(t.error_worst_query, x.error_worst_query);
        t.error_worst_head = std::max(t.error_worst_head, e);
        t.concentration += x.concentration / n;
        t.topk_recall += x.topk_recall / n;
        t.topk_recall_min = std::min(t.topk_recall_min, x.topk_recall);
        t.topk_mass += x.topk_mass / n;
      }
      const double le = answer_error(l.total.quality);
      t.error_retrieval = err_l.value(le);
      t.topk_recall_retrieval = topk_l.value(t.topk_recall);
      propagated = 1 - keep_before * (1 - std::min(le, 1.0));
      t.error_propagated = propagated;
      const double L = static_cast<double>(pt.layers.size());
      worst_query += t.error_worst_query / L;
      worst_head += t.error_worst_head / L;
      conc += t.concentration / L;
      topk += t.topk_recall / L;
      topk_min += t.topk_recall_min / L;
      mass += t.topk_mass / L;
      specific += t.specific_recall / L;
      specific_min += t.specific_recall_min / L;
    }
    Proxies& p = pt.total.quality.proxies;
    p.error_worst_query = worst_query;
    p.error_worst_head = worst_head;
    p.error_retrieval = err_all.value(answer_error(pt.total.quality));
    p.concentration = conc;
    p.error_propagated = propagated;
    p.topk_recall = topk;
    p.topk_recall_min = topk_min;
    p.topk_recall_retrieval = topk_all.value(topk);
    p.topk_mass = mass;
    p.specific_recall = specific;
    p.specific_recall_min = specific_min;
    if (none) {
      Proxies empty;
      for (int i = 0; i < kNumProxies; ++i) proxy_value(empty, i) = nan;
      for (LayerResult& l : pt.layers) {
        for (HeadResult& h : l.heads) h.quality.proxies = empty;
        l.total.quality.proxies = empty;
      }
      p = empty;
    }
  }
}

}  // namespace kvscope::sim
