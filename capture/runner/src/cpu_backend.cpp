// CPU decoder backend: OpenBLAS sgemm on one thread per call for the projections (and the attention of
// decode steps), the prefill's attention on micro-kernels of our own, parallelised with OpenMP over tiles
// of FIXED size (row blocks of tokens x column blocks of output features for the projections, heads x
// query blocks for attention). Tile boundaries depend only on the shapes, never on the thread count, and
// each tile is computed by one thread, so results are bit for bit the same for any number of OpenMP
// threads (docs/determinism.md).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

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

// 8 floats at a time for the row loops; 16 (one AVX-512 register, or two AVX2 ones) for the micro-kernels
// of the prefill's attention below (no BLAS: their summation order is fixed by this code, so the result is
// the same whatever the BLAS kernel, and the same for any kMr: every output lane is its own dot product in
// a fixed order). Blocks of kMr rows x kNr columns stay in registers: 12 x 16 floats in 12 of AVX-512's 32
// registers, 6 x 16 in 12 of AVX2's 16; GCC/Clang contract `acc += a * b` into FMAs where the target has
// them.
using V8 = kernels::Float8;
using V16 = float __attribute__((vector_size(16 * sizeof(float))));
#if defined(__AVX512F__)
constexpr int kMr = 12;  // rows of a register block
#else
constexpr int kMr = 6;
#endif
constexpr int kNr = 16;  // columns of a register block (one V16)

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(V8));
  return v;
}
inline void store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(V8)); }
inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(V16));
  return v;
}
inline void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof(V16)); }

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
  static_assert(kLanes == 16, "two V8 of partial sums");
  V8 acc0 = {}, acc1 = {};
  const int full = len / kLanes * kLanes;
  for (int s = 0; s < full; s += kLanes) {
    const V8 e0 = kernels::exp_fast(load8(row + s) - mx), e1 = kernels::exp_fast(load8(row + s + 8) - mx);
    store8(row + s, e0);
    store8(row + s + 8, e1);
    acc0 += e0;
    acc1 += e1;
  }
  float sum = 0;
  for (int s = full; s < len; ++s) sum += (row[s] = exp_fast(row[s] - mx));
  for (int l = 0; l < 8; ++l) sum += acc0[l];
  for (int l = 0; l < 8; ++l) sum += acc1[l];
  return sum;
}

// Keys [n, dh] (row stride dh) as panels of kNr keys: panel p holds kt[(p * dh + e) * kNr + c] = key
// p * kNr + c, element e; keys past n are 0.
void pack_keys(const float* keys, int n, int dh, float* kt) {
  const int panels = (n + kNr - 1) / kNr;
  for (int p = 0; p < panels; ++p) {
    float* dst = kt + static_cast<std::size_t>(p) * dh * kNr;
    const int cols = std::min(kNr, n - p * kNr);
    for (int c = 0; c < kNr; ++c) {
      if (c >= cols) {
        for (int e = 0; e < dh; ++e) dst[e * kNr + c] = 0.0f;
        continue;
      }
      const float* src = keys + static_cast<std::size_t>(p * kNr + c) * dh;
      for (int e = 0; e < dh; ++e) dst[e * kNr + c] = src[e];
    }
  }
}

// s [MR, panels * kNr] (row stride lds) = q [MR, dh] (row stride dh) x the key panels [panels] of kt.
template <int MR>
void scores_block(const float* __restrict q, int dh, const float* __restrict kt, int panels,
                  float* __restrict s, int lds) {
  for (int p = 0; p < panels; ++p) {
    const float* b = kt + static_cast<std::size_t>(p) * dh * kNr;
    V16 acc[MR] = {};
    for (int e = 0; e < dh; ++e) {
      const V16 be = load16(b + e * kNr);
      for (int r = 0; r < MR; ++r) acc[r] += q[r * dh + e] * be;
    }
    for (int r = 0; r < MR; ++r) store16(s + static_cast<std::size_t>(r) * lds + p * kNr, acc[r]);
  }
}

// o [MR, dh] (row stride dh) += p [MR, kc] (row stride ldp) x v [kc, dh] (row stride dh); dh % kNr == 0.
template <int MR>
void pv_block(const float* __restrict p, int ldp, const float* __restrict v, int kc, int dh,
              float* __restrict o) {
  for (int c0 = 0; c0 < dh; c0 += kNr) {
    V16 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = load16(o + r * dh + c0);
    for (int j = 0; j < kc; ++j) {
      const V16 bj = load16(v + static_cast<std::size_t>(j) * dh + c0);
      for (int r = 0; r < MR; ++r) acc[r] += p[static_cast<std::size_t>(r) * ldp + j] * bj;
    }
    for (int r = 0; r < MR; ++r) store16(o + r * dh + c0, acc[r]);
  }
}

// Calls f(std::integral_constant<int, MR>{}, r) for the register blocks of `rows` rows: blocks of kMr rows
// starting at r = 0, kMr, ..., then one narrower block for the rest.
template <int MR, class F>
void row_block_rest(int rest, int r, F& f) {
  if constexpr (MR > 0) {
    if (rest == MR) {
      f(std::integral_constant<int, MR>{}, r);
    } else {
      row_block_rest<MR - 1>(rest, r, f);
    }
  }
}
template <class F>
void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + kMr <= rows; r += kMr) f(std::integral_constant<int, kMr>{}, r);
  row_block_rest<kMr - 1>(rows - r, r, f);
}

// The two products over `rows` rows, in register blocks.
void scores_rows(const float* q, int rows, int dh, const float* kt, int panels, float* s, int lds) {
  for_row_blocks(rows, [&](auto mr, int r) {
    scores_block<decltype(mr)::value>(q + static_cast<std::size_t>(r) * dh, dh, kt, panels,
                                      s + static_cast<std::size_t>(r) * lds, lds);
  });
}

void pv_rows(const float* p, int ldp, int rows, const float* v, int kc, int dh, float* o) {
  for_row_blocks(rows, [&](auto mr, int r) {
    pv_block<decltype(mr)::value>(p + static_cast<std::size_t>(r) * ldp, ldp, v, kc, dh,
                                  o + static_cast<std::size_t>(r) * dh);
  });
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
    V8 ss8 = {};  // 8 partial sums of squares, combined in a fixed order
    const int full = d / 8 * 8;
    for (int j = 0; j < full; j += 8) {
      const V8 v = load8(xi + j);
      ss8 += v * v;
    }
    float ss = 0;
    for (int j = full; j < d; ++j) ss += xi[j] * xi[j];
    for (int l = 0; l < 8; ++l) ss += ss8[l];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    float* yi = y + static_cast<std::size_t>(i) * d;
    for (int j = 0; j < d; ++j) yi[j] = w[j] * (xi[j] * r);
  }
}

// g[j] = silu(g[j]) * u[j] = g[j] / (1 + exp(-g[j])) * u[j] for j < n, in place.
void silu_mul(float* __restrict g, const float* __restrict u, int n) {
  const int full = n / 8 * 8;
  for (int j = 0; j < full; j += 8) {
    const V8 x = load8(g + j);
    store8(g + j, x / (1.0f + exp_fast(-x)) * load8(u + j));
  }
  for (int j = full; j < n; ++j) g[j] = g[j] / (1.0f + exp_fast(-g[j])) * u[j];
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
    run({BatchedRequest{req, &cache, obs, &logits}}, true);
  }

  void forward_batch(const std::vector<BatchedRequest>& batch) override { run(batch, batch.size() == 1); }

 private:
  // The forward of every request of `batch` (forward() is a batch of one): the new tokens of all requests
  // are the rows of one matrix for the norms, projections, RoPE and MLP; each request's rows are observed,
  // appended to its cache and attend over it on their own. `ranges`: push the layer ranges (one request).
  void run(const std::vector<BatchedRequest>& batch, bool ranges) {
    kernels::pin_blas_to_one_thread();
    const int d = c_.hidden_size, dh = c_.head_dim, hq = c_.num_q_heads, hkv = c_.num_kv_heads;
    const int inter = c_.intermediate_size;
    const std::size_t n = batch.size();
    std::vector<int> row0(n + 1, 0);  // request i's tokens are rows row0[i] .. row0[i+1]-1
    for (std::size_t i = 0; i < n; ++i) row0[i + 1] = row0[i] + batch[i].request.num_tokens;
    const int t = row0[n];
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
    std::vector<TokenInfo> tokens;
    tokens.reserve(ut);
    for (std::size_t i = 0; i < n; ++i) {
      const ForwardRequest& req = batch[i].request;
      std::copy(req.x, req.x + static_cast<std::size_t>(req.num_tokens) * d,
                h + static_cast<std::size_t>(row0[i]) * d);
      tokens.insert(tokens.end(), req.tokens, req.tokens + req.num_tokens);
    }
    std::vector<float> cos_t, sin_t;
    detail::rope_tables(c_, tokens.data(), t, cos_t, sin_t);
    // Fork only when a layer's products are big enough (prefill); a decode step's are a few MFLOP.
    const long layer_flops = 2L * t * d * (hq * dh + 2 * hkv * dh + hq * dh + 3 * inter);
    const bool par = layer_flops >= kMinParallelFlops;
    RunObserver* const range_obs = ranges ? batch.front().observer : nullptr;
    for (int l = 0; l < c_.num_layers; ++l) {
      const LayerWeights& lw = w_->layers[static_cast<std::size_t>(l)];
      const std::string layer_name = detail::layer_range_name(l);
      ScopedRange layer_range(range_obs, layer_name.c_str());
      {
        const std::string name = detail::layer_range_name(l, "attention");
        ScopedRange attention_range(range_obs, name.c_str());
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
        for (std::size_t i = 0; i < n; ++i) {
          const ForwardRequest& req = batch[i].request;
          const int ti = req.num_tokens;
          const std::size_t r0 = static_cast<std::size_t>(row0[i]);
          float* qi = q + r0 * hq * dh;
          const float* ki = k + r0 * hkv * dh;
          const float* vi = v + r0 * hkv * dh;
          if (RunObserver* obs = batch[i].observer) {
            const TensorRef qr = head_major_view(qi, hq, ti, dh), kr = head_major_view(ki, hkv, ti, dh);
            const TensorRef vr = head_major_view(vi, hkv, ti, dh);
            if (req.decode_step < 0) {
              obs->on_prefill_layer(l, qr, kr, vr);
            } else {
              obs->on_decode_layer(l, req.decode_step, qr, kr, vr);
            }
          }
          KvCache& cache = *batch[i].cache;
          for (int g = 0; g < hkv; ++g) {
            const std::size_t off = static_cast<std::size_t>(g) * dh,
                              stride = static_cast<std::size_t>(hkv) * dh;
            cache.head(l, g).append_rows(ki + off, vi + off, stride, req.tokens, ti);
          }
          attend(cache, l, qi, ti, attn + r0 * hq * dh);
        }
        const Linear o[] = {{attn, lw.wo.data(), d, hq * dh, h, 1.0f}};  // h += attn Wo^T
#pragma omp parallel if (par)
        linear_tiles(o, t);
      }
      {
        const std::string name = detail::layer_range_name(l, "mlp");
        ScopedRange mlp_range(range_obs, name.c_str());
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
            silu_mul(gi, ui, inter);
          }
          linear_tiles(down, t);
        }
      }
    }
    // The output head over each request's last row (every row with all_logits), gathered contiguously.
    std::vector<int> out0(n + 1, 0);
    for (std::size_t i = 0; i < n; ++i)
      out0[i + 1] = out0[i] + (batch[i].request.all_logits ? batch[i].request.num_tokens : 1);
    const int rows = out0[n];
    const std::size_t V = static_cast<std::size_t>(c_.vocab_size);
    grow(last_, static_cast<std::size_t>(rows) * d);
    for (std::size_t i = 0; i < n; ++i) {
      const int ri = out0[i + 1] - out0[i];
      const float* src = h + static_cast<std::size_t>(row0[i + 1] - ri) * d;
      std::copy(src, src + static_cast<std::size_t>(ri) * d, last_.data() + static_cast<std::size_t>(out0[i]) * d);
    }
    std::vector<float>& out = n == 1 ? *batch.front().logits : head_out_;
    out.resize(static_cast<std::size_t>(rows) * V);
    const Linear head[] = {{a, w_->output().data(), c_.vocab_size, d, out.data()}};
    const bool par_head = 2L * rows * d * c_.vocab_size >= kMinParallelFlops;
#pragma omp parallel if (par_head)
    {
      rms_norm_rows(last_.data(), w_->final_norm.data(), rows, d, c_.rms_norm_eps, a);
      linear_tiles(head, rows);
    }
    if (n == 1) return;
    for (std::size_t i = 0; i < n; ++i) {
      std::vector<float>& li = *batch[i].logits;
      li.assign(out.begin() + static_cast<std::ptrdiff_t>(out0[i] * V),
                out.begin() + static_cast<std::ptrdiff_t>(out0[i + 1] * V));
    }
  }

  // attn [T, Hq*Dh]: query i of the new tokens attends to slots 0 .. size-T+i of its KV head, with bias.
  // Tiles: (query head, block of kQueryBlock queries); a tile reads only the slots its last query sees.
  // A prefill (t >= kQueryBlock) computes QK^T and PV with the micro-kernels above, over each head's keys
  // packed once per layer; fewer queries (decode steps) use sgemm, which reads the cache as it is.
  void attend(const KvCache& cache, int layer, const float* q, int t, float* out) {
    const int dh = c_.head_dim, hq = c_.num_q_heads, hkv = c_.num_kv_heads, group = hq / hkv;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
    int n_max = 0;
    for (int g = 0; g < hkv; ++g) n_max = std::max(n_max, cache.head(layer, g).size());
    const int qb = blocks(t, kQueryBlock), tiles = hkv * qb;
    const long work = static_cast<long>(t) * n_max * dh * hq;
    const int threads = work >= (1L << 20) ? omp_get_max_threads() : 1;
    const bool packed = t >= kQueryBlock && dh % kNr == 0;
    const std::size_t head_panels = packed ? static_cast<std::size_t>(blocks(n_max, kNr)) * kNr * dh : 0;
    if (packed) grow(kt_, head_panels * hkv);
    scratch_.resize(static_cast<std::size_t>(threads));
#pragma omp parallel num_threads(threads)
    {
      if (packed) {
#pragma omp for schedule(static)
        for (int g = 0; g < hkv; ++g) {
          const HeadCache& hc = cache.head(layer, g);
          pack_keys(hc.keys(), hc.size(), dh, kt_.data() + head_panels * g);
        }
      }
      std::vector<float>& p = scratch_[static_cast<std::size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
      for (int tile = 0; tile < tiles; ++tile) {
        // A tile: the `group` query heads of KV head g (they read the same slots) x one query block,
        // as one matrix of R = group x rows query rows (row hh * rows + r: head g*group + hh, query i0 + r).
        // Handed out last query block first: the costliest tiles (they see the most slots) go first, so
        // the threads finish together.
        const int g = tile % hkv, b = qb - 1 - tile / hkv;
        const HeadCache& hc = cache.head(layer, g);
        const int hn = hc.size(), base = hn - t;
        const int i0 = b * kQueryBlock, rows = std::min(kQueryBlock, t - i0), big_r = group * rows;
        const int cols = base + i0 + rows;  // slots the block's last query sees
        // Online softmax over blocks of kKeyBlock slots (the scores of a block stay in cache): running
        // maximum m and sum l per query row, the output rescaled when the maximum grows.
        const int lds = blocks(std::min(kKeyBlock, cols), kNr) * kNr;  // row stride of the scores
        const std::size_t ur = big_r, ulds = lds;
        grow(p, ur * (ulds + 2 * dh + 2));
        float* qg = p.data();         // [R, Dh] the tile's queries, scaled by 1/sqrt(Dh)
        float* sc = qg + ur * dh;     // [R, lds] scores, then probabilities
        float* acc = sc + ur * ulds;  // [R, Dh] unnormalised output
        float* m = acc + ur * dh;     // [R]
        float* l = m + ur;            // [R]
        for (int hh = 0; hh < group; ++hh) {
          for (int r = 0; r < rows; ++r) {
            const float* src = q + (static_cast<std::size_t>(i0 + r) * hq + g * group + hh) * dh;
            float* dst = qg + static_cast<std::size_t>(hh * rows + r) * dh;
            for (int e = 0; e < dh; ++e) dst[e] = src[e] * scale;
          }
        }
        std::fill(acc, acc + ur * dh, 0.0f);
        std::fill(m, m + ur, -std::numeric_limits<float>::infinity());
        std::fill(l, l + ur, 0.0f);
        const float* kt = kt_.data() + head_panels * g;
        for (int k0 = 0; k0 < cols; k0 += kKeyBlock) {
          const int kc = std::min(kKeyBlock, cols - k0);
          if (packed) {
            scores_rows(qg, big_r, dh, kt + static_cast<std::size_t>(k0) * dh, blocks(kc, kNr), sc, lds);
          } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, big_r, kc, dh, 1.0f, qg, dh, hc.key(k0), dh,
                        0.0f, sc, lds);
          }
          for (int rr = 0; rr < big_r; ++rr) {
            float* row = sc + static_cast<std::size_t>(rr) * ulds;
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
          if (packed) {
            pv_rows(sc, lds, big_r, hc.value(k0), kc, dh, acc);
          } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, big_r, dh, kc, 1.0f, sc, lds, hc.value(k0),
                        dh, 1.0f, acc, dh);
          }
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
  std::vector<float> last_, head_out_;       // the output head's input rows and, for a batch, its logits
  std::vector<std::vector<float>> scratch_;  // [thread] one attention tile's scores, output and statistics
  std::vector<float> kt_;                    // [kv head] a layer's keys as panels (pack_keys), prefill only
};

}  // namespace

std::unique_ptr<DecoderBackend> make_cpu_backend(const ModelConfig& config,
                                                 std::shared_ptr<const ModelWeights> weights) {
  return std::make_unique<CpuBackend>(config, std::move(weights));
}

}  // namespace kvscope::runner
