// Compaction: gather the kept token rows of K and V (and, alongside, the
// per-token merge multiplicities and modality codes) into dense buffers.
// Rows are copied byte for byte, so any dtype in gives the same dtype out.
// See docs/kernels/compact.md.
#pragma once

#include <cstdint>

#include "kvscope/kernels/common.hpp"

namespace kvscope::kernels {

// The source tensors: [num_heads, tokens, head_dim] row-major, `dtype` elements.
struct CompactShape {
  int num_heads = 0;
  int tokens = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;
};

// Which rows to keep. Output row r of head h is source token indices[...] of head h.
//  - shared list (offsets == nullptr): indices [num_kept], the same tokens for every
//    head; the output has num_heads * num_kept rows, head h at [h * num_kept, (h+1) * num_kept).
//  - per-head lists (offsets != nullptr): offsets [num_heads + 1] with offsets[0] = 0,
//    non-decreasing, offsets[num_heads] = num_kept; head h keeps indices[offsets[h] ..
//    offsets[h+1]) (ragged; equal lists of K have offsets[h] = h * K) and the output has
//    num_kept rows, head h at [offsets[h], offsets[h+1]).
// Indices must lie in [0, tokens); order is free and repeats are allowed.
struct KeptIndices {
  const std::int32_t* indices = nullptr;  // shared: [num_kept]; per-head: [num_kept] concatenated per head
  const std::int32_t* offsets = nullptr;  // nullptr (shared) or [num_heads + 1]
  int num_kept = 0;  // shared: K per head; per-head: total over heads (= offsets[num_heads])
};

// Number of output rows for `kept`: num_heads * num_kept (shared) or num_kept (per-head).
constexpr std::int64_t compact_rows(const CompactShape& shape, const KeptIndices& kept) {
  return kept.offsets == nullptr ? static_cast<std::int64_t>(shape.num_heads) * kept.num_kept : kept.num_kept;
}

// Source tensors; any of them may be null (not gathered), but not all.
struct CompactInputs {
  const void* keys = nullptr;                  // [num_heads, tokens, head_dim] dtype
  const void* values = nullptr;                // [num_heads, tokens, head_dim] dtype
  const std::int32_t* multiplicity = nullptr;  // [num_heads, tokens] if multiplicity_per_head, else [tokens]
  bool multiplicity_per_head = true;
  const std::uint8_t* modality = nullptr;  // [tokens] Modality codes (shared by all heads)
};

// Destinations, one row per output row (compact_rows). Non-null wherever the input is
// non-null (unless there are no output rows); ignored where the input is null.
struct CompactOutputs {
  void* keys = nullptr;    // [rows, head_dim] dtype, i.e. [num_heads, K, head_dim] for a shared list
  void* values = nullptr;  // [rows, head_dim] dtype
  std::int32_t* multiplicity = nullptr;  // [rows]
  std::uint8_t* modality = nullptr;      // [rows]
};

// Checks shape, num_kept and pointers (not the index values, which may live on a device).
Status validate_compact(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
                        const CompactOutputs& out);

namespace cpu {

// Gathers the kept rows. Returns Invalid (and writes nothing) when an index is out of
// range or the offsets are malformed; the message names the head and position.
Status compact(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
               const CompactOutputs& out);

}  // namespace cpu
}  // namespace kvscope::kernels
