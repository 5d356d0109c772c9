// Compressed-cache evaluation (kvscope/kernels/evaluate.hpp) on one llava-1.5-7b
// layer: 32 q heads = 32 kv heads, 32 evaluation queries, T in {576, 642, 2048, 8192},
// head_dim 128, fp16 full cache, compressed to 50% (S = T/2 slots per head, each slot
// holding 2 tokens, int32 multiplicities, proportional attention on).
//
// FLOPs per call (compute-bound, label "compute"): QK^T and P.V for the full and the
// compressed cache, 2 FLOPs per multiply-add:
//   flops = Hq * Nq * (2*T*D + 2*T*D)  +  Hq * Nq * (2*S*D + 2*S*D)
// (softmax, exp and the metrics are O(Hq*Nq*(T+S)) and not counted).
// Bytes per call: q, k, v in fp16, slot k/v in fp32, modality, token->slot map, multiplicities.
//
// A sweep computes the full-cache side once per layer (full_attention: the first
// term of flops) and evaluates every policy with the FullAttention overload (the
// second term; it also reads the [Hq, Nq, T] probabilities): both are benchmarked
// separately as BM_evaluate_full_attention/<backend> and BM_evaluate_compressed/<backend>.
#include <cstdint>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/evaluate.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/evaluate_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeadDim;
using kvscope::bench::kHeads;
using kvscope::bench::kQueries;

struct EvalInputs {
  kk::EvaluateParams params;
  std::vector<unsigned char> q, k, v;       // fp16 [Hq, Nq, D], [Hkv, T, D] x2
  std::vector<float> slot_k, slot_v;        // [Hkv * S, D]
  std::vector<std::int32_t> offsets;        // [Hkv + 1]
  std::vector<std::int32_t> mult;           // [Hkv * S]
  std::vector<std::uint8_t> modality;       // [T]
  std::vector<std::uint8_t> slot_modality;  // [Hkv * S]
  std::vector<std::int32_t> token_to_slot;  // [Hkv, T]
  int slots = 0;                            // S per head

  explicit EvalInputs(int T) {
    params = {kHeads, kHeads, kQueries, T, kHeadDim, kk::DType::kF16, true};
    const std::size_t kv = static_cast<std::size_t>(kHeads) * T * kHeadDim;
    q = kvscope::bench::random_tensor(kk::DType::kF16, static_cast<std::size_t>(kHeads) * kQueries * kHeadDim,
                                      1);
    k = kvscope::bench::random_tensor(kk::DType::kF16, kv, 2);
    v = kvscope::bench::random_tensor(kk::DType::kF16, kv, 3);
    slots = (T + 1) / 2;
    slot_k = kvscope::bench::random_f32(static_cast<std::size_t>(kHeads) * slots * kHeadDim, 4);
    slot_v = kvscope::bench::random_f32(slot_k.size(), 5);
    for (int h = 0; h <= kHeads; ++h) offsets.push_back(h * slots);
    mult.assign(static_cast<std::size_t>(kHeads) * slots, 2);
    modality.resize(T);
    for (int t = 0; t < T; ++t) modality[t] = t >= 16 && t < 16 + 576 ? 1 : 0;  // one image after a prompt
    slot_modality.resize(mult.size());
    for (int h = 0; h < kHeads; ++h)
      for (int s = 0; s < slots; ++s) slot_modality[h * slots + s] = modality[2 * s];
    token_to_slot.resize(static_cast<std::size_t>(kHeads) * T);
    for (int h = 0; h < kHeads; ++h)
      for (int t = 0; t < T; ++t) token_to_slot[static_cast<std::size_t>(h) * T + t] = t / 2;
  }
  double flops() const { return full_flops() + compressed_flops(); }
  double full_flops() const {
    return static_cast<double>(kHeads) * kQueries * 4.0 * kHeadDim * params.num_tokens;
  }
  double compressed_flops() const { return static_cast<double>(kHeads) * kQueries * 4.0 * kHeadDim * slots; }
  std::size_t rows() const { return static_cast<std::size_t>(kHeads) * kQueries; }
  kk::CompressedCache cache() const {
    kk::CompressedCache c;
    c.k = slot_k.data();
    c.v = slot_v.data();
    c.slot_offsets = offsets.data();
    c.multiplicity_i32 = mult.data();
    c.slot_modality = slot_modality.data();
    c.token_to_slot = token_to_slot.data();
    return c;
  }
  double bytes() const {
    return static_cast<double>(q.size() + k.size() + v.size() + modality.size() + slot_modality.size()) +
           4.0 * static_cast<double>(slot_k.size() + slot_v.size() + mult.size() + token_to_slot.size());
  }
};

void BM_evaluate_cpu(benchmark::State& state) {
  const EvalInputs in(static_cast<int>(state.range(0)));
  kk::CompressedCache c;
  c.k = in.slot_k.data();
  c.v = in.slot_v.data();
  c.slot_offsets = in.offsets.data();
  c.multiplicity_i32 = in.mult.data();
  c.slot_modality = in.slot_modality.data();
  c.token_to_slot = in.token_to_slot.data();
  const std::size_t rows = static_cast<std::size_t>(kHeads) * kQueries;
  std::vector<float> err(rows), recall(rows), kl(rows), dh(rows), rm(rows * 4), mf(rows * 4), mc(rows * 4);
  const kk::EvaluateOutputs out{err.data(), recall.data(), kl.data(), dh.data(),
                                rm.data(),  mf.data(),     mc.data()};
  for (auto _ : state) {
    const kk::Status s = kk::cpu::evaluate_attention(in.params, in.q.data(), in.k.data(), in.v.data(),
                                                     in.modality.data(), c, out);
    if (!s.ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(err.data());
  }
  kvscope::bench::set_compute_counters(state, in.flops(), in.bytes());
}
// T in {576, 642, 2048, 8192}.
void eval_token_args(benchmark::internal::Benchmark* b) {
  b->ArgName("T");
  for (int t : {576, 642, 2048, 8192}) b->Arg(t);
}

BENCHMARK(BM_evaluate_cpu)->Name("BM_evaluate/cpu")->Apply(eval_token_args)->UseRealTime();

// Probability / output / entropy / modality-mass buffers of cpu::full_attention.
struct FullBuffers {
  std::vector<float> probs, output, entropy, mass;
  explicit FullBuffers(const EvalInputs& in)
      : probs(in.rows() * in.params.num_tokens),
        output(in.rows() * kHeadDim),
        entropy(in.rows()),
        mass(in.rows() * 4) {}
  kk::FullAttention view() { return {probs.data(), output.data(), entropy.data(), mass.data()}; }
};

void BM_full_attention_cpu(benchmark::State& state) {
  const EvalInputs in(static_cast<int>(state.range(0)));
  FullBuffers full(in);
  for (auto _ : state) {
    const kk::Status s = kk::cpu::full_attention(in.params, in.q.data(), in.k.data(), in.v.data(),
                                                 in.modality.data(), full.view());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(full.probs.data());
  }
  kvscope::bench::set_compute_counters(state, in.full_flops(),
                                       static_cast<double>(in.q.size() + in.k.size() + in.v.size()) +
                                           4.0 * static_cast<double>(full.probs.size() + full.output.size()));
}
BENCHMARK(BM_full_attention_cpu)
    ->Name("BM_evaluate_full_attention/cpu")
    ->Apply(eval_token_args)
    ->UseRealTime();

void BM_evaluate_compressed_cpu(benchmark::State& state) {
  const EvalInputs in(static_cast<int>(state.range(0)));
  FullBuffers full(in);
  if (!kk::cpu::full_attention(in.params, in.q.data(), in.k.data(), in.v.data(), in.modality.data(),
                               full.view())
           .ok()) {
    return state.SkipWithError("full_attention failed");
  }
  const std::size_t rows = in.rows();
  std::vector<float> o(rows * 16);
  const kk::EvaluateOutputs out{o.data(),
                                o.data() + rows,
                                o.data() + 2 * rows,
                                o.data() + 3 * rows,
                                o.data() + 4 * rows,
                                o.data() + 8 * rows,
                                o.data() + 12 * rows};
  const kk::CompressedCache c = in.cache();
  for (auto _ : state) {
    const kk::Status s =
        kk::cpu::evaluate_attention(in.params, in.q.data(), in.modality.data(), full.view(), c, out);
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(o.data());
  }
  kvscope::bench::set_compute_counters(state, in.compressed_flops(),
                                       4.0 * static_cast<double>(full.probs.size() + in.slot_k.size() +
                                                                 in.slot_v.size() + in.token_to_slot.size()));
}
BENCHMARK(BM_evaluate_compressed_cpu)
    ->Name("BM_evaluate_compressed/cpu")
    ->Apply(eval_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
void BM_evaluate_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const EvalInputs in(static_cast<int>(state.range(0)));
  using kvscope::bench::DeviceBuffer;
  DeviceBuffer<unsigned char> q(in.q), k(in.k), v(in.v);
  DeviceBuffer<float> sk(in.slot_k), sv(in.slot_v);
  DeviceBuffer<std::int32_t> off(in.offsets), mult(in.mult), map(in.token_to_slot);
  DeviceBuffer<std::uint8_t> mod(in.modality), smod(in.slot_modality);
  const std::size_t rows = static_cast<std::size_t>(kHeads) * kQueries;
  DeviceBuffer<float> outs(rows * 16);
  if (!q.ok() || !k.ok() || !v.ok() || !sk.ok() || !sv.ok() || !outs.ok()) {
    state.SkipWithError("device allocation failed");
    return;
  }
  kk::CompressedCache c;
  c.k = sk.get();
  c.v = sv.get();
  c.slot_offsets = off.get();
  c.multiplicity_i32 = mult.get();
  c.slot_modality = smod.get();
  c.token_to_slot = map.get();
  float* o = outs.get();
  const kk::EvaluateOutputs out{
      o, o + rows, o + 2 * rows, o + 3 * rows, o + 4 * rows, o + 8 * rows, o + 12 * rows};
  const bool ok = kvscope::bench::time_cuda(state, nullptr, [&]() {
    return kk::cuda::evaluate_attention(in.params, q.get(), k.get(), v.get(), mod.get(), c, out, nullptr);
  });
  if (ok) kvscope::bench::set_compute_counters(state, in.flops(), in.bytes());
}
BENCHMARK(BM_evaluate_cuda)
    ->Name("BM_evaluate/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
