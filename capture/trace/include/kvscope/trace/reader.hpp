// Reader of trace v1 files. open() checks the whole structure (attributes,
// tokens, every dataset's shape and dtype) without reading tensors; tensors are
// then read one layer, or one (layer, head) slice, at a time, so the memory a
// reader needs is bounded by one layer whatever the depth of the model.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvscope/trace/error.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::trace {

enum class TensorKind { kQ, kK, kV };
const char* tensor_kind_name(TensorKind k);

struct DecodeTokens {
  std::vector<std::int32_t> token_id;  // [S]
  std::vector<std::int32_t> position;  // [S]
  std::vector<std::string> text;       // [S] or empty
  std::vector<std::uint8_t> role;      // [S] Role codes (kAnswer for every step when the trace has none)
};

struct ReaderOptions {
  // Refuse traces whose writer never finished (complete = 0). The validator
  // turns this off to describe what an incomplete trace contains.
  bool require_complete = true;
  // Check every tensor read for NaN/Inf (throws kValue naming dataset and index).
  bool check_finite = true;
};

class TraceReader {
 public:
  explicit TraceReader(const std::string& path, ReaderOptions options = {});
  ~TraceReader();
  TraceReader(TraceReader&&) noexcept;
  TraceReader& operator=(TraceReader&&) noexcept;

  const std::string& path() const;
  const TraceHeader& header() const;
  const ModelGeometry& geometry() const { return header().geometry; }
  std::size_t num_tokens() const;        // T, context (prefill) tokens
  std::size_t num_decode_steps() const;  // S, evaluation queries per head
  // tokens().role and decode_tokens().role are always filled: from /tokens/role and /decode/tokens/role
  // when present, else every context token kContext and every decode step kAnswer.
  const Tokens& tokens() const;
  const DecodeTokens& decode_tokens() const;
  // True when the trace records roles (/tokens/role or /decode/tokens/role present, format 1.1).
  bool has_roles() const;
  // Layers whose prefill (decode) tensors are present: all of them for a complete trace.
  int layers_present() const;
  int decode_layers_present() const;

  // Prefill q [Hq, T, D], k and v [Hkv, T, D] of one layer.
  LayerTensors read_layer(int layer) const;
  // One head's slice [1, T, D] of q (query head) or k/v (kv head).
  Tensor read_head(int layer, TensorKind kind, int head) const;
  // Decode q [Hq, S, D] and the appended k, v [Hkv, S, D] of one layer.
  LayerTensors read_decode_layer(int layer) const;
  // Precomputed aggregates if the trace has them.
  std::optional<LayerAggregates> read_aggregates(int layer) const;
  // Stored attention aggregates (format 1.2, /aggregates; docs/trace-format.md section 3a). The
  // structure check of the constructor does not look at them: a reader that can recompute them
  // decides what a bad aggregate means (kvsim warns and recomputes; kvcap validate fails).
  AggregateState aggregate_state() const;
  // The definition attributes; throws TraceError naming the attribute when one is missing or malformed.
  AggregateDefinition aggregate_definition() const;
  // One layer's datasets, checked against `definition` (shapes; values finite and in range).
  LayerAttentionAggregates read_attention_aggregates(int layer, const AggregateDefinition& definition) const;
  // /profile records (empty if the trace has none).
  Profile read_profile() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Index of the first NaN/Inf element of a tensor, or -1.
std::ptrdiff_t first_non_finite(const Tensor& t);

}  // namespace kvscope::trace
