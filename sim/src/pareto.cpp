#include "kvscope/sim/pareto.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvscope::sim {

namespace {
bool finite(const ParetoPoint& p) { return std::isfinite(p.memory) && std::isfinite(p.error); }
}  // namespace

bool dominates(const ParetoPoint& a, const ParetoPoint& b) {
  if (!finite(a) || !finite(b)) return false;
  return a.memory <= b.memory && a.error <= b.error && (a.memory < b.memory || a.error < b.error);
}

std::vector<bool> pareto_front(const std::vector<ParetoPoint>& points) {
  // Sort by (memory, error). Walking in that order, a point is on the front exactly when its
  // error is below the best error of every point with strictly smaller memory, and it is the
  // lowest error within its own memory value (ties on both axes all stay on the front).
  std::vector<std::size_t> order;
  order.reserve(points.size());
  for (std::size_t i = 0; i < points.size(); ++i) {
    if (finite(points[i])) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (points[a].memory != points[b].memory) return points[a].memory < points[b].memory;
    if (points[a].error != points[b].error) return points[a].error < points[b].error;
    return a < b;
  });
  std::vector<bool> front(points.size(), false);
  double best_error_before =
      std::numeric_limits<double>::infinity();  // best error among strictly smaller memory
  std::size_t g = 0;
  while (g < order.size()) {
    // One group of equal memory: its first element has the group's lowest error.
    std::size_t end = g;
    while (end < order.size() && points[order[end]].memory == points[order[g]].memory) ++end;
    const double group_min = points[order[g]].error;
    for (std::size_t k = g; k < end; ++k) {
      const double e = points[order[k]].error;
      front[order[k]] = e == group_min && e < best_error_before;
    }
    best_error_before = std::min(best_error_before, group_min);
    g = end;
  }
  return front;
}

namespace {
// The candidate of a point: (bytes_ratio(), total.quality.output_error).
ParetoPoint pareto_point(const PointResult& r) { return {r.bytes_ratio(), r.total.quality.output_error}; }
}  // namespace

void mark_pareto(std::vector<PointResult>& points) {
  mark_pareto(points, [](const PointResult&) { return true; });
}

void mark_pareto(std::vector<PointResult>& points, const std::function<bool(const PointResult&)>& candidate) {
  std::vector<ParetoPoint> p;
  std::vector<std::size_t> index;  // points[index[i]] is candidate i
  for (std::size_t i = 0; i < points.size(); ++i) {
    if (!candidate(points[i])) continue;
    p.push_back(pareto_point(points[i]));
    index.push_back(i);
  }
  const std::vector<bool> front = pareto_front(p);
  for (auto& r : points) r.pareto = false;
  for (std::size_t i = 0; i < index.size(); ++i) points[index[i]].pareto = front[i];
}

}  // namespace kvscope::sim
