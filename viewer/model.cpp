#include "model.hpp"

#include <algorithm>
#include <cmath>
#include <exception>

#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/results_reader.hpp"
#include "kvscope/trace/untrusted.hpp"

namespace kvscope::viewer {

std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

Model::~Model() { wait(); }

void Model::load(std::string trace_path, std::string results_path) {
  state_.store(LoadState::kLoading, std::memory_order_release);
  thread_ = std::thread([this, t = std::move(trace_path), r = std::move(results_path)]() mutable {
    run(std::move(t), std::move(r));
  });
}

void Model::wait() {
  if (thread_.joinable()) thread_.join();
}

std::string Model::status() const {
  std::lock_guard<std::mutex> lock(status_mutex_);
  return status_;
}

const std::string& Model::error() const { return error_; }

void Model::set_status(float progress, std::string what) {
  progress_.store(progress, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(status_mutex_);
  status_ = std::move(what);
}

void Model::run(std::string trace_path, std::string results_path) {
  try {
    registry_names_ = sim::PolicyRegistry().names();
    if (!trace_path.empty()) {
      set_status(0.05f, "opening " + trace_path);
      std::lock_guard<std::mutex> lock(hdf5_mutex());
      // Untrusted: parsed first in an isolated child (under the lock: no HDF5 call is under way
      // in another thread when it forks).
      trace::check_trace_file(trace_path);
      reader_ = std::make_unique<trace::TraceReader>(trace_path);
      set_status(0.25f, "summarising the trace");
      summary_ = sim::summarize(*reader_);
      tokens_ = reader_->tokens();
      set_status(0.4f, "reading the profile");
      profile_ = reader_->read_profile();
      context_ = std::make_unique<sim::TraceContext>(sim::TraceContext::from_reader(*reader_));
      trace_path_ = trace_path;
    }
    if (!results_path.empty()) {
      set_status(0.6f, "reading results " + results_path);
      std::lock_guard<std::mutex> lock(hdf5_mutex());
      sim::check_results_file(results_path);
      points_ = sim::read_results_hdf5(results_path, &meta_);
      intervals_ = sim::read_point_intervals(results_path);
      results_path_ = results_path;
      for (const sim::PointResult& p : points_) {
        if (std::find(policies_.begin(), policies_.end(), p.policy) == policies_.end()) {
          policies_.push_back(p.policy);
        }
      }
      if (reader_ && meta_.num_layers != geometry().num_layers) {
        throw std::runtime_error(results_path + ": results have " + std::to_string(meta_.num_layers) +
                                 " layers but the trace " + trace_path + " has " +
                                 std::to_string(geometry().num_layers) + ": not computed from this trace");
      }
    }
    set_status(1.0f, "ready");
    state_.store(LoadState::kReady, std::memory_order_release);
  } catch (const std::exception& e) {
    error_ = e.what();
    set_status(1.0f, "failed");
    state_.store(LoadState::kFailed, std::memory_order_release);
  }
}

int Model::find_point(const std::string& policy, const std::string& budget) const {
  for (std::size_t i = 0; i < points_.size(); ++i) {
    if (points_[i].policy == policy && points_[i].budget == budget) return static_cast<int>(i);
  }
  return -1;
}

int Model::search_point_for(int point) const {
  if (point < 0 || point >= static_cast<int>(points_.size())) return -1;
  const double want = points_[static_cast<std::size_t>(point)].bytes_ratio();
  int best = -1;
  double best_d = 0;
  for (std::size_t i = 0; i < points_.size(); ++i) {
    if (points_[i].kind != "search") continue;
    const double d = std::abs(points_[i].bytes_ratio() - want);
    if (best < 0 || d < best_d) {
      best = static_cast<int>(i);
      best_d = d;
    }
  }
  return best;
}

std::pair<trace::LayerTensors, trace::LayerTensors> Model::read_layer(int layer) const {
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  return {reader_->read_layer(layer), reader_->read_decode_layer(layer)};
}

}  // namespace kvscope::viewer
