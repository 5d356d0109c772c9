// CUDA decoder backend: cuBLAS for the projections, our kernels for RMSNorm, RoPE, attention over the
// cache slots (softmax in fp32, with the slot bias) and SwiGLU. The host KvCache stays the source of truth:
// each layer's new K/V are copied back and appended there, and a device mirror of every head is refreshed
// whenever a hook changed it (HeadCache::version()).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvscope/runner/backend.hpp"
#include "kvscope/runner/error.hpp"
#include "rope.hpp"

namespace kvscope::runner {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw RunnerError(ErrorKind::kCuda, std::string("CUDA: ") + what + ": " + cudaGetErrorName(e) + " (" +
                                            cudaGetErrorString(e) + ")");
  }
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw RunnerError(ErrorKind::kCuda,
                      std::string("cuBLAS: ") + what + ": status " + std::to_string(static_cast<int>(s)));
  }
}

#define KV_CHECK(call) check((call), #call)
#define KV_CHECK_LAUNCH(name) check(cudaPeekAtLastError(), name)

// y[t, :] = w * x[t, :] * rsqrt(mean(x^2) + eps); one block per row.
__global__ void RmsNormKernel(const float* x, const float* w, int d, float eps, float* y) {
  __shared__ float partial[32];
  const float* xr = x + static_cast<size_t>(blockIdx.x) * d;
  float ss = 0;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_down_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (int i = 0; i < static_cast<int>((blockDim.x + 31) >> 5); ++i) total += partial[i];
    partial[0] = rsqrtf(total / d + eps);
  }
  __syncthreads();
  const float r = partial[0];
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    y[static_cast<size_t>(blockIdx.x) * d + i] = w[i] * (xr[i] * r);
}

// x [T, heads, Dh] rotated in place; cos/sin [T, Dh/2]. One block per token.
__global__ void RopeKernel(float* x, int heads, int dh, const float* cos_t, const float* sin_t) {
  const int t = blockIdx.x, half = dh / 2;
  for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
    const int h = i / half, k = i % half;
    float* v = x + (static_cast<size_t>(t) * heads + h) * dh;
    const float c = cos_t[t * half + k], s = sin_t[t * half + k];
    const float a = v[k], b = v[k + half];
    v[k] = a * c - b * s;
    v[k + half] = b * c + a * s;
  }
}

// g = silu(g) * u.
__global__ void SwiGluKernel(float* g, const float* u, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

// Copies the new tokens' K/V [T, Hkv, Dh] into the mirror [Hkv, cap, Dh] at offsets len[h] .. len[h]+T-1.
__global__ void AppendKvKernel(const float* k, const float* v, int t, int hkv, int dh, int cap,
                               const int* len, float* kc, float* vc, float* bias) {
  const int tok = blockIdx.x, h = blockIdx.y;
  const size_t dst = (static_cast<size_t>(h) * cap + len[h] + tok) * dh;
  const size_t src = (static_cast<size_t>(tok) * hkv + h) * dh;
  for (int i = threadIdx.x; i < dh; i += blockDim.x) {
    kc[dst + i] = k[src + i];
    vc[dst + i] = v[src + i];
  }
  if (threadIdx.x == 0) bias[static_cast<size_t>(h) * cap + len[h] + tok] = 0.0f;
}

// out [T, Hq*Dh]: new token i, query head j attends to slots 0 .. n-T+i of KV head j/group (n = len[head],
// already including the new tokens): softmax(q.k/sqrt(Dh) + bias) in fp32. Grid (T, Hq); shared: n floats.
__global__ void AttentionKernel(const float* q, const float* kc, const float* vc, const float* bias,
                                const int* len, int t, int hq, int group, int dh, int cap, float scale,
                                float* out) {
  extern __shared__ float p[];
  __shared__ float red[32];
  const int i = blockIdx.x, j = blockIdx.y, h = j / group;
  const int n = len[h], limit = n - t + i;
  const float* qv = q + (static_cast<size_t>(i) * hq + j) * dh;
  const float* kh = kc + static_cast<size_t>(h) * cap * dh;
  const float* vh = vc + static_cast<size_t>(h) * cap * dh;
  const float* bh = bias + static_cast<size_t>(h) * cap;
  float mx = -INFINITY;
  for (int s = threadIdx.x; s <= limit; s += blockDim.x) {
    float dot = 0;
    for (int k = 0; k < dh; ++k) dot += qv[k] * kh[static_cast<size_t>(s) * dh + k];
    p[s] = dot * scale + bh[s];
    mx = fmaxf(mx, p[s]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_down_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int w = 0; w < static_cast<int>((blockDim.x + 31) >> 5); ++w) m = fmaxf(m, red[w]);
    red[0] = m;
  }
  __syncthreads();
  mx = red[0];
  __syncthreads();
  float sum = 0;
  for (int s = threadIdx.x; s <= limit; s += blockDim.x) {
    p[s] = expf(p[s] - mx);
    sum += p[s];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (int w = 0; w < static_cast<int>((blockDim.x + 31) >> 5); ++w) total += red[w];
    red[0] = total;
  }
  __syncthreads();
  const float inv = 1.0f / red[0];
  for (int k = threadIdx.x; k < dh; k += blockDim.x) {
    float acc = 0;
    for (int s = 0; s <= limit; ++s) acc += p[s] * vh[static_cast<size_t>(s) * dh + k];
    out[(static_cast<size_t>(i) * hq + j) * dh + k] = acc * inv;
  }
}

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { resize(n); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  void resize(size_t n) {
    if (n <= n_) return;
    cudaFree(p_);
    p_ = nullptr;
    KV_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), (n ? n : 1) * sizeof(T)));
    n_ = n;
  }
  void upload(const std::vector<T>& h, cudaStream_t s) {
    resize(h.size());
    KV_CHECK(cudaMemcpyAsync(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

struct DeviceLayer {
  DeviceBuffer<float> input_norm, wq, wk, wv, wo, post_norm, w_gate, w_up, w_down;
  DeviceBuffer<float> kcache, vcache, bias;  // [Hkv, cap, Dh], [Hkv, cap]
};

class CudaBackend final : public DecoderBackend {
 public:
  CudaBackend(const ModelConfig& c, const ModelWeights& w) : c_(c) {
    std::string why;
    if (!cuda_backend_available(&why)) {
      throw RunnerError(ErrorKind::kCuda, "--device cuda: no CUDA device available (" + why + ")");
    }
    cudaDeviceProp prop{};
    KV_CHECK(cudaGetDeviceProperties(&prop, 0));
    name_ = prop.name;
    KV_CHECK(cudaStreamCreate(&stream_));
    check(cublasCreate(&blas_), "cublasCreate");
    check(cublasSetStream(blas_, stream_), "cublasSetStream");
    cap_ = c_.max_position_embeddings;
    const size_t cache_n = static_cast<size_t>(c_.num_kv_heads) * cap_ * c_.head_dim;
    for (const LayerWeights& lw : w.layers) {
      DeviceLayer dl;
      dl.input_norm.upload(lw.input_norm, stream_);
      dl.wq.upload(lw.wq, stream_);
      dl.wk.upload(lw.wk, stream_);
      dl.wv.upload(lw.wv, stream_);
      dl.wo.upload(lw.wo, stream_);
      dl.post_norm.upload(lw.post_norm, stream_);
      dl.w_gate.upload(lw.w_gate, stream_);
      dl.w_up.upload(lw.w_up, stream_);
      dl.w_down.upload(lw.w_down, stream_);
      dl.kcache.resize(cache_n);
      dl.vcache.resize(cache_n);
      dl.bias.resize(static_cast<size_t>(c_.num_kv_heads) * cap_);
      layers_.push_back(std::move(dl));
    }
    final_norm_.upload(w.final_norm, stream_);
    lm_head_.upload(w.output(), stream_);
    seen_.assign(static_cast<size_t>(c_.num_layers) * c_.num_kv_heads, ~0ull);
    mirrored_len_.assign(seen_.size(), 0);
    KV_CHECK(cudaStreamSynchronize(stream_));
  }

  ~CudaBackend() override {
    if (blas_) cublasDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string device_name() const override { return name_; }

  void forward(const ForwardRequest& req, KvCache& cache, RunObserver* obs,
               std::vector<float>& logits) override {
    const int t = req.num_tokens, d = c_.hidden_size, dh = c_.head_dim, hq = c_.num_q_heads,
              hkv = c_.num_kv_heads;
    const int inter = c_.intermediate_size;
    const size_t ut = static_cast<size_t>(t);
    std::vector<float> cos_t, sin_t;
    detail::rope_tables(c_, req.tokens, t, cos_t, sin_t);
    h_.upload(std::vector<float>(req.x, req.x + ut * d), stream_);
    cos_.upload(cos_t, stream_);
    sin_.upload(sin_t, stream_);
    a_.resize(ut * d);
    q_.resize(ut * hq * dh);
    k_.resize(ut * hkv * dh);
    v_.resize(ut * hkv * dh);
    attn_.resize(ut * hq * dh);
    gate_.resize(ut * inter);
    up_.resize(ut * inter);
    len_.resize(static_cast<size_t>(hkv));
    std::vector<float> hq_host(ut * hq * dh), hk_host(ut * hkv * dh), hv_host(ut * hkv * dh);
    for (int l = 0; l < c_.num_layers; ++l) {
      DeviceLayer& dl = layers_[static_cast<size_t>(l)];
      const std::string layer_name = detail::layer_range_name(l);
      ScopedRange layer_range(obs, layer_name.c_str());
      sync_mirror(cache, l);
      {
        const std::string name = detail::layer_range_name(l, "attention");
        ScopedRange attention_range(obs, name.c_str());
        RmsNormKernel<<<t, 128, 0, stream_>>>(h_.get(), dl.input_norm.get(), d,
                                              static_cast<float>(c_.rms_norm_eps), a_.get());
        KV_CHECK_LAUNCH("RmsNormKernel");
        linear(a_.get(), dl.wq.get(), t, hq * dh, d, q_.get(), 0.0f);
        linear(a_.get(), dl.wk.get(), t, hkv * dh, d, k_.get(), 0.0f);
        linear(a_.get(), dl.wv.get(), t, hkv * dh, d, v_.get(), 0.0f);
        RopeKernel<<<t, 128, 0, stream_>>>(q_.get(), hq, dh, cos_.get(), sin_.get());
        KV_CHECK_LAUNCH("RopeKernel(q)");
        RopeKernel<<<t, 128, 0, stream_>>>(k_.get(), hkv, dh, cos_.get(), sin_.get());
        KV_CHECK_LAUNCH("RopeKernel(k)");
        // The host cache is the source of truth: bring the new K/V (and Q for the observer) back.
        KV_CHECK(
            cudaMemcpyAsync(hk_host.data(), k_.get(), hk_host.size() * 4, cudaMemcpyDeviceToHost, stream_));
        KV_CHECK(
            cudaMemcpyAsync(hv_host.data(), v_.get(), hv_host.size() * 4, cudaMemcpyDeviceToHost, stream_));
        if (obs)
          KV_CHECK(
              cudaMemcpyAsync(hq_host.data(), q_.get(), hq_host.size() * 4, cudaMemcpyDeviceToHost, stream_));
        std::vector<int> lens(static_cast<size_t>(hkv));
        for (int g = 0; g < hkv; ++g) lens[static_cast<size_t>(g)] = cache.head(l, g).size();
        for (int g = 0; g < hkv; ++g) {
          if (lens[static_cast<size_t>(g)] + t > cap_) {
            throw RunnerError(ErrorKind::kInput, "KV cache of layer " + std::to_string(l) + " exceeds " +
                                                     std::to_string(cap_) + " slots");
          }
        }
        len_.upload(lens, stream_);
        AppendKvKernel<<<dim3(t, hkv), 32, 0, stream_>>>(k_.get(), v_.get(), t, hkv, dh, cap_, len_.get(),
                                                         dl.kcache.get(), dl.vcache.get(), dl.bias.get());
        KV_CHECK_LAUNCH("AppendKvKernel");
        for (int& n : lens) n += t;
        len_.upload(lens, stream_);
        int max_len = 0;
        for (int n : lens) max_len = std::max(max_len, n);
        const size_t shared = static_cast<size_t>(max_len) * sizeof(float);
        AttentionKernel<<<dim3(t, hq), 128, shared, stream_>>>(
            q_.get(), dl.kcache.get(), dl.vcache.get(), dl.bias.get(), len_.get(), t, hq, hq / hkv, dh, cap_,
            1.0f / std::sqrt(static_cast<float>(dh)), attn_.get());
        KV_CHECK_LAUNCH("AttentionKernel");
        linear(attn_.get(), dl.wo.get(), t, d, hq * dh, h_.get(), 1.0f);  // h += o_proj(attn)
        KV_CHECK(cudaStreamSynchronize(stream_));                         // hk/hv/hq host copies are complete
        for (int g = 0; g < hkv; ++g) {
          HeadCache& hc = cache.head(l, g);
          for (int i = 0; i < t; ++i) {
            const size_t off = (static_cast<size_t>(i) * hkv + g) * dh;
            hc.append(hk_host.data() + off, hv_host.data() + off, 0.0f, SlotInfo{req.tokens[i], 1});
          }
          seen_[static_cast<size_t>(l * hkv + g)] = hc.version();
          mirrored_len_[static_cast<size_t>(l * hkv + g)] = hc.size();
        }
        if (obs) report(obs, l, req.decode_step, hq_host.data(), hk_host.data(), hv_host.data(), t);
      }
      {
        const std::string name = detail::layer_range_name(l, "mlp");
        ScopedRange mlp_range(obs, name.c_str());
        RmsNormKernel<<<t, 128, 0, stream_>>>(h_.get(), dl.post_norm.get(), d,
                                              static_cast<float>(c_.rms_norm_eps), a_.get());
        KV_CHECK_LAUNCH("RmsNormKernel");
        linear(a_.get(), dl.w_gate.get(), t, inter, d, gate_.get(), 0.0f);
        linear(a_.get(), dl.w_up.get(), t, inter, d, up_.get(), 0.0f);
        const size_t n = ut * inter;
        SwiGluKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream_>>>(gate_.get(), up_.get(), n);
        KV_CHECK_LAUNCH("SwiGluKernel");
        linear(gate_.get(), dl.w_down.get(), t, d, inter, h_.get(), 1.0f);  // h += down(...)
        KV_CHECK(cudaStreamSynchronize(stream_));                           // so the range covers the work
      }
    }
    const int rows = req.all_logits ? t : 1;
    RmsNormKernel<<<rows, 128, 0, stream_>>>(h_.get() + static_cast<size_t>(t - rows) * d, final_norm_.get(),
                                             d, static_cast<float>(c_.rms_norm_eps), a_.get());
    KV_CHECK_LAUNCH("RmsNormKernel(final)");
    logits_.resize(static_cast<size_t>(rows) * c_.vocab_size);
    linear(a_.get(), lm_head_.get(), rows, c_.vocab_size, d, logits_.get(), 0.0f);
    logits.assign(static_cast<size_t>(rows) * c_.vocab_size, 0.0f);
    KV_CHECK(
        cudaMemcpyAsync(logits.data(), logits_.get(), logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
    KV_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  // y [t, n] (+)= x [t, k] W^T with W [n, k] row-major: column-major y^T = W^T-view (op T) x x^T-view.
  void linear(const float* x, const float* w, int t, int n, int k, float* y, float beta) {
    const float alpha = 1.0f;
    check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, t, k, &alpha, w, k, x, k, &beta, y, n),
          "cublasSgemm");
  }

  // Re-uploads every head of layer l whose host slots changed since the device last saw them.
  void sync_mirror(const KvCache& cache, int l) {
    DeviceLayer& dl = layers_[static_cast<size_t>(l)];
    const int dh = c_.head_dim;
    for (int g = 0; g < c_.num_kv_heads; ++g) {
      const HeadCache& hc = cache.head(l, g);
      const size_t idx = static_cast<size_t>(l * c_.num_kv_heads + g);
      if (hc.version() == seen_[idx]) continue;
      if (hc.size() > cap_) {
        throw RunnerError(ErrorKind::kInput, "KV cache head holds " + std::to_string(hc.size()) +
                                                 " slots, more than " + std::to_string(cap_));
      }
      const size_t off = static_cast<size_t>(g) * cap_;
      const size_t n = static_cast<size_t>(hc.size());
      if (n) {
        KV_CHECK(cudaMemcpyAsync(dl.kcache.get() + off * dh, hc.keys(), n * dh * 4, cudaMemcpyHostToDevice,
                                 stream_));
        KV_CHECK(cudaMemcpyAsync(dl.vcache.get() + off * dh, hc.values(), n * dh * 4, cudaMemcpyHostToDevice,
                                 stream_));
        KV_CHECK(cudaMemcpyAsync(dl.bias.get() + off, hc.biases(), n * 4, cudaMemcpyHostToDevice, stream_));
      }
      // The host buffers may change after we return: finish the copies now.
      KV_CHECK(cudaStreamSynchronize(stream_));
      seen_[idx] = hc.version();
      mirrored_len_[idx] = hc.size();
    }
  }

  void report(RunObserver* obs, int l, int step, const float* q, const float* k, const float* v,
              int t) const {
    auto view = [&](const float* p, int heads) {
      TensorRef r;
      r.data = p;
      r.shape[0] = heads;
      r.shape[1] = t;
      r.shape[2] = c_.head_dim;
      r.stride[0] = c_.head_dim;
      r.stride[1] = static_cast<std::int64_t>(heads) * c_.head_dim;
      r.stride[2] = 1;
      return r;
    };
    const TensorRef qr = view(q, c_.num_q_heads), kr = view(k, c_.num_kv_heads),
                    vr = view(v, c_.num_kv_heads);
    if (step < 0) {
      obs->on_prefill_layer(l, qr, kr, vr);
    } else {
      obs->on_decode_layer(l, step, qr, kr, vr);
    }
  }

  ModelConfig c_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  int cap_ = 0;
  std::vector<DeviceLayer> layers_;
  DeviceBuffer<float> final_norm_, lm_head_;
  DeviceBuffer<float> h_, a_, q_, k_, v_, attn_, gate_, up_, cos_, sin_, logits_;
  DeviceBuffer<int> len_;
  std::vector<std::uint64_t> seen_;  // HeadCache::version() the mirror matches, per (layer, head)
  std::vector<int> mirrored_len_;
};

}  // namespace

bool cuda_backend_available(std::string* why) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    if (why) *why = e != cudaSuccess ? cudaGetErrorString(e) : "0 devices";
    return false;
  }
  return true;
}

std::unique_ptr<DecoderBackend> make_cuda_backend(const ModelConfig& config, const ModelWeights& weights) {
  return std::make_unique<CudaBackend>(config, weights);
}

}  // namespace kvscope::runner
