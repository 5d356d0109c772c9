#include "kvscope/trace/validate.hpp"

#include <optional>

#include "kvscope/trace/aggregates.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::trace {

ValidationReport validate_trace(const std::string& path,
                                const std::function<void(std::size_t, std::size_t)>& progress) {
  ValidationReport r;
  try {
    ReaderOptions opts;
    opts.require_complete = false;
    TraceReader reader(path, opts);
    const ModelGeometry& g = reader.geometry();
    r.num_layers = g.num_layers;
    r.layers_present = reader.layers_present();
    r.num_tokens = reader.num_tokens();
    r.num_decode_steps = reader.num_decode_steps();
    const std::size_t per_layer = static_cast<std::size_t>(g.num_q_heads + 2 * g.num_kv_heads) + 1;
    const std::size_t total = per_layer * static_cast<std::size_t>(r.layers_present);
    std::size_t done = 0;
    // Stored attention aggregates (1.2): complete ones must fit the trace and hold valid values;
    // incomplete ones (a stopped writer) are reported in the message, readers ignore them.
    const AggregateState aggregates = reader.aggregate_state();
    std::optional<AggregateDefinition> definition;
    if (aggregates == AggregateState::kPresent) {
      definition = reader.aggregate_definition();
      const std::string problem =
          aggregate_definition_problem(*definition, g, reader.header().dtype, reader.num_tokens());
      if (!problem.empty()) throw TraceError(ErrorKind::kValue, path, kAggregatesGroup, problem);
    }
    for (int l = 0; l < r.layers_present; ++l) {
      for (int h = 0; h < g.num_q_heads; ++h) {
        (void)reader.read_head(l, TensorKind::kQ, h);
        if (progress) progress(++done, total);
      }
      for (int h = 0; h < g.num_kv_heads; ++h) {
        (void)reader.read_head(l, TensorKind::kK, h);
        if (progress) progress(++done, total);
        (void)reader.read_head(l, TensorKind::kV, h);
        if (progress) progress(++done, total);
      }
      if (l < reader.decode_layers_present()) (void)reader.read_decode_layer(l);
      (void)reader.read_aggregates(l);
      if (definition) (void)reader.read_attention_aggregates(l, *definition);
      if (progress) progress(++done, total);
    }
    (void)reader.read_profile();
    if (!reader.header().complete) {
      r.incomplete = true;
      r.kind = ErrorKind::kIncomplete;
      r.message = path + ": incomplete trace (complete = 0, its writer did not finish): contains " +
                  std::to_string(r.num_tokens) + " tokens, " + std::to_string(r.num_decode_steps) +
                  " decode steps, " + std::to_string(r.layers_present) + " of " + std::to_string(r.num_layers) +
                  " prefill layers and " + std::to_string(reader.decode_layers_present()) +
                  " decode layers; the data present is valid";
      return r;
    }
    r.ok = true;
    r.message =
        path + ": valid kvscope trace v" + std::to_string(reader.header().version_major) + "." +
        std::to_string(reader.header().version_minor) + " (" + std::to_string(r.num_layers) + " layers, " +
        std::to_string(r.num_tokens) + " tokens, " + std::to_string(r.num_decode_steps) + " decode steps, " +
        kernels::dtype_name(reader.header().dtype) + (reader.header().synthetic ? ", synthetic)" : ")") +
        (r.num_decode_steps == 0 ? "; not replayable: no decode steps (kvsim run/sweep need S >= 1)" : "") +
        (aggregates == AggregateState::kPresent
             ? "; attention aggregates (window " + std::to_string(definition->window) + ")"
         : aggregates == AggregateState::kIncomplete ? "; /aggregates incomplete (ignored by readers)"
                                                     : "");
  } catch (const TraceError& e) {
    r.ok = false;
    r.kind = e.kind();
    r.incomplete = e.kind() == ErrorKind::kIncomplete;
    r.message = e.what();
  }
  return r;
}

}  // namespace kvscope::trace
