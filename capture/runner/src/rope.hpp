// RoPE angle tables shared by the CPU and CUDA backends (computed on the host in double precision).
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "kvscope/runner/config.hpp"
#include "kvscope/runner/kv_cache.hpp"

namespace kvscope::runner::detail {

// cos and sin [T, Dh/2] for the tokens' positions: angle = (pos / linear factor) * base^(-2i/Dh).
inline void rope_tables(const ModelConfig& c, const TokenInfo* tokens, int num_tokens,
                        std::vector<float>& cos_t, std::vector<float>& sin_t) {
  const int half = c.head_dim / 2;
  const double base = c.rope_base(), scale = c.rope_position_scale();
  cos_t.resize(static_cast<std::size_t>(num_tokens) * half);
  sin_t.resize(cos_t.size());
  for (int t = 0; t < num_tokens; ++t) {
    const double pos = tokens[t].position / scale;
    for (int i = 0; i < half; ++i) {
      const double inv_freq = std::pow(base, -2.0 * i / c.head_dim);
      const double angle = pos * inv_freq;
      cos_t[static_cast<std::size_t>(t) * half + i] = static_cast<float>(std::cos(angle));
      sin_t[static_cast<std::size_t>(t) * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

// Range names "layer 003", "layer 003/attention", "layer 003/mlp".
inline std::string layer_range_name(int layer, const char* part = nullptr) {
  std::string n = std::to_string(layer);
  n = "layer " + std::string(n.size() < 3 ? 3 - n.size() : 0, '0') + n;
  return part ? n + "/" + part : n;
}

}  // namespace kvscope::runner::detail
