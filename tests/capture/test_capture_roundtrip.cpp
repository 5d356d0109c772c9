// The capture library end to end with host tensors: every input dtype into every trace
// dtype, strided layouts, decode steps, tokens with text, aggregates; values read back
// with TraceReader are exact for the same dtype and correctly rounded otherwise.
#include <cmath>
#include <cstring>

#include "capture_test_util.hpp"
#include "kvscope/aggregate/aggregate.hpp"
#include "kvscope/kernels/common.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/validate.hpp"
#include "test_util.hpp"

namespace kvscope::testing {
namespace {

using kernels::DType;

DType dtype_of(kvscope_dtype d) {
  return d == KVSCOPE_F32 ? DType::kF32 : d == KVSCOPE_F16 ? DType::kF16 : DType::kBF16;
}

// Source values of one tensor, stored in `dtype` with the element layout given by `stride`.
struct Source {
  std::vector<std::byte> storage;
  std::vector<float> logical;  // [H, T, D] values as float (exactly representable in `dtype`)
  kvscope_tensor view{};
};

Source make_source(kvscope_dtype dtype, std::int64_t H, std::int64_t T, std::int64_t D,
                   std::array<std::int64_t, 3> stride, std::uint64_t seed) {
  Source s;
  const DType dt = dtype_of(dtype);
  std::int64_t extent = 1;  // elements the strided view spans
  for (int i = 0; i < 3; ++i) extent += (std::array<std::int64_t, 3>{H, T, D}[i] - 1) * stride[i];
  s.storage.assign(static_cast<std::size_t>(extent) * kernels::dtype_bytes(dt),
                   std::byte{0x7f});  // NaN-ish filler
  const std::vector<float> r = random_normal(static_cast<std::size_t>(H * T * D), seed, 3.0f);
  s.logical.resize(r.size());
  for (std::int64_t h = 0, i = 0; h < H; ++h) {
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t d = 0; d < D; ++d, ++i) {
        const auto at = static_cast<std::size_t>(h * stride[0] + t * stride[1] + d * stride[2]);
        kernels::store_element(s.storage.data(), dt, at, r[static_cast<std::size_t>(i)]);
        s.logical[static_cast<std::size_t>(i)] = kernels::load_element(s.storage.data(), dt, at);
      }
    }
  }
  s.view = capture::tensor(s.storage.data(), dtype, H, T, D);
  for (int i = 0; i < 3; ++i) s.view.stride[i] = stride[i];
  return s;
}

std::array<std::int64_t, 3> dense(std::int64_t, std::int64_t T, std::int64_t D) { return {T * D, D, 1}; }

// True if `bits` (a 16-bit value of `t`) is a nearest representable value of x (ties either way).
bool is_nearest(float x, std::uint16_t bits, DType t) {
  auto val = [&](std::uint16_t b) {
    return static_cast<double>(t == DType::kF16 ? kernels::half_to_float(b) : kernels::bf16_to_float(b));
  };
  const double err = std::fabs(val(bits) - x);
  for (int delta : {-1, 1}) {  // neighbours in magnitude order (same sign)
    const auto n = static_cast<std::uint16_t>(bits + delta);
    if ((n & 0x7fff) == 0x7fff || ((n ^ bits) & 0x8000)) continue;
    if (std::fabs(val(n) - x) < err) return false;
  }
  return true;
}

void expect_tensor(const trace::Tensor& got, const std::vector<float>& want, DType src, DType dst,
                   const std::string& what) {
  ASSERT_EQ(got.numel(), want.size()) << what;
  ASSERT_EQ(got.dtype, dst) << what;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (src == dst || dst == DType::kF32) {
      ASSERT_EQ(got.at(i), want[i]) << what << " element " << i;  // exact
    } else {
      std::uint16_t bits;
      std::memcpy(&bits, got.data.data() + 2 * i, 2);
      ASSERT_TRUE(is_nearest(want[i], bits, dst))
          << what << " element " << i << ": " << want[i] << " -> " << got.at(i);
    }
  }
}

struct Case {
  kvscope_dtype input, trace;
};

class RoundTrip : public CaptureTest, public ::testing::WithParamInterface<Case> {};

TEST_P(RoundTrip, EveryValueReadBack) {
  const Case c = GetParam();
  const Geometry g;
  const std::string file = path("t.h5");
  kvscope_capture_config cfg = make_config(g, c.trace);
  kvscope_capture* cap = nullptr;
  ASSERT_EQ(kvscope_capture_open(file.c_str(), &cfg, g.T, &cap), KVSCOPE_OK) << kvscope_capture_last_error();
  const capture::TokenTable tokens = make_tokens(g.T, true);
  set_tokens(cap, tokens);
  std::vector<std::array<Source, 3>> prefill(g.L);
  // Layers out of order; layer 1 token-major ([T, H, D] memory, as a [B, T, H, D] view),
  // layer 2 with padded rows and a non-unit innermost stride.
  for (int layer : {2, 0, 1}) {
    for (int i = 0; i < 3; ++i) {
      const std::int64_t H = i == 0 ? g.Hq : g.Hkv;
      std::array<std::int64_t, 3> stride = dense(H, g.T, g.D);
      if (layer == 1) stride = {g.D, H * g.D, 1};
      if (layer == 2) stride = {g.T * (2 * g.D + 3), 2 * g.D + 3, 2};
      prefill[layer][i] = make_source(c.input, H, g.T, g.D, stride, 1000 * layer + i);
    }
    ASSERT_EQ(kvscope_capture_prefill_layer(cap, layer, &prefill[layer][0].view, &prefill[layer][1].view,
                                            &prefill[layer][2].view),
              KVSCOPE_OK)
        << kvscope_capture_last_error();
  }
  const std::vector<float> colsum = random_uniform(static_cast<std::size_t>(g.Hq * g.T), 7, 0.0f, 2.0f);
  const std::vector<float> window = random_uniform(static_cast<std::size_t>(g.Hq * 2 * g.T), 8, 0.0f, 1.0f);
  ASSERT_EQ(kvscope_capture_layer_aggregates(cap, 1, colsum.data(), window.data(), 2), KVSCOPE_OK);
  const int S = 3;
  std::vector<std::vector<std::array<Source, 3>>> decode(g.L);
  for (int s = 0; s < S; ++s) {
    for (int layer = 0; layer < g.L; ++layer) {
      std::array<Source, 3> src;
      for (int i = 0; i < 3; ++i) {
        const std::int64_t H = i == 0 ? g.Hq : g.Hkv;
        src[i] = make_source(c.input, H, 1, g.D, {3 * g.D, g.D, 1}, 50000 + 100 * s + 10 * layer + i);
      }
      ASSERT_EQ(kvscope_capture_decode_layer(cap, layer, s, &src[0].view, &src[1].view, &src[2].view),
                KVSCOPE_OK)
          << kvscope_capture_last_error();
      decode[layer].push_back(std::move(src));
    }
    ASSERT_EQ(kvscope_capture_decode_token(cap, s, 500 + s, static_cast<int32_t>(g.T) + s,
                                           s == 1 ? "two" : nullptr),
              KVSCOPE_OK);
  }
  ASSERT_EQ(kvscope_capture_close(cap), KVSCOPE_OK) << kvscope_capture_last_error();

  const trace::ValidationReport report = trace::validate_trace(file);
  ASSERT_TRUE(report.ok) << report.message;
  const trace::TraceReader r(file);
  EXPECT_TRUE(r.header().complete);
  EXPECT_EQ(r.header().dtype, dtype_of(c.trace));
  EXPECT_EQ(r.geometry().model_name, "test-model");
  EXPECT_EQ(r.header().device, "cpu");
  EXPECT_EQ(r.num_tokens(), static_cast<std::size_t>(g.T));
  EXPECT_EQ(r.tokens().modality, tokens.modality);
  EXPECT_EQ(r.tokens().token_id, tokens.token_id);
  EXPECT_EQ(r.tokens().grid_row, tokens.grid_row);
  EXPECT_EQ(r.tokens().grid_col, tokens.grid_col);
  EXPECT_EQ(r.tokens().text, tokens.text);
  const DType src = dtype_of(c.input), dst = dtype_of(c.trace);
  for (int layer = 0; layer < g.L; ++layer) {
    const trace::LayerTensors t = r.read_layer(layer);
    const std::string where = "layer " + std::to_string(layer);
    expect_tensor(t.q, prefill[layer][0].logical, src, dst, where + " q");
    expect_tensor(t.k, prefill[layer][1].logical, src, dst, where + " k");
    expect_tensor(t.v, prefill[layer][2].logical, src, dst, where + " v");
    // Decode: [H, S, D] gathered from the per-step [H, 1, D] tensors.
    const trace::LayerTensors d = r.read_decode_layer(layer);
    for (int i = 0; i < 3; ++i) {
      const trace::Tensor& got = i == 0 ? d.q : (i == 1 ? d.k : d.v);
      const std::size_t H = i == 0 ? g.Hq : g.Hkv;
      ASSERT_EQ(got.shape,
                (std::vector<std::size_t>{H, static_cast<std::size_t>(S), static_cast<std::size_t>(g.D)}));
      std::vector<float> want;
      for (std::size_t h = 0; h < H; ++h) {
        for (int s = 0; s < S; ++s) {
          const auto& l = decode[layer][s][i].logical;
          want.insert(want.end(), l.begin() + h * g.D, l.begin() + (h + 1) * g.D);
        }
      }
      expect_tensor(got, want, src, dst, where + " decode tensor " + std::to_string(i));
    }
  }
  ASSERT_EQ(r.num_decode_steps(), static_cast<std::size_t>(S));
  EXPECT_EQ(r.decode_tokens().token_id, (std::vector<std::int32_t>{500, 501, 502}));
  EXPECT_EQ(r.decode_tokens().position, (std::vector<std::int32_t>{10, 11, 12}));
  EXPECT_EQ(r.decode_tokens().text, (std::vector<std::string>{"", "two", ""}));
  const auto agg = r.read_aggregates(1);
  ASSERT_TRUE(agg.has_value());
  EXPECT_EQ(agg->attn_colsum, colsum);
  EXPECT_EQ(agg->attn_window, window);
  EXPECT_EQ(agg->window, 2);
  EXPECT_FALSE(r.read_aggregates(0).has_value());
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const char* n[] = {"f32", "f16", "bf16"};
  return std::string(n[info.param.input]) + "_to_" + n[info.param.trace];
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, RoundTrip,
                         ::testing::Values(Case{KVSCOPE_F32, KVSCOPE_F32}, Case{KVSCOPE_F32, KVSCOPE_F16},
                                           Case{KVSCOPE_F32, KVSCOPE_BF16}, Case{KVSCOPE_F16, KVSCOPE_F16},
                                           Case{KVSCOPE_F16, KVSCOPE_F32}, Case{KVSCOPE_F16, KVSCOPE_BF16},
                                           Case{KVSCOPE_BF16, KVSCOPE_BF16}, Case{KVSCOPE_BF16, KVSCOPE_F16},
                                           Case{KVSCOPE_BF16, KVSCOPE_F32}),
                         case_name);

// Conversion rounds to nearest even on exact ties, and values beyond float16 are refused.
TEST_F(CaptureTest, HalfwayValuesRoundToEvenAndOverflowIsAnError) {
  Geometry g;
  g.L = 1;
  g.Hq = g.Hkv = 1;
  g.D = 2;
  g.T = 1;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F16);
  capture::Capture cap(path("t.h5"), cfg, g.T);
  cap.set_tokens(make_tokens(1, false));
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even -> 1.0. 1 + 3*2^-11 -> 1 + 2^-9.
  const float q[2] = {1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11)};
  cap.prefill_layer(0, capture::tensor(q, 1, 1, 2), capture::tensor(q, 1, 1, 2), capture::tensor(q, 1, 1, 2));
  cap.close();
  const trace::TraceReader r(path("t.h5"));
  const trace::Tensor t = r.read_layer(0).q;
  EXPECT_EQ(t.at(0), 1.0f);
  EXPECT_EQ(t.at(1), 1.0f + std::ldexp(1.0f, -9));

  capture::Capture big(path("big.h5"), cfg, g.T);
  big.set_tokens(make_tokens(1, false));
  const float huge[2] = {1.0f, 70000.0f};
  big.prefill_layer(0, capture::tensor(huge, 1, 1, 2), capture::tensor(q, 1, 1, 2),
                    capture::tensor(q, 1, 1, 2));
  try {
    big.close();
    FAIL() << "close accepted a value that overflows float16";
  } catch (const capture::CaptureError& e) {
    EXPECT_EQ(e.status(), KVSCOPE_ERR_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("layer 0 q: element [0, 0, 1] = 70000"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("not finite in float16"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(trace::validate_trace(path("big.h5")).ok);
}

// The C++ wrapper: RAII ranges, stats, and a Capture destroyed without close() leaves an
// incomplete trace.
TEST_F(CaptureTest, CppWrapperClosesOrAborts) {
  const Geometry g;
  const kvscope_capture_config cfg = make_config(g, KVSCOPE_F32);
  {
    capture::Capture cap(path("aborted.h5"), cfg, g.T);
    cap.set_tokens(make_tokens(g.T, false));
  }  // destroyed without close
  const trace::ValidationReport rep = trace::validate_trace(path("aborted.h5"));
  EXPECT_TRUE(rep.incomplete) << rep.message;

  capture::Capture cap(path("t.h5"), cfg, g.T);
  EXPECT_TRUE(cap.is_open());
  cap.set_tokens(make_tokens(g.T, false));
  const std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D), 0.5f);
  const std::vector<float> kv(static_cast<std::size_t>(g.Hkv * g.T * g.D), -0.25f);
  for (int l = 0; l < g.L; ++l) {
    auto range = cap.range("layer");
    cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D));
  }
  const kvscope_capture_stats s = cap.stats();
  EXPECT_EQ(s.queue_bytes_bound, 256ull << 20);
  std::vector<std::uint8_t> roles(static_cast<std::size_t>(g.T), KVSCOPE_ROLE_CONTEXT);
  roles.back() = KVSCOPE_ROLE_QUESTION;
  cap.set_token_roles(roles);
  cap.set_decode_roles({});                                       // S = 0
  EXPECT_THROW(cap.set_decode_roles({}), capture::CaptureError);  // once
  try {
    cap.prefill_layer(0, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D));
    FAIL() << "layer 0 recorded twice";
  } catch (const capture::CaptureError& e) {
    EXPECT_EQ(e.status(), KVSCOPE_ERR_STATE);
    EXPECT_STREQ(e.what(), "kvscope_capture_prefill_layer: layer 0 was already recorded");
  }
  cap.close();
  EXPECT_FALSE(cap.is_open());
  EXPECT_THROW(cap.range_push("x"), capture::CaptureError);
  const trace::TraceReader r(path("t.h5"));
  EXPECT_EQ(r.num_decode_steps(), 0u);
  EXPECT_EQ(r.tokens().role, roles);
  EXPECT_TRUE(r.has_roles());
  EXPECT_EQ(r.read_layer(2).k.at(5), -0.25f);
}

// config.aggregate_window: the writer thread stores the attention aggregates of every prefill layer,
// the values kvscope::aggregate computes from the tensors read back, marked complete at close; they
// need the tokens first.
TEST_F(CaptureTest, AggregateWindowStoresTheAttentionAggregates) {
  const Geometry g;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F16);
  cfg.aggregate_window = 4;
  {
    capture::Capture early(path("early.h5"), cfg, g.T);
    const std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D), 0.5f);
    try {
      early.prefill_layer(0, capture::tensor(q.data(), g.Hq, g.T, g.D),
                          capture::tensor(q.data(), g.Hkv, g.T, g.D),
                          capture::tensor(q.data(), g.Hkv, g.T, g.D));
      FAIL() << "prefill before tokens with aggregate_window";
    } catch (const capture::CaptureError& e) {
      EXPECT_EQ(e.status(), KVSCOPE_ERR_STATE);
      EXPECT_NE(std::string(e.what()).find("aggregate_window needs kvscope_capture_set_tokens"),
                std::string::npos)
          << e.what();
    }
  }
  capture::Capture cap(path("agg.h5"), cfg, g.T);
  cap.set_tokens(make_tokens(g.T, false));
  for (int l = 0; l < g.L; ++l) {
    const std::vector<float> q = random_normal(static_cast<std::size_t>(g.Hq * g.T * g.D), 10 + l, 1.0f);
    const std::vector<float> k = random_normal(static_cast<std::size_t>(g.Hkv * g.T * g.D), 20 + l, 1.0f);
    cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(k.data(), g.Hkv, g.T, g.D), capture::tensor(k.data(), g.Hkv, g.T, g.D));
  }
  cap.close();
  const trace::TraceReader r(path("agg.h5"));
  ASSERT_EQ(r.aggregate_state(), trace::AggregateState::kPresent);
  const trace::AggregateDefinition d = r.aggregate_definition();
  EXPECT_EQ(d.window, 4);
  EXPECT_EQ(d.input_dtype, "float16");
  const aggregate::AggregateComputer c(r.geometry(), r.header().dtype, r.tokens(), 4, "test");
  for (int l = 0; l < g.L; ++l) {
    const trace::LayerTensors t = r.read_layer(l);
    const trace::LayerAttentionAggregates want = c.compute(t.q.data.data(), t.k.data.data());
    const trace::LayerAttentionAggregates got = r.read_attention_aggregates(l, d);
    // The same kernels on the same float16 tensors.
    EXPECT_TRUE(all_close(got.h2o, want.h2o, 1e-6, 1e-6, "h2o"));
    EXPECT_TRUE(all_close(got.window_sum, want.window_sum, 1e-6, 1e-6, "window_sum"));
    EXPECT_TRUE(all_close(got.cross_given, want.cross_given, 1e-6, 1e-6, "cross_given"));
    EXPECT_TRUE(all_close(got.redundancy, want.redundancy, 1e-6, 1e-6, "redundancy"));
  }
  const trace::ValidationReport rep = trace::validate_trace(path("agg.h5"));
  EXPECT_TRUE(rep.ok) << rep.message;
  EXPECT_NE(rep.message.find("attention aggregates (window 4)"), std::string::npos) << rep.message;
}

}  // namespace
}  // namespace kvscope::testing
