// Streaming writer of trace v1 files. Each call writes straight to disk, so a
// model of any depth is captured with memory bounded by the caller's one layer.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvscope/trace/schema.hpp"

namespace kvscope::trace {

struct WriterOptions {
  int chunk_tokens = 256;  // tokens per chunk; a chunk covers one head and this many tokens
  int deflate_level = 0;   // 0 = no compression, 1..9 = gzip level
};

class TraceWriter {
 public:
  // Creates (truncates) `path` and writes the root attributes with complete = 0.
  // num_decode_steps is S, the number of generated tokens recorded under /decode; a writer that
  // learns S only at the end (a live capture) passes 0 and calls set_num_decode_steps() later.
  TraceWriter(const std::string& path, const TraceHeader& header, std::size_t context_tokens,
              std::size_t num_decode_steps, WriterOptions options = {});
  ~TraceWriter();  // closes the file without marking it complete unless close() was called
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  // /tokens, length T (and /tokens/role when tokens.role is not empty: the file becomes version 1.1).
  void write_tokens(const Tokens& tokens);
  // /layers/NNN/{q,k,v}: q [Hq, T, D], k and v [Hkv, T, D], all in header.dtype.
  void write_layer(int layer, const TensorView& q, const TensorView& k, const TensorView& v);
  // /tokens/role alone, for a writer that learns the roles after write_tokens (a live capture): Role codes
  // [T]; once, and not when write_tokens already wrote them. The file becomes version 1.1.
  void write_token_roles(const std::vector<std::uint8_t>& role);
  // Optional /layers/NNN/attn_colsum and attn_window.
  void write_layer_aggregates(int layer, const LayerAggregates& aggregates);
  // /aggregates/NNN (format 1.2, docs/trace-format.md section 3a): the first call creates /aggregates
  // with `definition`'s attributes and complete = 0 (every call must pass the same definition, for
  // this trace's geometry and T); close() sets complete = 1 when every layer has them, else leaves 0.
  void write_attention_aggregates(int layer, const AggregateDefinition& definition,
                                  const LayerAttentionAggregates& aggregates);
  // /decode/layers/NNN/{q,k,v}: q [Hq, S, D], k and v [Hkv, S, D].
  void write_decode_layer(int layer, const TensorView& q, const TensorView& k, const TensorView& v);
  // /decode/tokens: generated token ids [S] and positions [S] (modality text).
  // role: optional Role codes [S] (/decode/tokens/role; the file becomes version 1.1), empty = none.
  void write_decode_tokens(const std::vector<std::int32_t>& token_id,
                           const std::vector<std::int32_t>& position,
                           const std::vector<std::string>& text = {},
                           const std::vector<std::uint8_t>& role = {});
  // /profile/kernels and /profile/ranges (may be empty).
  void write_profile(const Profile& profile);

  // Sets S. Allowed until the first /decode tensor or /decode/tokens is written (kUsage otherwise).
  void set_num_decode_steps(std::size_t num_decode_steps);
  std::size_t num_decode_steps() const;
  // Flushes what was written so far to disk, so that a crash later leaves a readable
  // (incomplete) trace holding it.
  void flush();

  // Checks that every required part was written, sets complete = 1 and closes.
  // Throws TraceError (kUsage) naming what is missing; the file stays incomplete.
  void close();

  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvscope::trace
