// CPU backend of compaction: validate every index first, then copy rows in parallel
// (chunks of rows, dynamically scheduled).
#include "kvscope/kernels/compact.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels {

Status validate_compact(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
                        const CompactOutputs& out) {
  if (shape.num_heads <= 0)
    return Status::Invalid("compact: num_heads " + std::to_string(shape.num_heads) + " <= 0");
  if (shape.tokens <= 0) return Status::Invalid("compact: tokens " + std::to_string(shape.tokens) + " <= 0");
  if (shape.head_dim <= 0)
    return Status::Invalid("compact: head_dim " + std::to_string(shape.head_dim) + " <= 0");
  const int d = static_cast<int>(shape.dtype);
  if (d < 0 || d > static_cast<int>(DType::kBF16))
    return Status::Invalid("compact: dtype " + std::to_string(d) + " unknown");
  if (kept.num_kept < 0)
    return Status::Invalid("compact: num_kept " + std::to_string(kept.num_kept) + " negative");
  if (kept.indices == nullptr && kept.num_kept > 0) return Status::Invalid("compact: indices is null");
  if (in.keys == nullptr && in.values == nullptr && in.multiplicity == nullptr && in.modality == nullptr) {
    return Status::Invalid("compact: nothing to gather (all inputs null)");
  }
  const struct {
    const void* src;
    const void* dst;
    const char* name;
  } pairs[] = {{in.keys, out.keys, "keys"},
               {in.values, out.values, "values"},
               {in.multiplicity, out.multiplicity, "multiplicity"},
               {in.modality, out.modality, "modality"}};
  for (const auto& p : pairs) {
    if (p.src != nullptr && p.dst == nullptr && compact_rows(shape, kept) > 0)
      return Status::Invalid(std::string("compact: out.") + p.name + " is null");
  }
  return Status::Ok();
}

namespace cpu {
namespace {

// Host check of the index values: offsets well formed, every index in [0, tokens).
Status validate_indices(const CompactShape& shape, const KeptIndices& kept) {
  if (kept.offsets != nullptr) {
    if (kept.offsets[0] != 0)
      return Status::Invalid("compact: offsets[0] = " + std::to_string(kept.offsets[0]) + " != 0");
    for (int h = 0; h < shape.num_heads; ++h) {
      if (kept.offsets[h + 1] < kept.offsets[h]) {
        return Status::Invalid("compact: offsets decrease at head " + std::to_string(h) + " (" +
                               std::to_string(kept.offsets[h]) + " > " + std::to_string(kept.offsets[h + 1]) +
                               ")");
      }
    }
    if (kept.offsets[shape.num_heads] != kept.num_kept) {
      return Status::Invalid(
          "compact: offsets[num_heads] = " + std::to_string(kept.offsets[shape.num_heads]) + " != num_kept " +
          std::to_string(kept.num_kept));
    }
  }
  for (int i = 0; i < kept.num_kept; ++i) {
    const std::int32_t t = kept.indices[i];
    if (t < 0 || t >= shape.tokens) {
      return Status::Invalid("compact: indices[" + std::to_string(i) + "] = " + std::to_string(t) +
                             " out of range [0, " + std::to_string(shape.tokens) + ")");
    }
  }
  return Status::Ok();
}

// Output rows per dynamically scheduled chunk: large enough that the head of the
// chunk's first row is found once and then advanced, small enough that a thread the OS
// has descheduled (shared machines) leaves little work behind for the others.
constexpr std::int64_t kRowChunk = 64;

// Gathers output rows [r0, r1).
void gather_rows(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
                 const CompactOutputs& out, std::size_t row_bytes, std::int64_t r0, std::int64_t r1) {
  const std::int64_t H = shape.num_heads, T = shape.tokens;
  const bool shared = kept.offsets == nullptr;
  // Head of row r0: r0 / K for a shared list, the offsets segment holding r0 otherwise.
  std::int64_t h = shared ? r0 / kept.num_kept
                          : std::upper_bound(kept.offsets, kept.offsets + H + 1, r0) - kept.offsets - 1;
  std::int64_t head_end = shared ? (h + 1) * kept.num_kept : kept.offsets[h + 1];
  const char* keys = static_cast<const char*>(in.keys);
  const char* values = static_cast<const char*>(in.values);
  for (std::int64_t r = r0; r < r1; ++r) {
    while (r >= head_end) {  // next head (skips heads that keep no rows)
      ++h;
      head_end = shared ? (h + 1) * kept.num_kept : kept.offsets[h + 1];
    }
    const std::int64_t t = kept.indices[shared ? r - h * kept.num_kept : r];
    const std::size_t src = static_cast<std::size_t>(h * T + t) * row_bytes;
    const std::size_t dst = static_cast<std::size_t>(r) * row_bytes;
    if (keys != nullptr) std::memcpy(static_cast<char*>(out.keys) + dst, keys + src, row_bytes);
    if (values != nullptr) std::memcpy(static_cast<char*>(out.values) + dst, values + src, row_bytes);
    if (in.multiplicity != nullptr)
      out.multiplicity[r] = in.multiplicity[(in.multiplicity_per_head ? h * T : 0) + t];
    if (in.modality != nullptr) out.modality[r] = in.modality[t];
  }
}

}  // namespace

Status compact(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
               const CompactOutputs& out) {
  KVSCOPE_NVTX_RANGE("cpu::compact", kCompact);
  KVSCOPE_RETURN_IF_ERROR(validate_compact(shape, kept, in, out));
  KVSCOPE_RETURN_IF_ERROR(validate_indices(shape, kept));
  const std::int64_t rows = compact_rows(shape, kept);
  const std::size_t row_bytes = static_cast<std::size_t>(shape.head_dim) * dtype_bytes(shape.dtype);
  const std::int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
#pragma omp parallel for schedule(dynamic, 1) if (rows * static_cast <std::int64_t>(row_bytes) >= (1 << 18))
  for (std::int64_t c = 0; c < chunks; ++c) {
    gather_rows(shape, kept, in, out, row_bytes, c * kRowChunk, std::min(rows, (c + 1) * kRowChunk));
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kvscope::kernels
