// Compute backend of the simulator: the kernel families the replay engine calls
// (attention statistics, evaluation, quantization, selection) behind one small
// interface, so that the same engine runs them on the CPU or on a CUDA device.
// Every call takes and returns host memory; the CUDA backend copies in, runs the
// cuda:: kernel on its stream, and copies out. The math is the kernels' own:
// both backends call the same kernel family with the same parameter structs.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

#include "kvscope/kernels/attention_stats.hpp"
#include "kvscope/kernels/evaluate.hpp"
#include "kvscope/kernels/quantize.hpp"
#include "kvscope/kernels/select.hpp"

namespace kvscope::sim {

// A backend that cannot be used here (no CUDA in this build, no device).
class BackendError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class BackendKind { kAuto, kCpu, kCuda };

// "cpu", "cuda", "auto"; throws BackendError listing the valid names.
BackendKind parse_backend(const std::string& name);
const char* backend_name(BackendKind kind);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  virtual std::string description() const = 0;  // e.g. "cpu" or "cuda: NVIDIA H200 (sm_90, ...)"

  // Attention statistics (kvscope/kernels/attention_stats.hpp); a.q, a.k, positions: host.
  virtual kernels::Status accumulated_attention(const kernels::AttentionProblem& a, kernels::QueryRange range,
                                                float* out) = 0;
  virtual kernels::Status snapkv_scores(const kernels::AttentionProblem& a, const kernels::SnapKVParams& p,
                                        float* out) = 0;
  virtual kernels::Status tova_scores(const kernels::AttentionProblem& a, float* out) = 0;
  virtual kernels::Status cross_modal_interaction(const kernels::AttentionProblem& a, const std::uint8_t* k_modality,
                                                  const std::uint8_t* q_modality, float* received,
                                                  float* given) = 0;
  // Evaluation (kvscope/kernels/evaluate.hpp); every pointer, including those inside
  // `full`, `cache` and `out`, is host memory.
  virtual kernels::Status full_attention(const kernels::EvaluateParams& p, const void* q, const void* k,
                                         const void* v, const std::uint8_t* modality,
                                         const kernels::FullAttention& full) = 0;
  virtual kernels::Status evaluate_attention(const kernels::EvaluateParams& p, const void* q,
                                             const std::uint8_t* modality, const kernels::FullAttention& full,
                                             const kernels::CompressedCache& cache,
                                             const kernels::EvaluateOutputs& out) = 0;
  // Fake quantization (kvscope/kernels/quantize.hpp).
  virtual kernels::Status quantize_dequantize(const kernels::QuantSpec& spec, const kernels::QuantShape& shape,
                                              const void* x, float* out) = 0;
  // Selection (kvscope/kernels/select.hpp); params.modality / protected_mask are host arrays.
  virtual kernels::Status select_topk(const float* scores, int num_heads, int num_tokens,
                                      const kernels::SelectParams& p, std::int32_t* out_indices,
                                      std::int32_t* out_counts) = 0;
  virtual kernels::Status select_topk_shared(const float* scores, int num_heads, int num_tokens,
                                             const kernels::SelectParams& p, std::int32_t* out_indices,
                                             std::int32_t* out_count) = 0;
};

// The CPU backend (kernels::cpu), shared and thread-safe.
Backend& cpu_backend();
// True when this build contains the CUDA backend (KVSCOPE_HAVE_CUDA).
bool cuda_backend_built();
// A CUDA backend on device 0. Throws BackendError when the build has no CUDA backend
// or no CUDA device is present (the message says which).
std::unique_ptr<Backend> make_cuda_backend();

// Resolves a requested kind: kCpu -> the CPU backend; kCuda -> CUDA or BackendError;
// kAuto -> the CPU backend: the CUDA backend copies each call's inputs to the device and
// evaluates one decode step of one kv head per call, which on an H200 made a sweep slower
// than the CPU's batched evaluation (docs/perf.md, "kvsim on a GPU"); it runs only when asked.
// `owned` keeps a CUDA backend alive; the returned reference is valid while it lives.
Backend& select_backend(BackendKind kind, std::unique_ptr<Backend>& owned);

}  // namespace kvscope::sim
