// CPU backend of the token scores (OpenMP over heads x tokens).
#include "kvscope/kernels/scores.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cpu {
namespace {

// Below this many elementary operations a loop runs on the calling thread.
constexpr double kMinParallelWork = 32768.0;

Status validate_keys(const KeyTensor& k, const char* fn) {
  const std::string f(fn);
  if (k.k == nullptr) return Status::Invalid(f + ": k is null");
  if (k.num_heads <= 0 || k.num_tokens <= 0 || k.head_dim <= 0) {
    return Status::Invalid(f + ": sizes must be positive (num_heads " + std::to_string(k.num_heads) +
                           ", num_tokens " + std::to_string(k.num_tokens) + ", head_dim " +
                           std::to_string(k.head_dim) + ")");
  }
  if (k.dtype != DType::kF32 && k.dtype != DType::kF16 && k.dtype != DType::kBF16) {
    return Status::Invalid(f + ": unknown dtype");
  }
  return Status::Ok();
}

// Key row (h, t) as float into dst[head_dim].
void load_key(const KeyTensor& k, int h, int t, float* dst) {
  const std::size_t base = (static_cast<std::size_t>(h) * k.num_tokens + t) * k.head_dim;
  for (int d = 0; d < k.head_dim; ++d) dst[d] = load_element(k.k, k.dtype, base + d);
}

// Dot product with 8 independent fp32 partial sums (vectorisable, fixed order).
float dot(const float* a, const float* b, int n) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[d + l] * b[d + l];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Dense (row, col) -> token table of one segment.
struct SegmentGrid {
  int min_row = 0, min_col = 0, rows = 0, cols = 0;
  std::vector<std::int32_t> cell;  // [rows * cols], -1 = empty
  std::int32_t at(long long r, long long c) const {
    r -= min_row;
    c -= min_col;
    if (r < 0 || c < 0 || r >= rows || c >= cols) return -1;
    return cell[static_cast<std::size_t>(r * cols + c)];
  }
};

constexpr long long kMaxGridCells = 1LL << 26;

}  // namespace

Status key_norms(const KeyTensor& k, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::key_norms", kScores);
  KVSCOPE_RETURN_IF_ERROR(validate_keys(k, "key_norms"));
  if (out == nullptr) return Status::Invalid("key_norms: out is null");
#pragma omp parallel if (static_cast <double>(k.num_heads) * k.num_tokens * k.head_dim >= kMinParallelWork)
  {
    std::vector<float> row(k.head_dim);
#pragma omp for schedule(static)
    for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(k.num_heads) * k.num_tokens; ++e) {
      load_key(k, static_cast<int>(e / k.num_tokens), static_cast<int>(e % k.num_tokens), row.data());
      out[e] = std::sqrt(dot(row.data(), row.data(), k.head_dim));
    }
  }
  return Status::Ok();
}

Status build_neighbour_lists(const TokenGrid& grid, const RedundancyParams& params, NeighbourTable* out) {
  KVSCOPE_NVTX_RANGE("cpu::build_neighbour_lists", kScores);
  const int T = grid.num_tokens;
  if (out == nullptr) return Status::Invalid("build_neighbour_lists: out is null");
  if (T <= 0)
    return Status::Invalid("build_neighbour_lists: num_tokens " + std::to_string(T) + " must be positive");
  if (params.seq_radius < 0 || params.grid_radius < 0) {
    return Status::Invalid("build_neighbour_lists: seq_radius " + std::to_string(params.seq_radius) +
                           " and grid_radius " + std::to_string(params.grid_radius) + " must be >= 0");
  }
  if ((grid.row == nullptr) != (grid.col == nullptr)) {
    return Status::Invalid("build_neighbour_lists: row and col must both be given or both be null");
  }
  auto is_grid = [&](int t) { return grid.row != nullptr && grid.row[t] >= 0 && grid.col[t] >= 0; };
  auto segment_of = [&](int t) { return grid.segment != nullptr ? grid.segment[t] : 0; };

  // Per-segment bounding boxes, then dense lookup tables.
  std::map<std::int32_t, SegmentGrid> segments;
  for (int t = 0; t < T; ++t) {
    if (!is_grid(t)) continue;
    auto [it, fresh] = segments.try_emplace(segment_of(t));
    SegmentGrid& g = it->second;
    if (fresh) {
      g.min_row = grid.row[t], g.min_col = grid.col[t];
      g.rows = g.cols = 1;
      continue;
    }
    const int r0 = std::min(g.min_row, grid.row[t]), c0 = std::min(g.min_col, grid.col[t]);
    const int r1 = std::max(g.min_row + g.rows - 1, grid.row[t]),
              c1 = std::max(g.min_col + g.cols - 1, grid.col[t]);
    g.min_row = r0, g.min_col = c0, g.rows = r1 - r0 + 1, g.cols = c1 - c0 + 1;
  }
  for (auto& [seg, g] : segments) {
    if (static_cast<long long>(g.rows) * g.cols > kMaxGridCells) {
      return Status::Invalid("build_neighbour_lists: segment " + std::to_string(seg) + " grid spans " +
                             std::to_string(g.rows) + " x " + std::to_string(g.cols) + " cells (limit 2^26)");
    }
    g.cell.assign(static_cast<std::size_t>(g.rows) * g.cols, -1);
  }
  for (int t = 0; t < T; ++t) {
    if (!is_grid(t)) continue;
    SegmentGrid& g = segments[segment_of(t)];
    std::int32_t& c =
        g.cell[static_cast<std::size_t>(grid.row[t] - g.min_row) * g.cols + (grid.col[t] - g.min_col)];
    if (c >= 0) {
      return Status::Invalid("build_neighbour_lists: tokens " + std::to_string(c) + " and " +
                             std::to_string(t) + " share grid cell (" + std::to_string(grid.row[t]) + ", " +
                             std::to_string(grid.col[t]) + ") of segment " + std::to_string(segment_of(t)));
    }
    c = t;
  }

  out->offsets.assign(1, 0);
  out->offsets.reserve(static_cast<std::size_t>(T) + 1);
  out->indices.clear();
  const int R = params.grid_radius, K = params.seq_radius;
  for (int t = 0; t < T; ++t) {
    if (is_grid(t)) {
      const SegmentGrid& g = segments.find(segment_of(t))->second;
      for (long long r = static_cast<long long>(grid.row[t]) - R;
           r <= static_cast<long long>(grid.row[t]) + R; ++r) {
        for (long long c = static_cast<long long>(grid.col[t]) - R;
             c <= static_cast<long long>(grid.col[t]) + R; ++c) {
          const std::int32_t u = g.at(r, c);
          if (u >= 0 && u != t) out->indices.push_back(u);
        }
      }
    } else {
      for (int u = std::max(0, t - K); u <= std::min(T - 1, t + K); ++u) {
        if (u != t) out->indices.push_back(u);
      }
    }
    out->offsets.push_back(static_cast<std::int32_t>(out->indices.size()));
  }
  return Status::Ok();
}

Status redundancy(const KeyTensor& k, const NeighbourLists& nb, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::redundancy", kScores);
  KVSCOPE_RETURN_IF_ERROR(validate_keys(k, "redundancy"));
  if (out == nullptr) return Status::Invalid("redundancy: out is null");
  if (nb.offsets == nullptr || nb.num_tokens != k.num_tokens) {
    return Status::Invalid("redundancy: neighbour lists missing or built for " +
                           std::to_string(nb.num_tokens) + " tokens, keys have " +
                           std::to_string(k.num_tokens));
  }
  const int T = k.num_tokens;
  if (nb.offsets[0] != 0) return Status::Invalid("redundancy: neighbour offsets[0] must be 0");
  for (int t = 0; t < T; ++t) {
    if (nb.offsets[t + 1] < nb.offsets[t]) {
      return Status::Invalid("redundancy: neighbour offsets decrease at token " + std::to_string(t));
    }
  }
  if (nb.offsets[T] > 0 && nb.indices == nullptr)
    return Status::Invalid("redundancy: neighbour indices is null");
  for (std::int32_t e = 0; e < nb.offsets[T]; ++e) {
    if (nb.indices[e] < 0 || nb.indices[e] >= T) {
      return Status::Invalid("redundancy: neighbour index " + std::to_string(nb.indices[e]) +
                             " outside [0, " + std::to_string(T) + ")");
    }
  }
  const int D = k.head_dim;
  std::vector<float> norms(static_cast<std::size_t>(k.num_heads) * T);
  KVSCOPE_RETURN_IF_ERROR(key_norms(k, norms.data()));
#pragma omp parallel if (static_cast <double>(k.num_heads) * (nb.offsets[T] + T) * D >= kMinParallelWork)
  {
    std::vector<float> a(D), b(D);
#pragma omp for schedule(dynamic, 16)
    for (std::ptrdiff_t e = 0; e < static_cast<std::ptrdiff_t>(k.num_heads) * T; ++e) {
      const int h = static_cast<int>(e / T), t = static_cast<int>(e % T);
      const float* hn = norms.data() + static_cast<std::size_t>(h) * T;
      load_key(k, h, t, a.data());
      float best = 0.0f;
      bool any = false;
      for (std::int32_t n = nb.offsets[t]; n < nb.offsets[t + 1]; ++n) {
        const int u = nb.indices[n];
        load_key(k, h, u, b.data());
        const float c = detail::cosine_from(dot(a.data(), b.data(), D), hn[t], hn[u]);
        best = any ? std::max(best, c) : c;
        any = true;
      }
      out[e] = best;
    }
  }
  return Status::Ok();
}

Status redundancy(const KeyTensor& k, const TokenGrid& grid, const RedundancyParams& params, float* out) {
  NeighbourTable table;
  KVSCOPE_RETURN_IF_ERROR(build_neighbour_lists(grid, params, &table));
  return redundancy(k, table.view(), out);
}

Status unicache_score(const UniCacheInputs& in, const UniCacheParams& p, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::unicache_score", kScores);
  if (in.attention == nullptr || in.modality == nullptr || out == nullptr) {
    return Status::Invalid("unicache_score: attention, modality and out must not be null");
  }
  if (in.num_heads <= 0 || in.num_tokens <= 0) {
    return Status::Invalid("unicache_score: num_heads " + std::to_string(in.num_heads) + " and num_tokens " +
                           std::to_string(in.num_tokens) + " must be positive");
  }
  if (p.recency == RecencyKind::kExponential && !(p.recency_tau > 0.0f)) {
    return Status::Invalid("unicache_score: recency_tau " + std::to_string(p.recency_tau) + " must be > 0");
  }
  const int T = in.num_tokens;
  for (int t = 0; t < T; ++t) {
    if (in.modality[t] >= kNumModalities) {
      return Status::Invalid("unicache_score: modality[" + std::to_string(t) +
                             "] = " + std::to_string(in.modality[t]) + " is not a modality code 0..3");
    }
  }
#pragma omp parallel for schedule(dynamic, 1) if (static_cast <double>(in.num_heads) * T >= kMinParallelWork)
  for (int h = 0; h < in.num_heads; ++h) {
    const std::size_t base = static_cast<std::size_t>(h) * T;
    const float* a = in.attention + base;
    const float* c = in.cross != nullptr ? in.cross + base : nullptr;
    const float* d = in.redundancy != nullptr ? in.redundancy + base : nullptr;
    float a_lo[kNumModalities], a_hi[kNumModalities], c_lo[kNumModalities], c_hi[kNumModalities];
    for (int m = 0; m < kNumModalities; ++m) {
      a_lo[m] = c_lo[m] = INFINITY;
      a_hi[m] = c_hi[m] = -INFINITY;
    }
    for (int t = 0; t < T; ++t) {
      const int m = in.modality[t];
      a_lo[m] = std::min(a_lo[m], a[t]);
      a_hi[m] = std::max(a_hi[m], a[t]);
      if (c != nullptr) {
        c_lo[m] = std::min(c_lo[m], c[t]);
        c_hi[m] = std::max(c_hi[m], c[t]);
      }
    }
    for (int t = 0; t < T; ++t) {
      const int m = in.modality[t];
      const float an = detail::normalize_in_group(a[t], a_lo[m], a_hi[m], p.normalize);
      const float cn = c != nullptr ? detail::normalize_in_group(c[t], c_lo[m], c_hi[m], p.normalize) : 0.0f;
      const float dn = d != nullptr ? std::min(std::max(d[t], 0.0f), 1.0f) : 0.0f;
      float r;
      if (p.recency == RecencyKind::kLinear) {
        r = T > 1 ? static_cast<float>(t) / static_cast<float>(T - 1) : 1.0f;
      } else {
        r = std::exp(-static_cast<float>(T - 1 - t) / p.recency_tau);
      }
      // Separate products and sums (no fused multiply-add) so CUDA can match bit for bit.
      const float wa = p.w_a * an, wc = p.w_c * cn, wd = p.w_d * dn, wr = p.w_r * r;
      out[base + t] = ((wa + wc) - wd) + wr;
    }
  }
  return Status::Ok();
}

}  // namespace kvscope::kernels::cpu
