// CPU backend of compressed-cache evaluation (kvscope/kernels/evaluate.hpp).
// Work item: one kv head x a block of up to kRowBlock query rows (its GQA group's
// (q head, query) pairs), so every K/V tile converted to float is reused by all
// rows of the block while it sits in L1. Math: docs/kernels/evaluate.md.
#include "kvscope/kernels/evaluate.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cpu {
namespace {

constexpr int kRowBlock = 32;  // query rows per work item (K/V tiles converted once per block)
constexpr int kQkTile = 16;    // tokens per logits tile (K tile transposed to [D][kQkTile])
constexpr int kPvTile = 32;    // tokens per P.V tile
constexpr int kPvChunk = 16;   // output columns held in registers by the P.V micro-kernel

void to_float(const void* src, DType t, std::size_t offset, std::size_t n, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
    return;
  }
  const std::uint16_t* p = static_cast<const std::uint16_t*>(src) + offset;
  if (t == DType::kF16) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = half_to_float(p[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(p[i]);
  }
}

// Logits micro-kernel for R rows: acc[r][j] = sum_d q[r][d] * kt[d][j].
template <int R>
inline void qk_rows(const float* q, int D, const float* kt, float scale, float* z, std::size_t ldz, int nt) {
  float acc[R][kQkTile] = {};
  for (int d = 0; d < D; ++d) {
    const float* kd = kt + static_cast<std::size_t>(d) * kQkTile;
    for (int r = 0; r < R; ++r) {
      const float qd = q[static_cast<std::size_t>(r) * D + d];
      for (int j = 0; j < kQkTile; ++j) acc[r][j] += qd * kd[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nt; ++j) z[r * ldz + j] = acc[r][j] * scale;
}

// z[r * ldz + t] = scale * (q_r . x_t) for r < nr, t < n; x holds n rows of D elements
// of type dt starting at element x_off. scratch: 2 * kQkTile * D floats.
void logits(const float* q, int nr, int D, const void* x, DType dt, std::size_t x_off, int n, float scale,
            float* z, std::size_t ldz, float* scratch) {
  float* rows = scratch;
  float* kt = scratch + static_cast<std::size_t>(kQkTile) * D;
  for (int t0 = 0; t0 < n; t0 += kQkTile) {
    const int nt = std::min(kQkTile, n - t0);
    to_float(x, dt, x_off + static_cast<std::size_t>(t0) * D, static_cast<std::size_t>(nt) * D, rows);
    for (int j = 0; j < kQkTile; ++j)
      for (int d = 0; d < D; ++d)
        kt[static_cast<std::size_t>(d) * kQkTile + j] = j < nt ? rows[j * D + d] : 0.0f;
    int r = 0;
    for (; r + 2 <= nr; r += 2)
      qk_rows<2>(q + static_cast<std::size_t>(r) * D, D, kt, scale, z + r * ldz + t0, ldz, nt);
    if (r < nr) qk_rows<1>(q + static_cast<std::size_t>(r) * D, D, kt, scale, z + r * ldz + t0, ldz, nt);
  }
}

// o[r][c0 .. c0+W) += sum_j e[r][j] * vt[j][c0 ..] for R rows and W columns.
template <int R, int W>
inline void pv_rows(const float* e, std::size_t lde, int nt, const float* vt, int D, int c0, float* o) {
  float acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) acc[r][c] = o[static_cast<std::size_t>(r) * D + c0 + c];
  for (int j = 0; j < nt; ++j) {
    const float* vj = vt + static_cast<std::size_t>(j) * D + c0;
    for (int r = 0; r < R; ++r) {
      const float ej = e[r * lde + j];
      for (int c = 0; c < W; ++c) acc[r][c] += ej * vj[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) o[static_cast<std::size_t>(r) * D + c0 + c] = acc[r][c];
}

template <int R>
inline void pv_block(const float* e, std::size_t lde, int nt, const float* vt, int D, float* o) {
  int c0 = 0;
  for (; c0 + kPvChunk <= D; c0 += kPvChunk) pv_rows<R, kPvChunk>(e, lde, nt, vt, D, c0, o);
  for (; c0 < D; ++c0) pv_rows<R, 1>(e, lde, nt, vt, D, c0, o);
}

// o[r * D + d] += sum_{t < n} e[r * lde + t] * x_t[d]. scratch: kPvTile * D floats.
void accumulate_pv(const float* e, std::size_t lde, int nr, const void* x, DType dt, std::size_t x_off, int n,
                   int D, float* o, float* scratch) {
  for (int t0 = 0; t0 < n; t0 += kPvTile) {
    const int nt = std::min(kPvTile, n - t0);
    to_float(x, dt, x_off + static_cast<std::size_t>(t0) * D, static_cast<std::size_t>(nt) * D, scratch);
    int r = 0;
    for (; r + 2 <= nr; r += 2)
      pv_block<2>(e + r * lde + t0, lde, nt, scratch, D, o + static_cast<std::size_t>(r) * D);
    if (r < nr) pv_block<1>(e + r * lde + t0, lde, nt, scratch, D, o + static_cast<std::size_t>(r) * D);
  }
}

Status validate(const EvaluateParams& p, const void* q, const void* k, const void* v,
                const std::uint8_t* modality, const CompressedCache& c, const EvaluateOutputs& out) {
  const std::string f = "evaluate_attention: ";
  const auto positive = [&](int x, const char* name) {
    return x > 0 ? Status::Ok() : Status::Invalid(f + name + " " + std::to_string(x) + " must be > 0");
  };
  KVSCOPE_RETURN_IF_ERROR(positive(p.num_q_heads, "num_q_heads"));
  KVSCOPE_RETURN_IF_ERROR(positive(p.num_kv_heads, "num_kv_heads"));
  KVSCOPE_RETURN_IF_ERROR(positive(p.num_queries, "num_queries"));
  KVSCOPE_RETURN_IF_ERROR(positive(p.num_tokens, "num_tokens"));
  KVSCOPE_RETURN_IF_ERROR(positive(p.head_dim, "head_dim"));
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return Status::Invalid(f + "num_q_heads " + std::to_string(p.num_q_heads) +
                           " is not a multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (!q || !k || !v || !modality) return Status::Invalid(f + "q, k, v and modality must not be null");
  if (!c.slot_offsets || !c.token_to_slot) {
    return Status::Invalid(f + "cache.slot_offsets and cache.token_to_slot must not be null");
  }
  if (c.multiplicity_f32 && c.multiplicity_i32) {
    return Status::Invalid(f + "set at most one of cache.multiplicity_f32 and cache.multiplicity_i32");
  }
  if (!out.output_error && !out.recall && !out.kl && !out.entropy_change && !out.recall_modality &&
      !out.mass_full && !out.mass_compressed) {
    return Status::Invalid(f + "every output pointer is null");
  }
  const int Hkv = p.num_kv_heads, T = p.num_tokens;
  if (c.slot_offsets[0] != 0) return Status::Invalid(f + "cache.slot_offsets[0] must be 0");
  for (int h = 0; h < Hkv; ++h) {
    if (c.slot_offsets[h + 1] < c.slot_offsets[h]) {
      return Status::Invalid(f + "cache.slot_offsets decreases at head " + std::to_string(h));
    }
  }
  const std::int32_t total = c.slot_offsets[Hkv];
  if (total > 0 && (!c.k || !c.v || !c.slot_modality)) {
    return Status::Invalid(f + "cache.k, cache.v and cache.slot_modality must not be null");
  }
  for (int t = 0; t < T; ++t) {
    if (modality[t] >= kNumModalities) {
      return Status::Invalid(f + "modality[" + std::to_string(t) + "] = " + std::to_string(modality[t]) +
                             " >= 4");
    }
  }
  for (std::int32_t s = 0; s < total; ++s) {
    if (c.slot_modality[s] >= kNumModalities) {
      return Status::Invalid(f + "cache.slot_modality[" + std::to_string(s) + "] >= 4");
    }
    if (c.multiplicity_f32 && !(c.multiplicity_f32[s] > 0.0f && std::isfinite(c.multiplicity_f32[s]))) {
      return Status::Invalid(f + "cache.multiplicity_f32[" + std::to_string(s) + "] must be finite and > 0");
    }
    if (c.multiplicity_i32 && c.multiplicity_i32[s] < 1) {
      return Status::Invalid(f + "cache.multiplicity_i32[" + std::to_string(s) + "] must be >= 1");
    }
  }
  for (int h = 0; h < Hkv; ++h) {
    const std::int32_t slots = c.slot_offsets[h + 1] - c.slot_offsets[h];
    const std::int32_t* map = c.token_to_slot + static_cast<std::size_t>(h) * T;
    for (int t = 0; t < T; ++t) {
      if (map[t] < -1 || map[t] >= slots) {
        return Status::Invalid(f + "cache.token_to_slot[" + std::to_string(h) + ", " + std::to_string(t) +
                               "] = " + std::to_string(map[t]) + " is out of [-1, " + std::to_string(slots) +
                               ")");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status evaluate_attention(const EvaluateParams& p, const void* q, const void* k, const void* v,
                          const std::uint8_t* modality, const CompressedCache& c,
                          const EvaluateOutputs& out) {
  KVSCOPE_NVTX_RANGE("cpu::evaluate_attention", kEvaluate);
  KVSCOPE_RETURN_IF_ERROR(validate(p, q, k, v, modality, c, out));
  const int Hkv = p.num_kv_heads, T = p.num_tokens, D = p.head_dim;
  const int M = (p.num_q_heads / Hkv) * p.num_queries;  // query rows per kv head
  const int blocks_per_head = (M + kRowBlock - 1) / kRowBlock;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

#pragma omp parallel
  {
    std::vector<float> qf, z, zc, ec, slot_mass, log_n, o, oc;
    std::vector<float> scratch(static_cast<std::size_t>(std::max(2 * kQkTile, kPvTile)) * D);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < Hkv * blocks_per_head; ++item) {
      const int h = item / blocks_per_head;
      const int r0 = (item % blocks_per_head) * kRowBlock;
      const int nr = std::min(kRowBlock, M - r0);
      const std::size_t row0 = static_cast<std::size_t>(h) * M + r0;  // global row of the first query
      const int base = c.slot_offsets[h], S = c.slot_offsets[h + 1] - base;
      const std::int32_t* map = c.token_to_slot + static_cast<std::size_t>(h) * T;
      const std::size_t kv_off = static_cast<std::size_t>(h) * T * D;

      qf.resize(static_cast<std::size_t>(nr) * D);
      to_float(q, p.dtype, row0 * D, qf.size(), qf.data());

      // Full attention: logits, then e_t = exp(z_t - max) in place and row sums.
      z.resize(static_cast<std::size_t>(nr) * T);
      logits(qf.data(), nr, D, k, p.dtype, kv_off, T, scale, z.data(), T, scratch.data());
      slot_mass.assign(static_cast<std::size_t>(nr) * S, 0.0f);
      std::vector<double> sum(nr), ent(nr), mass(nr * kNumModalities, 0.0), surv(nr * kNumModalities, 0.0);
      for (int r = 0; r < nr; ++r) {
        float* zr = z.data() + static_cast<std::size_t>(r) * T;
        float* am = slot_mass.data() + static_cast<std::size_t>(r) * S;
        const float m = *std::max_element(zr, zr + T);
        double zs = 0.0, es = 0.0;
        for (int t = 0; t < T; ++t) {
          const float x = zr[t] - m;
          const float e = std::exp(x);
          zr[t] = e;
          zs += e;
          es += static_cast<double>(e) * x;
          mass[r * kNumModalities + modality[t]] += e;
          if (map[t] >= 0) {
            surv[r * kNumModalities + modality[t]] += e;
            am[map[t]] += e;
          }
        }
        sum[r] = zs;
        ent[r] = es;
      }
      o.assign(static_cast<std::size_t>(nr) * D, 0.0f);
      accumulate_pv(z.data(), T, nr, v, p.dtype, kv_off, T, D, o.data(), scratch.data());

      // Compressed attention over the S slots of head h.
      std::vector<double> csum(nr, 0.0), cent(nr, 0.0), cmass(nr * kNumModalities, 0.0);
      std::vector<float> cmax(nr, 0.0f);
      oc.assign(static_cast<std::size_t>(nr) * D, 0.0f);
      if (S > 0) {
        log_n.assign(S, 0.0f);
        if (p.proportional_attention) {
          for (int s = 0; s < S; ++s) {
            if (c.multiplicity_f32) log_n[s] = std::log(c.multiplicity_f32[base + s]);
            if (c.multiplicity_i32) log_n[s] = std::log(static_cast<float>(c.multiplicity_i32[base + s]));
          }
        }
        zc.resize(static_cast<std::size_t>(nr) * S);
        ec.resize(zc.size());
        const std::size_t slot_off = static_cast<std::size_t>(base) * D;
        logits(qf.data(), nr, D, c.k, DType::kF32, slot_off, S, scale, zc.data(), S, scratch.data());
        for (int r = 0; r < nr; ++r) {
          float* zr = zc.data() + static_cast<std::size_t>(r) * S;
          float* er = ec.data() + static_cast<std::size_t>(r) * S;
          for (int s = 0; s < S; ++s) zr[s] += log_n[s];
          const float m = *std::max_element(zr, zr + S);
          cmax[r] = m;
          for (int s = 0; s < S; ++s) {
            const float x = zr[s] - m;
            const float e = std::exp(x);
            er[s] = e;
            csum[r] += e;
            cent[r] += static_cast<double>(e) * x;
            cmass[r * kNumModalities + c.slot_modality[base + s]] += e;
          }
        }
        accumulate_pv(ec.data(), S, nr, c.v, DType::kF32, slot_off, S, D, oc.data(), scratch.data());
      }

      // Metrics per row.
      for (int r = 0; r < nr; ++r) {
        const std::size_t row = row0 + r;
        const float Z = static_cast<float>(sum[r]);
        const float Zc = static_cast<float>(csum[r]);
        double diff2 = 0.0, norm2 = 0.0;
        for (int d = 0; d < D; ++d) {
          const float od = o[static_cast<std::size_t>(r) * D + d] / Z;
          const float ocd = S > 0 ? oc[static_cast<std::size_t>(r) * D + d] / Zc : 0.0f;
          diff2 += static_cast<double>(ocd - od) * (ocd - od);
          norm2 += static_cast<double>(od) * od;
        }
        double survived = 0.0;
        for (int m = 0; m < kNumModalities; ++m) survived += surv[r * kNumModalities + m];
        double kl = 0.0;
        if (survived > 0.0 && S > 0) {
          const double log_surv = std::log(survived), log_zc = std::log(csum[r]);
          const float* am = slot_mass.data() + static_cast<std::size_t>(r) * S;
          const float* zr = zc.data() + static_cast<std::size_t>(r) * S;
          for (int s = 0; s < S; ++s) {
            if (!(am[s] > 0.0f)) continue;
            const double log_p = std::log(static_cast<double>(am[s])) - log_surv;
            const double log_pc = static_cast<double>(zr[s] - cmax[r]) - log_zc;
            kl += std::exp(log_p) * (log_p - log_pc);
          }
        }
        const double h_full = std::log(sum[r]) - ent[r] / sum[r];
        const double h_comp = S > 0 ? std::log(csum[r]) - cent[r] / csum[r] : 0.0;
        const double norm = std::sqrt(norm2), diff = std::sqrt(diff2);
        if (out.output_error) out.output_error[row] = static_cast<float>(norm > 0.0 ? diff / norm : diff);
        if (out.recall) out.recall[row] = static_cast<float>(survived / sum[r]);
        if (out.kl) out.kl[row] = static_cast<float>(kl);
        if (out.entropy_change) out.entropy_change[row] = static_cast<float>(h_comp - h_full);
        for (int m = 0; m < kNumModalities; ++m) {
          const std::size_t i = row * kNumModalities + m;
          const double full_m = mass[r * kNumModalities + m];
          if (out.recall_modality) {
            out.recall_modality[i] =
                static_cast<float>(full_m > 0.0 ? surv[r * kNumModalities + m] / full_m : 1.0);
          }
          if (out.mass_full) out.mass_full[i] = static_cast<float>(full_m / sum[r]);
          if (out.mass_compressed) {
            out.mass_compressed[i] =
                static_cast<float>(S > 0 ? cmass[r * kNumModalities + m] / csum[r] : 0.0);
          }
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
