// Internal: the /aggregates attributes and datasets (trace format 1.2), shared by the reader, the
// capture writer (TraceWriter) and AggregateWriter.
#pragma once

#include "h5.hpp"
#include "kvscope/trace/schema.hpp"

namespace kvscope::trace::aggregates_io {

// Creates `group` (must not exist) with the definition attributes and complete = 0.
void create_group(const h5::Ctx& c, hid_t file, const std::string& group, const AggregateDefinition& def);
// /aggregates/NNN/{h2o, ...} (checks the sizes against def).
void write_layer(const h5::Ctx& c, hid_t file, int layer, const AggregateDefinition& def,
                 const LayerAttentionAggregates& a);
void set_complete(const h5::Ctx& c, hid_t file, bool complete);

AggregateState state(const h5::Ctx& c, hid_t file);
// The definition attributes (throws kMissing / kValue naming the attribute).
AggregateDefinition read_definition(const h5::Ctx& c, hid_t file);
// One layer's datasets, checked: shapes against def, every value finite and in its range.
LayerAttentionAggregates read_layer(const h5::Ctx& c, hid_t file, int layer, const AggregateDefinition& def);

}  // namespace kvscope::trace::aggregates_io
