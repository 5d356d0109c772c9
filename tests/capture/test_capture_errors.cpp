// Every documented error path of the C API returns its status and a one-line message that
// names the problem; the capture stays usable after an argument error.
#include <cmath>
#include <filesystem>
#include <limits>

#include "capture_test_util.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/validate.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "common/gpu.hpp"
#endif

namespace kvscope::testing {
namespace {

// Expects `status` == want and the last error to contain `text` on one line.
#define EXPECT_CAPTURE_ERROR(call, want, text)                                              \
  do {                                                                                      \
    const int _st = (call);                                                                 \
    const std::string _msg = kvscope_capture_last_error();                                  \
    EXPECT_EQ(_st, want) << #call << ": " << _msg;                                          \
    EXPECT_NE(_msg.find(text), std::string::npos) << #call << ": message '" << _msg << "'"; \
    EXPECT_EQ(_msg.find('\n'), std::string::npos) << _msg;                                  \
  } while (0)

class CaptureErrors : public CaptureTest {
 protected:
  void SetUp() override {
    CaptureTest::SetUp();
    cfg_ = make_config(g_, KVSCOPE_F32);
    q_.assign(static_cast<std::size_t>(g_.Hq * g_.T * g_.D), 1.0f);
    kv_.assign(static_cast<std::size_t>(g_.Hkv * g_.T * g_.D), 2.0f);
    qt_ = capture::tensor(q_.data(), g_.Hq, g_.T, g_.D);
    kvt_ = capture::tensor(kv_.data(), g_.Hkv, g_.T, g_.D);
    dq_ = capture::tensor(q_.data(), g_.Hq, 1, g_.D);
    dkv_ = capture::tensor(kv_.data(), g_.Hkv, 1, g_.D);
  }
  void TearDown() override {
    kvscope_capture_abort(cap_);
    CaptureTest::TearDown();
  }
  kvscope_capture* open() {
    EXPECT_EQ(kvscope_capture_open(path("t.h5").c_str(), &cfg_, g_.T, &cap_), KVSCOPE_OK)
        << kvscope_capture_last_error();
    return cap_;
  }
  Geometry g_;
  kvscope_capture_config cfg_{};
  std::vector<float> q_, kv_;
  kvscope_tensor qt_{}, kvt_{}, dq_{}, dkv_{};
  kvscope_capture* cap_ = nullptr;
};

TEST_F(CaptureErrors, OpenArguments) {
  kvscope_capture* c = nullptr;
  const std::string p = path("t.h5");
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &cfg_, g_.T, nullptr), KVSCOPE_ERR_ARGUMENT,
                       "out is NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(nullptr, &cfg_, g_.T, &c), KVSCOPE_ERR_ARGUMENT, "path is NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), nullptr, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "config is NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &cfg_, 0, &c), KVSCOPE_ERR_ARGUMENT,
                       "context_tokens must be > 0 (got 0)");
  kvscope_capture_config bad = cfg_;
  bad.struct_size = 0;
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "config->struct_size is 0");
  bad = cfg_;
  bad.num_q_heads = 3;
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "config.num_q_heads (3) must be a multiple of config.num_kv_heads (2)");
  bad = cfg_;
  bad.num_layers = 0;
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "config.num_layers must be > 0");
  // What the trace reader would refuse (docs/trace-format.md) is refused at open.
  for (const double theta : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    bad = cfg_;
    bad.rope_theta = theta;
    EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                         "config.rope_theta must be a finite number > 0");
  }
  bad = cfg_;
  bad.num_q_heads = bad.num_kv_heads = 2048;
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "over the trace format's limits");
  bad = cfg_;
  bad.dtype = static_cast<kvscope_dtype>(7);
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "config.dtype 7");
  bad = cfg_;
  bad.deflate_level = 10;
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &bad, g_.T, &c), KVSCOPE_ERR_ARGUMENT,
                       "deflate_level");
  EXPECT_EQ(c, nullptr);
  EXPECT_FALSE(std::filesystem::exists(p));  // nothing created before the arguments are valid
}

TEST_F(CaptureErrors, UnwritablePath) {
  kvscope_capture* c = nullptr;
  const std::string p = path("no/such/dir/t.h5");
  EXPECT_CAPTURE_ERROR(kvscope_capture_open(p.c_str(), &cfg_, g_.T, &c), KVSCOPE_ERR_IO, p);
  EXPECT_EQ(c, nullptr);
}

TEST_F(CaptureErrors, NullHandleEverywhere) {
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(nullptr, 0, &qt_, &kvt_, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "kvscope_capture_prefill_layer: capture handle is NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_decode_layer(nullptr, 0, 0, &dq_, &dkv_, &dkv_), KVSCOPE_ERR_ARGUMENT,
                       "kvscope_capture_decode_layer: capture handle is NULL");
  EXPECT_CAPTURE_ERROR(
      kvscope_capture_set_tokens(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
      KVSCOPE_ERR_ARGUMENT, "kvscope_capture_set_tokens: capture handle is NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_range_push(nullptr, "x"), KVSCOPE_ERR_ARGUMENT, "handle is NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_close(nullptr), KVSCOPE_ERR_ARGUMENT, "kvscope_capture_close");
  kvscope_capture_abort(nullptr);  // no-op
}

TEST_F(CaptureErrors, TensorArguments) {
  open();
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, nullptr, &kvt_, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "kvscope_capture_prefill_layer: q is NULL");
  kvscope_tensor wrong = kvt_;
  wrong.shape[1] = g_.T - 1;
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &qt_, &wrong, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "k has shape [2, 9, 8], expected [Hkv, T, D] = [2, 10, 8]");
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &kvt_, &kvt_, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "q has shape [2, 10, 8], expected [Hq, T, D] = [4, 10, 8]");
  wrong = kvt_;
  wrong.data = nullptr;
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &qt_, &kvt_, &wrong), KVSCOPE_ERR_ARGUMENT,
                       "v.data is NULL");
  wrong = kvt_;
  wrong.stride[1] = -1;
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &qt_, &wrong, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "k.stride[1] is negative");
  wrong = kvt_;
  wrong.dtype = static_cast<kvscope_dtype>(9);
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &qt_, &wrong, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "k.dtype 9");
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, g_.L, &qt_, &kvt_, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "layer 3 out of range [0, 3)");
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, -1, &qt_, &kvt_, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "layer -1 out of range");
  EXPECT_CAPTURE_ERROR(kvscope_capture_decode_layer(cap_, 0, 0, &qt_, &dkv_, &dkv_), KVSCOPE_ERR_ARGUMENT,
                       "q has shape [4, 10, 8], expected [Hq, 1, D] = [4, 1, 8]");
  EXPECT_CAPTURE_ERROR(kvscope_capture_layer_aggregates(cap_, 0, nullptr, nullptr, 0), KVSCOPE_ERR_ARGUMENT,
                       "attn_colsum and attn_window are both NULL");
  EXPECT_CAPTURE_ERROR(kvscope_capture_layer_aggregates(cap_, 0, nullptr, q_.data(), 0), KVSCOPE_ERR_ARGUMENT,
                       "window must be > 0");
  // After argument errors the capture still works.
  EXPECT_EQ(kvscope_capture_prefill_layer(cap_, 0, &qt_, &kvt_, &kvt_), KVSCOPE_OK)
      << kvscope_capture_last_error();
}

TEST_F(CaptureErrors, TokenArguments) {
  open();
  capture::TokenTable t = make_tokens(g_.T, false);
  EXPECT_CAPTURE_ERROR(
      kvscope_capture_set_tokens(cap_, t.modality.data(), nullptr, t.token_id.data(), t.segment.data(),
                                 t.grid_row.data(), t.grid_col.data(), nullptr),
      KVSCOPE_ERR_ARGUMENT, "kvscope_capture_set_tokens: position is NULL");
  t.modality[4] = 9;
  set_tokens(cap_, t, KVSCOPE_ERR_ARGUMENT);
  EXPECT_STREQ(kvscope_capture_last_error(),
               "kvscope_capture_set_tokens: modality[4] = 9 is not a kvscope_modality code (0..3)");
  t.modality[4] = KVSCOPE_VISION;
  set_tokens(cap_, t);
  set_tokens(cap_, t, KVSCOPE_ERR_STATE);
  EXPECT_STREQ(kvscope_capture_last_error(), "kvscope_capture_set_tokens: tokens were already set");
}

TEST_F(CaptureErrors, OrderOfCalls) {
  open();
  ASSERT_EQ(kvscope_capture_prefill_layer(cap_, 1, &qt_, &kvt_, &kvt_), KVSCOPE_OK);
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 1, &qt_, &kvt_, &kvt_), KVSCOPE_ERR_STATE,
                       "layer 1 was already recorded");
  EXPECT_CAPTURE_ERROR(kvscope_capture_decode_layer(cap_, 0, 1, &dq_, &dkv_, &dkv_), KVSCOPE_ERR_STATE,
                       "decode step 1 of layer 0 out of order: expected step 0");
  EXPECT_CAPTURE_ERROR(kvscope_capture_decode_layer(cap_, 0, cfg_.max_decode_steps, &dq_, &dkv_, &dkv_),
                       KVSCOPE_ERR_ARGUMENT, "step 8 out of range [0, 8) (config.max_decode_steps)");
  ASSERT_EQ(kvscope_capture_decode_layer(cap_, 0, 0, &dq_, &dkv_, &dkv_), KVSCOPE_OK);
  EXPECT_CAPTURE_ERROR(kvscope_capture_decode_layer(cap_, 0, 0, &dq_, &dkv_, &dkv_), KVSCOPE_ERR_STATE,
                       "decode step 0 of layer 0 out of order: expected step 1");
  EXPECT_CAPTURE_ERROR(kvscope_capture_decode_token(cap_, 2, 1, 1, nullptr), KVSCOPE_ERR_STATE,
                       "decode token of step 2 out of order: expected step 0");
  EXPECT_CAPTURE_ERROR(kvscope_capture_range_pop(cap_), KVSCOPE_ERR_STATE,
                       "no open range (pop without push)");
  EXPECT_CAPTURE_ERROR(kvscope_capture_range_push(cap_, nullptr), KVSCOPE_ERR_ARGUMENT, "name is NULL");
  const float colsum[40] = {};
  ASSERT_EQ(kvscope_capture_layer_aggregates(cap_, 0, colsum, nullptr, 0), KVSCOPE_OK);
  EXPECT_CAPTURE_ERROR(kvscope_capture_layer_aggregates(cap_, 0, colsum, nullptr, 0), KVSCOPE_ERR_STATE,
                       "aggregates of layer 0 were already recorded");
}

TEST_F(CaptureErrors, CloseNamesWhatIsMissing) {
  open();
  ASSERT_EQ(kvscope_capture_prefill_layer(cap_, 0, &qt_, &kvt_, &kvt_), KVSCOPE_OK);
  ASSERT_EQ(kvscope_capture_decode_layer(cap_, 1, 0, &dq_, &dkv_, &dkv_), KVSCOPE_OK);
  const int st = kvscope_capture_close(cap_);
  cap_ = nullptr;  // freed by close even on failure
  EXPECT_EQ(st, KVSCOPE_ERR_STATE);
  EXPECT_STREQ(
      kvscope_capture_last_error(),
      "kvscope_capture_close: tokens not set; prefill layers not recorded: 1, 2; decode steps differ "
      "between layers: layer 0 has 0, layers 1 have 1; trace left incomplete");
  const trace::ValidationReport rep = trace::validate_trace(path("t.h5"));
  EXPECT_TRUE(rep.incomplete) << rep.message;
  EXPECT_EQ(rep.layers_present, 1);  // the recorded layer was written before close gave up
}

TEST_F(CaptureErrors, CloseNamesMissingDecodeTokens) {
  open();
  set_tokens(cap_, make_tokens(g_.T, false));
  for (int l = 0; l < g_.L; ++l) {
    ASSERT_EQ(kvscope_capture_prefill_layer(cap_, l, &qt_, &kvt_, &kvt_), KVSCOPE_OK);
    ASSERT_EQ(kvscope_capture_decode_layer(cap_, l, 0, &dq_, &dkv_, &dkv_), KVSCOPE_OK);
  }
  const int st = kvscope_capture_close(cap_);
  cap_ = nullptr;
  EXPECT_EQ(st, KVSCOPE_ERR_STATE);
  EXPECT_STREQ(kvscope_capture_last_error(),
               "kvscope_capture_close: 0 decode tokens recorded for 1 decode steps; trace left incomplete");
}

// Token roles through the C API: bad codes and a count that does not match the steps are refused in one
// line; good ones reach the trace (format 1.1).
TEST_F(CaptureErrors, RolesAreCheckedAndRecorded) {
  open();
  set_tokens(cap_, make_tokens(g_.T, false));
  std::vector<std::uint8_t> ctx(static_cast<std::size_t>(g_.T), KVSCOPE_ROLE_CONTEXT);
  ctx[0] = KVSCOPE_ROLE_TEMPLATE;
  std::vector<std::uint8_t> bad = ctx;
  bad[3] = 4;
  EXPECT_CAPTURE_ERROR(kvscope_capture_set_token_roles(cap_, bad.data()), KVSCOPE_ERR_ARGUMENT,
                       "kvscope_capture_set_token_roles: roles[3] = 4 is not a kvscope_role code (0..3)");
  EXPECT_CAPTURE_ERROR(kvscope_capture_set_token_roles(cap_, nullptr), KVSCOPE_ERR_ARGUMENT, "roles is NULL");
  ASSERT_EQ(kvscope_capture_set_token_roles(cap_, ctx.data()), KVSCOPE_OK) << kvscope_capture_last_error();
  EXPECT_CAPTURE_ERROR(kvscope_capture_set_token_roles(cap_, ctx.data()), KVSCOPE_ERR_STATE, "already set");
  const std::uint8_t steps[3] = {KVSCOPE_ROLE_QUESTION, KVSCOPE_ROLE_ANSWER, 9};
  EXPECT_CAPTURE_ERROR(kvscope_capture_set_decode_roles(cap_, steps, 3), KVSCOPE_ERR_ARGUMENT,
                       "roles[2] = 9 is not a kvscope_role code");
  EXPECT_CAPTURE_ERROR(kvscope_capture_set_decode_roles(cap_, steps, 100), KVSCOPE_ERR_ARGUMENT,
                       "num_steps 100 out of range [0, 8]");
  ASSERT_EQ(kvscope_capture_set_decode_roles(cap_, steps, 2), KVSCOPE_OK) << kvscope_capture_last_error();
  for (int l = 0; l < g_.L; ++l) {
    ASSERT_EQ(kvscope_capture_prefill_layer(cap_, l, &qt_, &kvt_, &kvt_), KVSCOPE_OK);
    for (int s = 0; s < 2; ++s)
      ASSERT_EQ(kvscope_capture_decode_layer(cap_, l, s, &dq_, &dkv_, &dkv_), KVSCOPE_OK);
  }
  for (int s = 0; s < 2; ++s)
    ASSERT_EQ(kvscope_capture_decode_token(cap_, s, 5 + s, 10 + s, nullptr), KVSCOPE_OK);
  ASSERT_EQ(kvscope_capture_close(cap_), KVSCOPE_OK) << kvscope_capture_last_error();
  cap_ = nullptr;
  trace::TraceReader r(path("t.h5"));
  EXPECT_TRUE(r.has_roles());
  EXPECT_EQ(r.header().version_minor, 1);
  EXPECT_EQ(r.tokens().role, ctx);
  EXPECT_EQ(r.decode_tokens().role, (std::vector<std::uint8_t>{1, 2}));
}

TEST_F(CaptureErrors, CloseNamesDecodeRolesThatDoNotMatchTheSteps) {
  open();
  set_tokens(cap_, make_tokens(g_.T, false));
  const std::uint8_t steps[2] = {KVSCOPE_ROLE_QUESTION, KVSCOPE_ROLE_ANSWER};
  ASSERT_EQ(kvscope_capture_set_decode_roles(cap_, steps, 2), KVSCOPE_OK);
  for (int l = 0; l < g_.L; ++l) {
    ASSERT_EQ(kvscope_capture_prefill_layer(cap_, l, &qt_, &kvt_, &kvt_), KVSCOPE_OK);
    ASSERT_EQ(kvscope_capture_decode_layer(cap_, l, 0, &dq_, &dkv_, &dkv_), KVSCOPE_OK);
  }
  ASSERT_EQ(kvscope_capture_decode_token(cap_, 0, 5, 10, nullptr), KVSCOPE_OK);
  const int st = kvscope_capture_close(cap_);
  cap_ = nullptr;
  EXPECT_EQ(st, KVSCOPE_ERR_STATE);
  EXPECT_STREQ(kvscope_capture_last_error(),
               "kvscope_capture_close: 2 decode roles set for 1 decode steps; trace left incomplete");
}

// A writer-thread failure (here: a value that is not finite) is reported by the next call.
TEST_F(CaptureErrors, WriterErrorReachesTheNextCall) {
  open();
  std::vector<float> nan_q = q_;
  nan_q[17] = std::numeric_limits<float>::quiet_NaN();
  const kvscope_tensor t = capture::tensor(nan_q.data(), g_.Hq, g_.T, g_.D);
  ASSERT_EQ(kvscope_capture_prefill_layer(cap_, 0, &t, &kvt_, &kvt_), KVSCOPE_OK);
  int st = KVSCOPE_OK;
  for (int i = 0; i < 1000 && st == KVSCOPE_OK; ++i) {  // the writer works asynchronously
    st = kvscope_capture_range_push(cap_, "probe");
    if (st == KVSCOPE_OK) {
      ASSERT_EQ(kvscope_capture_range_pop(cap_), KVSCOPE_OK);
      usleep(1000);
    }
  }
  EXPECT_EQ(st, KVSCOPE_ERR_ARGUMENT);
  EXPECT_STREQ(
      kvscope_capture_last_error(),
      "kvscope_capture_range_push: the writer thread failed earlier: prefill layer 0 q: element [0, 2, 1] = "
      "nan is not finite in float32 (NaN, Inf or out of range); a trace holds finite values only");
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 1, &qt_, &kvt_, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "writer thread failed earlier");
  EXPECT_CAPTURE_ERROR(kvscope_capture_close(cap_), KVSCOPE_ERR_ARGUMENT,
                       "kvscope_capture_close: the writer thread failed");
  cap_ = nullptr;
  EXPECT_TRUE(trace::validate_trace(path("t.h5")).incomplete);
}

TEST_F(CaptureErrors, DeviceTensorWithoutCuda) {
#if defined(KVSCOPE_HAVE_CUDA)
  if (gpu_available())
    GTEST_SKIP() << "a CUDA GPU is present: the device path is tested in test_capture_cuda";
#endif
  open();
  kvscope_tensor dev = kvt_;
  dev.memory = KVSCOPE_DEVICE;
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &qt_, &dev, &kvt_), KVSCOPE_ERR_CUDA,
                       "a KVSCOPE_DEVICE tensor was given, but");
  dev.stride[2] = 2;
  EXPECT_CAPTURE_ERROR(kvscope_capture_prefill_layer(cap_, 0, &qt_, &dev, &kvt_), KVSCOPE_ERR_ARGUMENT,
                       "k is a device tensor with innermost stride 2");
  // The failed call recorded nothing: the layer can still be recorded from host memory.
  EXPECT_EQ(kvscope_capture_prefill_layer(cap_, 0, &qt_, &kvt_, &kvt_), KVSCOPE_OK)
      << kvscope_capture_last_error();
}

TEST_F(CaptureErrors, AbiVersion) {
  EXPECT_EQ(kvscope_capture_abi_version(), KVSCOPE_CAPTURE_ABI_VERSION);
  kvscope_capture_stats s{};
  open();
  EXPECT_CAPTURE_ERROR(kvscope_capture_get_stats(cap_, &s), KVSCOPE_ERR_ARGUMENT, "out->struct_size is 0");
}

}  // namespace
}  // namespace kvscope::testing
