// Straightforward float64 reference of the quantization family, written from the
// specification in docs/kernels/quantize.md (not from the kernels): group ids by
// explicit formulas, scales and codes in double, code fields unpacked bit by bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <vector>

#include "kvscope/kernels/quantize.hpp"

namespace kvscope::testing {

using kernels::Granularity;
using kernels::QuantSpec;

struct RefShape {
  int heads, tokens, dim;
};

inline int ref_quant_tokens(const QuantSpec& s, const RefShape& sh) {
  return sh.tokens - std::min(s.residual_tokens, sh.tokens);
}

// Group (scale index) of quantized element (h, t, i).
inline std::int64_t ref_group(const QuantSpec& s, const RefShape& sh, int h, int t, int i) {
  const std::int64_t tq = ref_quant_tokens(s, sh);
  switch (s.granularity) {
    case Granularity::kPerTensor:
      return 0;
    case Granularity::kPerHead:
      return h;
    case Granularity::kPerToken: {
      const std::int64_t g = s.group_size > 0 ? s.group_size : sh.dim;
      const std::int64_t per_row = (sh.dim + g - 1) / g;
      return (h * tq + t) * per_row + i / g;
    }
    case Granularity::kPerChannel: {
      const std::int64_t g = s.group_size > 0 ? s.group_size : tq;
      const std::int64_t token_groups = (tq + g - 1) / g;
      return (h * token_groups + t / g) * sh.dim + i;
    }
  }
  return -1;
}

inline std::int64_t ref_num_groups(const QuantSpec& s, const RefShape& sh) {
  const std::int64_t tq = ref_quant_tokens(s, sh);
  switch (s.granularity) {
    case Granularity::kPerTensor:
      return 1;
    case Granularity::kPerHead:
      return sh.heads;
    case Granularity::kPerToken: {
      const std::int64_t g = s.group_size > 0 ? s.group_size : sh.dim;
      return sh.heads * tq * ((sh.dim + g - 1) / g);
    }
    case Granularity::kPerChannel: {
      if (tq == 0) return 0;
      const std::int64_t g = s.group_size > 0 ? s.group_size : tq;
      return sh.heads * ((tq + g - 1) / g) * sh.dim;
    }
  }
  return 0;
}

struct RefQuant {
  std::vector<double> scales, zeros;  // [num_groups]
  std::vector<int> codes;             // [heads, Tq, dim], signed for symmetric
  std::vector<double> deq;            // [heads, tokens, dim]
  std::vector<double> ratio;          // [heads, Tq, dim]: (x - zero) / scale before rounding (0 if scale 0)
};

// x: [heads, tokens, dim] as doubles (the values the input dtype represents).
inline RefQuant reference_quantize(const QuantSpec& s, const RefShape& sh, const std::vector<double>& x) {
  const int tq = ref_quant_tokens(s, sh);
  const std::int64_t ng = ref_num_groups(s, sh);
  std::vector<double> mn(ng, std::numeric_limits<double>::infinity()),
      mx(ng, -std::numeric_limits<double>::infinity());
  auto at = [&](int h, int t, int i) { return (static_cast<std::int64_t>(h) * sh.tokens + t) * sh.dim + i; };
  for (int h = 0; h < sh.heads; ++h)
    for (int t = 0; t < tq; ++t)
      for (int i = 0; i < sh.dim; ++i) {
        const std::int64_t g = ref_group(s, sh, h, t, i);
        mn[g] = std::min(mn[g], x[at(h, t, i)]);
        mx[g] = std::max(mx[g], x[at(h, t, i)]);
      }
  const double levels = s.symmetric ? (1 << (s.bits - 1)) - 1 : (1 << s.bits) - 1;
  RefQuant r;
  r.scales.assign(ng, 0.0);
  r.zeros.assign(ng, 0.0);
  for (std::int64_t g = 0; g < ng; ++g) {
    if (mn[g] > mx[g]) mn[g] = mx[g] = 0.0;  // empty group (all tokens residual)
    if (s.symmetric) {
      const double amax = std::max(std::fabs(mn[g]), std::fabs(mx[g]));
      r.scales[g] = mn[g] == mx[g] ? amax : amax / levels;  // constant group: codes +-1, exact
    } else {
      r.scales[g] = (mx[g] - mn[g]) / levels;
      r.zeros[g] = mn[g];
    }
  }
  const double lo = s.symmetric ? -levels : 0.0, hi = levels;
  r.codes.assign(static_cast<std::size_t>(sh.heads) * tq * sh.dim, 0);
  r.ratio.assign(r.codes.size(), 0.0);
  r.deq = x;
  for (int h = 0; h < sh.heads; ++h)
    for (int t = 0; t < tq; ++t)
      for (int i = 0; i < sh.dim; ++i) {
        const std::int64_t g = ref_group(s, sh, h, t, i);
        const std::size_t c = (static_cast<std::size_t>(h) * tq + t) * sh.dim + i;
        int q = 0;
        if (r.scales[g] > 0.0) {
          r.ratio[c] = (x[at(h, t, i)] - r.zeros[g]) / r.scales[g];
          q = static_cast<int>(std::clamp(std::round(r.ratio[c]), lo, hi));  // half away from zero
        }
        r.codes[c] = q;
        r.deq[at(h, t, i)] = r.zeros[g] + q * r.scales[g];
      }
  return r;
}

// Code of element i of a packed row: bits [i*b, i*b + b) of the row, little-endian bit order.
inline int ref_unpack(const std::uint8_t* row, int i, int bits, bool symmetric) {
  int u = 0;
  for (int k = 0; k < bits; ++k) {
    const int bit = i * bits + k;
    u |= ((row[bit / 8] >> (bit % 8)) & 1) << k;
  }
  if (symmetric && u >= (1 << (bits - 1))) u -= 1 << bits;
  return u;
}

}  // namespace kvscope::testing
