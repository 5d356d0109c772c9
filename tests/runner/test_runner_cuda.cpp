// The CUDA backend against the CPU backend (logits and generation); skipped without a GPU.
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/model.hpp"
#include "runner_test_util.hpp"

namespace kvscope::runner {
namespace {

TEST(CudaBackend, NoGpuIsACleanError) {
  if (cuda_backend_available(nullptr)) GTEST_SKIP() << "a GPU is present";
  try {
    (void)Model::load(testing::fixture_dir("none").string(), Device::kCuda);
    ADD_FAILURE() << "no error";
  } catch (const RunnerError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kCuda);
    EXPECT_NE(std::string(e.what()).find("--device cuda"), std::string::npos) << e.what();
  }
}

TEST(CudaBackend, MatchesCpuLogitsAndGeneration) {
  std::string why;
  if (!cuda_backend_available(&why)) GTEST_SKIP() << "CUDA backend unavailable: " << why;
  for (const auto& dir : testing::reference_model_dirs()) {
    SCOPED_TRACE(dir.string());
    Model cpu = Model::load(dir.string(), Device::kCpu);
    Model gpu = Model::load(dir.string(), Device::kCuda);
    const Prompt p =
        cpu.build_prompt({render_scene(7).image, render_scene(8).image}, "which image has more shapes ?");
    EXPECT_LT(testing::max_abs_diff(gpu.forward_logits(p), cpu.forward_logits(p)), 1e-3f);
    GenerateOptions opt;
    opt.max_new = 8;
    opt.keep_logits = true;
    const Generation a = cpu.generate(p, opt), b = gpu.generate(p, opt);
    EXPECT_EQ(a.tokens, b.tokens);
    for (std::size_t s = 0; s < std::min(a.logits.size(), b.logits.size()); ++s) {
      EXPECT_LT(testing::max_abs_diff(a.logits[s], b.logits[s]), 1e-3f) << "step " << s;
    }
  }
}

}  // namespace
}  // namespace kvscope::runner
