// The C boundary: every entry point catches everything, stores a one-line thread-local
// message and returns a kvscope_status. No exception crosses into C.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>

#include "kvscope_capture.h"
#include "session.hpp"

using kvscope::capture::detail::Failure;
using kvscope::capture::detail::Session;

struct kvscope_capture {
  Session* session = nullptr;
};

namespace {

thread_local std::string g_last_error;

int set_error(int status, std::string message) {
  std::replace(message.begin(), message.end(), '\n', ' ');  // one line, whatever a library said
  g_last_error = std::move(message);
  return status;
}

// Runs `fn` and converts what it throws into a status and message.
template <typename Fn>
int guarded(const char* where, Fn&& fn) {
  try {
    fn();
    return KVSCOPE_OK;
  } catch (const Failure& f) {
    return set_error(f.status(), f.what());
  } catch (const kvscope::trace::TraceError& e) {
    return set_error(KVSCOPE_ERR_IO, std::string(where) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return set_error(KVSCOPE_ERR_INTERNAL, std::string(where) + ": out of memory");
  } catch (const std::exception& e) {
    return set_error(KVSCOPE_ERR_INTERNAL, std::string(where) + ": " + e.what());
  } catch (...) {
    return set_error(KVSCOPE_ERR_INTERNAL, std::string(where) + ": unknown exception");
  }
}

int null_handle(const char* where) {
  return set_error(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": capture handle is NULL");
}

}  // namespace

extern "C" {

int kvscope_capture_abi_version(void) { return KVSCOPE_CAPTURE_ABI_VERSION; }

const char* kvscope_capture_last_error(void) { return g_last_error.c_str(); }

int kvscope_capture_open(const char* path, const kvscope_capture_config* config, int64_t context_tokens,
                         kvscope_capture** out) {
  const char* where = "kvscope_capture_open";
  if (out == nullptr) return set_error(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": out is NULL");
  *out = nullptr;
  if (path == nullptr || *path == '\0')
    return set_error(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": path is NULL or empty");
  if (config == nullptr) return set_error(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": config is NULL");
  constexpr std::size_t kMinSize = offsetof(kvscope_capture_config, rope_theta);
  if (config->struct_size < kMinSize || config->struct_size > sizeof(kvscope_capture_config)) {
    return set_error(
        KVSCOPE_ERR_ARGUMENT,
        std::string(where) + ": config->struct_size is " + std::to_string(config->struct_size) +
            "; set it to sizeof(kvscope_capture_config) = " + std::to_string(sizeof(kvscope_capture_config)));
  }
  kvscope_capture_config resolved{};
  std::memcpy(&resolved, config, config->struct_size);  // fields the caller does not know keep zero defaults
  return guarded(where, [&] {
    auto* handle = new kvscope_capture;
    try {
      handle->session = new Session(path, resolved, context_tokens);
    } catch (...) {
      delete handle;
      throw;
    }
    *out = handle;
  });
}

int kvscope_capture_set_tokens(kvscope_capture* c, const uint8_t* modality, const int32_t* position,
                               const int32_t* token_id, const int32_t* segment, const int32_t* grid_row,
                               const int32_t* grid_col, const char* const* text) {
  const char* where = "kvscope_capture_set_tokens";
  if (!c) return null_handle(where);
  return guarded(where, [&] {
    c->session->set_tokens(modality, position, token_id, segment, grid_row, grid_col, text);
  });
}

int kvscope_capture_prefill_layer(kvscope_capture* c, int32_t layer, const kvscope_tensor* q,
                                  const kvscope_tensor* k, const kvscope_tensor* v) {
  const char* where = "kvscope_capture_prefill_layer";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->prefill_layer(layer, q, k, v); });
}

int kvscope_capture_layer_aggregates(kvscope_capture* c, int32_t layer, const float* attn_colsum,
                                     const float* attn_window, int32_t window) {
  const char* where = "kvscope_capture_layer_aggregates";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->layer_aggregates(layer, attn_colsum, attn_window, window); });
}

int kvscope_capture_decode_layer(kvscope_capture* c, int32_t layer, int32_t step, const kvscope_tensor* q,
                                 const kvscope_tensor* k, const kvscope_tensor* v) {
  const char* where = "kvscope_capture_decode_layer";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->decode_layer(layer, step, q, k, v); });
}

int kvscope_capture_decode_token(kvscope_capture* c, int32_t step, int32_t token_id, int32_t position,
                                 const char* text) {
  const char* where = "kvscope_capture_decode_token";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->decode_token(step, token_id, position, text); });
}

int kvscope_capture_set_token_roles(kvscope_capture* c, const uint8_t* roles) {
  const char* where = "kvscope_capture_set_token_roles";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->set_token_roles(roles); });
}

int kvscope_capture_set_decode_roles(kvscope_capture* c, const uint8_t* roles, int64_t num_steps) {
  const char* where = "kvscope_capture_set_decode_roles";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->set_decode_roles(roles, num_steps); });
}

int kvscope_capture_range_push(kvscope_capture* c, const char* name) {
  const char* where = "kvscope_capture_range_push";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->range_push(name); });
}

int kvscope_capture_range_pop(kvscope_capture* c) {
  const char* where = "kvscope_capture_range_pop";
  if (!c) return null_handle(where);
  return guarded(where, [&] { c->session->range_pop(); });
}

int kvscope_capture_close(kvscope_capture* c) {
  const char* where = "kvscope_capture_close";
  if (!c) return null_handle(where);
  const int status = guarded(where, [&] { c->session->close(); });
  delete c->session;  // on failure the destructor stops the writer and leaves the trace incomplete
  delete c;
  return status;
}

void kvscope_capture_abort(kvscope_capture* c) {
  if (!c) return;
  c->session->abort();
  delete c->session;
  delete c;
}

int kvscope_capture_get_stats(const kvscope_capture* c, kvscope_capture_stats* out) {
  const char* where = "kvscope_capture_get_stats";
  if (!c) return null_handle(where);
  if (!out) return set_error(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": out is NULL");
  if (out->struct_size < offsetof(kvscope_capture_stats, queue_bytes_peak)) {
    return set_error(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": out->struct_size is " +
                                               std::to_string(out->struct_size) +
                                               "; set it to sizeof(kvscope_capture_stats)");
  }
  return guarded(where, [&] { c->session->stats(out); });
}

}  // extern "C"
