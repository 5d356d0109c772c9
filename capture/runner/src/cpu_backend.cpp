// CPU decoder backend: OpenBLAS sgemm for every projection and attention product, OpenMP over heads.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/runner/backend.hpp"
#include "rope.hpp"

namespace kvscope::runner {
namespace {

// y [T, n] = x [T, k] W^T, W [n, k] row-major.
void linear(const float* x, const std::vector<float>& w, int t, int n, int k, float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t, n, k, 1.0f, x, k, w.data(), k, 0.0f, y, n);
}

void rms_norm(const float* x, const std::vector<float>& w, int t, int d, double eps, float* y) {
  for (int i = 0; i < t; ++i) {
    const float* xi = x + static_cast<std::size_t>(i) * d;
    float ss = 0;
    for (int j = 0; j < d; ++j) ss += xi[j] * xi[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    float* yi = y + static_cast<std::size_t>(i) * d;
    for (int j = 0; j < d; ++j) yi[j] = w[static_cast<std::size_t>(j)] * (xi[j] * r);
  }
}

// Rotates every head of x [T, heads*Dh] in place ("rotate_half" convention).
void apply_rope(float* x, int t, int heads, int dh, const std::vector<float>& cos_t,
                const std::vector<float>& sin_t) {
  const int half = dh / 2;
  for (int i = 0; i < t; ++i) {
    const float* c = cos_t.data() + static_cast<std::size_t>(i) * half;
    const float* s = sin_t.data() + static_cast<std::size_t>(i) * half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (static_cast<std::size_t>(i) * heads + h) * dh;
      for (int k = 0; k < half; ++k) {
        const float a = v[k], b = v[k + half];
        v[k] = a * c[k] - b * s[k];
        v[k + half] = b * c[k] + a * s[k];
      }
    }
  }
}

TensorRef head_major_view(const float* data, int heads, int t, int dh) {
  TensorRef r;
  r.data = data;
  r.shape[0] = heads;
  r.shape[1] = t;
  r.shape[2] = dh;
  r.stride[0] = dh;
  r.stride[1] = static_cast<std::int64_t>(heads) * dh;
  r.stride[2] = 1;
  return r;
}

class CpuBackend final : public DecoderBackend {
 public:
  CpuBackend(const ModelConfig& c, std::shared_ptr<const ModelWeights> w) : c_(c), w_(std::move(w)) {}

  std::string device_name() const override { return "cpu"; }

  void forward(const ForwardRequest& req, KvCache& cache, RunObserver* obs,
               std::vector<float>& logits) override {
    // Parallelism comes from OpenMP over heads; BLAS runs on one thread inside, which also makes every
    // product independent of the BLAS kernel's thread split (kernels::pin_blas_to_one_thread).
    kernels::pin_blas_to_one_thread();
    const int t = req.num_tokens, d = c_.hidden_size, dh = c_.head_dim, hq = c_.num_q_heads,
              hkv = c_.num_kv_heads;
    const int inter = c_.intermediate_size;
    const std::size_t ut = static_cast<std::size_t>(t);
    std::vector<float> h(req.x, req.x + ut * d), a(ut * d), q(ut * hq * dh), k(ut * hkv * dh),
        v(ut * hkv * dh);
    std::vector<float> attn(ut * hq * dh), tmp(ut * d), gate(ut * inter), up(ut * inter);
    std::vector<float> cos_t, sin_t;
    detail::rope_tables(c_, req.tokens, t, cos_t, sin_t);
    for (int l = 0; l < c_.num_layers; ++l) {
      const LayerWeights& lw = w_->layers[static_cast<std::size_t>(l)];
      const std::string layer_name = detail::layer_range_name(l);
      ScopedRange layer_range(obs, layer_name.c_str());
      {
        const std::string name = detail::layer_range_name(l, "attention");
        ScopedRange attention_range(obs, name.c_str());
        rms_norm(h.data(), lw.input_norm, t, d, c_.rms_norm_eps, a.data());
        linear(a.data(), lw.wq, t, hq * dh, d, q.data());
        linear(a.data(), lw.wk, t, hkv * dh, d, k.data());
        linear(a.data(), lw.wv, t, hkv * dh, d, v.data());
        apply_rope(q.data(), t, hq, dh, cos_t, sin_t);
        apply_rope(k.data(), t, hkv, dh, cos_t, sin_t);
        if (obs) {
          const TensorRef qr = head_major_view(q.data(), hq, t, dh),
                          kr = head_major_view(k.data(), hkv, t, dh);
          const TensorRef vr = head_major_view(v.data(), hkv, t, dh);
          if (req.decode_step < 0) {
            obs->on_prefill_layer(l, qr, kr, vr);
          } else {
            obs->on_decode_layer(l, req.decode_step, qr, kr, vr);
          }
        }
        for (int g = 0; g < hkv; ++g) {
          HeadCache& hc = cache.head(l, g);
          for (int i = 0; i < t; ++i) {
            const std::size_t off = (static_cast<std::size_t>(i) * hkv + g) * dh;
            hc.append(k.data() + off, v.data() + off, 0.0f, SlotInfo{req.tokens[i], 1});
          }
        }
        attend(cache, l, q.data(), t, attn.data());
        linear(attn.data(), lw.wo, t, d, hq * dh, tmp.data());
        for (std::size_t i = 0; i < h.size(); ++i) h[i] += tmp[i];
      }
      {
        const std::string name = detail::layer_range_name(l, "mlp");
        ScopedRange mlp_range(obs, name.c_str());
        rms_norm(h.data(), lw.post_norm, t, d, c_.rms_norm_eps, a.data());
        linear(a.data(), lw.w_gate, t, inter, d, gate.data());
        linear(a.data(), lw.w_up, t, inter, d, up.data());
        for (std::size_t i = 0; i < gate.size(); ++i) {
          const float g = gate[i];
          gate[i] = g / (1.0f + std::exp(-g)) * up[i];
        }
        linear(gate.data(), lw.w_down, t, d, inter, tmp.data());
        for (std::size_t i = 0; i < h.size(); ++i) h[i] += tmp[i];
      }
    }
    const int rows = req.all_logits ? t : 1;
    const float* last = h.data() + static_cast<std::size_t>(t - rows) * d;
    rms_norm(last, w_->final_norm, rows, d, c_.rms_norm_eps, a.data());
    logits.assign(static_cast<std::size_t>(rows) * c_.vocab_size, 0.0f);
    linear(a.data(), w_->output(), rows, c_.vocab_size, d, logits.data());
  }

 private:
  // attn [T, Hq*Dh]: query i of the new tokens attends to slots 0 .. size-T+i of its KV head, with bias.
  void attend(const KvCache& cache, int layer, const float* q, int t, float* out) const {
    const int dh = c_.head_dim, hq = c_.num_q_heads, group = c_.num_q_heads / c_.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    // Threads only pay off for real work: a tiny decode step is faster on one thread than a fork/join.
    const long work = static_cast<long>(t) * cache.head(layer, 0).size() * dh * hq;
#pragma omp parallel for schedule(static) if (work >= (1L << 20))
    for (int j = 0; j < hq; ++j) {
      const HeadCache& hc = cache.head(layer, j / group);
      const int n = hc.size(), base = n - t;
      std::vector<float> p(static_cast<std::size_t>(t) * n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t, n, dh, scale,
                  q + static_cast<std::size_t>(j) * dh, hq * dh, hc.keys(), dh, 0.0f, p.data(), n);
      const float* bias = hc.biases();
      for (int i = 0; i < t; ++i) {
        float* row = p.data() + static_cast<std::size_t>(i) * n;
        const int limit = base + i;  // last visible slot
        float mx = -std::numeric_limits<float>::infinity();
        for (int s = 0; s <= limit; ++s) {
          row[s] += bias[s];
          mx = std::max(mx, row[s]);
        }
        float sum = 0;
        for (int s = 0; s <= limit; ++s) {
          row[s] = std::exp(row[s] - mx);
          sum += row[s];
        }
        const float inv = 1.0f / sum;
        for (int s = 0; s <= limit; ++s) row[s] *= inv;
        for (int s = limit + 1; s < n; ++s) row[s] = 0.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, t, dh, n, 1.0f, p.data(), n, hc.values(), dh,
                  0.0f, out + static_cast<std::size_t>(j) * dh, hq * dh);
    }
  }

  ModelConfig c_;
  std::shared_ptr<const ModelWeights> w_;
};

}  // namespace

std::unique_ptr<DecoderBackend> make_cpu_backend(const ModelConfig& config,
                                                 std::shared_ptr<const ModelWeights> weights) {
  return std::make_unique<CpuBackend>(config, std::move(weights));
}

}  // namespace kvscope::runner
