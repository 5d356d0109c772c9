// CUDA backend: every call copies its host inputs to device memory, runs the
// kernels::cuda:: launcher of the same family on a per-thread stream, and copies
// the outputs back (synchronous). Device buffers come from the stream-ordered pool
// (cudaMallocAsync), so a call's allocations neither synchronise the device nor go
// back to the driver. Compiled only when the build has CUDA.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kvscope/kernels/attention_stats_cuda.hpp"
#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/device.hpp"
#include "kvscope/kernels/evaluate_cuda.hpp"
#include "kvscope/kernels/quantize_cuda.hpp"
#include "kvscope/kernels/select_cuda.hpp"
#include "kvscope/sim/backend.hpp"

namespace kvscope::sim {

namespace {

using kernels::Status;

// Device buffers of one call, freed when the call returns.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (void* p : ptrs_) pooled() ? cudaFreeAsync(p, stream()) : cudaFree(p);
  }
  // Device copy of `bytes` host bytes (nullptr stays nullptr).
  template <typename T>
  T* in(const T* host, std::size_t count) {
    if (host == nullptr) return nullptr;
    T* d = alloc<T>(count);
    if (d && count) status_ = merge(cudaMemcpyAsync(d, host, count * sizeof(T), cudaMemcpyHostToDevice, stream()));
    return d;
  }
  const void* in_bytes(const void* host, std::size_t bytes) {
    return in(static_cast<const unsigned char*>(host), bytes);
  }
  template <typename T>
  T* out(T* host, std::size_t count) {
    if (host == nullptr) return nullptr;
    T* d = alloc<T>(count);
    if (d) outs_.push_back({host, d, count * sizeof(T)});
    return d;
  }
  // Runs after the launcher: copies every output back and synchronises.
  Status finish(const Status& launched) {
    if (!launched.ok()) return launched;
    for (const auto& o : outs_) {
      status_ = merge(cudaMemcpyAsync(o.host, o.dev, o.bytes, cudaMemcpyDeviceToHost, stream()));
    }
    status_ = merge(cudaStreamSynchronize(stream()));
    return status_;
  }
  Status status() const { return status_; }
  static cudaStream_t stream() { return cudaStreamPerThread; }

 private:
  template <typename T>
  T* alloc(std::size_t count) {
    void* p = nullptr;
    const std::size_t bytes = count ? count * sizeof(T) : 1;
    const cudaError_t e = pooled() ? cudaMallocAsync(&p, bytes, stream()) : cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      status_ = merge(e);
      return nullptr;
    }
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }
  // Whether the device has stream-ordered memory pools (asked once; cudaMalloc otherwise).
  // The default pool keeps freed memory (release threshold: no limit) instead of handing
  // it back to the driver at every synchronisation.
  static bool pooled() {
    static const bool yes = [] {
      int device = 0, supported = 0;
      cudaMemPool_t pool = nullptr;
      std::uint64_t keep = ~std::uint64_t{0};
      return cudaGetDevice(&device) == cudaSuccess &&
             cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess &&
             supported != 0 && cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
             cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) == cudaSuccess;
    }();
    return yes;
  }
  Status merge(cudaError_t e) {
    if (!status_.ok()) return status_;
    return kernels::cuda::cuda_status(e, "kvsim cuda backend");
  }
  struct Out {
    void* host;
    void* dev;
    std::size_t bytes;
  };
  std::vector<void*> ptrs_;
  std::vector<Out> outs_;
  Status status_ = Status::Ok();
};

std::size_t n(long long a) { return a > 0 ? static_cast<std::size_t>(a) : 0; }

// Device copy of an attention problem's inputs.
kernels::AttentionProblem to_device(const kernels::AttentionProblem& a, Arena& ar) {
  kernels::AttentionProblem d = a;
  const std::size_t e = kernels::dtype_bytes(a.dtype);
  d.q = ar.in_bytes(a.q, n(1ll * a.num_q_heads * a.q_len * a.head_dim) * e);
  d.k = ar.in_bytes(a.k, n(1ll * a.num_kv_heads * a.k_len * a.head_dim) * e);
  d.q_pos = ar.in(a.q_pos, n(a.q_len));
  d.k_pos = ar.in(a.k_pos, n(a.k_len));
  return d;
}

class CudaBackend final : public Backend {
 public:
  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string description() const override { return "cuda: " + kernels::cuda_device_description(); }

  Status accumulated_attention(const kernels::AttentionProblem& a, kernels::QueryRange r, float* out) override {
    Arena ar;
    const auto d = to_device(a, ar);
    float* o = ar.out(out, n(1ll * a.num_q_heads * a.k_len));
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::accumulated_attention(d, r, o, Arena::stream()));
  }
  Status snapkv_scores(const kernels::AttentionProblem& a, const kernels::SnapKVParams& p, float* out) override {
    Arena ar;
    const auto d = to_device(a, ar);
    float* o = ar.out(out, n(1ll * a.num_q_heads * a.k_len));
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::snapkv_scores(d, p, o, Arena::stream()));
  }
  Status tova_scores(const kernels::AttentionProblem& a, float* out) override {
    Arena ar;
    const auto d = to_device(a, ar);
    float* o = ar.out(out, n(1ll * a.num_q_heads * a.k_len));
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::tova_scores(d, o, Arena::stream()));
  }
  Status cross_modal_interaction(const kernels::AttentionProblem& a, const std::uint8_t* km, const std::uint8_t* qm,
                                 float* received, float* given) override {
    Arena ar;
    const auto d = to_device(a, ar);
    const std::uint8_t* dkm = ar.in(km, n(a.k_len));
    const std::uint8_t* dqm = ar.in(qm, n(a.q_len));
    float* rec = ar.out(received, n(1ll * a.num_q_heads * a.k_len));
    float* giv = ar.out(given, n(1ll * a.num_q_heads * a.k_len));
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::cross_modal_interaction(d, dkm, dqm, rec, giv, Arena::stream()));
  }
  Status full_attention(const kernels::EvaluateParams& p, const void* q, const void* k, const void* v,
                        const std::uint8_t* modality, const kernels::FullAttention& full) override {
    Arena ar;
    const std::size_t e = kernels::dtype_bytes(p.dtype);
    const std::size_t rows = n(1ll * p.num_q_heads * p.num_queries);
    const std::size_t kv = n(1ll * p.num_kv_heads * p.num_tokens * p.head_dim) * e;
    const void* dq = ar.in_bytes(q, rows * n(p.head_dim) * e);
    const void* dk = ar.in_bytes(k, kv);
    const void* dv = ar.in_bytes(v, kv);
    const std::uint8_t* dm = ar.in(modality, n(p.num_tokens));
    kernels::FullAttention df{ar.out(full.probs, rows * n(p.num_tokens)), ar.out(full.output, rows * n(p.head_dim)),
                              ar.out(full.entropy, rows), ar.out(full.modality_mass, rows * 4)};
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::full_attention(p, dq, dk, dv, dm, df, Arena::stream()));
  }
  Status evaluate_attention(const kernels::EvaluateParams& p, const void* q, const std::uint8_t* modality,
                            const kernels::FullAttention& full, const kernels::CompressedCache& c,
                            const kernels::EvaluateOutputs& out) override {
    if (c.slot_offsets == nullptr || c.token_to_slot == nullptr) {
      return Status::Invalid("evaluate_attention: slot_offsets and token_to_slot are required");
    }
    Arena ar;
    const std::size_t e = kernels::dtype_bytes(p.dtype);
    const std::size_t rows = n(1ll * p.num_q_heads * p.num_queries), T = n(p.num_tokens), D = n(p.head_dim);
    const std::size_t slots = n(c.slot_offsets[p.num_kv_heads]);
    const void* dq = ar.in_bytes(q, rows * D * e);
    const std::uint8_t* dm = ar.in(modality, T);
    kernels::FullAttention df{const_cast<float*>(ar.in(full.probs, rows * T)),
                              const_cast<float*>(ar.in(full.output, rows * D)),
                              const_cast<float*>(ar.in(full.entropy, rows)),
                              const_cast<float*>(ar.in(full.modality_mass, rows * 4))};
    kernels::CompressedCache dc;
    dc.k = ar.in(c.k, slots * D);
    dc.v = ar.in(c.v, slots * D);
    dc.slot_offsets = ar.in(c.slot_offsets, n(p.num_kv_heads) + 1);
    dc.multiplicity_f32 = ar.in(c.multiplicity_f32, slots);
    dc.multiplicity_i32 = ar.in(c.multiplicity_i32, slots);
    dc.slot_modality = ar.in(c.slot_modality, slots);
    dc.token_to_slot = ar.in(c.token_to_slot, n(p.num_kv_heads) * T);
    kernels::EvaluateOutputs dout{ar.out(out.output_error, rows),   ar.out(out.recall, rows),
                                  ar.out(out.kl, rows),             ar.out(out.entropy_change, rows),
                                  ar.out(out.recall_modality, rows * 4), ar.out(out.mass_full, rows * 4),
                                  ar.out(out.mass_compressed, rows * 4)};
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::evaluate_attention(p, dq, dm, df, dc, dout, Arena::stream()));
  }
  Status quantize_dequantize(const kernels::QuantSpec& spec, const kernels::QuantShape& s, const void* x,
                             float* out) override {
    Arena ar;
    const std::size_t count = n(1ll * s.num_heads * s.tokens * s.head_dim);
    const void* dx = ar.in_bytes(x, count * kernels::dtype_bytes(s.dtype));
    float* dout = ar.out(out, count);
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::quantize_dequantize(spec, s, dx, dout, Arena::stream()));
  }
  Status select_topk(const float* scores, int heads, int tokens, const kernels::SelectParams& p, std::int32_t* idx,
                     std::int32_t* counts) override {
    Arena ar;
    kernels::SelectParams dp = p;
    const float* ds = ar.in(scores, n(1ll * heads * tokens));
    dp.modality = ar.in(p.modality, n(tokens));
    dp.protected_mask = ar.in(p.protected_mask, n(tokens));
    std::int32_t* di = ar.out(idx, n(1ll * heads * p.k));
    std::int32_t* dc = ar.out(counts, n(heads));
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::select_topk(ds, heads, tokens, dp, di, dc, Arena::stream()));
  }
  Status select_topk_shared(const float* scores, int heads, int tokens, const kernels::SelectParams& p,
                            std::int32_t* idx, std::int32_t* count) override {
    Arena ar;
    kernels::SelectParams dp = p;
    const float* ds = ar.in(scores, n(1ll * heads * tokens));
    dp.modality = ar.in(p.modality, n(tokens));
    dp.protected_mask = ar.in(p.protected_mask, n(tokens));
    std::int32_t* di = ar.out(idx, n(p.k));
    std::int32_t* dc = ar.out(count, 1);
    if (!ar.status().ok()) return ar.status();
    return ar.finish(kernels::cuda::select_topk_shared(ds, heads, tokens, dp, di, dc, Arena::stream()));
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  if (kernels::cuda_device_count() == 0) {
    throw BackendError("--backend cuda: " + kernels::cuda_device_description() +
                       " on this machine; use --backend cpu or auto");
  }
  return std::make_unique<CudaBackend>();
}

}  // namespace kvscope::sim
