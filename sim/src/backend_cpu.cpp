// CPU backend (kernels::cpu) and backend selection. The CUDA backend lives in
// backend_cuda.cpp, compiled only when the build has CUDA (KVSCOPE_HAVE_CUDA).
#include "kvscope/kernels/device.hpp"
#include "kvscope/sim/backend.hpp"

namespace kvscope::sim {

namespace {

class CpuBackend final : public Backend {
 public:
  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string description() const override { return "cpu"; }
  kernels::Status accumulated_attention(const kernels::AttentionProblem& a, kernels::QueryRange r,
                                        float* out) override {
    return kernels::cpu::accumulated_attention(a, r, out);
  }
  kernels::Status snapkv_scores(const kernels::AttentionProblem& a, const kernels::SnapKVParams& p,
                                float* out) override {
    return kernels::cpu::snapkv_scores(a, p, out);
  }
  kernels::Status tova_scores(const kernels::AttentionProblem& a, float* out) override {
    return kernels::cpu::tova_scores(a, out);
  }
  kernels::Status cross_modal_interaction(const kernels::AttentionProblem& a, const std::uint8_t* km,
                                          const std::uint8_t* qm, float* received, float* given) override {
    return kernels::cpu::cross_modal_interaction(a, km, qm, received, given);
  }
  kernels::Status full_attention(const kernels::EvaluateParams& p, const void* q, const void* k, const void* v,
                                 const std::uint8_t* modality, const kernels::FullAttention& full) override {
    return kernels::cpu::full_attention(p, q, k, v, modality, full);
  }
  kernels::Status evaluate_attention(const kernels::EvaluateParams& p, const void* q, const std::uint8_t* modality,
                                     const kernels::FullAttention& full, const kernels::CompressedCache& cache,
                                     const kernels::EvaluateOutputs& out) override {
    return kernels::cpu::evaluate_attention(p, q, modality, full, cache, out);
  }
  kernels::Status quantize_dequantize(const kernels::QuantSpec& spec, const kernels::QuantShape& shape,
                                      const void* x, float* out) override {
    return kernels::cpu::quantize_dequantize(spec, shape, x, out);
  }
  kernels::Status select_topk(const float* scores, int heads, int tokens, const kernels::SelectParams& p,
                              std::int32_t* idx, std::int32_t* counts) override {
    return kernels::cpu::select_topk(scores, heads, tokens, p, idx, counts);
  }
  kernels::Status select_topk_shared(const float* scores, int heads, int tokens, const kernels::SelectParams& p,
                                     std::int32_t* idx, std::int32_t* count) override {
    return kernels::cpu::select_topk_shared(scores, heads, tokens, p, idx, count);
  }
};

}  // namespace

BackendKind parse_backend(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  throw BackendError("unknown backend '" + name + "' (valid: cpu, cuda, auto)");
}

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCpu: return "cpu";
    case BackendKind::kCuda: return "cuda";
    case BackendKind::kAuto: break;
  }
  return "auto";
}

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

bool cuda_backend_built() { return kernels::built_with_cuda(); }

#if !defined(KVSCOPE_HAVE_CUDA)
std::unique_ptr<Backend> make_cuda_backend() {
  throw BackendError("--backend cuda: this kvsim was built without CUDA (configure with nvcc available, "
                     "KVSCOPE_CUDA=ON); use --backend cpu or auto");
}
#endif

Backend& select_backend(BackendKind kind, std::unique_ptr<Backend>& owned) {
  if (kind == BackendKind::kCpu) return cpu_backend();
  if (kind == BackendKind::kCuda) {
    owned = make_cuda_backend();
    return *owned;
  }
  return cpu_backend();  // kAuto: see backend.hpp
}

}  // namespace kvscope::sim
