// CPU quantization vs the float64 reference, plus the family's properties:
// half-step error bound, exact round trip of representable values and constant
// groups, bit-identical residual tokens, packing with odd head_dim, byte accounting
// and argument validation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kernels/reference_quantize.hpp"
#include "kvscope/kernels/quantize.hpp"

namespace kvscope::testing {
namespace {

using kernels::DType;
using kernels::QuantBuffers;
using kernels::QuantBytes;
using kernels::QuantLayout;
using kernels::QuantShape;
namespace cpu = kernels::cpu;

// An input tensor in its dtype plus the exact values it represents.
struct Input {
  DType dtype;
  std::vector<std::uint8_t> bytes;
  std::vector<double> values;
};

Input make_input(const std::vector<float>& v, DType dt) {
  Input in{dt, std::vector<std::uint8_t>(v.size() * kernels::dtype_bytes(dt)), std::vector<double>(v.size())};
  for (std::size_t i = 0; i < v.size(); ++i) {
    kernels::store_element(in.bytes.data(), dt, i, v[i]);
    in.values[i] = kernels::load_element(in.bytes.data(), dt, i);
  }
  return in;
}

// Everything the CPU backend produces for one input, in buffers of exactly the accounted sizes.
struct Quantized {
  QuantBytes bytes;
  std::vector<std::uint8_t> codes;
  std::vector<float> scales, zeros;
  std::vector<std::uint8_t> residual;
  std::vector<float> deq, fake;
};

Quantized run_cpu(const QuantSpec& spec, const QuantShape& shape, const Input& in) {
  Quantized q;
  q.bytes = kernels::quantized_bytes(spec, shape.num_heads, shape.tokens, shape.head_dim, shape.dtype);
  q.codes.assign(static_cast<std::size_t>(q.bytes.codes), 0xff);  // 0xff: unwritten padding would show
  q.scales.assign(static_cast<std::size_t>(q.bytes.scales / 4), -1.0f);
  q.zeros.assign(static_cast<std::size_t>(q.bytes.zeros / 4), -1.0f);
  q.residual.assign(static_cast<std::size_t>(q.bytes.residual), 0xcd);
  const QuantBuffers out{q.codes.data(), q.scales.data(), q.zeros.data(), q.residual.data()};
  EXPECT_TRUE(cpu::quantize(spec, shape, in.bytes.data(), out).ok());
  q.deq.assign(in.values.size(), NAN);
  EXPECT_TRUE(cpu::dequantize(spec, shape, kernels::as_const(out), q.deq.data()).ok());
  q.fake.assign(in.values.size(), NAN);
  EXPECT_TRUE(cpu::quantize_dequantize(spec, shape, in.bytes.data(), q.fake.data()).ok());
  return q;
}

std::string describe(const QuantSpec& s, const QuantShape& sh) {
  std::ostringstream o;
  o << "bits=" << s.bits << (s.symmetric ? " sym " : " asym ") << kernels::granularity_name(s.granularity)
    << " G=" << s.group_size << " R=" << s.residual_tokens << " shape=[" << sh.num_heads << "," << sh.tokens
    << "," << sh.head_dim << "] " << kernels::dtype_name(sh.dtype);
  return o.str();
}

// Full comparison of one configuration against the reference and the properties.
void check_config(const QuantSpec& spec, const QuantShape& shape, const Input& in) {
  const std::string params = describe(spec, shape);
  SCOPED_TRACE(params);
  const RefShape rs{shape.num_heads, shape.tokens, shape.head_dim};
  const RefQuant ref = reference_quantize(spec, rs, in.values);
  const Quantized q = run_cpu(spec, shape, in);
  const int tq = ref_quant_tokens(spec, rs), res = shape.tokens - tq, d = shape.head_dim;
  const std::int64_t row_bytes = (static_cast<std::int64_t>(d) * spec.bits + 7) / 8;
  const std::size_t esz = kernels::dtype_bytes(shape.dtype);

  // Byte accounting: exactly the sizes of the stored buffers.
  const std::int64_t ng = ref_num_groups(spec, rs);
  ASSERT_EQ(q.bytes.codes, static_cast<std::int64_t>(shape.num_heads) * tq * row_bytes);
  ASSERT_EQ(q.bytes.scales, ng * 4);
  ASSERT_EQ(q.bytes.zeros, spec.symmetric ? 0 : ng * 4);
  ASSERT_EQ(q.bytes.residual,
            static_cast<std::int64_t>(shape.num_heads) * res * d * static_cast<std::int64_t>(esz));
  ASSERT_EQ(q.bytes.total, q.bytes.codes + q.bytes.scales + q.bytes.zeros + q.bytes.residual);

  EXPECT_TRUE(all_close(q.scales, ref.scales, 0.0, 1e-6, params + " scales"));
  if (!spec.symmetric) {
    EXPECT_TRUE(all_close(q.zeros, ref.zeros, 0.0, 0.0, params + " zeros"));
  }

  // Codes: equal to the reference except a +-1 at an exact rounding tie (float vs double ratio).
  std::vector<double> got_codes(ref.codes.size()), want_codes(ref.codes.size());
  std::int64_t pad_errors = 0;
  for (int h = 0; h < shape.num_heads; ++h) {
    for (int t = 0; t < tq; ++t) {
      const std::uint8_t* row = q.codes.data() + (static_cast<std::int64_t>(h) * tq + t) * row_bytes;
      for (int i = 0; i < d; ++i) {
        const std::size_t c = (static_cast<std::size_t>(h) * tq + t) * d + i;
        got_codes[c] = ref_unpack(row, i, spec.bits, spec.symmetric);
        const double frac = std::fabs(ref.ratio[c] - std::trunc(ref.ratio[c]));
        const bool tie = std::fabs(frac - 0.5) < 1e-5;
        want_codes[c] = tie && std::fabs(got_codes[c] - ref.codes[c]) == 1 ? got_codes[c] : ref.codes[c];
      }
      // Padding bits of the row's last byte are 0.
      const int used = (d * spec.bits) % 8;
      if (used != 0 && (row[row_bytes - 1] >> used) != 0) ++pad_errors;
    }
  }
  EXPECT_TRUE(all_close(got_codes, want_codes, 0.0, 0.0, params + " codes"));
  EXPECT_EQ(pad_errors, 0) << params << ": rows with non-zero padding bits";

  // Dequantized values against the reference (same codes), and the half-step bound.
  std::vector<double> want_deq = ref.deq;
  double max_mag = 0.0;
  std::int64_t bound_errors = 0, first_bound = -1;
  for (int h = 0; h < shape.num_heads; ++h) {
    for (int t = 0; t < tq; ++t) {
      for (int i = 0; i < d; ++i) {
        const std::size_t c = (static_cast<std::size_t>(h) * tq + t) * d + i;
        const std::size_t e = (static_cast<std::size_t>(h) * shape.tokens + t) * d + i;
        const std::int64_t g = ref_group(spec, rs, h, t, i);
        want_deq[e] = ref.zeros[g] + got_codes[c] * ref.scales[g];
        const double mag = std::fabs(ref.zeros[g]) + std::fabs(ref.scales[g]) * (1 << spec.bits);
        max_mag = std::max(max_mag, mag);
        const double err = std::fabs(in.values[e] - q.deq[e]);
        if (!(err <= q.scales[g] / 2.0 + 1e-6 * mag)) {
          if (bound_errors++ == 0) first_bound = static_cast<std::int64_t>(e);
        }
      }
    }
  }
  EXPECT_TRUE(all_close(q.deq, want_deq, 1e-6 * max_mag, 1e-6, params + " dequantized"));
  EXPECT_EQ(bound_errors, 0) << params << ": |x - deq(q(x))| > scale/2 first at element " << first_bound;

  // Fused fake quantization equals dequantize(quantize(x)) bit for bit.
  EXPECT_EQ(std::memcmp(q.fake.data(), q.deq.data(), q.deq.size() * sizeof(float)), 0)
      << params << ": fake quant";

  // Residual tokens: stored bit for bit, dequantized exactly.
  for (int h = 0; h < shape.num_heads && res > 0; ++h) {
    const std::size_t n = static_cast<std::size_t>(res) * d * esz;
    const std::size_t src = (static_cast<std::size_t>(h) * shape.tokens + tq) * d * esz;
    EXPECT_EQ(std::memcmp(q.residual.data() + h * n, in.bytes.data() + src, n), 0)
        << params << ": residual head " << h;
    for (std::size_t k = 0; k < static_cast<std::size_t>(res) * d; ++k) {
      const std::size_t e = (static_cast<std::size_t>(h) * shape.tokens + tq) * d + k;
      ASSERT_EQ(static_cast<double>(q.deq[e]), in.values[e]) << params << ": residual element " << e;
    }
  }
}

std::vector<QuantSpec> granularities(int bits, bool sym, int residual) {
  return {
      {bits, sym, Granularity::kPerTensor, 0, residual},  {bits, sym, Granularity::kPerHead, 0, residual},
      {bits, sym, Granularity::kPerToken, 0, residual},   {bits, sym, Granularity::kPerToken, 4, residual},
      {bits, sym, Granularity::kPerChannel, 0, residual}, {bits, sym, Granularity::kPerChannel, 5, residual},
  };
}

TEST(Quantize, MatchesFloat64ReferenceAllConfigs) {
  const QuantShape shapes[] = {{1, 1, 1, DType::kF32},
                               {1, 7, 7, DType::kF32},
                               {3, 33, 7, DType::kF32},
                               {2, 40, 33, DType::kF32},
                               {4, 96, 128, DType::kF32}};
  std::uint64_t seed = 1;
  for (QuantShape shape : shapes) {
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      shape.dtype = dt;
      const auto x =
          random_normal(static_cast<std::size_t>(shape.num_heads) * shape.tokens * shape.head_dim, seed++);
      const Input in = make_input(x, dt);
      for (int bits : {8, 4, 2})
        for (bool sym : {true, false})
          for (int residual : {0, 3})
            for (const QuantSpec& spec : granularities(bits, sym, residual)) check_config(spec, shape, in);
    }
  }
}

TEST(Quantize, LargeKiviAndInt8) {
  const QuantShape shape{8, 1024, 128, DType::kF16};
  const Input in = make_input(random_normal(8 * 1024 * 128, 77, 2.0f), DType::kF16);
  check_config(kernels::kivi_key_spec(2, 32, 128), shape, in);
  check_config(kernels::kivi_value_spec(2, 32, 128), shape, in);
  check_config({8, true, Granularity::kPerToken, 0, 0}, shape, in);
  check_config({4, true, Granularity::kPerHead, 0, 0}, shape, in);
}

TEST(Quantize, ShiftedAndSkewedInputs) {
  // All-positive and all-negative data, a spike: asymmetric zero points far from 0.
  const QuantShape shape{2, 33, 16, DType::kF32};
  auto x = random_uniform(2 * 33 * 16, 5, 3.0f, 7.0f);
  check_config({4, false, Granularity::kPerToken, 0, 0}, shape, make_input(x, DType::kF32));
  for (float& v : x) v = -v;
  x[17] = -300.0f;
  for (const QuantSpec& spec : granularities(8, true, 2))
    check_config(spec, shape, make_input(x, DType::kF32));
  for (const QuantSpec& spec : granularities(2, false, 2))
    check_config(spec, shape, make_input(x, DType::kF32));
}

// Builds x whose every group holds z + k * s for integer codes k including both ends of the range;
// *codes receives the codes quantize must produce.
std::vector<float> representable(const QuantSpec& spec, const RefShape& rs, float s, float z,
                                 std::uint64_t seed, std::vector<int>* codes) {
  const int lo = spec.symmetric ? -((1 << (spec.bits - 1)) - 1) : 0;
  const int hi = spec.symmetric ? (1 << (spec.bits - 1)) - 1 : (1 << spec.bits) - 1;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(lo, hi);
  const int tq = ref_quant_tokens(spec, rs);
  std::vector<float> x(static_cast<std::size_t>(rs.heads) * rs.tokens * rs.dim);
  codes->assign(static_cast<std::size_t>(rs.heads) * tq * rs.dim, 0);
  std::vector<int> seen(static_cast<std::size_t>(ref_num_groups(spec, rs)), 0);
  std::vector<std::size_t> last(seen.size());
  for (int h = 0; h < rs.heads; ++h)
    for (int t = 0; t < tq; ++t)
      for (int i = 0; i < rs.dim; ++i) {
        const std::int64_t g = ref_group(spec, rs, h, t, i);
        const std::size_t c = (static_cast<std::size_t>(h) * tq + t) * rs.dim + i;
        (*codes)[c] = seen[g]++ == 0 ? lo : pick(rng);  // first element of a group: lowest code
        last[g] = c;
      }
  for (std::size_t g = 0; g < seen.size(); ++g) {
    if (seen[g] > 1) (*codes)[last[g]] = hi;  // last element: highest code
  }
  for (int h = 0; h < rs.heads; ++h)
    for (int t = 0; t < rs.tokens; ++t)
      for (int i = 0; i < rs.dim; ++i) {
        const std::size_t e = (static_cast<std::size_t>(h) * rs.tokens + t) * rs.dim + i;
        x[e] = t < tq
                   ? z + static_cast<float>((*codes)[(static_cast<std::size_t>(h) * tq + t) * rs.dim + i]) * s
                   : 0.375f * static_cast<float>(i);
      }
  // A one-element group is a constant group: symmetric code sign(x) = -1 (x = -qmax * s), asymmetric 0.
  for (std::size_t g = 0; g < seen.size(); ++g) {
    if (seen[g] == 1) (*codes)[last[g]] = spec.symmetric ? -1 : 0;
  }
  return x;
}

TEST(Quantize, RepresentableValuesRoundTripExactly) {
  const QuantShape shape{3, 21, 9, DType::kF32};
  const RefShape rs{3, 21, 9};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int bits : {8, 4, 2}) {
      for (bool sym : {true, false}) {
        for (const QuantSpec& spec : granularities(bits, sym, 2)) {
          QuantShape sh = shape;
          sh.dtype = dt;
          std::vector<int> codes;
          const auto x = representable(spec, rs, 0.125f, sym ? 0.0f : -1.5f, 11, &codes);
          const Input in = make_input(x, dt);
          for (std::size_t e = 0; e < x.size(); ++e)
            ASSERT_EQ(in.values[e], x[e]) << "test input not representable";
          const Quantized q = run_cpu(spec, sh, in);
          const std::string params = describe(spec, sh);
          std::vector<float> want(x.begin(), x.end());
          EXPECT_TRUE(all_close(q.deq, want, 0.0, 0.0, params + " representable round trip"));
          const int tq = ref_quant_tokens(spec, rs);
          const std::int64_t row_bytes = (9 * bits + 7) / 8;
          std::vector<int> got(codes.size());
          for (std::size_t c = 0; c < codes.size(); ++c) {
            got[c] = ref_unpack(q.codes.data() + static_cast<std::int64_t>(c / 9) * row_bytes,
                                static_cast<int>(c % 9), bits, sym);
          }
          EXPECT_TRUE(all_close(got, codes, 0.0, 0.0, params + " codes"));
          (void)tq;
        }
      }
    }
  }
}

TEST(Quantize, ConstantGroupsRoundTripExactly) {
  const RefShape rs{2, 19, 10};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int bits : {8, 4, 2}) {
      for (bool sym : {true, false}) {
        for (const QuantSpec& spec : granularities(bits, sym, 1)) {
          const auto group_value =
              random_normal(static_cast<std::size_t>(ref_num_groups(spec, rs)), 3, 10.0f);
          std::vector<float> x(2 * 19 * 10, 0.0f);
          const int tq = ref_quant_tokens(spec, rs);
          for (int h = 0; h < 2; ++h)
            for (int t = 0; t < tq; ++t)
              for (int i = 0; i < 10; ++i) {
                const std::int64_t g = ref_group(spec, rs, h, t, i);
                x[(static_cast<std::size_t>(h) * 19 + t) * 10 + i] = g % 3 == 0 ? 0.0f : group_value[g];
              }
          const Input in = make_input(x, dt);
          const QuantShape sh{2, 19, 10, dt};
          const Quantized q = run_cpu(spec, sh, in);
          EXPECT_TRUE(all_close(q.deq, in.values, 0.0, 0.0, describe(spec, sh) + " constant groups"));
          for (float v : q.deq) ASSERT_FALSE(std::isnan(v));
        }
      }
    }
  }
}

TEST(Quantize, ResidualCoversAllTokens) {
  // residual >= tokens: nothing is quantized, everything is kept bit for bit.
  const QuantShape shape{2, 5, 8, DType::kBF16};
  const Input in = make_input(random_normal(80, 9), DType::kBF16);
  for (auto g :
       {Granularity::kPerTensor, Granularity::kPerHead, Granularity::kPerToken, Granularity::kPerChannel}) {
    const QuantSpec spec{4, false, g, 0, 9};
    const QuantBytes b = kernels::quantized_bytes(spec, 2, 5, 8, DType::kBF16);
    EXPECT_EQ(b.codes, 0);
    EXPECT_EQ(b.residual, 2 * 5 * 8 * 2);
    check_config(spec, shape, in);
  }
}

TEST(Quantize, Fp16ConversionEveryBitPattern) {
  // All 65536 fp16 patterns as residual tokens: dequantize must give half_to_float exactly
  // (bit for bit, NaN payloads and signed zeros included).
  const QuantShape shape{1, 256, 256, DType::kF16};
  std::vector<std::uint16_t> x(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) x[b] = static_cast<std::uint16_t>(b);
  const QuantSpec spec{8, true, Granularity::kPerHead, 0, 256};
  std::vector<std::uint8_t> residual(65536 * 2);
  std::vector<float> scales(1), out(65536), fake(65536);
  ASSERT_TRUE(cpu::quantize(spec, shape, x.data(), {nullptr, scales.data(), nullptr, residual.data()}).ok());
  ASSERT_TRUE(
      cpu::dequantize(spec, shape, {nullptr, scales.data(), nullptr, residual.data()}, out.data()).ok());
  ASSERT_TRUE(cpu::quantize_dequantize(spec, shape, x.data(), fake.data()).ok());
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const std::uint32_t want = kernels::float_to_bits(kernels::half_to_float(static_cast<std::uint16_t>(b)));
    ASSERT_EQ(kernels::float_to_bits(out[b]), want) << "fp16 bits 0x" << std::hex << b;
    ASSERT_EQ(kernels::float_to_bits(fake[b]), want) << "fp16 bits 0x" << std::hex << b;
  }
}

TEST(Quantize, PackingOddHeadDim) {
  // head_dim 7: 4-bit rows take 4 bytes, 2-bit rows 2 bytes; the unused high bits are 0.
  const QuantShape shape{2, 9, 7, DType::kF32};
  const Input in = make_input(random_normal(2 * 9 * 7, 21), DType::kF32);
  for (int bits : {4, 2}) {
    const QuantSpec spec{bits, true, Granularity::kPerToken, 0, 0};
    QuantLayout l;
    ASSERT_TRUE(kernels::quant_layout(spec, shape, &l).ok());
    EXPECT_EQ(l.row_bytes, bits == 4 ? 4 : 2);
    const Quantized q = run_cpu(spec, shape, in);
    for (std::int64_t r = 0; r < 2 * 9; ++r) {
      const std::uint8_t last = q.codes[static_cast<std::size_t>((r + 1) * l.row_bytes - 1)];
      EXPECT_EQ(last >> (bits == 4 ? 4 : 6), 0) << "bits=" << bits << " row " << r;
    }
    check_config(spec, shape, in);
  }
}

TEST(Quantize, ByteAccountingKnownValues) {
  // llava-1.5-7b layer: 32 heads x 576 tokens x 128, fp16.
  const QuantBytes int8 =
      kernels::quantized_bytes({8, true, Granularity::kPerToken, 0, 0}, 32, 576, 128, DType::kF16);
  EXPECT_EQ(int8.codes, 32 * 576 * 128);
  EXPECT_EQ(int8.scales, 32 * 576 * 4);
  EXPECT_EQ(int8.zeros, 0);
  EXPECT_EQ(int8.residual, 0);
  EXPECT_EQ(int8.total, 32 * 576 * 128 + 32 * 576 * 4);
  const QuantBytes head4 =
      kernels::quantized_bytes({4, false, Granularity::kPerHead, 0, 0}, 32, 576, 128, DType::kF16);
  EXPECT_EQ(head4.codes, 32 * 576 * 64);
  EXPECT_EQ(head4.scales, 32 * 4);
  EXPECT_EQ(head4.zeros, 32 * 4);
  // KIVI-2 keys: G = 32 tokens per channel group, 128 residual tokens: Tq = 448 -> 14 groups.
  const QuantBytes kk =
      kernels::quantized_bytes(kernels::kivi_key_spec(2, 32, 128), 32, 576, 128, DType::kF16);
  EXPECT_EQ(kk.codes, 32 * 448 * 32);
  EXPECT_EQ(kk.scales, 32 * 14 * 128 * 4);
  EXPECT_EQ(kk.zeros, kk.scales);
  EXPECT_EQ(kk.residual, 32 * 128 * 128 * 2);
  // KIVI-2 values: per token, groups of 32 channels -> 4 groups per row.
  const QuantBytes kv =
      kernels::quantized_bytes(kernels::kivi_value_spec(2, 32, 128), 32, 576, 128, DType::kF16);
  EXPECT_EQ(kv.scales, 32 * 448 * 4 * 4);
  EXPECT_EQ(kv.total, kv.codes + kv.scales + kv.zeros + kv.residual);
  // Per-tensor, per-tensor partial groups and invalid specs.
  EXPECT_EQ(kernels::quantized_bytes({2, true, Granularity::kPerTensor, 0, 0}, 1, 3, 7, DType::kF32).codes,
            3 * 2);
  EXPECT_EQ(kernels::quantized_bytes({3, true, Granularity::kPerTensor, 0, 0}, 1, 3, 7, DType::kF32).total,
            0);
}

TEST(Quantize, RejectsInvalidArguments) {
  const QuantShape shape{2, 4, 8, DType::kF32};
  std::vector<float> x(64, 1.0f), deq(64);
  std::vector<std::uint8_t> codes(64), residual(256);
  std::vector<float> scales(64), zeros(64);
  const QuantBuffers ok{codes.data(), scales.data(), zeros.data(), residual.data()};
  const QuantSpec good{8, false, Granularity::kPerToken, 4, 1};
  ASSERT_TRUE(cpu::quantize(good, shape, x.data(), ok).ok());

  auto expect_invalid = [&](const QuantSpec& s, const QuantShape& sh, const void* xp, const QuantBuffers& b,
                            const char* what) {
    const kernels::Status st = cpu::quantize(s, sh, xp, b);
    EXPECT_FALSE(st.ok()) << what;
    EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(st.message().find("quantize"), std::string::npos) << st.message();
  };
  expect_invalid({3, true, Granularity::kPerToken, 0, 0}, shape, x.data(), ok, "bits 3");
  expect_invalid({16, true, Granularity::kPerToken, 0, 0}, shape, x.data(), ok, "bits 16");
  expect_invalid({8, true, Granularity::kPerToken, -1, 0}, shape, x.data(), ok, "group_size -1");
  expect_invalid({8, true, Granularity::kPerHead, 4, 0}, shape, x.data(), ok, "group_size with per-head");
  expect_invalid({8, true, Granularity::kPerTensor, 4, 0}, shape, x.data(), ok, "group_size with per-tensor");
  expect_invalid({8, true, static_cast<Granularity>(9), 0, 0}, shape, x.data(), ok, "granularity 9");
  expect_invalid({8, true, Granularity::kPerToken, 0, -2}, shape, x.data(), ok, "residual -2");
  expect_invalid(good, {0, 4, 8, DType::kF32}, x.data(), ok, "heads 0");
  expect_invalid(good, {2, 0, 8, DType::kF32}, x.data(), ok, "tokens 0");
  expect_invalid(good, {2, 4, -8, DType::kF32}, x.data(), ok, "head_dim -8");
  expect_invalid(good, {2, 4, 8, static_cast<DType>(7)}, x.data(), ok, "dtype 7");
  expect_invalid(good, shape, nullptr, ok, "x null");
  expect_invalid(good, shape, x.data(), {nullptr, scales.data(), zeros.data(), residual.data()},
                 "codes null");
  expect_invalid(good, shape, x.data(), {codes.data(), nullptr, zeros.data(), residual.data()},
                 "scales null");
  expect_invalid(good, shape, x.data(), {codes.data(), scales.data(), nullptr, residual.data()},
                 "zeros null");
  expect_invalid(good, shape, x.data(), {codes.data(), scales.data(), zeros.data(), nullptr},
                 "residual null");
  // Symmetric needs no zeros buffer, no residual buffer without residual tokens.
  EXPECT_TRUE(cpu::quantize({8, true, Granularity::kPerToken, 0, 0}, shape, x.data(),
                            {codes.data(), scales.data(), nullptr, nullptr})
                  .ok());

  EXPECT_FALSE(cpu::dequantize(good, shape, kernels::as_const(ok), nullptr).ok());
  EXPECT_FALSE(
      cpu::dequantize(good, shape, {nullptr, scales.data(), zeros.data(), residual.data()}, deq.data()).ok());
  EXPECT_FALSE(
      cpu::dequantize({5, true, Granularity::kPerToken, 0, 0}, shape, kernels::as_const(ok), deq.data())
          .ok());
  EXPECT_FALSE(cpu::quantize_dequantize(good, shape, nullptr, deq.data()).ok());
  EXPECT_FALSE(cpu::quantize_dequantize(good, shape, x.data(), nullptr).ok());
  EXPECT_FALSE(cpu::quantize_dequantize(good, shape, x.data(), x.data()).ok());
  EXPECT_FALSE(cpu::quantize_dequantize(good, {2, 4, 0, DType::kF32}, x.data(), deq.data()).ok());
  QuantLayout l;
  EXPECT_FALSE(kernels::quant_layout(good, shape, nullptr).ok());
  EXPECT_FALSE(kernels::quant_layout({8, true, Granularity::kPerHead, 2, 0}, shape, &l).ok());
}

}  // namespace
}  // namespace kvscope::testing
