// Documented limits on sizes a trace declares (docs/trace-format.md section 8, docs/robustness.md
// "Limits on declared sizes and flags"). Every allocation the reader makes from a size read from
// the file is checked against these and against the bytes the file actually stores first.
#pragma once

#include <cstdint>

namespace kvscope::trace::limits {

// Model geometry. The largest open models have 126 layers, 128 query heads and head_dim 256;
// these leave a wide margin while keeping per-head bookkeeping of a replay small.
inline constexpr std::int64_t kMaxLayers = 1024;
inline constexpr std::int64_t kMaxHeads = 1024;  // num_q_heads (num_kv_heads divides it)
inline constexpr std::int64_t kMaxHeadDim = 4096;
// Context tokens T and decode steps S.
inline constexpr std::uint64_t kMaxTokens = std::uint64_t{1} << 24;       // 16,777,216
inline constexpr std::uint64_t kMaxDecodeSteps = std::uint64_t{1} << 20;  // 1,048,576
// Rows of /profile/kernels and of /profile/ranges, each.
inline constexpr std::uint64_t kMaxProfileRows = std::uint64_t{1} << 22;  // 4,194,304

// A dataset can hold at most this many logical bytes per byte it stores: deflate's maximum
// compression ratio is 1032:1 (zlib technical details; shuffle does not change it). A dataset
// without filters holds exactly the bytes it stores.
inline constexpr std::uint64_t kMaxCompressionRatio = 1032;
// Datasets smaller than this are not checked against their storage (unwritten fill-value data).
inline constexpr std::uint64_t kStorageSlackBytes = 64 * 1024;
// One buffer the reader fills from one read (a layer's q, k or v; a whole /tokens dataset).
inline constexpr std::uint64_t kMaxReadBytes = std::uint64_t{4} << 30;  // 4 GiB
// All strings of one string dataset together (/tokens/text, /profile names), and one attribute string.
inline constexpr std::uint64_t kMaxStringBytes = std::uint64_t{256} << 20;    // 256 MiB
inline constexpr std::uint64_t kMaxAttrStringBytes = std::uint64_t{1} << 20;  // 1 MiB

}  // namespace kvscope::trace::limits
