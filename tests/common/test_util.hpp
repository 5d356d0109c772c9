// Helpers shared by the GoogleTest suites: seeded inputs, element-wise
// comparison that reports the first mismatch with its parameters, GPU probing.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace kvscope::testing {

// Deterministic normal(0, stddev) values for a seed.
inline std::vector<float> random_normal(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<float> random_uniform(std::size_t n, std::uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Compares every element: |got - want| <= atol + rtol * |want|.
// On failure reports `params`, the first mismatching index and the count.
template <typename A, typename B>
::testing::AssertionResult all_close(const A& got, const B& want, double atol, double rtol,
                                     const std::string& params) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << params << ": size " << got.size() << " != " << want.size();
  }
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    const bool ok = (std::isnan(g) && std::isnan(w)) || std::fabs(g - w) <= atol + rtol * std::fabs(w);
    if (!ok) {
      if (bad == 0) first = i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << params << ": " << bad << " of " << got.size()
                                       << " elements differ; first at [" << first << "]: got "
                                       << static_cast<double>(got[first]) << ", want "
                                       << static_cast<double>(want[first]) << " (atol " << atol
                                       << ", rtol " << rtol << ")";
}

}  // namespace kvscope::testing
