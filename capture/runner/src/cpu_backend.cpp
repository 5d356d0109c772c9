// CPU decoder backend: OpenBLAS sgemm on one thread per call, parallelised with OpenMP over tiles of FIXED
// size (row blocks of tokens x column blocks of output features for the projections, heads x query blocks
// for attention). Tile boundaries depend only on the shapes, never on the thread count, and each tile is
// computed by one thread with one single-threaded sgemm, so results are bit for bit the same for any
// number of OpenMP threads (docs/determinism.md).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/fast_math.hpp"
#include "kvscope/runner/backend.hpp"
#include "rope.hpp"

namespace kvscope::runner {
namespace {

// Tiles are large enough that sgemm's packing of both operands stays a small part of each call (measured on
// SmolLM2-135M's shapes, 1 thread: the MLP took 15-20 % longer with 256 x 192 tiles than with 512 x 768),
// and many enough for 2 threads at 1K tokens; a decode step (few rows) cuts its weights into narrower
// column blocks so that every thread has some.
constexpr int kRowBlock = 512;    // tokens per projection tile
constexpr int kColBlock = 768;    // output features per projection tile (1536 = 2 x 768)
constexpr int kColBlockFew = 64;  // the same for at most kFewRows rows
constexpr int kFewRows = 64;
constexpr int kQueryBlock = 64;               // queries per attention tile
constexpr int kKeyBlock = 256;                // slots per step of a tile's online softmax
constexpr long kMinParallelFlops = 1L << 21;  // below this a fork/join costs more than it saves

using kernels::exp_fast;

constexpr int kLanes = 16;  // partial maxima / sums of the vectorised row loops

// row[s] += bias[s] for s < len, in place; returns the maximum (kLanes partial maxima combined in a fixed
// order).
float add_bias_max(float* __restrict row, const float* __restrict bias, int len) {
  // GCC/Clang vector extension: one AVX-512 register, or two AVX2 / four SSE ones.
  using V = float __attribute__((vector_size(kLanes * sizeof(float))));
  V m;
  for (int l = 0; l < kLanes; ++l) m[l] = -std::numeric_limits<float>::infinity();
  const int full = len / kLanes * kLanes;
  for (int s = 0; s < full; s += kLanes) {
    V x, b;
    std::memcpy(&x, row + s, sizeof(V));
    std::memcpy(&b, bias + s, sizeof(V));
    x += b;
    std::memcpy(row + s, &x, sizeof(V));
    m = m < x ? x : m;
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (int s = full; s < len; ++s) {
    row[s] += bias[s];
    mx = std::max(mx, row[s]);
  }
  for (int l = 0; l < kLanes; ++l) mx = std::max(mx, m[l]);
  return mx;
}

// row[s] = exp(row[s] - mx) for s < len, in place; returns their sum (kLanes partial sums, fixed order).
float exp_sum(float* __restrict row, float mx, int len) {
  float acc[kLanes];
  std::fill(acc, acc + kLanes, 0.0f);
  const int full = len / kLanes * kLanes;
  for (int s = 0; s < full; s += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_fast(row[s + l] - mx);
      row[s + l] = e;
      acc[l] += e;
    }
  }
  float sum = 0;
  for (int s = full; s < len; ++s) sum += (row[s] = exp_fast(row[s] - mx));
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

// One product y [T, n] (+)= x [T, k] W^T with W [n, k] row-major, cut into tiles.
struct Linear {
  const float* x;  // [T, k], row stride k
  const float* w;  // [n, k]
  int n, k;
  float* y;          // [T, n], row stride n
  float beta = 0.f;  // 1: accumulate into y (residual add)
};

inline int blocks(int n, int b) { return (n + b - 1) / b; }

// Runs every tile of `ops` (all of T rows) as an omp for; call inside a parallel region (or outside one,
// then on the calling thread). Tile (r, c) of an op is rows [r*kRowBlock, ..) x features [c*cb, ..), with
// cb = kColBlock, or kColBlockFew for T <= kFewRows: boundaries depend on the shapes only.
template <std::size_t N>
void linear_tiles(const Linear (&ops)[N], int t) {
  const int col_block = t <= kFewRows ? kColBlockFew : kColBlock;
  int start[N + 1];
  start[0] = 0;
  const int rb = blocks(t, kRowBlock);
  for (std::size_t i = 0; i < N; ++i) start[i + 1] = start[i] + rb * blocks(ops[i].n, col_block);
#pragma omp for schedule(dynamic, 1)
  for (int tile = 0; tile < start[N]; ++tile) {
    std::size_t i = 0;
    while (tile >= start[i + 1]) ++i;
    const Linear& op = ops[i];
    const int local = tile - start[i], cb = blocks(op.n, col_block);
    const int r = local / cb, c = local % cb;
    const int r0 = r * kRowBlock, rows = std::min(kRowBlock, t - r0);
    const int c0 = c * col_block, cols = std::min(col_block, op.n - c0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, op.k, 1.0f,
                op.x + static_cast<std::size_t>(r0) * op.k, op.k, op.w + static_cast<std::size_t>(c0) * op.k,
                op.k, op.beta, op.y + static_cast<std::size_t>(r0) * op.n + c0, op.n);
  }
}

// y [T, d] = RMSNorm(x) * w, rows split over the team.
void rms_norm_rows(const float* x, const float* w, int t, int d, double eps, float* y) {
#pragma omp for schedule(static)
  for (int i = 0; i < t; ++i) {
    const float* xi = x + static_cast<std::size_t>(i) * d;
    float ss = 0;
    for (int j = 0; j < d; ++j) ss += xi[j] * xi[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    float* yi = y + static_cast<std::size_t>(i) * d;
    for (int j = 0; j < d; ++j) yi[j] = w[j] * (xi[j] * r);
  }
}

// Rotates every head of x [T, heads*Dh] in place ("rotate_half" convention), rows split over the team.
void rope_rows(float* x, int t, int heads, int dh, const float* cos_t, const float* sin_t) {
  const int half = dh / 2;
#pragma omp for schedule(static)
  for (int i = 0; i < t; ++i) {
    const float* c = cos_t + static_cast<std::size_t>(i) * half;
    const float* s = sin_t + static_cast<std::size_t>(i) * half;
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

template <typename T>
void grow(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

class CpuBackend final : public DecoderBackend {
 public:
  CpuBackend(const ModelConfig& c, std::shared_ptr<const ModelWeights> w) : c_(c), w_(std::move(w)) {}

  std::string device_name() const override { return "cpu"; }

  void forward(const ForwardRequest& req, KvCache& cache, RunObserver* obs,
               std::vector<float>& logits) override {
    kernels::pin_blas_to_one_thread();
    const int t = req.num_tokens, d = c_.hidden_size, dh = c_.head_dim, hq = c_.num_q_heads,
              hkv = c_.num_kv_heads;
    const int inter = c_.intermediate_size;
    const std::size_t ut = static_cast<std::size_t>(t);
    // Work buffers, kept between calls (decode steps reuse them).
    grow(h_, ut * d);  // [T, d] residual stream
    grow(a_, ut * d);  // [T, d] normed input
    grow(q_, ut * hq * dh);
    grow(k_, ut * hkv * dh);
    grow(v_, ut * hkv * dh);
    grow(attn_, ut * hq * dh);  // [T, Hq*Dh]
    grow(gate_, ut * inter);    // [T, I]
    grow(up_, ut * inter);      // [T, I]
    float *h = h_.data(), *a = a_.data(), *q = q_.data(), *k = k_.data(), *v = v_.data();
    float *attn = attn_.data(), *gate = gate_.data(), *up = up_.data();
    std::copy(req.x, req.x + ut * d, h);
    std::vector<float> cos_t, sin_t;
    detail::rope_tables(c_, req.tokens, t, cos_t, sin_t);
    // Fork only when a layer's products are big enough (prefill); a decode step's are a few MFLOP.
    const long layer_flops = 2L * t * d * (hq * dh + 2 * hkv * dh + hq * dh + 3 * inter);
    const bool par = layer_flops >= kMinParallelFlops;
    for (int l = 0; l < c_.num_layers; ++l) {
      const LayerWeights& lw = w_->layers[static_cast<std::size_t>(l)];
      const std::string layer_name = detail::layer_range_name(l);
      ScopedRange layer_range(obs, layer_name.c_str());
      {
        const std::string name = detail::layer_range_name(l, "attention");
        ScopedRange attention_range(obs, name.c_str());
        const Linear qkv[] = {{a, lw.wq.data(), hq * dh, d, q},
                              {a, lw.wk.data(), hkv * dh, d, k},
                              {a, lw.wv.data(), hkv * dh, d, v}};
#pragma omp parallel if (par)
        {
          rms_norm_rows(h, lw.input_norm.data(), t, d, c_.rms_norm_eps, a);
          linear_tiles(qkv, t);
          rope_rows(q, t, hq, dh, cos_t.data(), sin_t.data());
          rope_rows(k, t, hkv, dh, cos_t.data(), sin_t.data());
        }
        if (obs) {
          const TensorRef qr = head_major_view(q, hq, t, dh), kr = head_major_view(k, hkv, t, dh);
          const TensorRef vr = head_major_view(v, hkv, t, dh);
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
            hc.append(k + off, v + off, 0.0f, SlotInfo{req.tokens[i], 1});
          }
        }
        attend(cache, l, q, t, attn);
        const Linear o[] = {{attn, lw.wo.data(), d, hq * dh, h, 1.0f}};  // h += attn Wo^T
#pragma omp parallel if (par)
        linear_tiles(o, t);
      }
      {
        const std::string name = detail::layer_range_name(l, "mlp");
        ScopedRange mlp_range(obs, name.c_str());
        const Linear gate_up[] = {{a, lw.w_gate.data(), inter, d, gate}, {a, lw.w_up.data(), inter, d, up}};
        const Linear down[] = {{gate, lw.w_down.data(), d, inter, h, 1.0f}};  // h += silu(g)*u Wd^T
#pragma omp parallel if (par)
        {
          rms_norm_rows(h, lw.post_norm.data(), t, d, c_.rms_norm_eps, a);
          linear_tiles(gate_up, t);
#pragma omp for schedule(static)
          for (int i = 0; i < t; ++i) {
            float* gi = gate + static_cast<std::size_t>(i) * inter;
            const float* ui = up + static_cast<std::size_t>(i) * inter;
            for (int j = 0; j < inter; ++j) gi[j] = gi[j] / (1.0f + exp_fast(-gi[j])) * ui[j];
          }
          linear_tiles(down, t);
        }
      }
    }
    const int rows = req.all_logits ? t : 1;
    const float* last = h + static_cast<std::size_t>(t - rows) * d;
    logits.resize(static_cast<std::size_t>(rows) * c_.vocab_size);
    const Linear head[] = {{a, w_->output().data(), c_.vocab_size, d, logits.data()}};
    const bool par_head = 2L * rows * d * c_.vocab_size >= kMinParallelFlops;
#pragma omp parallel if (par_head)
    {
      rms_norm_rows(last, w_->final_norm.data(), rows, d, c_.rms_norm_eps, a);
      linear_tiles(head, rows);
    }
  }

 private:
  // attn [T, Hq*Dh]: query i of the new tokens attends to slots 0 .. size-T+i of its KV head, with bias.
  // Tiles: (query head, block of kQueryBlock queries); a tile reads only the slots its last query sees.
  void attend(const KvCache& cache, int layer, const float* q, int t, float* out) {
    const int dh = c_.head_dim, hq = c_.num_q_heads, hkv = c_.num_kv_heads, group = hq / hkv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    const int n = cache.head(layer, 0).size();
    const int qb = blocks(t, kQueryBlock), tiles = hkv * qb;
    const long work = static_cast<long>(t) * n * dh * hq;
    const int threads = work >= (1L << 20) ? omp_get_max_threads() : 1;
    scratch_.resize(static_cast<std::size_t>(threads));
#pragma omp parallel num_threads(threads)
    {
      std::vector<float>& p = scratch_[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
      for (int tile = 0; tile < tiles; ++tile) {
        // A tile: the `group` query heads of KV head g (they read the same slots) x one query block,
        // as one matrix of R = group x rows query rows (row hh * rows + r: head g*group + hh, query i0 + r).
        const int g = tile / qb, b = tile % qb;
        const HeadCache& hc = cache.head(layer, g);
        const int hn = hc.size(), base = hn - t;
        const int i0 = b * kQueryBlock, rows = std::min(kQueryBlock, t - i0), big_r = group * rows;
        const int cols = base + i0 + rows;  // slots the block's last query sees
        // Online softmax over blocks of kKeyBlock slots (the scores of a block stay in cache): running
        // maximum m and sum l per query row, the output rescaled when the maximum grows.
        const std::size_t kb_max = static_cast<std::size_t>(std::min(kKeyBlock, cols)), ur = big_r;
        grow(p, ur * (kb_max + 2 * dh + 2));
        float* qg = p.data();           // [R, Dh] the tile's queries
        float* sc = qg + ur * dh;       // [R, kc] scores, then probabilities
        float* acc = sc + ur * kb_max;  // [R, Dh] unnormalised output
        float* m = acc + ur * dh;       // [R]
        float* l = m + ur;              // [R]
        for (int hh = 0; hh < group; ++hh) {
          for (int r = 0; r < rows; ++r) {
            const float* src = q + (static_cast<std::size_t>(i0 + r) * hq + g * group + hh) * dh;
            std::copy(src, src + dh, qg + static_cast<std::size_t>(hh * rows + r) * dh);
          }
        }
        std::fill(acc, acc + ur * dh, 0.0f);
        std::fill(m, m + ur, -std::numeric_limits<float>::infinity());
        std::fill(l, l + ur, 0.0f);
        for (int k0 = 0; k0 < cols; k0 += kKeyBlock) {
          const int kc = std::min(kKeyBlock, cols - k0);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, big_r, kc, dh, scale, qg, dh, hc.key(k0), dh,
                      0.0f, sc, kc);
          for (int rr = 0; rr < big_r; ++rr) {
            float* row = sc + static_cast<std::size_t>(rr) * kc;
            const int vis = std::clamp(base + i0 + rr % rows + 1 - k0, 0, kc);  // slots of this block it sees
            std::fill(row + vis, row + kc, 0.0f);
            if (vis == 0) continue;
            const float mx = std::max(m[rr], add_bias_max(row, hc.biases() + k0, vis));
            const float alpha = exp_fast(m[rr] - mx);  // 0 for the first block (m = -inf)
            l[rr] = l[rr] * alpha + exp_sum(row, mx, vis);
            m[rr] = mx;
            if (alpha != 1.0f) {
              float* ar = acc + static_cast<std::size_t>(rr) * dh;
              for (int e = 0; e < dh; ++e) ar[e] *= alpha;
            }
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, big_r, dh, kc, 1.0f, sc, kc, hc.value(k0),
                      dh, 1.0f, acc, dh);
        }
        for (int rr = 0; rr < big_r; ++rr) {
          const int hh = rr / rows, r = rr % rows;
          float* o = out + (static_cast<std::size_t>(i0 + r) * hq + g * group + hh) * dh;
          const float inv = 1.0f / l[rr];
          for (int e = 0; e < dh; ++e) o[e] = acc[static_cast<std::size_t>(rr) * dh + e] * inv;
        }
      }
    }
  }

  ModelConfig c_;
  std::shared_ptr<const ModelWeights> w_;
  std::vector<float> h_, a_, q_, k_, v_, attn_, gate_, up_;
  std::vector<std::vector<float>> scratch_;  // [thread] one attention tile's scores, output and statistics
};

}  // namespace

std::unique_ptr<DecoderBackend> make_cpu_backend(const ModelConfig& config,
                                                 std::shared_ptr<const ModelWeights> weights) {
  return std::make_unique<CpuBackend>(config, std::move(weights));
}

}  // namespace kvscope::runner
