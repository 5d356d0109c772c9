// kvscope::capture — a thin RAII C++ wrapper over the C API in kvscope_capture.h.
// Every failing call throws CaptureError carrying the C status and its one-line message.
// A Capture that is destroyed without close() aborts: the trace stays incomplete.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvscope_capture.h"

namespace kvscope::capture {

class CaptureError : public std::runtime_error {
 public:
  CaptureError(int status, const std::string& message) : std::runtime_error(message), status_(status) {}
  // A kvscope_status value (KVSCOPE_ERR_ARGUMENT, ...).
  int status() const { return status_; }

 private:
  int status_;
};

namespace detail {
inline void check(int status) {
  if (status != KVSCOPE_OK) throw CaptureError(status, kvscope_capture_last_error());
}
}  // namespace detail

// A contiguous (or strided) [heads, tokens, head_dim] tensor view for the recording calls.
inline kvscope_tensor tensor(const void* data, kvscope_dtype dtype, std::int64_t heads, std::int64_t tokens,
                             std::int64_t head_dim, kvscope_memory memory = KVSCOPE_HOST) {
  kvscope_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.memory = memory;
  t.shape[0] = heads;
  t.shape[1] = tokens;
  t.shape[2] = head_dim;
  return t;  // zero strides: contiguous
}
inline kvscope_tensor tensor(const float* data, std::int64_t heads, std::int64_t tokens,
                             std::int64_t head_dim) {
  return tensor(data, KVSCOPE_F32, heads, tokens, head_dim);
}

// A configuration with struct_size set and every option at its default.
inline kvscope_capture_config default_config() {
  kvscope_capture_config c{};
  c.struct_size = sizeof(kvscope_capture_config);
  c.rope_theta = 10000.0;
  c.dtype = KVSCOPE_F16;
  return c;
}

// /tokens of the context, one entry per token (text optional: empty = none).
struct TokenTable {
  std::vector<std::uint8_t> modality;  // kvscope_modality codes
  std::vector<std::int32_t> position, token_id, segment, grid_row, grid_col;
  std::vector<std::string> text;
};

class Capture {
 public:
  Capture(const std::string& path, const kvscope_capture_config& config, std::int64_t context_tokens) {
    detail::check(kvscope_capture_open(path.c_str(), &config, context_tokens, &handle_));
  }
  ~Capture() { abort(); }
  Capture(Capture&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
  Capture& operator=(Capture&& o) noexcept {
    if (this != &o) {
      abort();
      handle_ = std::exchange(o.handle_, nullptr);
    }
    return *this;
  }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;

  void set_tokens(const TokenTable& t) {
    std::vector<const char*> text;
    for (const auto& s : t.text) text.push_back(s.c_str());
    const std::size_t n = t.modality.size();
    for (std::size_t len :
         {t.position.size(), t.token_id.size(), t.segment.size(), t.grid_row.size(), t.grid_col.size()}) {
      if (len != n)
        throw CaptureError(KVSCOPE_ERR_ARGUMENT, "Capture::set_tokens: token columns differ in length");
    }
    if (!text.empty() && text.size() != n) {
      throw CaptureError(KVSCOPE_ERR_ARGUMENT,
                         "Capture::set_tokens: text has a different length than modality");
    }
    detail::check(kvscope_capture_set_tokens(handle(), t.modality.data(), t.position.data(),
                                             t.token_id.data(), t.segment.data(), t.grid_row.data(),
                                             t.grid_col.data(), text.empty() ? nullptr : text.data()));
  }
  void prefill_layer(int layer, const kvscope_tensor& q, const kvscope_tensor& k, const kvscope_tensor& v) {
    detail::check(kvscope_capture_prefill_layer(handle(), layer, &q, &k, &v));
  }
  void layer_aggregates(int layer, const float* attn_colsum, const float* attn_window = nullptr,
                        int window = 0) {
    detail::check(kvscope_capture_layer_aggregates(handle(), layer, attn_colsum, attn_window, window));
  }
  void decode_layer(int layer, int step, const kvscope_tensor& q, const kvscope_tensor& k,
                    const kvscope_tensor& v) {
    detail::check(kvscope_capture_decode_layer(handle(), layer, step, &q, &k, &v));
  }
  void decode_token(int step, std::int32_t token_id, std::int32_t position, const char* text = nullptr) {
    detail::check(kvscope_capture_decode_token(handle(), step, token_id, position, text));
  }
  // Token roles (kvscope_role codes): T context roles; decode roles of steps 0..roles.size()-1.
  void set_token_roles(const std::vector<std::uint8_t>& roles) {
    detail::check(kvscope_capture_set_token_roles(handle(), roles.data()));
  }
  void set_decode_roles(const std::vector<std::uint8_t>& roles) {
    detail::check(
        kvscope_capture_set_decode_roles(handle(), roles.data(), static_cast<std::int64_t>(roles.size())));
  }
  void range_push(const char* name) { detail::check(kvscope_capture_range_push(handle(), name)); }
  void range_pop() { detail::check(kvscope_capture_range_pop(handle())); }

  // A named range for the lifetime of the object (pops in its destructor).
  class Range {
   public:
    Range(Capture& c, const char* name) : c_(&c) { c.range_push(name); }
    ~Range() {
      if (c_ && c_->handle_) (void)kvscope_capture_range_pop(c_->handle_);
    }
    Range(const Range&) = delete;
    Range& operator=(const Range&) = delete;

   private:
    Capture* c_;
  };
  Range range(const char* name) { return Range(*this, name); }

  kvscope_capture_stats stats() const {
    kvscope_capture_stats s{};
    s.struct_size = sizeof s;
    detail::check(kvscope_capture_get_stats(handle(), &s));
    return s;
  }

  // Writes the rest, marks the trace complete. The Capture is closed afterwards even if it throws.
  void close() { detail::check(kvscope_capture_close(std::exchange(handle_, nullptr))); }
  // Stops without marking the trace complete. Idempotent.
  void abort() noexcept { kvscope_capture_abort(std::exchange(handle_, nullptr)); }

  bool is_open() const { return handle_ != nullptr; }
  kvscope_capture* get() const { return handle_; }

 private:
  kvscope_capture* handle() const {
    if (!handle_) throw CaptureError(KVSCOPE_ERR_STATE, "kvscope::capture::Capture: capture is closed");
    return handle_;
  }
  kvscope_capture* handle_ = nullptr;
};

}  // namespace kvscope::capture
