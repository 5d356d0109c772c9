// CPU backend of compressed-cache evaluation (kvscope/kernels/evaluate.hpp).
// Work item: one kv head x a block of up to kRowBlock query rows (its GQA group's
// (q head, query) pairs stacked, [rows, D]). Q K^T and P V are single-threaded
// cblas_sgemm calls on fp32 copies (the full cache's K and V converted a chunk of
// kTokenChunk tokens at a time); OpenMP runs the work items in parallel with OpenBLAS
// kept at one thread.
// The full-cache side (full_attention) is computed once per layer and reused for
// every compressed cache. Math: docs/kernels/evaluate.md.
#include "kvscope/kernels/evaluate.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_rows.hpp"
#include "kvscope/kernels/blas_runtime.hpp"
#include "kvscope/kernels/nvtx.hpp"
#include "row_math.hpp"

namespace kvscope::kernels::cpu {
namespace {

using rowmath::to_float;

constexpr int kRowBlock = 64;  // query rows per work item
// Full-cache tokens per GEMM: a float chunk of K or V (256 KiB at D = 128) stays in
// L2 from its conversion to the GEMM's packing; a whole head (4 MiB at T = 8192)
// went through L3, shared by both cores.
constexpr int kTokenChunk = 512;

// Inputs outside float32's range (|q . k| / sqrt(D), a norm or an attention-weighted sum that
// overflows) make a row's metrics NaN or infinite: the row is flagged (one isfinite per row, off
// the vectorised loops) and the call fails with this message instead of returning such values.
// The CUDA backend flags the same rows with the same message.
constexpr const char* kNotFinite =
    "a metric is not finite in float32 (attention logits, norms or sums overflow: inputs outside the range "
    "this kernel computes in; outputs undefined)";

// max of x[0, n), n >= 1, with 16 independent lanes, so that it vectorises.
inline float row_max(const float* x, int n) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = x[0];
  int t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = lane[l] > x[t + l] ? lane[l] : x[t + l];
  for (; t < n; ++t) lane[0] = lane[0] > x[t] ? lane[0] : x[t];
  float m = lane[0];
  for (int l = 1; l < kLanes; ++l) m = m > lane[l] ? m : lane[l];
  return m;
}

// Elements [offset, offset + n) of a dtype tensor as float: the tensor itself for
// fp32, else a per-thread converted copy.
class FloatSpan {
 public:
  const float* get(const void* x, DType dt, std::size_t offset, std::size_t n) {
    if (dt == DType::kF32) return static_cast<const float*>(x) + offset;
    buf_.resize(n);
    to_float(x, dt, offset, n, buf_.data());
    return buf_.data();
  }

 private:
  std::vector<float> buf_;
};

// Work items: kv head h, rows [r0, r0 + nr) of its M = G * Nq stacked query rows;
// global row of local row r is h * M + r0 + r.
template <typename Body>
void for_each_row_block(const EvaluateParams& p, Body body) {
  pin_blas_to_one_thread();  // sgemm inside OpenMP regions, and results independent of the BLAS kernel
  const int Hkv = p.num_kv_heads;
  const int M = (p.num_q_heads / Hkv) * p.num_queries;
  const int blocks_per_head = (M + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    typename Body::Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < Hkv * blocks_per_head; ++item) {
      const int h = item / blocks_per_head;
      const int r0 = (item % blocks_per_head) * kRowBlock;
      body(h, static_cast<std::size_t>(h) * M + r0, std::min(kRowBlock, M - r0), scratch);
    }
  }
}

Status validate_sizes(const EvaluateParams& p, const std::string& f) {
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
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16) {
    return Status::Invalid(f + "unknown dtype");
  }
  return Status::Ok();
}

Status validate_modality(const std::uint8_t* modality, int T, const std::string& f) {
  if (!modality) return Status::Invalid(f + "modality must not be null");
  for (int t = 0; t < T; ++t) {
    if (modality[t] >= kNumModalities) {
      return Status::Invalid(f + "modality[" + std::to_string(t) + "] = " + std::to_string(modality[t]) +
                             " >= 4");
    }
  }
  return Status::Ok();
}

Status validate_cache(const EvaluateParams& p, const CompressedCache& c, const EvaluateOutputs& out) {
  const std::string f = "evaluate_attention: ";
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

// Thread-local buffers of a full_attention work item.
struct FullScratch {
  FloatSpan k, v;
  std::vector<float> q;  // [kRowBlock, D]
};

// Thread-local buffers of a compressed-evaluation work item.
struct CompressedScratch {
  std::vector<float> q, zc, ec, oc, log_n, slot_mass;  // [nr, D], [nr, S] x2, [nr, D], [S], [nr, S]
};

}  // namespace

Status full_attention(const EvaluateParams& p, const void* q, const void* k, const void* v,
                      const std::uint8_t* modality, const FullAttention& full) {
  KVSCOPE_NVTX_RANGE("cpu::full_attention", kEvaluate);
  const std::string f = "full_attention: ";
  KVSCOPE_RETURN_IF_ERROR(validate_sizes(p, f));
  if (!q || !k || !v) return Status::Invalid(f + "q, k and v must not be null");
  if (!full.probs || !full.output || !full.entropy) {
    return Status::Invalid(f + "full.probs, full.output and full.entropy must not be null");
  }
  if (full.modality_mass) KVSCOPE_RETURN_IF_ERROR(validate_modality(modality, p.num_tokens, f));
  const int T = p.num_tokens, D = p.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  struct Body {
    using Scratch = FullScratch;
    const EvaluateParams& p;
    const void *q, *k, *v;
    const std::uint8_t* modality;
    const FullAttention& full;
    int T, D;
    float scale;
    std::atomic<bool>* not_finite;
    void operator()(int h, std::size_t row0, int nr, Scratch& s) const {
      s.q.resize(static_cast<std::size_t>(nr) * D);
      to_float(q, p.dtype, row0 * D, s.q.size(), s.q.data());
      float* z = full.probs + row0 * T;  // logits, then probabilities, in place
      const std::size_t head = static_cast<std::size_t>(h) * T * D;
      for (int t0 = 0; t0 < T; t0 += kTokenChunk) {
        const int tc = std::min(kTokenChunk, T - t0);
        const float* kc =
            s.k.get(k, p.dtype, head + static_cast<std::size_t>(t0) * D, static_cast<std::size_t>(tc) * D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, tc, D, scale, s.q.data(), D, kc, D, 0.0f,
                    z + t0, T);
      }
      for (int r = 0; r < nr; ++r) {
        float* zr = z + static_cast<std::size_t>(r) * T;
        const float m = row_max(zr, T);
        // e_t = exp(z_t - m); Z = sum e; H = log Z - sum e (z - m) / Z.
        double zs = 0.0, es = 0.0;
        rowmath::softmax_numerators(zr, T, m, zr, &zs, &es, nullptr, nullptr);
        const float inv = static_cast<float>(1.0 / zs);
        for (int t = 0; t < T; ++t) zr[t] *= inv;
        full.entropy[row0 + r] = static_cast<float>(std::log(zs) - es / zs);
        if (!std::isfinite(full.entropy[row0 + r])) not_finite->store(true, std::memory_order_relaxed);
        if (full.modality_mass) {
          double mass[kNumModalities] = {0.0, 0.0, 0.0, 0.0};
          for (int t = 0; t < T; ++t) mass[modality[t]] += zr[t];
          for (int mm = 0; mm < kNumModalities; ++mm) {
            full.modality_mass[(row0 + r) * kNumModalities + mm] = static_cast<float>(mass[mm]);
          }
        }
      }
      // o = P V, accumulated over the same token chunks.
      for (int t0 = 0; t0 < T; t0 += kTokenChunk) {
        const int tc = std::min(kTokenChunk, T - t0);
        const float* vc =
            s.v.get(v, p.dtype, head + static_cast<std::size_t>(t0) * D, static_cast<std::size_t>(tc) * D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, D, tc, 1.0f, z + t0, T, vc, D,
                    t0 == 0 ? 0.0f : 1.0f, full.output + row0 * D, D);
      }
    }
  };
  std::atomic<bool> not_finite{false};
  for_each_row_block(p, Body{p, q, k, v, modality, full, T, D, scale, &not_finite});
  if (not_finite.load()) return Status::Invalid(f + kNotFinite);
  return Status::Ok();
}

Status evaluate_attention(const EvaluateParams& p, const void* q, const std::uint8_t* modality,
                          const FullAttention& full, const CompressedCache& c, const EvaluateOutputs& out) {
  KVSCOPE_NVTX_RANGE("cpu::evaluate_attention", kEvaluate);
  const std::string f = "evaluate_attention: ";
  KVSCOPE_RETURN_IF_ERROR(validate_sizes(p, f));
  if (!q) return Status::Invalid(f + "q must not be null");
  if (!full.probs || !full.output || !full.entropy) {
    return Status::Invalid(f + "full.probs, full.output and full.entropy must not be null");
  }
  KVSCOPE_RETURN_IF_ERROR(validate_modality(modality, p.num_tokens, f));
  KVSCOPE_RETURN_IF_ERROR(validate_cache(p, c, out));
  const int T = p.num_tokens, D = p.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  struct Body {
    using Scratch = CompressedScratch;
    const EvaluateParams& p;
    const void* q;
    const std::uint8_t* modality;
    const FullAttention& full;
    const CompressedCache& c;
    const EvaluateOutputs& out;
    int T, D;
    float scale;
    std::atomic<bool>* not_finite;
    void operator()(int h, std::size_t row0, int nr, Scratch& s) const {
      const int base = c.slot_offsets[h], S = c.slot_offsets[h + 1] - base;
      const std::int32_t* map = c.token_to_slot + static_cast<std::size_t>(h) * T;
      // Compressed attention over the S slots of head h: logits + log n_s, softmax
      // numerators e (max subtracted), their sums and o~ = E V~ (unnormalised).
      std::vector<double> csum(nr, 0.0), cent(nr, 0.0), cmass(nr * kNumModalities, 0.0);
      std::vector<float> cmax(nr, 0.0f);
      s.oc.assign(static_cast<std::size_t>(nr) * D, 0.0f);
      if (S > 0) {
        s.q.resize(static_cast<std::size_t>(nr) * D);
        to_float(q, p.dtype, row0 * D, s.q.size(), s.q.data());
        s.log_n.assign(S, 0.0f);
        if (p.proportional_attention) {
          for (int k = 0; k < S; ++k) {
            if (c.multiplicity_f32) s.log_n[k] = std::log(c.multiplicity_f32[base + k]);
            if (c.multiplicity_i32) s.log_n[k] = std::log(static_cast<float>(c.multiplicity_i32[base + k]));
          }
        }
        s.zc.resize(static_cast<std::size_t>(nr) * S);
        s.ec.resize(s.zc.size());
        const float* slot_k = c.k + static_cast<std::size_t>(base) * D;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, S, D, scale, s.q.data(), D, slot_k, D, 0.0f,
                    s.zc.data(), S);
        for (int r = 0; r < nr; ++r) {
          float* zr = s.zc.data() + static_cast<std::size_t>(r) * S;
          float* er = s.ec.data() + static_cast<std::size_t>(r) * S;
          for (int k = 0; k < S; ++k) zr[k] += s.log_n[k];
          const float m = row_max(zr, S);
          cmax[r] = m;
          double zs = 0.0, es = 0.0;
          rowmath::softmax_numerators(zr, S, m, er, &zs, &es, c.slot_modality + base,
                                      &cmass[r * kNumModalities]);
          csum[r] = zs;
          cent[r] = es;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, D, S, 1.0f, s.ec.data(), S,
                    c.v + static_cast<std::size_t>(base) * D, D, 0.0f, s.oc.data(), D);
      }
      s.slot_mass.assign(static_cast<std::size_t>(nr) * S, 0.0f);
      for (int r = 0; r < nr; ++r) {
        const std::size_t row = row0 + r;
        const float* pr = full.probs + row * T;
        // Full probabilities per modality, over surviving tokens, and per slot.
        double mass[kNumModalities], surv[kNumModalities];
        rowmath::modality_sums(pr, modality, map, T, mass, surv);
        float* am = s.slot_mass.data() + static_cast<std::size_t>(r) * S;
        for (int t = 0; t < T; ++t) {
          if (map[t] >= 0) am[map[t]] += pr[t];
        }
        const double total = (mass[0] + mass[1]) + (mass[2] + mass[3]);
        const float Zc = static_cast<float>(csum[r]);
        const float* o = full.output + row * D;
        double diff2 = 0.0, norm2 = 0.0;
        for (int d = 0; d < D; ++d) {
          const float od = o[d];
          const float ocd = S > 0 ? s.oc[static_cast<std::size_t>(r) * D + d] / Zc : 0.0f;
          diff2 += static_cast<double>(ocd - od) * (ocd - od);
          norm2 += static_cast<double>(od) * od;
        }
        const double survived = (surv[0] + surv[1]) + (surv[2] + surv[3]);
        double kl = 0.0;
        if (out.kl && survived > 0.0 && S > 0) {
          const double log_surv = std::log(survived), log_zc = std::log(csum[r]);
          kl = rowmath::kl_row(am, s.zc.data() + static_cast<std::size_t>(r) * S, S, cmax[r], survived,
                               log_surv, log_zc);
        }
        const double h_comp = S > 0 ? std::log(csum[r]) - cent[r] / csum[r] : 0.0;
        const double norm = std::sqrt(norm2), diff = std::sqrt(diff2);
        const float err = static_cast<float>(norm > 0.0 ? diff / norm : diff);
        const float rec = static_cast<float>(survived / total);
        const float dent = static_cast<float>(h_comp - static_cast<double>(full.entropy[row]));
        // Every output of the row in one sum: NaN or infinite if any of them is.
        double check = static_cast<double>(err) + rec + static_cast<float>(kl) + dent;
        if (out.output_error) out.output_error[row] = err;
        if (out.recall) out.recall[row] = rec;
        if (out.kl) out.kl[row] = static_cast<float>(kl);
        if (out.entropy_change) out.entropy_change[row] = dent;
        for (int m = 0; m < kNumModalities; ++m) {
          const std::size_t i = row * kNumModalities + m;
          const float rm = static_cast<float>(mass[m] > 0.0 ? surv[m] / mass[m] : 1.0);
          const float mf = static_cast<float>(mass[m] / total);
          const float mc = static_cast<float>(S > 0 ? cmass[r * kNumModalities + m] / csum[r] : 0.0);
          check += static_cast<double>(rm) + mf + mc;
          if (out.recall_modality) out.recall_modality[i] = rm;
          if (out.mass_full) out.mass_full[i] = mf;
          if (out.mass_compressed) out.mass_compressed[i] = mc;
        }
        if (!std::isfinite(check)) not_finite->store(true, std::memory_order_relaxed);
      }
    }
  };
  std::atomic<bool> not_finite{false};
  for_each_row_block(p, Body{p, q, modality, full, c, out, T, D, scale, &not_finite});
  if (not_finite.load()) return Status::Invalid(f + kNotFinite);
  return Status::Ok();
}

Status evaluate_attention(const EvaluateParams& p, const void* q, const void* k, const void* v,
                          const std::uint8_t* modality, const CompressedCache& c,
                          const EvaluateOutputs& out) {
  KVSCOPE_NVTX_RANGE("cpu::evaluate_attention", kEvaluate);
  const std::string f = "evaluate_attention: ";
  KVSCOPE_RETURN_IF_ERROR(validate_sizes(p, f));
  if (!q || !k || !v || !modality) return Status::Invalid(f + "q, k, v and modality must not be null");
  KVSCOPE_RETURN_IF_ERROR(validate_modality(modality, p.num_tokens, f));
  KVSCOPE_RETURN_IF_ERROR(validate_cache(p, c, out));
  const std::size_t rows = static_cast<std::size_t>(p.num_q_heads) * p.num_queries;
  std::vector<float> probs(rows * p.num_tokens), output(rows * p.head_dim), entropy(rows);
  const FullAttention full{probs.data(), output.data(), entropy.data(), nullptr};
  KVSCOPE_RETURN_IF_ERROR(full_attention(p, q, k, v, modality, full));
  return evaluate_attention(p, q, modality, full, c, out);
}

}  // namespace kvscope::kernels::cpu
