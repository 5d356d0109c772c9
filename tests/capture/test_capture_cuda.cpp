// The device path: tensors in CUDA memory (contiguous and strided, fp32/fp16/bf16) are
// copied on the side stream after the model's stream and read back equal; pinned staging
// stays within the queue bound. Skipped without a GPU.
#include <cuda_runtime_api.h>

#include "capture_test_util.hpp"
#include "common/gpu.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/validate.hpp"

namespace kvscope::testing {
namespace {

struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(ptr); }
  void* ptr = nullptr;
};

TEST_F(CaptureTest, DeviceTensorsRoundTrip) {
  KVSCOPE_REQUIRE_GPU();
  Geometry g;
  g.L = 6;
  g.T = 33;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F32);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cfg.cuda_stream = stream;
  cfg.queue_bytes = 3 * static_cast<std::uint64_t>((g.Hq + 2 * g.Hkv) * g.T * g.D) * 2;  // ~1.5 fp32 layers
  cfg.profile = 1;
  const kvscope_dtype dtypes[3] = {KVSCOPE_F32, KVSCOPE_F16, KVSCOPE_BF16};
  std::vector<std::vector<float>> want(static_cast<std::size_t>(g.L));
  {
    capture::Capture cap(path("dev.h5"), cfg, g.T);
    cap.set_tokens(make_tokens(g.T, false));
    // One device buffer per tensor role, reused for every layer on the model stream: the
    // capture's copy must be ordered after the kernel that fills it and before the next fill.
    const std::size_t pad = 5;  // token-major padded layout [T][H*D + pad]
    for (int l = 0; l < g.L; ++l) {
      const kvscope_dtype dt = dtypes[l % 3];
      const kernels::DType kdt = static_cast<kernels::DType>(dt);
      const std::size_t eb = kernels::dtype_bytes(kdt);
      const std::size_t row = static_cast<std::size_t>(g.Hq * g.D) + pad;
      std::vector<std::byte> host(row * static_cast<std::size_t>(g.T) * eb);
      want[l].assign(static_cast<std::size_t>(g.Hq * g.T * g.D), 0.0f);
      for (int h = 0; h < g.Hq; ++h) {
        for (int t = 0; t < g.T; ++t) {
          for (int d = 0; d < g.D; ++d) {
            const float x = static_cast<float>(l * 100 + h * 10 + t) * 0.5f + static_cast<float>(d) * 0.125f;
            const std::size_t at = static_cast<std::size_t>(t) * row + h * g.D + d;
            kernels::store_element(host.data(), kdt, at, x);
            // The value as stored: bf16 has 8 significant bits, so 100.125 is 100 there.
            want[l][(static_cast<std::size_t>(h) * g.T + t) * g.D + d] =
                kernels::load_element(host.data(), kdt, at);
          }
        }
      }
      DeviceBuffer q(host.size()), kv(static_cast<std::size_t>(g.Hkv * g.T * g.D) * eb);
      ASSERT_EQ(cudaMemcpyAsync(q.ptr, host.data(), host.size(), cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(kv.ptr, 0, static_cast<std::size_t>(g.Hkv * g.T * g.D) * eb, stream),
                cudaSuccess);
      kvscope_tensor tq = capture::tensor(q.ptr, dt, g.Hq, g.T, g.D, KVSCOPE_DEVICE);
      tq.stride[0] = g.D;
      tq.stride[1] = static_cast<std::int64_t>(row);
      tq.stride[2] = 1;
      const kvscope_tensor tkv = capture::tensor(kv.ptr, dt, g.Hkv, g.T, g.D, KVSCOPE_DEVICE);
      cap.prefill_layer(l, tq, tkv, tkv);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // before q/kv are freed
    }
    const kvscope_capture_stats s = cap.stats();
    EXPECT_LE(s.queue_bytes_peak, cfg.queue_bytes);
    EXPECT_GT(s.pinned_bytes_peak, 0u);
    cap.close();
  }
  cudaStreamDestroy(stream);
  const trace::ValidationReport rep = trace::validate_trace(path("dev.h5"));
  ASSERT_TRUE(rep.ok) << rep.message;
  const trace::TraceReader r(path("dev.h5"));
  for (int l = 0; l < g.L; ++l) {
    const trace::LayerTensors t = r.read_layer(l);
    ASSERT_EQ(t.q.to_float(), want[l]) << "layer " << l;
    ASSERT_EQ(t.k.at(0), 0.0f);
  }
  const trace::Profile p = r.read_profile();
  bool htod = false, dtoh = false;
  for (const auto& k : p.kernels) {
    htod |= k.kind == "memcpy_htod";
    dtoh |= k.kind == "memcpy_dtoh";
  }
  EXPECT_TRUE(htod && dtoh) << p.kernels.size() << " CUPTI records (built with CUPTI?)";
}

}  // namespace
}  // namespace kvscope::testing
