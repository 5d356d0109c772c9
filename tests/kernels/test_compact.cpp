// CPU compaction vs a naive gather written here, for shared and per-head (ragged)
// index lists, every dtype, with multiplicities and modality codes; plus rejection
// of out-of-range indices and malformed offsets (nothing written) and argument checks.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.hpp"
#include "kvscope/kernels/compact.hpp"

namespace kvscope::testing {
namespace {

using kernels::CompactInputs;
using kernels::CompactOutputs;
using kernels::CompactShape;
using kernels::DType;
using kernels::KeptIndices;
namespace cpu = kernels::cpu;

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

// A random problem: K/V bytes, multiplicities, modality codes and kept lists.
struct Problem {
  CompactShape shape;
  std::vector<std::uint8_t> keys, values, modality;
  std::vector<std::int32_t> multiplicity;  // [heads, tokens]
  std::vector<std::int32_t> indices, offsets;
};

Problem make_problem(CompactShape shape, bool per_head, int k, std::uint64_t seed) {
  Problem p;
  p.shape = shape;
  const std::size_t bytes = static_cast<std::size_t>(shape.num_heads) * shape.tokens * shape.head_dim *
                            kernels::dtype_bytes(shape.dtype);
  p.keys = random_bytes(bytes, seed);
  p.values = random_bytes(bytes, seed + 1);
  std::mt19937_64 rng(seed + 2);
  std::uniform_int_distribution<int> token(0, shape.tokens - 1), mod(0, kernels::kNumModalities - 1),
      count(0, k), mult(1, 9);
  for (int t = 0; t < shape.tokens; ++t) p.modality.push_back(static_cast<std::uint8_t>(mod(rng)));
  for (int e = 0; e < shape.num_heads * shape.tokens; ++e) p.multiplicity.push_back(mult(rng));
  if (!per_head) {
    for (int j = 0; j < k; ++j) p.indices.push_back(token(rng));  // repeats allowed
  } else {
    p.offsets.push_back(0);
    for (int h = 0; h < shape.num_heads; ++h) {
      const int kh = h == 1 ? 0 : count(rng);  // head 1 (if any) keeps nothing
      for (int j = 0; j < kh; ++j) p.indices.push_back(token(rng));
      p.offsets.push_back(static_cast<std::int32_t>(p.indices.size()));
    }
  }
  return p;
}

KeptIndices kept_of(const Problem& p) {
  return KeptIndices{p.indices.data(), p.offsets.empty() ? nullptr : p.offsets.data(),
                     static_cast<int>(p.indices.size())};
}

struct Gathered {
  std::vector<std::uint8_t> keys, values, modality;
  std::vector<std::int32_t> multiplicity;
};

// Naive gather: for each head, for each kept position, copy the row.
Gathered naive_gather(const Problem& p, bool mult_per_head) {
  Gathered g;
  const std::size_t row = static_cast<std::size_t>(p.shape.head_dim) * kernels::dtype_bytes(p.shape.dtype);
  for (int h = 0; h < p.shape.num_heads; ++h) {
    const int begin = p.offsets.empty() ? 0 : p.offsets[h];
    const int end = p.offsets.empty() ? static_cast<int>(p.indices.size()) : p.offsets[h + 1];
    for (int j = begin; j < end; ++j) {
      const int t = p.indices[j];
      const std::size_t src = (static_cast<std::size_t>(h) * p.shape.tokens + t) * row;
      g.keys.insert(g.keys.end(), p.keys.begin() + src, p.keys.begin() + src + row);
      g.values.insert(g.values.end(), p.values.begin() + src, p.values.begin() + src + row);
      g.multiplicity.push_back(p.multiplicity[(mult_per_head ? h * p.shape.tokens : 0) + t]);
      g.modality.push_back(p.modality[t]);
    }
  }
  return g;
}

Gathered run_cpu(const Problem& p, bool mult_per_head, kernels::Status* status) {
  const std::int64_t rows = kernels::compact_rows(p.shape, kept_of(p));
  const std::size_t row = static_cast<std::size_t>(p.shape.head_dim) * kernels::dtype_bytes(p.shape.dtype);
  Gathered g{std::vector<std::uint8_t>(rows * row, 0xee), std::vector<std::uint8_t>(rows * row, 0xee),
             std::vector<std::uint8_t>(rows, 0xee), std::vector<std::int32_t>(rows, -7)};
  const CompactInputs in{p.keys.data(), p.values.data(), p.multiplicity.data(), mult_per_head,
                         p.modality.data()};
  const CompactOutputs out{g.keys.data(), g.values.data(), g.multiplicity.data(), g.modality.data()};
  *status = cpu::compact(p.shape, kept_of(p), in, out);
  return g;
}

std::string describe(const Problem& p, bool per_head) {
  std::ostringstream o;
  o << "shape=[" << p.shape.num_heads << "," << p.shape.tokens << "," << p.shape.head_dim << "] "
    << kernels::dtype_name(p.shape.dtype) << (per_head ? " per-head" : " shared")
    << " kept=" << p.indices.size();
  return o.str();
}

void check_against_naive(const Problem& p, bool per_head) {
  const std::string params = describe(p, per_head);
  for (bool mult_per_head : {true, false}) {
    kernels::Status st;
    const Gathered got = run_cpu(p, mult_per_head, &st);
    ASSERT_TRUE(st.ok()) << params << ": " << st.message();
    const Gathered want = naive_gather(p, mult_per_head);
    EXPECT_TRUE(all_close(got.keys, want.keys, 0, 0, params + " keys"));
    EXPECT_TRUE(all_close(got.values, want.values, 0, 0, params + " values"));
    EXPECT_TRUE(all_close(got.multiplicity, want.multiplicity, 0, 0, params + " multiplicity"));
    EXPECT_TRUE(all_close(got.modality, want.modality, 0, 0, params + " modality"));
  }
}

TEST(Compact, MatchesNaiveGather) {
  const CompactShape shapes[] = {{1, 1, 1, DType::kF32},
                                 {1, 7, 7, DType::kF32},
                                 {3, 33, 7, DType::kF32},
                                 {5, 33, 33, DType::kF32},
                                 {8, 300, 64, DType::kF32}};
  std::uint64_t seed = 1;
  for (CompactShape shape : shapes) {
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      shape.dtype = dt;
      for (bool per_head : {false, true}) {
        for (int k : {1, 5, shape.tokens})
          check_against_naive(make_problem(shape, per_head, k, seed++), per_head);
      }
    }
  }
}

TEST(Compact, LargeLlavaLayer) {
  // 32 heads x 2048 tokens x 128, fp16, keeping about half (parallel path).
  for (bool per_head : {false, true}) {
    check_against_naive(make_problem({32, 2048, 128, DType::kF16}, per_head, 1024, 41), per_head);
  }
}

TEST(Compact, EqualPerHeadListsGiveHeadMajorLayout) {
  // Per-head lists of the same K: offsets h * K, output [heads, K, D].
  CompactShape shape{4, 50, 3, DType::kF16};
  Problem p = make_problem(shape, false, 1, 99);
  p.indices.clear();
  for (int h = 0; h < 4; ++h) {
    for (int j = 0; j < 6; ++j) p.indices.push_back((h * 7 + j * 5) % 50);
    p.offsets.push_back(h * 6);
  }
  p.offsets.push_back(24);
  kernels::Status st;
  const Gathered got = run_cpu(p, true, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  for (int h = 0; h < 4; ++h) {
    for (int j = 0; j < 6; ++j) {
      const int t = (h * 7 + j * 5) % 50;
      EXPECT_EQ(std::memcmp(got.keys.data() + (h * 6 + j) * 6, p.keys.data() + (h * 50 + t) * 6, 6), 0)
          << "head " << h << " slot " << j;
    }
  }
}

TEST(Compact, GathersOnlyWhatIsAsked) {
  // Modality alone (no K/V), and keys alone.
  const Problem p = make_problem({2, 9, 4, DType::kF32}, false, 4, 5);
  std::vector<std::uint8_t> mod(8, 0xee), keys(8 * 16, 0xee);
  CompactInputs in;
  in.modality = p.modality.data();
  CompactOutputs out;
  out.modality = mod.data();
  ASSERT_TRUE(cpu::compact(p.shape, kept_of(p), in, out).ok());
  for (int r = 0; r < 8; ++r) EXPECT_EQ(mod[r], p.modality[p.indices[r % 4]]);
  in = CompactInputs{};
  in.keys = p.keys.data();
  out = CompactOutputs{};
  out.keys = keys.data();
  ASSERT_TRUE(cpu::compact(p.shape, kept_of(p), in, out).ok());
  EXPECT_EQ(std::memcmp(keys.data() + 16 * 5, p.keys.data() + (9 + p.indices[1]) * 16, 16), 0);
  // Nothing kept: fine, nothing written.
  const KeptIndices none{nullptr, nullptr, 0};
  EXPECT_TRUE(cpu::compact(p.shape, none, in, out).ok());
}

TEST(Compact, RejectsOutOfRangeIndicesAndWritesNothing) {
  for (bool per_head : {false, true}) {
    for (int bad : {-1, 33, 1 << 30}) {
      Problem p = make_problem({3, 33, 8, DType::kBF16}, per_head, 6, 17);
      ASSERT_FALSE(p.indices.empty());
      p.indices[p.indices.size() / 2] = bad;
      kernels::Status st;
      const Gathered got = run_cpu(p, true, &st);
      EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument) << "index " << bad;
      EXPECT_NE(st.message().find("out of range"), std::string::npos) << st.message();
      for (std::uint8_t b : got.keys) ASSERT_EQ(b, 0xee) << "output written despite the error";
    }
  }
}

TEST(Compact, RejectsMalformedOffsets) {
  const Problem base = make_problem({3, 20, 4, DType::kF32}, true, 5, 23);
  auto expect_bad = [&](std::vector<std::int32_t> offsets, int num_kept, const char* what) {
    const KeptIndices kept{base.indices.data(), offsets.data(), num_kept};
    std::vector<std::uint8_t> keys(1024);
    CompactInputs in;
    in.keys = base.keys.data();
    CompactOutputs out;
    out.keys = keys.data();
    const kernels::Status st = cpu::compact(base.shape, kept, in, out);
    EXPECT_EQ(st.code(), kernels::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(st.message().find("offsets"), std::string::npos) << what << ": " << st.message();
  };
  const int n = static_cast<int>(base.indices.size());
  expect_bad({1, 1, 1, n}, n, "offsets[0] != 0");
  expect_bad({0, 2, 1, n}, n, "decreasing");
  expect_bad({0, 0, 0, n}, n + 1, "last != num_kept");
}

TEST(Compact, RejectsInvalidArguments) {
  const Problem p = make_problem({2, 9, 4, DType::kF32}, false, 3, 31);
  std::vector<std::uint8_t> keys(6 * 16), values(6 * 16), mod(6);
  std::vector<std::int32_t> mult(6);
  const CompactInputs in{p.keys.data(), p.values.data(), p.multiplicity.data(), true, p.modality.data()};
  const CompactOutputs out{keys.data(), values.data(), mult.data(), mod.data()};
  const KeptIndices kept = kept_of(p);
  ASSERT_TRUE(cpu::compact(p.shape, kept, in, out).ok());
  auto invalid = [](const kernels::Status& st) { return st.code() == kernels::StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(cpu::compact({0, 9, 4, DType::kF32}, kept, in, out)));
  EXPECT_TRUE(invalid(cpu::compact({2, 0, 4, DType::kF32}, kept, in, out)));
  EXPECT_TRUE(invalid(cpu::compact({2, 9, 0, DType::kF32}, kept, in, out)));
  EXPECT_TRUE(invalid(cpu::compact({2, 9, 4, static_cast<DType>(5)}, kept, in, out)));
  EXPECT_TRUE(invalid(cpu::compact(p.shape, {nullptr, nullptr, 3}, in, out)));
  EXPECT_TRUE(invalid(cpu::compact(p.shape, {p.indices.data(), nullptr, -1}, in, out)));
  EXPECT_TRUE(invalid(cpu::compact(p.shape, kept, CompactInputs{}, out)));
  CompactOutputs missing = out;
  missing.keys = nullptr;
  EXPECT_TRUE(invalid(cpu::compact(p.shape, kept, in, missing)));
  missing = out;
  missing.values = nullptr;
  EXPECT_TRUE(invalid(cpu::compact(p.shape, kept, in, missing)));
  missing = out;
  missing.multiplicity = nullptr;
  EXPECT_TRUE(invalid(cpu::compact(p.shape, kept, in, missing)));
  missing = out;
  missing.modality = nullptr;
  EXPECT_TRUE(invalid(cpu::compact(p.shape, kept, in, missing)));
}

}  // namespace
}  // namespace kvscope::testing
