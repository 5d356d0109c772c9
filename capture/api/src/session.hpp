// One capture: the model-thread side (argument and order checks, staging of tensors into
// the bounded queue) and the writer thread (device-copy waits, dtype conversion, HDF5
// writes through kvscope::trace). The C API in capture_api.cpp is a thin shell around it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "convert.hpp"
#include "device_stager.hpp"
#include "failure.hpp"
#include "job_queue.hpp"
#include "kvscope/aggregate/aggregate.hpp"
#include "kvscope/trace/error.hpp"
#include "kvscope/trace/limits.hpp"
#include "kvscope/trace/writer.hpp"
#include "kvscope_capture.h"
#include "profiler.hpp"

namespace kvscope::capture::detail {

inline constexpr std::uint64_t kDefaultQueueBytes = 256ull << 20;
inline constexpr int kDefaultChunkTokens = 256;
inline constexpr int kDefaultMaxDecodeSteps = 4096;

class Session {
 public:
  // `config` has its struct_size resolved (zero defaults filled). Throws Failure.
  Session(const std::string& path, const kvscope_capture_config& config, std::int64_t context_tokens);
  ~Session();  // aborts a capture that was neither closed nor aborted
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void set_tokens(const std::uint8_t* modality, const std::int32_t* position, const std::int32_t* token_id,
                  const std::int32_t* segment, const std::int32_t* grid_row, const std::int32_t* grid_col,
                  const char* const* text);
  void prefill_layer(std::int32_t layer, const kvscope_tensor* q, const kvscope_tensor* k,
                     const kvscope_tensor* v);
  void layer_aggregates(std::int32_t layer, const float* attn_colsum, const float* attn_window,
                        std::int32_t window);
  void decode_layer(std::int32_t layer, std::int32_t step, const kvscope_tensor* q, const kvscope_tensor* k,
                    const kvscope_tensor* v);
  void decode_token(std::int32_t step, std::int32_t token_id, std::int32_t position, const char* text);
  void set_token_roles(const std::uint8_t* roles);
  void set_decode_roles(const std::uint8_t* roles, std::int64_t num_steps);
  void range_push(const char* name);
  void range_pop();
  void close();
  void abort() noexcept;
  void stats(kvscope_capture_stats* out) const;

 private:
  void check_writer(const char* where) const;
  void check_layer(const char* where, std::int32_t layer) const;
  void enqueue_tensors(JobKind kind, int layer, int step, const TensorLayout (&t)[3]);
  void stop_writer() noexcept;  // writes every queued job, then joins the writer thread
  void writer_main() noexcept;
  void handle(Job& job);
  std::vector<std::byte> to_trace_dtype(const Job& job, int which, const char* what) const;
  void write_decode_and_profile();
  std::string missing_parts() const;

  // Set at open.
  trace::ModelGeometry geometry_;
  DType dtype_;
  std::int64_t T_;
  int max_decode_steps_;
  void* cuda_stream_;
  std::unique_ptr<trace::TraceWriter> writer_;  // model thread at open/close, writer thread between
  Profiler profiler_;
  JobQueue queue_;
  std::unique_ptr<DeviceStager> stager_;  // created at the first device tensor
  std::thread thread_;
  bool running_ = false;

  // Model-thread bookkeeping of what was recorded.
  bool tokens_set_ = false;
  int aggregate_window_ = 0;                                // config.aggregate_window
  std::optional<aggregate::AggregateComputer> aggregator_;  // writer thread, from the tokens job
  std::vector<bool> prefill_recorded_, aggregates_recorded_;
  std::vector<int> decode_steps_;  // per layer
  std::vector<std::int32_t> decode_token_id_, decode_position_;
  std::vector<std::string> decode_text_;
  bool decode_has_text_ = false;
  std::vector<std::uint8_t> token_roles_, decode_roles_;  // empty = not set
  bool token_roles_set_ = false, decode_roles_set_ = false;

  // Writer-thread state.
  struct DecodeStore {
    std::vector<std::byte> q, k, v;  // step-major [S][H][D] in the trace dtype
  };
  std::vector<DecodeStore> decode_store_;
  std::atomic<bool> discard_{false};  // set after a writer error: later jobs are dropped, not written
  std::atomic<std::uint64_t> tensors_written_{0}, layers_written_{0};
  mutable std::mutex error_mutex_;
  std::optional<Failure> writer_error_;
};

}  // namespace kvscope::capture::detail
