// Trace summary for `kvsim info`: geometry, tokens per modality and segment,
// and exact full-cache KV bytes per layer and per modality.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscope/trace/reader.hpp"

namespace kvscope::sim {

struct SegmentSummary {
  int segment = 0;
  std::array<std::size_t, kernels::kNumModalities> tokens{};  // per modality code
  std::size_t first_token = 0, last_token = 0;
  int grid_rows = 0, grid_cols = 0;  // patch grid extent for vision segments
};

struct TraceSummary {
  std::string file;
  trace::TraceHeader header;
  std::size_t num_tokens = 0, num_decode_steps = 0;
  std::array<std::size_t, kernels::kNumModalities> tokens_per_modality{};
  std::vector<SegmentSummary> segments;
  // Full (uncompressed) K+V bytes of the context in one layer, total and per modality.
  std::uint64_t kv_bytes_per_layer = 0;
  std::array<std::uint64_t, kernels::kNumModalities> kv_bytes_per_layer_modality{};
  std::uint64_t kv_bytes_total = 0;     // all layers, context tokens
  std::uint64_t kv_bytes_per_token = 0; // all layers
  // Token roles (trace::Role codes): counts of context tokens and decode steps per role; has_roles false
  // when the trace records none (counts then by the defaults: context, answer).
  bool has_roles = false;
  std::array<std::size_t, trace::kNumRoles> context_roles{}, decode_roles{};
  bool has_profile = false;
  std::size_t profile_kernels = 0, profile_ranges = 0;
};

TraceSummary summarize(const trace::TraceReader& reader);
// Human-readable report (what `kvsim info` prints).
std::string format_summary(const TraceSummary& s);

}  // namespace kvscope::sim
