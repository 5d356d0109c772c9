// CUDA backend of compaction: one warp per output row, copying the row with the
// widest vector type that the row size and all row pointers allow.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kvscope/kernels/compact_cuda.hpp"
#include "kvscope/kernels/cuda_check.hpp"
#include "kvscope/kernels/nvtx.hpp"

namespace kvscope::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

struct CompactArgs {
  CompactInputs in;
  CompactOutputs out;
  const std::int32_t* indices;  // [num_kept]
  const std::int32_t* offsets;  // [heads + 1] or null (shared list)
  std::int64_t heads, tokens, rows, num_kept;
  std::int64_t row_bytes;
};

// Malformed offsets (checked by one thread): errors[1] += 1.
__global__ void check_offsets_kernel(const std::int32_t* offsets, std::int64_t heads, std::int64_t num_kept,
                                     int* errors) {
  if (threadIdx.x != 0 || blockIdx.x != 0 || errors == nullptr) return;
  bool bad = offsets[0] != 0 || offsets[heads] != num_kept;
  for (std::int64_t h = 0; h < heads; ++h) bad = bad || offsets[h + 1] < offsets[h];
  if (bad) atomicAdd(errors + 1, 1);
}

// Head of output row r in a per-head (ragged) list: the last h with offsets[h] <= r.
__device__ std::int64_t head_of_row(const std::int32_t* offsets, std::int64_t heads, std::int64_t r) {
  std::int64_t lo = 0, hi = heads;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The warp's lanes copy one row of `units` V's (zeros when the index was invalid).
template <typename V>
__device__ void copy_row(const void* in, void* out, std::int64_t src, std::int64_t dst, std::int64_t units,
                         int lane, bool valid) {
  if (in == nullptr) return;
  const V* s = static_cast<const V*>(in) + src;
  V* d = static_cast<V*>(out) + dst;
  for (std::int64_t k = lane; k < units; k += 32) d[k] = valid ? s[k] : V{};
}

// One warp per output row; V is the copy unit (its size divides row_bytes and every row address).
template <typename V>
__global__ void compact_kernel(CompactArgs a, int* errors) {
  const int lane = threadIdx.x % 32;
  const std::int64_t units = a.row_bytes / static_cast<std::int64_t>(sizeof(V));
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; r < a.rows;
       r += stride) {
    const bool shared = a.offsets == nullptr;
    const std::int64_t h = shared ? r / a.num_kept : head_of_row(a.offsets, a.heads, r);
    const std::int64_t t = a.indices[shared ? r % a.num_kept : r];
    const bool valid = t >= 0 && t < a.tokens;
    if (!valid && lane == 0 && errors != nullptr) atomicAdd(errors, 1);
    const std::int64_t src = (h * a.tokens + (valid ? t : 0)) * units, dst = r * units;
    copy_row<V>(a.in.keys, a.out.keys, src, dst, units, lane, valid);
    copy_row<V>(a.in.values, a.out.values, src, dst, units, lane, valid);
    if (lane == 0) {
      if (a.in.multiplicity != nullptr) {
        a.out.multiplicity[r] =
            valid ? a.in.multiplicity[(a.in.multiplicity_per_head ? h * a.tokens : 0) + t] : 0;
      }
      if (a.in.modality != nullptr) a.out.modality[r] = valid ? a.in.modality[t] : 0;
    }
  }
}

// Largest power-of-two unit <= 16 bytes that divides the row size and every row pointer.
int copy_unit(const CompactArgs& a) {
  std::uintptr_t bits = static_cast<std::uintptr_t>(a.row_bytes);
  for (const void* p : {a.in.keys, a.in.values, static_cast<const void*>(a.out.keys),
                        static_cast<const void*>(a.out.values)}) {
    if (p != nullptr) bits |= reinterpret_cast<std::uintptr_t>(p);
  }
  for (int unit = 16; unit > 1; unit /= 2) {
    if ((bits & static_cast<std::uintptr_t>(unit - 1)) == 0) return unit;
  }
  return 1;
}

template <typename V>
Status launch_compact(const CompactArgs& a, int* errors, cudaStream_t stream) {
  const std::int64_t blocks =
      std::clamp<std::int64_t>((a.rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, 1 << 20);
  compact_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, errors);
  KVSCOPE_CUDA_CHECK_LAUNCH("compact_kernel");
  return Status::Ok();
}

Status launch_all(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
                  const CompactOutputs& out, int* errors, cudaStream_t stream) {
  CompactArgs a{
      in,
      out,
      kept.indices,
      kept.offsets,
      shape.num_heads,
      shape.tokens,
      compact_rows(shape, kept),
      kept.num_kept,
      static_cast<std::int64_t>(shape.head_dim) * static_cast<std::int64_t>(dtype_bytes(shape.dtype))};
  if (kept.offsets != nullptr) {
    check_offsets_kernel<<<1, 32, 0, stream>>>(kept.offsets, a.heads, a.num_kept, errors);
    KVSCOPE_CUDA_CHECK_LAUNCH("check_offsets_kernel");
  }
  if (a.rows == 0) return Status::Ok();
  switch (copy_unit(a)) {
    case 16:
      return launch_compact<uint4>(a, errors, stream);
    case 8:
      return launch_compact<uint2>(a, errors, stream);
    case 4:
      return launch_compact<unsigned>(a, errors, stream);
    case 2:
      return launch_compact<unsigned short>(a, errors, stream);
    default:
      return launch_compact<unsigned char>(a, errors, stream);
  }
}

}  // namespace

Status compact_unchecked(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
                         const CompactOutputs& out, int* errors, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::compact_unchecked", kCompact);
  KVSCOPE_RETURN_IF_ERROR(validate_compact(shape, kept, in, out));
  return launch_all(shape, kept, in, out, errors, stream);
}

Status compact(const CompactShape& shape, const KeptIndices& kept, const CompactInputs& in,
               const CompactOutputs& out, cudaStream_t stream) {
  KVSCOPE_NVTX_RANGE("cuda::compact", kCompact);
  KVSCOPE_RETURN_IF_ERROR(validate_compact(shape, kept, in, out));
  int* errors = nullptr;
  KVSCOPE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&errors), 2 * sizeof(int), stream));
  int host_errors[2] = {0, 0};
  const auto run = [&]() -> Status {
    KVSCOPE_CUDA_TRY(cudaMemsetAsync(errors, 0, 2 * sizeof(int), stream));
    KVSCOPE_RETURN_IF_ERROR(launch_all(shape, kept, in, out, errors, stream));
    KVSCOPE_CUDA_TRY(
        cudaMemcpyAsync(host_errors, errors, sizeof(host_errors), cudaMemcpyDeviceToHost, stream));
    return Status::Ok();
  };
  const Status st = run();
  KVSCOPE_CUDA_TRY(cudaFreeAsync(errors, stream));
  KVSCOPE_RETURN_IF_ERROR(st);
  KVSCOPE_CUDA_TRY(cudaStreamSynchronize(stream));
  if (host_errors[1] != 0) {
    return Status::Invalid(
        "cuda::compact: offsets malformed (offsets[0] != 0, decreasing, or offsets[num_heads] != " +
        std::to_string(kept.num_kept) + ")");
  }
  if (host_errors[0] != 0) {
    return Status::Invalid("cuda::compact: " + std::to_string(host_errors[0]) + " indices out of range [0, " +
                           std::to_string(shape.tokens) + "); those rows were zero-filled");
  }
  return Status::Ok();
}

}  // namespace kvscope::kernels::cuda
