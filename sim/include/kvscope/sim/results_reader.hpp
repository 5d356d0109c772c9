// Reader of HDF5 results files ("kvscope-results" 1.x, docs/results-format.md), the inverse of
// write_hdf5: what kvview and scripts use to get PointResults back without re-running a sweep.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscope/sim/report.hpp"
#include "kvscope/sim/results.hpp"
#include "kvscope/trace/error.hpp"

namespace kvscope::sim {

// A results file could not be read: names the file and, where it applies, the dataset or attribute.
class ResultsReadError : public std::runtime_error {
 public:
  ResultsReadError(std::string file, std::string object, const std::string& message)
      : std::runtime_error(
            trace::one_line(object.empty() ? file + ": " + message : file + ": " + object + ": " + message)),
        file_(std::move(file)),
        object_(std::move(object)) {}
  const std::string& file() const { return file_; }
  const std::string& object() const { return object_; }  // "/points/policy", "/@version", "" for the file

 private:
  std::string file_;
  std::string object_;
};

// Reads every point (with its layers, heads, flags and Pareto mark) of a results file; fills *meta
// when non-null. Padding rows (layer or kv head index -1) are dropped, so a point gets back
// exactly the layers and heads it was written with. Refuses other formats and major versions.
// Reads 1.0 files too: the 1.1 fields (bytes_full_end, bytes_end, bytes_peak, mode) are then 0 and
// "prefill"; from 1.1 on they are required.
// Thread-compatible: HDF5 is not thread-safe, so callers serialise it with any other HDF5 use.
std::vector<PointResult> read_results_hdf5(const std::string& path, ResultsMeta* meta = nullptr);

// A dataset sweep's mean of one metric over the samples and its bootstrap interval (results format 1.4,
// /aggregate rows of the grouping "all", layer all, modality all).
struct PointInterval {
  double mean = 0, lo = 0, hi = 0;
};
struct PointIntervals {
  PointInterval output_error, attention_recall, kl, bytes_ratio;
  std::int64_t n = 0;  // samples with the point (0: no aggregate row)
};
// One entry per /points row; empty when the file has no /aggregate table (a single-trace sweep or a file
// before 1.4). Throws ResultsReadError naming the file and the dataset.
std::vector<PointIntervals> read_point_intervals(const std::string& path);

// The pre-check of an untrusted results file (docs/robustness.md): refuses a non-regular file, then
// (unless trace::trusted_files()) runs read_results_hdf5 in an isolated child with
// trace::run_isolated's limits, so a crash, hang or memory blow-up inside HDF5 becomes a
// ResultsReadError naming the file and the object. Call before read_results_hdf5.
void check_results_file(const std::string& path);

}  // namespace kvscope::sim
