/* kvscope capture library: the C API (stable ABI).
 *
 * Records a model run into a kvscope trace (docs/trace-format.md): the context tokens, per layer the
 * prefill Q, K (after RoPE) and V, per decode step the query and the appended K/V, optional attention
 * aggregates, and a profile of the run (NVTX / steady-clock ranges, CUPTI kernels and memcpys on a GPU).
 *
 * Tensors may live in host memory or in CUDA device memory, as float32, float16 or bfloat16. Device
 * tensors are copied asynchronously on a side stream (ordered after the model's stream) into pinned
 * buffers; a writer thread converts and writes them through the trace library. The queue of tensors in
 * flight is bounded by bytes: when it is full the recording call waits (back-pressure) — no tensor is
 * ever dropped and memory never grows without bound.
 *
 * A trace is marked incomplete (root attribute complete = 0) when it is opened and complete only by a
 * successful kvscope_capture_close(); a crashed or aborted run leaves a file that `kvcap validate`
 * reports as incomplete, with what it contains.
 *
 * Every function returns KVSCOPE_OK or an error code; kvscope_capture_last_error() gives a one-line
 * message naming the problem (thread-local, valid until the next call on the same thread). Functions
 * never abort the process and never throw across the C boundary.
 *
 * Thread safety: one capture handle is used by one thread at a time (the model's thread); the writer
 * thread is internal.
 */
#ifndef KVSCOPE_CAPTURE_H_
#define KVSCOPE_CAPTURE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVSCOPE_CAPTURE_ABI_VERSION 1

#if defined(_WIN32)
#define KVSCOPE_CAPTURE_API __declspec(dllexport)
#else
#define KVSCOPE_CAPTURE_API __attribute__((visibility("default")))
#endif

typedef enum kvscope_status {
  KVSCOPE_OK = 0,
  KVSCOPE_ERR_ARGUMENT = 1, /* bad argument: null pointer, wrong shape, out-of-range layer or step */
  KVSCOPE_ERR_STATE = 2,    /* call out of order (e.g. a layer recorded twice, tokens not set) */
  KVSCOPE_ERR_IO = 3,       /* HDF5 / file system error (unwritable path, disk full) */
  KVSCOPE_ERR_CUDA = 4,     /* CUDA error, or a device pointer given to a build/machine without CUDA */
  KVSCOPE_ERR_INTERNAL = 5  /* anything else; the message says what */
} kvscope_status;

typedef enum kvscope_dtype { KVSCOPE_F32 = 0, KVSCOPE_F16 = 1, KVSCOPE_BF16 = 2 } kvscope_dtype;

typedef enum kvscope_memory { KVSCOPE_HOST = 0, KVSCOPE_DEVICE = 1 } kvscope_memory;

typedef enum kvscope_modality {
  KVSCOPE_TEXT = 0,
  KVSCOPE_VISION = 1,
  KVSCOPE_AUDIO = 2,
  KVSCOPE_SPECIAL = 3
} kvscope_modality;

/* A 3-D tensor [heads, tokens, head_dim] viewed through element strides (not bytes). A stride of 0
 * means "contiguous in this order": stride = {tokens*head_dim, head_dim, 1}. The innermost stride must
 * be 1 for device tensors (each (head, token) row is one contiguous run). */
typedef struct kvscope_tensor {
  const void* data;
  kvscope_dtype dtype;
  kvscope_memory memory;
  int64_t shape[3];  /* heads, tokens, head_dim */
  int64_t stride[3]; /* in elements; all 0 = contiguous */
} kvscope_tensor;

/* Geometry and options of a capture. Zero-initialise, set struct_size = sizeof(kvscope_capture_config),
 * then fill what you need; fields after the ones a caller knows keep their zero defaults. */
typedef struct kvscope_capture_config {
  uint32_t struct_size;
  int32_t num_layers;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  double rope_theta;      /* the model's RoPE base: finite and > 0 (kvscope_capture_open refuses others) */
  const char* model_name; /* root attribute model_name */
  const char* device;     /* root attribute device: "cpu", "NVIDIA H200", ...; NULL = detected */
  const char* creator;    /* root attribute creator; NULL = "kvscope-capture <version>" */
  kvscope_dtype dtype;    /* element type stored in the trace (inputs of other types are converted) */
  int32_t max_decode_steps; /* upper bound on decode steps (decode tensors are kept until close); 0 = 4096 */
  uint64_t queue_bytes;   /* bound on bytes of tensors in flight; 0 = 256 MiB */
  int32_t chunk_tokens;   /* HDF5 chunk length in tokens; 0 = 256 */
  int32_t deflate_level;  /* 0 = none, 1..9 gzip */
  int32_t profile;        /* 1 = record ranges (and CUPTI activity on a GPU) into /profile */
  void* cuda_stream;      /* the model's cudaStream_t: device copies are ordered after it; NULL = default */
  /* > 0: after writing each prefill layer, the writer thread computes its attention aggregates (trace
   * format 1.2 /aggregates: H2O, the window sums of the last aggregate_window queries, the last query's
   * row, cross-modal shares, key redundancy; docs/trace-format.md section 3a) on the CPU, exactly as
   * `kvcap aggregate --window N` does, and stores them; kvscope_capture_set_tokens must then come
   * before the first prefill layer. 0 = none. */
  int32_t aggregate_window;
} kvscope_capture_config;

typedef struct kvscope_capture kvscope_capture; /* opaque */

KVSCOPE_CAPTURE_API int kvscope_capture_abi_version(void);

/* One-line message of the last failed call on this thread ("" if none). */
KVSCOPE_CAPTURE_API const char* kvscope_capture_last_error(void);

/* Creates `path` (truncating it) with complete = 0 and starts the writer thread. context_tokens is T,
 * the number of prefill tokens. */
KVSCOPE_CAPTURE_API int kvscope_capture_open(const char* path, const kvscope_capture_config* config,
                                             int64_t context_tokens, kvscope_capture** out);

/* /tokens: arrays of length context_tokens. modality holds kvscope_modality codes; token_id is -1 where
 * there is none (image patches); grid_row/grid_col are -1 for non-vision tokens. text may be NULL (no
 * per-token text) or an array of context_tokens NUL-terminated strings. */
KVSCOPE_CAPTURE_API int kvscope_capture_set_tokens(kvscope_capture* c, const uint8_t* modality,
                                                   const int32_t* position, const int32_t* token_id,
                                                   const int32_t* segment, const int32_t* grid_row,
                                                   const int32_t* grid_col, const char* const* text);

/* Prefill tensors of one layer: q [Hq, T, D], k and v [Hkv, T, D] (k after RoPE, as cached). Returns once
 * the tensors are copied (host) or their copy is enqueued (device); the caller may then reuse host
 * buffers. Device buffers must stay valid until the copy has run on the side stream, which is ordered
 * after cuda_stream: reusing them on cuda_stream is safe. */
KVSCOPE_CAPTURE_API int kvscope_capture_prefill_layer(kvscope_capture* c, int32_t layer,
                                                      const kvscope_tensor* q, const kvscope_tensor* k,
                                                      const kvscope_tensor* v);

/* Optional precomputed aggregates of a prefill layer (host float32): attn_colsum [Hq, T] and
 * attn_window [Hq, window, T]; either may be NULL. */
KVSCOPE_CAPTURE_API int kvscope_capture_layer_aggregates(kvscope_capture* c, int32_t layer,
                                                         const float* attn_colsum, const float* attn_window,
                                                         int32_t window);

/* Decode step `step` (0-based, steps in order) of one layer: q [Hq, 1, D], k and v [Hkv, 1, D] of the
 * token generated and fed back at that step. */
KVSCOPE_CAPTURE_API int kvscope_capture_decode_layer(kvscope_capture* c, int32_t layer, int32_t step,
                                                     const kvscope_tensor* q, const kvscope_tensor* k,
                                                     const kvscope_tensor* v);

/* The token fed at decode step `step`: its id, position and optional text (NULL = none). */
KVSCOPE_CAPTURE_API int kvscope_capture_decode_token(kvscope_capture* c, int32_t step, int32_t token_id,
                                                     int32_t position, const char* text);

/* Token roles (trace format 1.1; kvscope_role codes: what part of the prompt a token is). Optional: a
 * trace without them reads as every context token KVSCOPE_ROLE_CONTEXT and every decode step
 * KVSCOPE_ROLE_ANSWER. Both may be called any time before kvscope_capture_close, each at most once. */
typedef enum kvscope_role {
  KVSCOPE_ROLE_CONTEXT = 0,  /* the material the question is about (document, haystack, images) */
  KVSCOPE_ROLE_QUESTION = 1, /* the question / instruction */
  KVSCOPE_ROLE_ANSWER = 2,   /* the answer: a pre-filled answer prefix and the generated tokens */
  KVSCOPE_ROLE_TEMPLATE = 3  /* chat-template markup, system prompt */
} kvscope_role;

/* Roles of the context_tokens context tokens (/tokens/role). */
KVSCOPE_CAPTURE_API int kvscope_capture_set_token_roles(kvscope_capture* c, const uint8_t* roles);

/* Roles of decode steps 0..num_steps-1 (/decode/tokens/role); at close num_steps must equal the number of
 * decode steps recorded. */
KVSCOPE_CAPTURE_API int kvscope_capture_set_decode_roles(kvscope_capture* c, const uint8_t* roles,
                                                         int64_t num_steps);

/* Named ranges (NVTX domain "kvscope" on every build with NVTX; timed with a steady clock into
 * /profile/ranges when config.profile = 1). Pushes and pops must nest. */
KVSCOPE_CAPTURE_API int kvscope_capture_range_push(kvscope_capture* c, const char* name);
KVSCOPE_CAPTURE_API int kvscope_capture_range_pop(kvscope_capture* c);

/* Waits for every queued tensor, writes /decode and /profile, marks the trace complete and frees the
 * handle (also on failure: the handle is invalid after this call). The number of decode steps in the
 * trace is the number of steps recorded (every layer must have the same). */
KVSCOPE_CAPTURE_API int kvscope_capture_close(kvscope_capture* c);

/* Writes the tensors already recorded, stops the writer and frees the handle without marking the trace
 * complete (the file is left for post-mortem inspection; delete it if it is not wanted). */
KVSCOPE_CAPTURE_API void kvscope_capture_abort(kvscope_capture* c);

/* Counters of a capture, for tests and tuning. Set struct_size = sizeof(kvscope_capture_stats). */
typedef struct kvscope_capture_stats {
  uint32_t struct_size;
  uint64_t queue_bytes_bound; /* the effective config.queue_bytes */
  uint64_t queue_bytes_peak;  /* most staged bytes in flight at once (a larger call passes alone) */
  uint64_t queue_waits;       /* recording calls that waited for the writer (back-pressure) */
  uint64_t tensors_written;   /* tensors the writer converted and wrote (or kept for /decode) */
  uint64_t layers_written;    /* prefill layers on disk */
  uint64_t pinned_bytes_peak; /* most pinned staging memory allocated at once (device tensors) */
} kvscope_capture_stats;

KVSCOPE_CAPTURE_API int kvscope_capture_get_stats(const kvscope_capture* c, kvscope_capture_stats* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSCOPE_CAPTURE_H_ */
