// Portable deterministic random numbers for synthetic traces (the same stream
// on every platform and standard library, unlike std::normal_distribution).
#pragma once

#include <cmath>
#include <cstdint>

namespace kvscope::synth {

std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b);

class Rng {
 public:
  explicit Rng(std::uint64_t seed);
  std::uint64_t next_u64();
  double uniform();           // [0, 1)
  float normal();             // N(0, 1), Box-Muller
  int uniform_int(int lo, int hi);  // [lo, hi]

 private:
  std::uint64_t s_[4];
  bool have_spare_ = false;
  float spare_ = 0.0f;
};

}  // namespace kvscope::synth
