// Writer-thread side of a capture and its end: waits for device copies, converts to the
// trace dtype, writes prefill layers as they arrive and keeps decode steps until close,
// which checks completeness, writes /decode and /profile and marks the trace complete.
#include <algorithm>
#include <cstring>
#include <new>

#include "session.hpp"

namespace kvscope::capture::detail {

namespace {

kvscope_status status_of(trace::ErrorKind k) {
  switch (k) {
    case trace::ErrorKind::kIo:
      return KVSCOPE_ERR_IO;
    case trace::ErrorKind::kUsage:
      return KVSCOPE_ERR_STATE;
    case trace::ErrorKind::kShape:
    case trace::ErrorKind::kValue:
    case trace::ErrorKind::kDType:
      return KVSCOPE_ERR_ARGUMENT;
    default:
      return KVSCOPE_ERR_INTERNAL;
  }
}

const char* kTensorNames[3] = {"q", "k", "v"};

std::string list_layers(const std::vector<int>& layers) {
  std::string s;
  for (std::size_t i = 0; i < layers.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(layers[i]);
  if (layers.size() > 8) s += ", ... (" + std::to_string(layers.size()) + " in all)";
  return s;
}

}  // namespace

void Session::writer_main() noexcept {
  for (;;) {
    Job job = queue_.pop();
    if (job.kind == JobKind::kStop) return;
    if (!discard_.load()) {
      try {
        handle(job);
      } catch (const Failure& f) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        writer_error_ = f;
      } catch (const trace::TraceError& e) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        writer_error_ = Failure(status_of(e.kind()), e.what());
      } catch (const std::bad_alloc&) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        writer_error_ = Failure(KVSCOPE_ERR_INTERNAL, "out of memory on the writer thread");
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        writer_error_ = Failure(KVSCOPE_ERR_INTERNAL, e.what());
      }
      if (writer_error_) discard_ = true;  // later jobs are dropped; every later call reports the error
    }
    if (stager_ && (job.pinned.data || job.ready_event)) {
      if (job.ready_event && discard_.load()) {
        try {
          stager_->wait(job.ready_event);  // the buffer may not be reused before its copy ends
        } catch (const Failure&) {
        }
      }
      stager_->release(job.pinned, job.ready_event);
    }
    queue_.release(job.bytes);
  }
}

std::vector<std::byte> Session::to_trace_dtype(const Job& job, int which, const char* what) const {
  const StagedTensor& s = job.tensors[static_cast<std::size_t>(which)];
  const std::byte* src = job.staging() + s.offset;
  std::vector<std::byte> out(s.numel() * kernels::dtype_bytes(dtype_));
  const std::ptrdiff_t bad = convert_elements(src, s.dtype, out.data(), dtype_, s.numel());
  if (bad >= 0) {
    const auto i = static_cast<std::size_t>(bad);
    const std::size_t D = s.shape[2], T = s.shape[1];
    fail(KVSCOPE_ERR_ARGUMENT, std::string(what) + " layer " + std::to_string(job.layer) + " " +
                                   kTensorNames[which] + ": element [" + std::to_string(i / (T * D)) + ", " +
                                   std::to_string(i / D % T) + ", " + std::to_string(i % D) +
                                   "] = " + std::to_string(kernels::load_element(src, s.dtype, i)) +
                                   " is not finite in " + kernels::dtype_name(dtype_) +
                                   " (NaN, Inf or out of range); a trace holds finite values only");
  }
  return out;
}

void Session::handle(Job& job) {
  if (job.ready_event) stager_->wait(job.ready_event);
  switch (job.kind) {
    case JobKind::kTokens:
      writer_->write_tokens(job.tokens);
      if (aggregate_window_ > 0) {
        aggregator_.emplace(geometry_, dtype_, job.tokens, aggregate_window_,
                            "kvscope-capture " KVSCOPE_CAPTURE_VERSION);
      }
      break;
    case JobKind::kAggregates:
      writer_->write_layer_aggregates(job.layer, job.aggregates);
      break;
    case JobKind::kPrefill: {
      Profiler::Scope range(profiler_, "capture/write layer " + std::to_string(job.layer), 0);
      std::vector<std::byte> t[3];
      trace::TensorView view[3];
      for (int i = 0; i < 3; ++i) {
        t[i] = to_trace_dtype(job, i, "prefill");
        view[i] = {t[i].data(), dtype_, job.tensors[static_cast<std::size_t>(i)].shape};
      }
      writer_->write_layer(job.layer, view[0], view[1], view[2]);
      if (aggregator_) {
        Profiler::Scope agg(profiler_, "capture/aggregate layer " + std::to_string(job.layer), 1);
        writer_->write_attention_aggregates(job.layer, aggregator_->definition(),
                                            aggregator_->compute(t[0].data(), t[1].data()));
      }
      writer_->flush();  // a crash later still leaves this layer readable
      tensors_written_ += 3;
      ++layers_written_;
      break;
    }
    case JobKind::kDecode: {
      DecodeStore& store = decode_store_[static_cast<std::size_t>(job.layer)];
      std::vector<std::byte>* dst[3] = {&store.q, &store.k, &store.v};
      for (int i = 0; i < 3; ++i) {
        const std::vector<std::byte> c = to_trace_dtype(job, i, "decode");
        dst[i]->insert(dst[i]->end(), c.begin(), c.end());
      }
      tensors_written_ += 3;
      break;
    }
    case JobKind::kStop:
      break;
  }
}

void Session::stop_writer() noexcept {
  if (!running_) return;
  Job stop;
  stop.kind = JobKind::kStop;
  queue_.push(std::move(stop));
  thread_.join();
  running_ = false;
}

std::string Session::missing_parts() const {
  std::vector<std::string> parts;
  if (!tokens_set_) parts.push_back("tokens not set");
  std::vector<int> missing;
  for (std::size_t l = 0; l < prefill_recorded_.size(); ++l) {
    if (!prefill_recorded_[l]) missing.push_back(static_cast<int>(l));
  }
  if (!missing.empty()) parts.push_back("prefill layers not recorded: " + list_layers(missing));
  const int S = decode_steps_.empty() ? 0 : decode_steps_[0];
  std::vector<int> uneven;
  for (std::size_t l = 0; l < decode_steps_.size(); ++l) {
    if (decode_steps_[l] != S) uneven.push_back(static_cast<int>(l));
  }
  if (!uneven.empty()) {
    parts.push_back("decode steps differ between layers: layer 0 has " + std::to_string(S) + ", layers " +
                    list_layers(uneven) + " have " +
                    std::to_string(decode_steps_[static_cast<std::size_t>(uneven[0])]) +
                    (uneven.size() > 1 ? ", ..." : ""));
  } else if (decode_token_id_.size() != static_cast<std::size_t>(S)) {
    parts.push_back(std::to_string(decode_token_id_.size()) + " decode tokens recorded for " +
                    std::to_string(S) + " decode steps");
  } else if (decode_roles_set_ && decode_roles_.size() != static_cast<std::size_t>(S)) {
    parts.push_back(std::to_string(decode_roles_.size()) + " decode roles set for " + std::to_string(S) +
                    " decode steps");
  }
  std::string s;
  for (std::size_t i = 0; i < parts.size(); ++i) s += (i ? "; " : "") + parts[i];
  return s;
}

void Session::write_decode_and_profile() {
  const auto S = static_cast<std::size_t>(decode_steps_[0]);
  const auto D = static_cast<std::size_t>(geometry_.head_dim), eb = kernels::dtype_bytes(dtype_);
  writer_->set_num_decode_steps(S);
  for (int l = 0; l < geometry_.num_layers; ++l) {
    DecodeStore& store = decode_store_[static_cast<std::size_t>(l)];
    std::vector<std::byte>* src[3] = {&store.q, &store.k, &store.v};
    std::vector<std::byte> t[3];
    trace::TensorView view[3];
    for (int i = 0; i < 3; ++i) {  // step-major [S][H][D] -> [H][S][D]
      const std::size_t H = i == 0 ? static_cast<std::size_t>(geometry_.num_q_heads)
                                   : static_cast<std::size_t>(geometry_.num_kv_heads);
      t[i].resize(H * S * D * eb);
      for (std::size_t s = 0; s < S; ++s) {
        for (std::size_t h = 0; h < H; ++h) {
          std::memcpy(t[i].data() + (h * S + s) * D * eb, src[i]->data() + (s * H + h) * D * eb, D * eb);
        }
      }
      src[i]->clear();
      src[i]->shrink_to_fit();
      view[i] = {t[i].data(), dtype_, {H, S, D}};
    }
    writer_->write_decode_layer(l, view[0], view[1], view[2]);
  }
  writer_->write_decode_tokens(decode_token_id_, decode_position_,
                               decode_has_text_ ? decode_text_ : std::vector<std::string>{},
                               decode_roles_set_ ? decode_roles_ : std::vector<std::uint8_t>{});
  if (token_roles_set_) writer_->write_token_roles(token_roles_);
  writer_->write_profile(profiler_.finish());
}

void Session::close() {
  const char* where = "kvscope_capture_close";
  stop_writer();  // every queued tensor is written before anything else
  const std::string missing = missing_parts();
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (writer_error_) {
      fail(writer_error_->status(), std::string(where) + ": the writer thread failed: " +
                                        writer_error_->what() + "; trace left incomplete");
    }
  }
  if (!missing.empty())
    fail(KVSCOPE_ERR_STATE, std::string(where) + ": " + missing + "; trace left incomplete");
  try {
    write_decode_and_profile();
    writer_->close();
  } catch (const trace::TraceError& e) {
    fail(status_of(e.kind()), std::string(where) + ": " + e.what() + "; trace left incomplete");
  }
  writer_.reset();
}

void Session::abort() noexcept {
  // Tensors already recorded are still written (a post-mortem trace holds everything the run
  // handed over); only the completeness mark is withheld.
  stop_writer();
  stager_.reset();  // synchronizes the side stream before freeing pinned memory
  writer_.reset();  // closes the file with complete = 0
}

}  // namespace kvscope::capture::detail
