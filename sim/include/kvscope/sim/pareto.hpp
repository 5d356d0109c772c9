// Pareto front of a sweep: memory (bytes ratio) against quality loss (output error),
// both to be minimised.
#pragma once

#include <functional>
#include <vector>

#include "kvscope/sim/results.hpp"

namespace kvscope::sim {

// One candidate: lower is better on both axes.
struct ParetoPoint {
  double memory = 0;  // kept bytes / full bytes
  double error = 0;   // output error
};

// True when `a` dominates `b`: a.memory <= b.memory and a.error <= b.error with at least one strict.
bool dominates(const ParetoPoint& a, const ParetoPoint& b);

// front[i] is true when no other point dominates point i. Equal points do not dominate each
// other, so duplicates are on the front together. A point with a NaN coordinate is never on
// the front and never dominates another. The result does not depend on the input order.
std::vector<bool> pareto_front(const std::vector<ParetoPoint>& points);

// Sets PointResult::pareto for every point from its (bytes_ratio(), total.quality.output_error).
void mark_pareto(std::vector<PointResult>& points);
// The same with the front taken over the points for which candidate(point) is true (the others
// are never on it), in place: a sweep's results are large, so they are not copied to a subset.
void mark_pareto(std::vector<PointResult>& points, const std::function<bool(const PointResult&)>& candidate);

}  // namespace kvscope::sim
