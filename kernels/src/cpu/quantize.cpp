// CPU backend of the quantization family (OpenMP over code rows).
// The scalar math lives in quant_math (quantize.hpp), shared with the CUDA backend.
#include "kvscope/kernels/quantize.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels {

Status validate_quant(const QuantSpec& spec, const QuantShape& shape) {
  if (spec.bits != 8 && spec.bits != 4 && spec.bits != 2) {
    return Status::Invalid("quantize: bits " + std::to_string(spec.bits) + " not supported (8, 4 or 2)");
  }
  const int g = static_cast<int>(spec.granularity);
  if (g < 0 || g > static_cast<int>(Granularity::kPerChannel)) {
    return Status::Invalid("quantize: granularity " + std::to_string(g) + " unknown");
  }
  if (spec.group_size < 0) {
    return Status::Invalid("quantize: group_size " + std::to_string(spec.group_size) + " negative");
  }
  if (spec.group_size != 0 &&
      (spec.granularity == Granularity::kPerTensor || spec.granularity == Granularity::kPerHead)) {
    return Status::Invalid(std::string("quantize: group_size ") + std::to_string(spec.group_size) +
                           " with granularity " + granularity_name(spec.granularity) +
                           " (groups need per_token or per_channel)");
  }
  if (spec.residual_tokens < 0) {
    return Status::Invalid("quantize: residual_tokens " + std::to_string(spec.residual_tokens) + " negative");
  }
  if (shape.num_heads <= 0)
    return Status::Invalid("quantize: num_heads " + std::to_string(shape.num_heads) + " <= 0");
  if (shape.tokens <= 0) return Status::Invalid("quantize: tokens " + std::to_string(shape.tokens) + " <= 0");
  if (shape.head_dim <= 0)
    return Status::Invalid("quantize: head_dim " + std::to_string(shape.head_dim) + " <= 0");
  const int d = static_cast<int>(shape.dtype);
  if (d < 0 || d > static_cast<int>(DType::kBF16)) {
    return Status::Invalid("quantize: dtype " + std::to_string(d) + " unknown");
  }
  return Status::Ok();
}

Status quant_layout(const QuantSpec& spec, const QuantShape& shape, QuantLayout* layout) {
  KVSCOPE_RETURN_IF_ERROR(validate_quant(spec, shape));
  if (layout == nullptr) return Status::Invalid("quant_layout: layout is null");
  QuantLayout l;
  const std::int64_t h = shape.num_heads, t = shape.tokens, d = shape.head_dim;
  l.residual_tokens = std::min<std::int64_t>(spec.residual_tokens, t);
  l.quant_tokens = t - l.residual_tokens;
  l.row_bytes = (d * spec.bits + 7) / 8;
  switch (spec.granularity) {
    case Granularity::kPerTensor:
      l.num_groups = 1;
      break;
    case Granularity::kPerHead:
      l.num_groups = h;
      break;
    case Granularity::kPerToken:
      l.group_size = spec.group_size > 0 ? spec.group_size : d;
      l.groups_per_row = (d + l.group_size - 1) / l.group_size;
      l.num_groups = h * l.quant_tokens * l.groups_per_row;
      break;
    case Granularity::kPerChannel:
      l.group_size = spec.group_size > 0 ? spec.group_size : l.quant_tokens;
      l.groups_per_row = l.quant_tokens > 0 ? (l.quant_tokens + l.group_size - 1) / l.group_size : 0;
      l.num_groups = h * l.groups_per_row * d;
      break;
  }
  l.code_bytes = h * l.quant_tokens * l.row_bytes;
  l.scale_bytes = l.num_groups * static_cast<std::int64_t>(sizeof(float));
  l.zero_bytes = spec.symmetric ? 0 : l.scale_bytes;
  l.residual_bytes = h * l.residual_tokens * d * static_cast<std::int64_t>(dtype_bytes(shape.dtype));
  *layout = l;
  return Status::Ok();
}

QuantBytes quantized_bytes(const QuantSpec& spec, int num_heads, int tokens, int head_dim, DType input) {
  QuantLayout l;
  if (!quant_layout(spec, QuantShape{num_heads, tokens, head_dim, input}, &l).ok()) return {};
  return QuantBytes{l.code_bytes, l.scale_bytes, l.zero_bytes, l.residual_bytes, l.total_bytes()};
}

namespace cpu {
namespace {

using quant_math::max_f;
using quant_math::min_f;

// Below this many elements the OpenMP fork/join costs more than it saves.
constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 16;

// dst[0..n) = elements [offset, offset + n) of x, converted to float.
void load_row(const void* x, DType t, std::int64_t offset, int n, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(x) + offset, static_cast<std::size_t>(n) * sizeof(float));
  } else if (t == DType::kF16) {
    // Same values as half_to_float (every bit pattern, tested), written branch-free so it vectorizes.
    const std::uint16_t* p = static_cast<const std::uint16_t*>(x) + offset;
    for (int i = 0; i < n; ++i) {
      const std::uint32_t h = p[i], sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
      // Normal: rebias the exponent (15 -> 127); Inf/NaN: exponent 31 -> 255.
      const std::uint32_t normal =
          (em << 13) + 0x38000000u + static_cast<std::uint32_t>(em >= 0x7c00u) * 0x38000000u;
      // Zero and subnormal: mantissa * 2^-24, exact in float.
      const std::uint32_t sub =
          float_to_bits(static_cast<float>(static_cast<std::int32_t>(em)) * 5.9604644775390625e-8f);
      const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(em < 0x400u);  // all ones or 0
      dst[i] = bits_to_float(((sub & is_sub) | (normal & ~is_sub)) | sign);
    }
  } else {
    const std::uint16_t* p = static_cast<const std::uint16_t*>(x) + offset;
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(p[i]);
  }
}

// Everything the row loops need, derived once from spec + shape + layout.
struct Plan {
  QuantSpec spec;
  QuantShape shape;
  QuantLayout layout;
  int lo = 0, hi = 0;     // code range
  bool parallel = false;  // worth a parallel region (small tensors run serially)
  std::int64_t row_offset(std::int64_t h, std::int64_t t) const {
    return (h * shape.tokens + t) * shape.head_dim;
  }
};

Plan make_plan(const QuantSpec& spec, const QuantShape& shape, const QuantLayout& layout) {
  const std::int64_t elements = static_cast<std::int64_t>(shape.num_heads) * shape.tokens * shape.head_dim;
  return Plan{spec,
              shape,
              layout,
              quant_math::code_min(spec.bits, spec.symmetric),
              quant_math::code_max(spec.bits, spec.symmetric),
              elements >= kParallelMinElements};
}

void set_params(const Plan& p, std::int64_t group, float mn, float mx, float* scales, float* zeros) {
  float s = 0.0f, z = 0.0f;
  quant_math::group_params(mn, mx, p.spec.bits, p.spec.symmetric, &s, &z);
  scales[group] = s;
  if (zeros != nullptr) zeros[group] = z;
}

// Group minima/maxima -> scales (and zeros when asymmetric; zeros may be null when symmetric).
void compute_params(const Plan& p, const void* x, float* scales, float* zeros) {
  const std::int64_t H = p.shape.num_heads, Tq = p.layout.quant_tokens, D = p.shape.head_dim;
  const int d = p.shape.head_dim;
  const DType dt = p.shape.dtype;
  switch (p.spec.granularity) {
    case Granularity::kPerTensor:
    case Granularity::kPerHead: {
      // Row minima/maxima in parallel, then an exact (order-free) reduction per head.
      std::vector<float> row_mn(static_cast<std::size_t>(H * Tq)), row_mx(row_mn.size());
#pragma omp parallel if (p.parallel)
      {
        std::vector<float> buf(static_cast<std::size_t>(d));
#pragma omp for schedule(static)
        for (std::int64_t r = 0; r < H * Tq; ++r) {
          load_row(x, dt, p.row_offset(r / Tq, r % Tq), d, buf.data());
          float mn = buf[0], mx = buf[0];
          for (int i = 1; i < d; ++i) {
            mn = min_f(mn, buf[i]);
            mx = max_f(mx, buf[i]);
          }
          row_mn[static_cast<std::size_t>(r)] = mn;
          row_mx[static_cast<std::size_t>(r)] = mx;
        }
      }
      const std::int64_t groups = p.spec.granularity == Granularity::kPerTensor ? 1 : H;
      const std::int64_t rows_per_group = H * Tq / groups;
      for (std::int64_t g = 0; g < groups; ++g) {
        float mn = std::numeric_limits<float>::infinity(), mx = -mn;
        for (std::int64_t r = g * rows_per_group; r < (g + 1) * rows_per_group; ++r) {
          mn = min_f(mn, row_mn[static_cast<std::size_t>(r)]);
          mx = max_f(mx, row_mx[static_cast<std::size_t>(r)]);
        }
        if (rows_per_group == 0) mn = mx = 0.0f;  // everything is residual
        set_params(p, g, mn, mx, scales, zeros);
      }
      break;
    }
    case Granularity::kPerToken: {
      const std::int64_t G = p.layout.group_size, ng = p.layout.groups_per_row;
#pragma omp parallel if (p.parallel)
      {
        std::vector<float> buf(static_cast<std::size_t>(d));
#pragma omp for schedule(static)
        for (std::int64_t r = 0; r < H * Tq; ++r) {
          load_row(x, dt, p.row_offset(r / Tq, r % Tq), d, buf.data());
          for (std::int64_t g = 0; g < ng; ++g) {
            const std::int64_t i0 = g * G, i1 = std::min(D, i0 + G);
            float mn = buf[static_cast<std::size_t>(i0)], mx = mn;
            for (std::int64_t i = i0 + 1; i < i1; ++i) {
              mn = min_f(mn, buf[static_cast<std::size_t>(i)]);
              mx = max_f(mx, buf[static_cast<std::size_t>(i)]);
            }
            set_params(p, r * ng + g, mn, mx, scales, zeros);
          }
        }
      }
      break;
    }
    case Granularity::kPerChannel: {
      const std::int64_t G = p.layout.group_size, ngt = p.layout.groups_per_row;
#pragma omp parallel if (p.parallel)
      {
        std::vector<float> buf(static_cast<std::size_t>(d)), mn(buf.size()), mx(buf.size());
#pragma omp for schedule(static)
        for (std::int64_t hg = 0; hg < H * ngt; ++hg) {
          const std::int64_t h = hg / ngt, t0 = (hg % ngt) * G, t1 = std::min(Tq, t0 + G);
          load_row(x, dt, p.row_offset(h, t0), d, mn.data());
          std::copy(mn.begin(), mn.end(), mx.begin());
          for (std::int64_t t = t0 + 1; t < t1; ++t) {
            load_row(x, dt, p.row_offset(h, t), d, buf.data());
            for (int i = 0; i < d; ++i) {
              mn[i] = min_f(mn[i], buf[i]);
              mx[i] = max_f(mx[i], buf[i]);
            }
          }
          for (int i = 0; i < d; ++i) set_params(p, hg * D + i, mn[i], mx[i], scales, zeros);
        }
      }
      break;
    }
  }
}

// Per-channel scale and zero of code row (h, t): s[i], z[i] for i < head_dim.
void row_params(const Plan& p, const float* scales, const float* zeros, std::int64_t h, std::int64_t t,
                float* s, float* z) {
  const int d = p.shape.head_dim;
  const std::int64_t D = d;
  switch (p.spec.granularity) {
    case Granularity::kPerTensor:
    case Granularity::kPerHead: {
      const std::int64_t g = p.spec.granularity == Granularity::kPerTensor ? 0 : h;
      std::fill(s, s + d, scales[g]);
      std::fill(z, z + d, zeros != nullptr ? zeros[g] : 0.0f);
      break;
    }
    case Granularity::kPerToken: {
      const std::int64_t G = p.layout.group_size,
                         base = (h * p.layout.quant_tokens + t) * p.layout.groups_per_row;
      for (std::int64_t g = 0; g < p.layout.groups_per_row; ++g) {
        const std::int64_t i0 = g * G, i1 = std::min(D, i0 + G);
        std::fill(s + i0, s + i1, scales[base + g]);
        std::fill(z + i0, z + i1, zeros != nullptr ? zeros[base + g] : 0.0f);
      }
      break;
    }
    case Granularity::kPerChannel: {
      const std::int64_t base = (h * p.layout.groups_per_row + t / p.layout.group_size) * D;
      std::copy(scales + base, scales + base + D, s);
      if (zeros != nullptr) {
        std::copy(zeros + base, zeros + base + D, z);
      } else {
        std::fill(z, z + d, 0.0f);
      }
      break;
    }
  }
}

// Per-thread scratch for one row.
struct RowScratch {
  explicit RowScratch(int d)
      : x(static_cast<std::size_t>(d)), s(x.size()), z(x.size()), div(x.size()), q(x.size()) {}
  std::vector<float> x, s, z, div;
  std::vector<int> q;
};

// Codes of one row; two simple loops so that both vectorize.
void encode_row(const Plan& p, RowScratch& r, int* q) {
  const int d = p.shape.head_dim, lo = p.lo, hi = p.hi;
  float* __restrict div = r.div.data();
  const float* __restrict s = r.s.data();
  const float* __restrict x = r.x.data();
  const float* __restrict z = r.z.data();
  for (int i = 0; i < d; ++i) div[i] = quant_math::encode_divisor(s[i]);
  for (int i = 0; i < d; ++i) q[i] = quant_math::encode_with_divisor(x[i], div[i], z[i], lo, hi);
}

void pack_row(const int* q, int d, int bits, std::uint8_t* out) {
  if (bits == 8) {
    for (int i = 0; i < d; ++i) out[i] = static_cast<std::uint8_t>(quant_math::to_field(q[i], 8));
    return;
  }
  const int per = 8 / bits;
  const int nbytes = (d * bits + 7) / 8;
  for (int j = 0; j < nbytes; ++j) {
    unsigned byte = 0;
    for (int k = 0; k < per; ++k) {
      const int i = j * per + k;
      if (i < d) byte |= quant_math::to_field(q[i], bits) << (k * bits);
    }
    out[j] = static_cast<std::uint8_t>(byte);
  }
}

template <int kBits>
void unpack_row_bits(const std::uint8_t* __restrict in, int d, bool symmetric, int* __restrict q) {
  constexpr int kPer = 8 / kBits;
  constexpr unsigned kMask = (1u << kBits) - 1u;
  for (int i = 0; i < d; ++i) {
    const unsigned field = (static_cast<unsigned>(in[i / kPer]) >> ((i % kPer) * kBits)) & kMask;
    q[i] = quant_math::from_field(field, kBits, symmetric);
  }
}

void unpack_row(const std::uint8_t* in, int d, int bits, bool symmetric, int* q) {
  if (bits == 8) {
    unpack_row_bits<8>(in, d, symmetric, q);
  } else if (bits == 4) {
    unpack_row_bits<4>(in, d, symmetric, q);
  } else {
    unpack_row_bits<2>(in, d, symmetric, q);
  }
}

// Residual tokens of every head converted to float into out [H, T, D].
void residual_to_float(const Plan& p, const void* src, std::int64_t src_tokens, std::int64_t src_first,
                       float* out) {
  const std::int64_t H = p.shape.num_heads, R = p.layout.residual_tokens, Tq = p.layout.quant_tokens;
  const int d = p.shape.head_dim;
#pragma omp parallel for schedule(static) if (p.parallel)
  for (std::int64_t r = 0; r < H * R; ++r) {
    const std::int64_t h = r / R, t = r % R;
    load_row(src, p.shape.dtype, (h * src_tokens + src_first + t) * d, d, out + p.row_offset(h, Tq + t));
  }
}

Status plan_for(const char* fn, const QuantSpec& spec, const QuantShape& shape, Plan* plan) {
  QuantLayout layout;
  const Status s = quant_layout(spec, shape, &layout);
  if (!s.ok()) return Status::Invalid(std::string(fn) + ": " + s.message());
  *plan = make_plan(spec, shape, layout);
  return Status::Ok();
}

}  // namespace

Status quantize(const QuantSpec& spec, const QuantShape& shape, const void* x, const QuantBuffers& out) {
  KVSCOPE_NVTX_RANGE("cpu::quantize", kQuantize);
  Plan p;
  KVSCOPE_RETURN_IF_ERROR(plan_for("quantize", spec, shape, &p));
  const QuantLayout& l = p.layout;
  if (x == nullptr) return Status::Invalid("quantize: x is null");
  if (out.codes == nullptr && l.code_bytes > 0) return Status::Invalid("quantize: out.codes is null");
  if (out.scales == nullptr && l.num_groups > 0) return Status::Invalid("quantize: out.scales is null");
  if (out.zeros == nullptr && l.zero_bytes > 0)
    return Status::Invalid("quantize: out.zeros is null (asymmetric)");
  if (out.residual == nullptr && l.residual_bytes > 0) {
    return Status::Invalid("quantize: out.residual is null (residual_tokens > 0)");
  }
  float* zeros = spec.symmetric ? nullptr : out.zeros;
  compute_params(p, x, out.scales, zeros);

  const std::int64_t H = shape.num_heads, Tq = l.quant_tokens;
  const int d = shape.head_dim;
#pragma omp parallel if (p.parallel)
  {
    RowScratch r(d);
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < H * Tq; ++row) {
      const std::int64_t h = row / Tq, t = row % Tq;
      load_row(x, shape.dtype, p.row_offset(h, t), d, r.x.data());
      row_params(p, out.scales, zeros, h, t, r.s.data(), r.z.data());
      encode_row(p, r, r.q.data());
      pack_row(r.q.data(), d, spec.bits, out.codes + row * l.row_bytes);
    }
  }
  // Residual: the last R tokens of every head, copied byte for byte.
  const std::size_t esz = dtype_bytes(shape.dtype);
  const std::size_t res_row = static_cast<std::size_t>(l.residual_tokens) * d * esz;
  for (std::int64_t h = 0; h < H && res_row > 0; ++h) {
    std::memcpy(static_cast<char*>(out.residual) + h * res_row,
                static_cast<const char*>(x) + static_cast<std::size_t>(p.row_offset(h, Tq)) * esz, res_row);
  }
  return Status::Ok();
}

Status dequantize(const QuantSpec& spec, const QuantShape& shape, const QuantConstBuffers& in, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::dequantize", kQuantize);
  Plan p;
  KVSCOPE_RETURN_IF_ERROR(plan_for("dequantize", spec, shape, &p));
  const QuantLayout& l = p.layout;
  if (out == nullptr) return Status::Invalid("dequantize: out is null");
  if (in.codes == nullptr && l.code_bytes > 0) return Status::Invalid("dequantize: in.codes is null");
  if (in.scales == nullptr && l.num_groups > 0) return Status::Invalid("dequantize: in.scales is null");
  if (in.zeros == nullptr && l.zero_bytes > 0)
    return Status::Invalid("dequantize: in.zeros is null (asymmetric)");
  if (in.residual == nullptr && l.residual_bytes > 0)
    return Status::Invalid("dequantize: in.residual is null");
  const float* zeros = spec.symmetric ? nullptr : in.zeros;

  const std::int64_t H = shape.num_heads, Tq = l.quant_tokens;
  const int d = shape.head_dim;
#pragma omp parallel if (p.parallel)
  {
    RowScratch r(d);
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < H * Tq; ++row) {
      const std::int64_t h = row / Tq, t = row % Tq;
      row_params(p, in.scales, zeros, h, t, r.s.data(), r.z.data());
      unpack_row(in.codes + row * l.row_bytes, d, spec.bits, spec.symmetric, r.q.data());
      float* o = out + p.row_offset(h, t);
      for (int i = 0; i < d; ++i) o[i] = quant_math::decode(r.q[i], r.s[i], r.z[i]);
    }
  }
  residual_to_float(p, in.residual, l.residual_tokens, 0, out);
  return Status::Ok();
}

Status quantize_dequantize(const QuantSpec& spec, const QuantShape& shape, const void* x, float* out) {
  KVSCOPE_NVTX_RANGE("cpu::quantize_dequantize", kQuantize);
  Plan p;
  KVSCOPE_RETURN_IF_ERROR(plan_for("quantize_dequantize", spec, shape, &p));
  const QuantLayout& l = p.layout;
  if (x == nullptr) return Status::Invalid("quantize_dequantize: x is null");
  if (out == nullptr) return Status::Invalid("quantize_dequantize: out is null");
  if (static_cast<const void*>(out) == x) return Status::Invalid("quantize_dequantize: out aliases x");
  std::vector<float> scales(static_cast<std::size_t>(l.num_groups));
  std::vector<float> zeros(spec.symmetric ? 0 : scales.size());
  float* zp = spec.symmetric ? nullptr : zeros.data();
  compute_params(p, x, scales.data(), zp);

  const std::int64_t H = shape.num_heads, Tq = l.quant_tokens;
  const int d = shape.head_dim;
#pragma omp parallel if (p.parallel)
  {
    RowScratch r(d);
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < H * Tq; ++row) {
      const std::int64_t h = row / Tq, t = row % Tq;
      load_row(x, shape.dtype, p.row_offset(h, t), d, r.x.data());
      row_params(p, scales.data(), zp, h, t, r.s.data(), r.z.data());
      encode_row(p, r, r.q.data());
      float* o = out + p.row_offset(h, t);
      for (int i = 0; i < d; ++i) o[i] = quant_math::decode(r.q[i], r.s[i], r.z[i]);
    }
  }
  residual_to_float(p, x, shape.tokens, Tq, out);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kvscope::kernels
