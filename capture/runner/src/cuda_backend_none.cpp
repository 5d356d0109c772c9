// Builds without CUDA: --device cuda is a clear error, never a crash.
#include "kvscope/runner/backend.hpp"
#include "kvscope/runner/error.hpp"

namespace kvscope::runner {

bool cuda_backend_available(std::string* why) {
  if (why) *why = "built without CUDA";
  return false;
}

std::unique_ptr<DecoderBackend> make_cuda_backend(const ModelConfig&, const ModelWeights&) {
  throw RunnerError(ErrorKind::kCuda, "--device cuda: this build has no CUDA backend (rebuild with nvcc)");
}

}  // namespace kvscope::runner
