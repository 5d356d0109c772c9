// Process settings of the BLAS and OpenMP runtimes that are read when the libraries load, so a
// program applies them by re-executing itself once, early in main(); and the allocator setting of the
// programs that run the decoder.
#pragma once

namespace kvscope::kernels {

struct BlasRuntimeOptions {
  // Set OMP_WAIT_POLICY=PASSIVE unless the user set it: idle OpenMP threads sleep instead of
  // spinning (programs with many short parallel regions, where spinning threads steal cores).
  bool passive_omp_wait = true;
  // Program name for a one-line note on stderr when the OpenBLAS core is changed; nullptr = silent.
  const char* announce_as = nullptr;
};

// OpenBLAS 0.3.21 does not recognise some current x86 CPUs and falls back to its generic
// kernels (about 2x slower): where it reports a generic core and the CPU has AVX-512 or AVX2,
// this sets OPENBLAS_CORETYPE=SkylakeX or Haswell. Variables a user set are kept. Re-executes
// /proc/self/exe with argv at most once (marked by KVSCOPE_ENV_SET); returns if nothing changes
// or the exec fails (the program carries on with the settings it started with).
void use_fast_blas_runtime(char** argv, const BlasRuntimeOptions& options = {});

// The OpenBLAS core in use ("SkylakeX", "Haswell", "Prescott", ...).
const char* blas_core_name();

// Makes OpenBLAS run every product on the calling thread (a process-wide setting; cheap when
// already set). Every sgemm in kvscope runs this way, called before each product from outside
// OpenMP parallel regions: OpenBLAS's Haswell and Zen kernels (chosen on AMD CPUs and with
// OPENBLAS_CORETYPE=Haswell/Zen) give results that depend on how many threads split a product
// (1 vs 2 threads: about a third of a [64, 192] x [192, 48] product's elements differ in the
// last bits; the SkylakeX kernels do not), so with a fixed single thread every product is a
// function of its operands and shape alone, whatever the BLAS kernel, and two runs of the same
// computation agree bit for bit. Parallelism comes from OpenMP around the products.
void pin_blas_to_one_thread();

// The machine's sgemm rate through the OpenBLAS kvscope links: C = A * B, n x n x n, on `threads` BLAS
// threads, best of `reps` after one untimed product; FLOP/s counting 2 n^3. Leaves OpenBLAS on `threads`
// threads (pin_blas_to_one_thread() before the next product of a kvscope kernel).
double measure_sgemm_flops_per_s(int threads, int n, int reps);

// Keeps freed memory in the process (glibc malloc, a no-op elsewhere: blocks up to 32 MiB come from the
// heap, which is never trimmed), so a request reuses the pages an earlier one touched instead of faulting
// in fresh zeroed ones: the decoder frees and allocates its KV cache and work buffers again for every
// request. On the development VM the first timed 1K-token prefill after a warm-up spent 1.19 s in
// attention without it, 0.52 s with it (docs/perf.md "Real model: runner vs Hugging Face"). The process's
// memory stays at its peak. For kvcap run / eval and kvrunner-bench; kvsim does the opposite
// (cli::release_large_blocks_promptly).
void keep_freed_memory();

}  // namespace kvscope::kernels
