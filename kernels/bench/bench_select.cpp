// Token selection on one llava-1.5-7b layer: scores [32 heads, T] float,
// T in {576, 2048, 8192}, keep k = T / 4 per head with 4 sinks, a 32-token
// recent window and per-modality budgets (text 1/3, vision 2/3 of k; text is
// every 5th token). Memory-bound ("mem"): read scores and modality, write
// [32, k] int32 (per head) or [k] (shared across heads).
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvscope/kernels/select.hpp"
#if defined(KVSCOPE_HAVE_CUDA)
#include "kvscope/kernels/select_cuda.hpp"
#endif

namespace {

namespace kk = kvscope::kernels;
using kvscope::bench::kHeads;

struct SelectInputs {
  std::vector<float> scores;
  std::vector<std::uint8_t> mod;
  kk::SelectParams params(const std::uint8_t* modality) const {
    const int t = static_cast<int>(mod.size());
    kk::SelectParams p;
    p.k = t / 4;
    p.use_modality_budgets = true;
    p.modality = modality;
    p.modality_budget[0] = p.k / 3;
    p.modality_budget[1] = p.k - p.k / 3;
    p.num_sinks = 4;
    p.recent_window = 32;
    return p;
  }
};

SelectInputs select_inputs(int t) {
  SelectInputs in{kvscope::bench::random_f32(static_cast<std::size_t>(kHeads) * t, 9),
                  std::vector<std::uint8_t>(t)};
  for (int i = 0; i < t; ++i) in.mod[i] = static_cast<std::uint8_t>(i % 5 == 0 ? 0 : 1);
  return in;
}

template <bool kShared>
void BM_select_cpu(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const SelectInputs in = select_inputs(t);
  const kk::SelectParams p = in.params(in.mod.data());
  std::vector<std::int32_t> out(static_cast<std::size_t>(kHeads) * p.k), counts(kHeads);
  for (auto _ : state) {
    const kk::Status s =
        kShared ? kk::cpu::select_topk_shared(in.scores.data(), kHeads, t, p, out.data(), counts.data())
                : kk::cpu::select_topk(in.scores.data(), kHeads, t, p, out.data(), counts.data());
    if (!s.ok()) return state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  kvscope::bench::set_mem_counters(state, 4.0 * kHeads * t + t, 4.0 * (kShared ? 1 : kHeads) * p.k);
}
BENCHMARK(BM_select_cpu<false>)
    ->Name("BM_select_topk/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();
BENCHMARK(BM_select_cpu<true>)
    ->Name("BM_select_topk_shared/cpu")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseRealTime();

#if defined(KVSCOPE_HAVE_CUDA)
template <bool kShared>
void BM_select_cuda(benchmark::State& state) {
  KVSCOPE_BENCH_REQUIRE_GPU(state);
  const int t = static_cast<int>(state.range(0));
  const SelectInputs in = select_inputs(t);
  kvscope::bench::DeviceBuffer<float> scores(in.scores);
  kvscope::bench::DeviceBuffer<std::uint8_t> mod(in.mod);
  const kk::SelectParams p = in.params(mod.get());
  kvscope::bench::DeviceBuffer<std::int32_t> out(static_cast<std::size_t>(kHeads) * p.k), counts(kHeads);
  if (!scores.ok() || !mod.ok() || !out.ok() || !counts.ok())
    return state.SkipWithError("device allocation failed");
  const bool ok = kvscope::bench::time_cuda(state, nullptr, [&]() {
    return kShared
               ? kk::cuda::select_topk_shared(scores.get(), kHeads, t, p, out.get(), counts.get(), nullptr)
               : kk::cuda::select_topk(scores.get(), kHeads, t, p, out.get(), counts.get(), nullptr);
  });
  if (ok) kvscope::bench::set_mem_counters(state, 4.0 * kHeads * t + t, 4.0 * (kShared ? 1 : kHeads) * p.k);
}
BENCHMARK(BM_select_cuda<false>)
    ->Name("BM_select_topk/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
BENCHMARK(BM_select_cuda<true>)
    ->Name("BM_select_topk_shared/cuda")
    ->Apply(kvscope::bench::llava_token_args)
    ->UseManualTime();
#endif

}  // namespace
