// Sweeps over datasets of traces (kvsim sweep --dataset, docs/datasets.md): the per-sample results of
// every trace, their mean points (Pareto front and bound on the aggregates), and the mean with a seeded
// bootstrap confidence interval of every metric per point x layer x modality, over all samples and per
// metadata group. docs/results-format.md "Dataset sweeps" describes the tables.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvscope/sim/info.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/sim/results.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/trace/dataset.hpp"

namespace kvscope::sim {

// One sample's replay: its points as a single-trace sweep reports them, or the error that failed it.
struct SampleResult {
  bool ok = false;
  std::string error;  // one line, when !ok
  ResultsMeta meta;   // the replay's shape (tokens, decode steps, roles, ...)
  std::vector<PointResult> points;
};

struct BootstrapOptions {
  int resamples = 1000;    // resamples of the samples, drawn with replacement
  std::uint64_t seed = 0;  // each group's resamples come from (seed, grouping, group) only
  double confidence = 0.95;
};

// The metrics aggregated per row (a point x layer or all x modality or all), in table order; on a
// modality row attention_recall is that modality's recall and the shares are that modality's, the
// other metrics are the layer's (as in the CSV). With `query_sets` the answer/question metrics follow.
std::vector<std::string> aggregate_metric_names(bool query_sets);

// Length bucket of a context of `tokens` tokens: "128-255" (powers of two), "0-0" for 0.
std::string length_bucket(std::int64_t tokens);

// Mean and percentile bootstrap interval of `values` (NaN values ignored; NaN when none is finite):
// `resamples` resamples of the values' indices from a splitmix64 stream seeded with `seed`.
struct Interval {
  double mean = 0, lo = 0, hi = 0;
};
Interval bootstrap_interval(const std::vector<double>& values, const BootstrapOptions& options,
                            std::uint64_t seed);

struct DatasetResults {
  std::vector<PointResult> points;   // mean over the successful samples that have the point
  std::vector<ResultsTable> tables;  // samples, sample_points, aggregate
  ResultsMeta meta;                  // root attributes of the file
  bool has_roles = false;
};

// Throws std::runtime_error naming the grouping when a --by name is neither "length" nor a column of
// the dataset's manifest.
void check_groupings(const trace::Dataset& dataset, const std::vector<std::string>& by);

// Aggregates a dataset sweep one sample at a time, so that its memory does not hold every sample's
// results: add() folds sample i's points into the mean points (bytes and token counts summed, quality
// metrics weighted by 1 / samples, their head rows then dropped) and keeps of the sample only its
// layer and point totals' metrics (a few hundred bytes per point x layer: what /sample_points and the
// bootstrap read). Samples must be added in dataset order (results[i] for dataset.samples[i]): the
// sums then run in the same order on any number of ranks. `dataset` must outlive the aggregator.
class DatasetAggregator {
 public:
  DatasetAggregator(const trace::Dataset& dataset, std::vector<std::string> by, BootstrapOptions options,
                    CollapseThresholds thresholds);
  ~DatasetAggregator();
  DatasetAggregator(const DatasetAggregator&) = delete;
  DatasetAggregator& operator=(const DatasetAggregator&) = delete;

  // The next sample of the dataset (throws std::logic_error past the last).
  void add(SampleResult result);
  std::size_t added() const;

  // After the last sample: the mean points (Pareto front, collapse flags), the file's meta and the
  // tables. /sample_points is a streamed table (ResultsTable::stream) that reads this aggregator's
  // kept rows when it is written: the aggregator must outlive the results' tables. Throws
  // std::runtime_error when no sample succeeded.
  DatasetResults finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Aggregates the samples (results[i] belongs to dataset.samples[i]) with a DatasetAggregator; the
// returned tables hold their rows (none is streamed). Points are matched across samples by (policy,
// budget, mode, kind), in the order of their first appearance. Bytes and token counts of the mean
// points are sums over the samples, quality metrics means; the Pareto front is marked on the mean
// points (policies only) and their collapse flags come from the mean layers. Throws
// std::runtime_error when no sample succeeded. Deterministic: the same inputs give the same tables, on
// any number of threads.
DatasetResults aggregate_dataset(const trace::Dataset& dataset, const std::vector<SampleResult>& results,
                                 const std::vector<std::string>& by, const BootstrapOptions& options,
                                 const CollapseThresholds& thresholds);

// The compact stdout summary: per grouping and group, per budget, the `top` policies with the lowest
// mean output error among those within the budget (bytes ratio <= the requested fraction plus half a
// token of the shortest context), each with its interval, the bound's row at that budget, and a line
// naming the policies whose bytes are above the budget (not ranked).
std::string format_dataset_summary(const DatasetResults& results, int top);

}  // namespace kvscope::sim
