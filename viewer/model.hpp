// kvview's data model: a trace and a results file loaded in a background thread, read by the
// panels only through const getters once state() is kReady. No UI include (Tracy's server/ split).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/info.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/sim/results.hpp"
#include "kvscope/sim/results_reader.hpp"
#include "kvscope/trace/reader.hpp"

namespace kvscope::viewer {

// HDF5 (Debian's build) is not thread-safe: every HDF5 call of the viewer holds this lock.
std::mutex& hdf5_mutex();

enum class LoadState { kIdle, kLoading, kReady, kFailed };

class Model {
 public:
  Model() = default;
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Starts loading in a background thread (either path may be empty). Call once.
  void load(std::string trace_path, std::string results_path);
  // Blocks until loading ends (tests, headless mode).
  void wait();

  LoadState state() const { return state_.load(std::memory_order_acquire); }
  float progress() const { return progress_.load(std::memory_order_relaxed); }  // 0..1 while loading
  std::string status() const;        // what the loader is doing now
  const std::string& error() const;  // one line naming the file, when state() == kFailed

  // Valid once state() == kReady.
  bool has_trace() const { return reader_ != nullptr; }
  bool has_results() const { return !results_path_.empty(); }
  const std::string& trace_path() const { return trace_path_; }
  const std::string& results_path() const { return results_path_; }
  const sim::TraceSummary& summary() const { return summary_; }
  const trace::ModelGeometry& geometry() const { return summary_.header.geometry; }
  const trace::Tokens& tokens() const { return tokens_; }
  const trace::Profile& profile() const { return profile_; }
  const sim::TraceContext& context() const { return *context_; }
  const std::vector<sim::PointResult>& points() const { return points_; }
  const sim::ResultsMeta& results_meta() const { return meta_; }
  // A dataset sweep's intervals, one per points() row (results format 1.4); empty for one trace's results.
  const std::vector<sim::PointIntervals>& point_intervals() const { return intervals_; }
  const std::vector<std::string>& policies() const { return policies_; }  // distinct, in file order
  const std::vector<std::string>& registry_policies() const { return registry_names_; }

  // Row of points() for (policy, budget), or -1.
  int find_point(const std::string& policy, const std::string& budget) const;
  // The allocation-search point (kind "search", alloc-search:SCORER) with the bytes ratio closest to
  // points()[point]'s, or -1.
  int search_point_for(int point) const;

  // Prefill and decode tensors of one layer, read under hdf5_mutex(). Throws TraceError.
  std::pair<trace::LayerTensors, trace::LayerTensors> read_layer(int layer) const;

 private:
  void run(std::string trace_path, std::string results_path);
  void set_status(float progress, std::string what);

  std::thread thread_;
  std::atomic<LoadState> state_{LoadState::kIdle};
  std::atomic<float> progress_{0};
  mutable std::mutex status_mutex_;
  std::string status_, error_;

  std::string trace_path_, results_path_;
  std::unique_ptr<trace::TraceReader> reader_;
  sim::TraceSummary summary_;
  trace::Tokens tokens_;
  trace::Profile profile_;
  std::unique_ptr<sim::TraceContext> context_;
  std::vector<sim::PointResult> points_;
  sim::ResultsMeta meta_;
  std::vector<sim::PointIntervals> intervals_;
  std::vector<std::string> policies_, registry_names_;
};

}  // namespace kvscope::viewer
