// Background recomputation of one layer through the simulator library (run_policy_on_layer with
// record_tokens): what the token map, attention and what-if panels show. One job runs at a time
// on a worker thread; the newest request waits behind it; finished layers are cached. No UI include.
#pragma once

#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/results.hpp"

namespace kvscope::viewer {

class Model;

struct LayerRequest {
  sim::PolicySpec policy;
  double keep = 1.0;  // mean fraction of tokens kept (the point's budget_value)
  int layer = 0;
  std::string tag;  // distinguishes edited specs with the same name (what-if)
  std::string key() const;
};

struct LayerOutcome {
  std::string error;  // non-empty when the recomputation failed
  std::vector<std::string> warnings;
  sim::LayerResult result;   // token_maps filled, one per kv head
  int T = 0, S = 0, Hq = 0;  // context tokens, evaluation queries, query heads
  // Attention of the evaluation queries over context + decode keys (causal on decode keys).
  std::vector<float> attn_full;        // [Hq, S, T + S]
  std::vector<float> attn_compressed;  // [Hq, S, T + S]: surviving slots only (see docs/viewer.md)
  double seconds = 0;
};

class LayerJobs {
 public:
  explicit LayerJobs(const Model& model) : model_(model) {}
  ~LayerJobs();
  LayerJobs(const LayerJobs&) = delete;
  LayerJobs& operator=(const LayerJobs&) = delete;

  // The cached outcome, or nullptr while it is computed (the request is queued if needed).
  // Never blocks. Call poll() once per frame to collect finished jobs.
  std::shared_ptr<const LayerOutcome> get(const LayerRequest& request);
  void poll();
  bool busy() const { return running_.valid() || queued_.has_value(); }
  // The error of the first finished job that failed ("" if none): a layer that cannot be read.
  const std::string& first_error() const { return first_error_; }

  // Computes one layer synchronously (what the worker runs).
  static LayerOutcome compute(const Model& model, const LayerRequest& request);

 private:
  void start(const LayerRequest& request);

  const Model& model_;
  std::future<LayerOutcome> running_;
  std::string running_key_;
  std::optional<LayerRequest> queued_;
  std::map<std::string, std::shared_ptr<const LayerOutcome>> cache_;
  std::deque<std::string> order_;  // cache keys, oldest first
  std::string first_error_;
};

}  // namespace kvscope::viewer
