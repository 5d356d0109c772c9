// Stored attention aggregates (trace format 1.2, /aggregates; docs/trace-format.md section 3a):
// writing them into an existing trace safely, and the checks a reader applies to them.
// TraceReader reads them (aggregate_state, aggregate_definition, read_attention_aggregates);
// TraceWriter::write_attention_aggregates writes them while a trace is captured.
#pragma once

#include <memory>
#include <string>

#include "kvscope/trace/schema.hpp"

namespace kvscope::trace {

// What is wrong with stored aggregates of `def` for a trace of this geometry and T ("" = nothing):
// a definition name this library does not know, another L, T, head count or GQA grouping, a window
// outside 1..T, a softmax scale other than float32(1 / sqrt(D)), a non-causal mask, another dtype.
std::string aggregate_definition_problem(const AggregateDefinition& def, const ModelGeometry& geometry,
                                         DType dtype, std::size_t num_tokens);

// Adds /aggregates to an existing, complete trace without ever leaving one that looks aggregated
// before every layer is in it. Layers are staged in `trace_path + ".aggregates.partial"` (a separate
// HDF5 file, created here; the trace is not opened for writing until commit()). commit() then opens
// the trace read-write for one short step: an old /aggregates is first marked incomplete and
// unlinked, the staged group (complete = 0) is copied in, the root version raised to 1.2, and only
// then /aggregates@complete set to 1. A run killed before commit() leaves the trace untouched (and
// the staging file, which the next run overwrites); one killed inside commit() leaves no /aggregates
// or one with complete = 0, which readers ignore. The trace must not be open elsewhere in the
// process during commit() (HDF5 refuses a second open with other flags).
class AggregateWriter {
 public:
  AggregateWriter(const std::string& trace_path, const AggregateDefinition& definition);
  ~AggregateWriter();  // removes the staging file (committed or not)
  AggregateWriter(const AggregateWriter&) = delete;
  AggregateWriter& operator=(const AggregateWriter&) = delete;

  void write_layer(int layer, const LayerAttentionAggregates& aggregates);
  // Every layer must have been written (kUsage otherwise, naming the first missing one).
  void commit();
  const std::string& staging_path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvscope::trace
