// Small helpers shared by the replay engines (prefill mode, decode mode, layer statistics).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kvscope/kernels/common.hpp"

namespace kvscope::sim::detail {

// Throws std::runtime_error "<what>: <kernel message>" when a kernel call failed.
inline void check(const kernels::Status& s, const char* what) {
  if (!s.ok()) throw std::runtime_error(std::string(what) + ": " + s.message());
}

// The `random` scorer: a splitmix64 hash of (seed, layer, kv head, token id) mapped to [0, 1), so that
// prefill-mode and decode-mode replays (decode token j has id T + j) score every token alike.
inline float random_token_score(std::uint64_t seed, int layer, int kv_head, int token) {
  std::uint64_t x = seed * 0x100000001b3ull ^ (static_cast<std::uint64_t>(layer) << 40) ^
                    (static_cast<std::uint64_t>(kv_head) << 24) ^ static_cast<std::uint64_t>(token);
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) / 16777216.0f;
}

}  // namespace kvscope::sim::detail
