// CUDA compaction vs the CPU backend: byte-identical rows, multiplicities and
// modality codes; device-side rejection of out-of-range indices and malformed
// offsets. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/gpu.hpp"
#include "common/test_util.hpp"
#include "kvscope/kernels/compact.hpp"
#include "kvscope/kernels/compact_cuda.hpp"

namespace kvscope::testing {
namespace {

using kernels::CompactInputs;
using kernels::CompactOutputs;
using kernels::CompactShape;
using kernels::DType;
using kernels::KeptIndices;

template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : n_(host.size()) {
    if (n_ > 0) {
      EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceVector() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() const { return p_; }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

struct Problem {
  CompactShape shape;
  std::vector<std::uint8_t> keys, values, modality;
  std::vector<std::int32_t> multiplicity, indices, offsets;
};

Problem make_problem(CompactShape shape, bool per_head, int k, std::uint64_t seed) {
  Problem p{shape, {}, {}, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  const std::size_t bytes = static_cast<std::size_t>(shape.num_heads) * shape.tokens * shape.head_dim *
                            kernels::dtype_bytes(shape.dtype);
  for (std::size_t i = 0; i < bytes; ++i) {
    p.keys.push_back(static_cast<std::uint8_t>(rng()));
    p.values.push_back(static_cast<std::uint8_t>(rng()));
  }
  std::uniform_int_distribution<int> token(0, shape.tokens - 1), count(0, k);
  for (int t = 0; t < shape.tokens; ++t) p.modality.push_back(static_cast<std::uint8_t>(rng() % 4));
  for (int e = 0; e < shape.num_heads * shape.tokens; ++e)
    p.multiplicity.push_back(static_cast<int>(rng() % 9) + 1);
  if (!per_head) {
    for (int j = 0; j < k; ++j) p.indices.push_back(token(rng));
  } else {
    p.offsets.push_back(0);
    for (int h = 0; h < shape.num_heads; ++h) {
      const int kh = h == 1 ? 0 : count(rng);
      for (int j = 0; j < kh; ++j) p.indices.push_back(token(rng));
      p.offsets.push_back(static_cast<std::int32_t>(p.indices.size()));
    }
  }
  return p;
}

std::string describe(const Problem& p) {
  std::ostringstream o;
  o << "shape=[" << p.shape.num_heads << "," << p.shape.tokens << "," << p.shape.head_dim << "] "
    << kernels::dtype_name(p.shape.dtype) << (p.offsets.empty() ? " shared" : " per-head")
    << " kept=" << p.indices.size();
  return o.str();
}

// Runs both backends; returns the CUDA status.
kernels::Status compare_backends(const Problem& p, bool expect_equal) {
  const std::string params = describe(p);
  const KeptIndices host_kept{p.indices.data(), p.offsets.empty() ? nullptr : p.offsets.data(),
                              static_cast<int>(p.indices.size())};
  const std::int64_t rows = kernels::compact_rows(p.shape, host_kept);
  const std::size_t row = static_cast<std::size_t>(p.shape.head_dim) * kernels::dtype_bytes(p.shape.dtype);
  std::vector<std::uint8_t> keys(rows * row), values(rows * row), mod(rows);
  std::vector<std::int32_t> mult(rows);
  const CompactInputs hin{p.keys.data(), p.values.data(), p.multiplicity.data(), true, p.modality.data()};
  const kernels::Status cpu_status =
      kernels::cpu::compact(p.shape, host_kept, hin, {keys.data(), values.data(), mult.data(), mod.data()});

  DeviceVector<std::uint8_t> dk(p.keys), dv(p.values), dmod(p.modality), ok(keys), ov(values), omod(mod);
  DeviceVector<std::int32_t> dmult(p.multiplicity), didx(p.indices), doff(p.offsets), omult(mult);
  const KeptIndices dev_kept{didx.get(), p.offsets.empty() ? nullptr : doff.get(),
                             static_cast<int>(p.indices.size())};
  const CompactInputs din{dk.get(), dv.get(), dmult.get(), true, dmod.get()};
  const kernels::Status st =
      kernels::cuda::compact(p.shape, dev_kept, din, {ok.get(), ov.get(), omult.get(), omod.get()}, nullptr);
  EXPECT_EQ(st.ok(), cpu_status.ok())
      << params << ": cuda " << st.message() << " / cpu " << cpu_status.message();
  if (expect_equal) {
    EXPECT_TRUE(all_close(ok.download(), keys, 0, 0, params + " keys"));
    EXPECT_TRUE(all_close(ov.download(), values, 0, 0, params + " values"));
    EXPECT_TRUE(all_close(omult.download(), mult, 0, 0, params + " multiplicity"));
    EXPECT_TRUE(all_close(omod.download(), mod, 0, 0, params + " modality"));
  }
  return st;
}

TEST(CompactCuda, MatchesCpu) {
  KVSCOPE_REQUIRE_GPU();
  const CompactShape shapes[] = {{1, 1, 1, DType::kF32},       {1, 7, 7, DType::kF16},
                                 {3, 33, 7, DType::kBF16},     {5, 33, 33, DType::kF16},
                                 {32, 2048, 128, DType::kF16}, {8, 300, 64, DType::kF32}};
  std::uint64_t seed = 1;
  for (const CompactShape& shape : shapes) {
    for (bool per_head : {false, true}) {
      for (int k : {1, 5, shape.tokens / 2 + 1}) {
        const kernels::Status st = compare_backends(make_problem(shape, per_head, k, seed++), true);
        EXPECT_TRUE(st.ok()) << st.message();
      }
    }
  }
}

TEST(CompactCuda, RejectsOutOfRangeAndMalformedOffsets) {
  KVSCOPE_REQUIRE_GPU();
  for (bool per_head : {false, true}) {
    Problem p = make_problem({3, 33, 8, DType::kF16}, per_head, 6, 5);
    p.indices[p.indices.size() / 2] = 33;
    const kernels::Status st = compare_backends(p, false);
    EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("out of range"), std::string::npos) << st.message();
  }
  Problem p = make_problem({3, 33, 8, DType::kF16}, true, 6, 9);
  p.offsets[1] = p.offsets[2] + 1;  // decreasing
  const kernels::Status st = compare_backends(p, false);
  EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("offsets"), std::string::npos) << st.message();
}

TEST(CompactCuda, UncheckedCountsErrorsAndZeroFills) {
  KVSCOPE_REQUIRE_GPU();
  Problem p = make_problem({2, 10, 4, DType::kF32}, false, 3, 3);
  p.indices = {2, -5, 9};
  DeviceVector<std::uint8_t> dk(p.keys), ok(std::vector<std::uint8_t>(6 * 16, 0xee));
  DeviceVector<std::int32_t> didx(p.indices), errors(std::vector<std::int32_t>{0, 0});
  CompactInputs in;
  in.keys = dk.get();
  CompactOutputs out;
  out.keys = ok.get();
  const kernels::Status st =
      kernels::cuda::compact_unchecked(p.shape, {didx.get(), nullptr, 3}, in, out, errors.get(), nullptr);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto err = errors.download();
  EXPECT_EQ(err[0], 2);  // one bad index, two heads
  EXPECT_EQ(err[1], 0);
  const auto got = ok.download();
  for (int b = 0; b < 16; ++b) {
    EXPECT_EQ(got[16 + b], 0) << "zero-filled row, byte " << b;
    EXPECT_EQ(got[b], p.keys[2 * 16 + b]);
  }
}

}  // namespace
}  // namespace kvscope::testing
