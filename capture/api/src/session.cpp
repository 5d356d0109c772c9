// Model-thread side of a capture: checks every argument against the geometry and the
// order of calls, then stages the tensors into the bounded queue.
#include "session.hpp"

#include <cmath>
#include <cstring>
#include <utility>

namespace kvscope::capture::detail {

namespace {

std::string layer_name(int layer) {
  std::string s = std::to_string(layer);
  return std::string(s.size() < 3 ? 3 - s.size() : 0, '0') + s;
}

}  // namespace

Session::Session(const std::string& path, const kvscope_capture_config& c, std::int64_t context_tokens)
    : dtype_(to_dtype(raw_enum(c.dtype))),
      T_(context_tokens),
      max_decode_steps_(c.max_decode_steps == 0 ? kDefaultMaxDecodeSteps : c.max_decode_steps),
      cuda_stream_(c.cuda_stream),
      profiler_(c.profile == 1),
      queue_(c.queue_bytes == 0 ? kDefaultQueueBytes : c.queue_bytes) {
  const char* where = "kvscope_capture_open";
  auto bad = [&](const std::string& what) { fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": " + what); };
  if (c.num_layers <= 0) bad("config.num_layers must be > 0 (got " + std::to_string(c.num_layers) + ")");
  if (c.num_q_heads <= 0) bad("config.num_q_heads must be > 0 (got " + std::to_string(c.num_q_heads) + ")");
  if (c.num_kv_heads <= 0)
    bad("config.num_kv_heads must be > 0 (got " + std::to_string(c.num_kv_heads) + ")");
  if (c.num_q_heads % c.num_kv_heads != 0) {
    bad("config.num_q_heads (" + std::to_string(c.num_q_heads) +
        ") must be a multiple of config.num_kv_heads (" + std::to_string(c.num_kv_heads) + ")");
  }
  if (c.head_dim <= 0) bad("config.head_dim must be > 0 (got " + std::to_string(c.head_dim) + ")");
  // The trace format's limits and rope_theta rule (docs/trace-format.md): a capture the reader would
  // refuse is refused when it is opened.
  if (c.num_layers > trace::limits::kMaxLayers || c.num_q_heads > trace::limits::kMaxHeads ||
      c.head_dim > trace::limits::kMaxHeadDim) {
    bad("config geometry over the trace format's limits (num_layers <= 1024, num_q_heads <= 1024, head_dim "
        "<= 4096)");
  }
  if (!(std::isfinite(c.rope_theta) && c.rope_theta > 0)) {
    bad("config.rope_theta must be a finite number > 0 (the model's RoPE base, e.g. 10000; got " +
        std::to_string(c.rope_theta) + ")");
  }
  if (!valid_dtype(raw_enum(c.dtype)))
    bad("config.dtype " + std::to_string(raw_enum(c.dtype)) +
        " is not KVSCOPE_F32, KVSCOPE_F16 or KVSCOPE_BF16");
  if (c.max_decode_steps < 0) bad("config.max_decode_steps must be >= 0");
  if (c.chunk_tokens < 0) bad("config.chunk_tokens must be >= 0");
  if (c.deflate_level < 0 || c.deflate_level > 9) bad("config.deflate_level must be in 0..9");
  if (c.profile != 0 && c.profile != 1) bad("config.profile must be 0 or 1");
  if (c.aggregate_window < 0) bad("config.aggregate_window must be >= 0 (0 = no aggregates)");
  aggregate_window_ = c.aggregate_window;
  if (context_tokens <= 0) bad("context_tokens must be > 0 (got " + std::to_string(context_tokens) + ")");

  geometry_.num_layers = c.num_layers;
  geometry_.num_q_heads = c.num_q_heads;
  geometry_.num_kv_heads = c.num_kv_heads;
  geometry_.head_dim = c.head_dim;
  geometry_.rope_theta = c.rope_theta;
  geometry_.model_name = c.model_name ? c.model_name : "";
  trace::TraceHeader header;
  header.geometry = geometry_;
  header.dtype = dtype_;
  header.creator = c.creator ? c.creator : std::string("kvscope-capture ") + KVSCOPE_CAPTURE_VERSION;
  header.device = c.device ? c.device : detect_device_name();
  trace::WriterOptions options;
  options.chunk_tokens = c.chunk_tokens == 0 ? kDefaultChunkTokens : c.chunk_tokens;
  options.deflate_level = c.deflate_level;
  try {
    writer_ = std::make_unique<trace::TraceWriter>(path, header, static_cast<std::size_t>(T_), 0, options);
  } catch (const trace::TraceError& e) {
    fail(e.kind() == trace::ErrorKind::kIo ? KVSCOPE_ERR_IO : KVSCOPE_ERR_ARGUMENT,
         std::string(where) + ": " + e.what());
  }
  const auto L = static_cast<std::size_t>(c.num_layers);
  prefill_recorded_.assign(L, false);
  aggregates_recorded_.assign(L, false);
  decode_steps_.assign(L, 0);
  decode_store_.resize(L);
  (void)profiler_.start_kernels();  // no kernel records without CUPTI or a GPU: ranges only
  thread_ = std::thread([this] { writer_main(); });
  running_ = true;
}

Session::~Session() { abort(); }

void Session::check_writer(const char* where) const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (writer_error_) {
    fail(writer_error_->status(),
         std::string(where) + ": the writer thread failed earlier: " + writer_error_->what());
  }
}

void Session::check_layer(const char* where, std::int32_t layer) const {
  if (layer < 0 || layer >= geometry_.num_layers) {
    fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": layer " + std::to_string(layer) +
                                   " out of range [0, " + std::to_string(geometry_.num_layers) + ")");
  }
}

void Session::set_tokens(const std::uint8_t* modality, const std::int32_t* position,
                         const std::int32_t* token_id, const std::int32_t* segment,
                         const std::int32_t* grid_row, const std::int32_t* grid_col,
                         const char* const* text) {
  const char* where = "kvscope_capture_set_tokens";
  check_writer(where);
  const std::pair<const void*, const char*> required[] = {{modality, "modality"}, {position, "position"},
                                                          {token_id, "token_id"}, {segment, "segment"},
                                                          {grid_row, "grid_row"}, {grid_col, "grid_col"}};
  for (const auto& [p, name] : required) {
    if (p == nullptr) fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": " + name + " is NULL");
  }
  if (tokens_set_) fail(KVSCOPE_ERR_STATE, std::string(where) + ": tokens were already set");
  const auto T = static_cast<std::size_t>(T_);
  Job job;
  job.kind = JobKind::kTokens;
  trace::Tokens& t = job.tokens;
  for (std::size_t i = 0; i < T; ++i) {
    if (modality[i] >= kernels::kNumModalities) {
      fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": modality[" + std::to_string(i) + "] = " +
                                     std::to_string(modality[i]) + " is not a kvscope_modality code (0..3)");
    }
    if (text && text[i] == nullptr) {
      fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": text[" + std::to_string(i) + "] is NULL");
    }
  }
  t.modality.assign(modality, modality + T);
  t.position.assign(position, position + T);
  t.token_id.assign(token_id, token_id + T);
  t.segment.assign(segment, segment + T);
  t.grid_row.assign(grid_row, grid_row + T);
  t.grid_col.assign(grid_col, grid_col + T);
  job.bytes = T * (1 + 5 * sizeof(std::int32_t));
  if (text) {
    t.text.assign(text, text + T);
    for (const auto& s : t.text) job.bytes += s.size();
  }
  queue_.reserve(job.bytes);
  queue_.push(std::move(job));
  tokens_set_ = true;
}

void Session::enqueue_tensors(JobKind kind, int layer, int step, const TensorLayout (&t)[3]) {
  Job job;
  job.kind = kind;
  job.layer = layer;
  job.step = step;
  bool device = false;
  for (int i = 0; i < 3; ++i) {
    job.tensors[i].dtype = t[i].dtype;
    for (int d = 0; d < 3; ++d) job.tensors[i].shape[d] = static_cast<std::size_t>(t[i].shape[d]);
    job.tensors[i].offset = job.bytes;
    job.bytes += t[i].bytes();
    device |= t[i].memory == KVSCOPE_DEVICE;
  }
  if (device && !stager_) stager_ = std::make_unique<DeviceStager>(cuda_stream_, queue_.bound());
  const std::string name =
      std::string(kind == JobKind::kPrefill ? "capture/prefill layer " : "capture/decode layer ") +
      layer_name(layer) + (kind == JobKind::kDecode ? " step " + std::to_string(step) : "");
  Profiler::Scope range(profiler_, name, profiler_.depth());
  queue_.reserve(job.bytes);  // back-pressure: waits while the writer is behind
  try {
    std::byte* dst = nullptr;
    if (device) {
      job.pinned = stager_->acquire(job.bytes);
      dst = job.pinned.data;
      stager_->begin_job();
    } else {
      job.host.resize(job.bytes);
      dst = job.host.data();
    }
    for (int i = 0; i < 3; ++i) {
      if (t[i].memory == KVSCOPE_DEVICE)
        stager_->copy_to_host(t[i], dst + job.tensors[i].offset);
      else
        gather_host(t[i], dst + job.tensors[i].offset);
    }
    if (device) job.ready_event = stager_->end_job();
  } catch (...) {
    if (stager_ && job.pinned.data) {
      void* done = nullptr;
      try {  // copies already enqueued into the buffer must end before it is reused
        done = stager_->end_job();
        stager_->wait(done);
      } catch (const Failure&) {
      }
      stager_->release(job.pinned, done);
    }
    queue_.unreserve(job.bytes);
    throw;
  }
  queue_.push(std::move(job));
}

void Session::prefill_layer(std::int32_t layer, const kvscope_tensor* q, const kvscope_tensor* k,
                            const kvscope_tensor* v) {
  const char* where = "kvscope_capture_prefill_layer";
  check_writer(where);
  check_layer(where, layer);
  const std::int64_t Hq = geometry_.num_q_heads, Hkv = geometry_.num_kv_heads, D = geometry_.head_dim;
  const TensorLayout t[3] = {check_tensor(where, "q", q, {Hq, T_, D}, "[Hq, T, D]"),
                             check_tensor(where, "k", k, {Hkv, T_, D}, "[Hkv, T, D]"),
                             check_tensor(where, "v", v, {Hkv, T_, D}, "[Hkv, T, D]")};
  if (prefill_recorded_[static_cast<std::size_t>(layer)]) {
    fail(KVSCOPE_ERR_STATE,
         std::string(where) + ": layer " + std::to_string(layer) + " was already recorded");
  }
  if (aggregate_window_ > 0 && !tokens_set_) {
    fail(KVSCOPE_ERR_STATE, std::string(where) +
                                ": config.aggregate_window needs kvscope_capture_set_tokens before the first "
                                "prefill layer (the aggregates read positions and modalities)");
  }
  enqueue_tensors(JobKind::kPrefill, layer, -1, t);
  prefill_recorded_[static_cast<std::size_t>(layer)] = true;
}

void Session::layer_aggregates(std::int32_t layer, const float* attn_colsum, const float* attn_window,
                               std::int32_t window) {
  const char* where = "kvscope_capture_layer_aggregates";
  check_writer(where);
  check_layer(where, layer);
  if (!attn_colsum && !attn_window) {
    fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": attn_colsum and attn_window are both NULL");
  }
  if (attn_window && window <= 0) {
    fail(KVSCOPE_ERR_ARGUMENT,
         std::string(where) + ": window must be > 0 with attn_window (got " + std::to_string(window) + ")");
  }
  if (aggregates_recorded_[static_cast<std::size_t>(layer)]) {
    fail(KVSCOPE_ERR_STATE,
         std::string(where) + ": aggregates of layer " + std::to_string(layer) + " were already recorded");
  }
  const auto n = static_cast<std::size_t>(geometry_.num_q_heads) * static_cast<std::size_t>(T_);
  Job job;
  job.kind = JobKind::kAggregates;
  job.layer = layer;
  if (attn_colsum) job.aggregates.attn_colsum.assign(attn_colsum, attn_colsum + n);
  if (attn_window) {
    job.aggregates.window = window;
    job.aggregates.attn_window.assign(attn_window, attn_window + n * static_cast<std::size_t>(window));
  }
  job.bytes = (job.aggregates.attn_colsum.size() + job.aggregates.attn_window.size()) * sizeof(float);
  queue_.reserve(job.bytes);
  queue_.push(std::move(job));
  aggregates_recorded_[static_cast<std::size_t>(layer)] = true;
}

void Session::decode_layer(std::int32_t layer, std::int32_t step, const kvscope_tensor* q,
                           const kvscope_tensor* k, const kvscope_tensor* v) {
  const char* where = "kvscope_capture_decode_layer";
  check_writer(where);
  check_layer(where, layer);
  if (step < 0 || step >= max_decode_steps_) {
    fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": step " + std::to_string(step) + " out of range [0, " +
                                   std::to_string(max_decode_steps_) + ") (config.max_decode_steps)");
  }
  const std::int64_t Hq = geometry_.num_q_heads, Hkv = geometry_.num_kv_heads, D = geometry_.head_dim;
  const TensorLayout t[3] = {check_tensor(where, "q", q, {Hq, 1, D}, "[Hq, 1, D]"),
                             check_tensor(where, "k", k, {Hkv, 1, D}, "[Hkv, 1, D]"),
                             check_tensor(where, "v", v, {Hkv, 1, D}, "[Hkv, 1, D]")};
  int& next = decode_steps_[static_cast<std::size_t>(layer)];
  if (step != next) {
    fail(KVSCOPE_ERR_STATE, std::string(where) + ": decode step " + std::to_string(step) + " of layer " +
                                std::to_string(layer) + " out of order: expected step " +
                                std::to_string(next));
  }
  enqueue_tensors(JobKind::kDecode, layer, step, t);
  ++next;
}

void Session::decode_token(std::int32_t step, std::int32_t token_id, std::int32_t position,
                           const char* text) {
  const char* where = "kvscope_capture_decode_token";
  check_writer(where);
  if (step < 0 || step >= max_decode_steps_) {
    fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": step " + std::to_string(step) + " out of range [0, " +
                                   std::to_string(max_decode_steps_) + ") (config.max_decode_steps)");
  }
  if (static_cast<std::size_t>(step) != decode_token_id_.size()) {
    fail(KVSCOPE_ERR_STATE, std::string(where) + ": decode token of step " + std::to_string(step) +
                                " out of order: expected step " + std::to_string(decode_token_id_.size()));
  }
  decode_token_id_.push_back(token_id);
  decode_position_.push_back(position);
  decode_text_.emplace_back(text ? text : "");
  decode_has_text_ |= text != nullptr;
}

namespace {
void check_role_codes(const char* where, const std::uint8_t* roles, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (roles[i] >= trace::kNumRoles) {
      fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": roles[" + std::to_string(i) + "] = " +
                                     std::to_string(roles[i]) + " is not a kvscope_role code (0..3)");
    }
  }
}
}  // namespace

void Session::set_token_roles(const std::uint8_t* roles) {
  const char* where = "kvscope_capture_set_token_roles";
  check_writer(where);
  if (!roles) fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": roles is NULL");
  if (token_roles_set_) fail(KVSCOPE_ERR_STATE, std::string(where) + ": token roles were already set");
  const auto T = static_cast<std::size_t>(T_);
  check_role_codes(where, roles, T);
  token_roles_.assign(roles, roles + T);
  token_roles_set_ = true;
}

void Session::set_decode_roles(const std::uint8_t* roles, std::int64_t num_steps) {
  const char* where = "kvscope_capture_set_decode_roles";
  check_writer(where);
  if (num_steps < 0 || num_steps > max_decode_steps_) {
    fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": num_steps " + std::to_string(num_steps) +
                                   " out of range [0, " + std::to_string(max_decode_steps_) +
                                   "] (config.max_decode_steps)");
  }
  if (!roles && num_steps > 0) fail(KVSCOPE_ERR_ARGUMENT, std::string(where) + ": roles is NULL");
  if (decode_roles_set_) fail(KVSCOPE_ERR_STATE, std::string(where) + ": decode roles were already set");
  const auto n = static_cast<std::size_t>(num_steps);
  check_role_codes(where, roles, n);
  decode_roles_.assign(roles, roles + n);
  decode_roles_set_ = true;
}

void Session::range_push(const char* name) {
  check_writer("kvscope_capture_range_push");
  if (!name) fail(KVSCOPE_ERR_ARGUMENT, "kvscope_capture_range_push: name is NULL");
  profiler_.push(name);
}

void Session::range_pop() {
  check_writer("kvscope_capture_range_pop");
  profiler_.pop();
}

void Session::stats(kvscope_capture_stats* out) const {
  kvscope_capture_stats s{};
  s.struct_size = out->struct_size;
  s.queue_bytes_bound = queue_.bound();
  s.queue_bytes_peak = queue_.peak_bytes();
  s.queue_waits = queue_.waits();
  s.tensors_written = tensors_written_.load();
  s.layers_written = layers_written_.load();
  s.pinned_bytes_peak = stager_ ? stager_->pinned_peak() : 0;
  std::memcpy(out, &s, std::min<std::size_t>(out->struct_size, sizeof s));
}

}  // namespace kvscope::capture::detail
