// Reports of simulator results: the stdout table, the CSV file and the HDF5 results file.
// docs/results-format.md is the normative description of both files.
#pragma once

#include <array>
#include <functional>
#include <iosfwd>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscope/sim/info.hpp"
#include "kvscope/sim/results.hpp"

namespace kvscope::sim {

// A results file could not be written. Nothing is left at path() (nor at path() + ".partial").
class ReportError : public std::runtime_error {
 public:
  ReportError(std::string path, const std::string& message)
      : std::runtime_error(path + ": " + message), path_(std::move(path)) {}
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// What the results were computed from; stored in the files next to the results.
struct ResultsMeta {
  std::string trace_path;
  std::string model_name;
  bool synthetic = false;
  int num_layers = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  std::int64_t num_tokens = 0;             // context (prefill) tokens
  std::int64_t num_decode_steps = 0;       // evaluation queries per query head
  PerModalityCount tokens_per_modality{};  // [4] by modality code
  // Token roles (results format 1.2): whether the trace records them, the decode steps moved into the
  // context (--question-in-context; 0 = the question after compression) and the steps of each query set.
  bool has_roles = false;
  std::int64_t steps_in_context = 0;
  std::array<std::int64_t, kQuerySets> query_set_steps{};
  std::string attention_statistics;        // stored /aggregates or recomputed (SweepOutput); "" = not said
  std::string command_line;                // the kvsim invocation, shell-quoted
  std::string created;                     // ISO-8601 UTC; empty = time of writing
  // A dataset sweep's file (results format 1.4, kvsim sweep --dataset): the root attributes of its
  // samples and bootstrap; the counts above are then sums over the successful samples.
  bool dataset = false;
  std::string dataset_source;  // the dataset directory, or the list / glob of traces
  std::int64_t num_samples = 0, failed_samples = 0;
  std::int64_t bootstrap_resamples = 0;
  std::uint64_t bootstrap_seed = 0;
  double confidence = 0.95;
  std::string group_by;  // the --by groupings, comma-separated ("" = none)
};

// A table of named columns, one value per row in each (results format 1.4: /samples, /sample_points and
// /aggregate of a dataset sweep); written as one HDF5 group of 1-D datasets or as one CSV file.
struct ResultsColumn {
  enum class Type { kF64, kI64, kStr };
  std::string name, description;
  Type type = Type::kF64;
  std::vector<double> f64;
  std::vector<std::int64_t> i64;
  std::vector<std::string> str;
  std::size_t size() const {
    return type == Type::kF64 ? f64.size() : type == Type::kI64 ? i64.size() : str.size();
  }
};
struct ResultsTable {
  std::string name;         // HDF5 group, e.g. "aggregate"
  std::string description;  // its description attribute
  std::vector<ResultsColumn> columns;
  // A streamed table holds no rows: its columns only name and type them, and when the table is written,
  // stream(sink) hands its `streamed_rows` rows to sink in consecutive blocks, each a table with the same
  // columns (a dataset sweep's /sample_points, which would otherwise grow with the samples in memory).
  std::size_t streamed_rows = 0;
  std::function<void(const std::function<void(const ResultsTable&)>&)> stream;
  std::size_t rows() const { return stream ? streamed_rows : columns.empty() ? 0 : columns.front().size(); }
  // A table holding the rows of this one (a streamed table's blocks appended; a copy otherwise).
  ResultsTable materialized() const;
  ResultsColumn& add(std::string name, ResultsColumn::Type type, std::string description);
  ResultsColumn* find(const std::string& name);
  const ResultsColumn* find(const std::string& name) const;
};

// Meta from a trace summary (kvsim run/sweep fill command_line from argv).
ResultsMeta results_meta(const TraceSummary& summary, std::string command_line);
// argv joined with spaces, each argument single-quoted where the shell would need it.
std::string command_line_string(int argc, const char* const* argv);

// Modality codes reported per modality in the table and the CSV, ascending: those with context
// tokens in meta.tokens_per_modality or, when meta has no counts, in the points' totals.
std::vector<int> reported_modalities(const std::vector<PointResult>& points, const ResultsMeta& meta);
// "L3-L9,L12" for {3,4,5,6,7,8,9,12} (sorted, duplicates ignored); "" for none.
std::string format_layer_ranges(std::vector<int> layers);
// Short table name of a collapse mode: blind, drift, repeat, overcomp (others unchanged).
std::string flag_short_name(const std::string& mode);

struct TableOptions {
  int max_width = 140;             // rows longer than this get their flags cut with "..."
  std::optional<bool> show_audio;  // audio recall column; nullopt = when any point has audio tokens
  bool legend = true;              // explanation lines under the table
  // Query-set columns (error and recall on the answer's and the question's queries): traces with roles.
  bool query_sets = false;
  // The policy rows are ranked by this proxy (a Proxies column name, or output_error, output_error_answer),
  // best first, and the table says which it is; "default" = kDefaultRankProxy, "none" = run order.
  std::string rank_by = "default";
};

// The proxy the table ranks by default: the best on held-out real-model data (docs/validation.md,
// "Held-out validation of the proxies").
extern const char* const kDefaultRankProxy;
// The names rank_by accepts, comma-separated (for --help and errors).
std::string rank_proxy_names();

// One row per point, in the given order: policy, budget, memory saved (%), bytes ratio,
// output error, attention recall, recall per modality, KL, entropy change, Pareto mark (*),
// collapse flags with their layers.
std::string format_table(const std::vector<PointResult>& points, const TableOptions& options = {});

// CSV: one row per point x (each layer, then "all") x (each reported modality, then "all").
// Written to path + ".partial" and renamed; throws ReportError (leaving no file) on failure.
void write_csv(const std::string& path, const std::vector<PointResult>& points, const ResultsMeta& meta);
// The same CSV text, to a stream / as a string (the Python package's DataFrames read it).
void write_csv(std::ostream& os, const std::vector<PointResult>& points, const ResultsMeta& meta);
std::string format_csv(const std::vector<PointResult>& points, const ResultsMeta& meta);

// HDF5 results file (format "kvscope-results", version 1.5), written to path + ".partial" and
// renamed when complete; throws ReportError (leaving no file) on failure. `tables` become groups of
// their own (a dataset sweep's /samples, /sample_points, /aggregate).
void write_hdf5(const std::string& path, const std::vector<PointResult>& points, const ResultsMeta& meta,
                const std::vector<ResultsTable>& tables = {});

// CSV of one table: a header of the column names, then one line per row (same quoting and number text
// as write_csv). Written to path + ".partial" and renamed; throws ReportError (leaving no file).
void write_table_csv(const std::string& path, const ResultsTable& table);

inline constexpr const char* kResultsFormat = "kvscope-results";
inline constexpr const char* kResultsVersion = "1.5";

}  // namespace kvscope::sim
