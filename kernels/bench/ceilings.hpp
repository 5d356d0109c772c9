// Machine ceilings measured inside a kvbench run, with the same thread count as the
// benchmarks: STREAM triad bandwidth and sgemm rate, for the CPU and (when present)
// the GPU. Results go into Ceilings (kvbench_report.hpp).
#pragma once

#include <cstddef>
#include <string>

#include "kvbench_report.hpp"

namespace kvscope::bench {

// Triad a[i] = b[i] + s * c[i] over three double arrays of bytes_per_array bytes each,
// OpenMP with `threads` threads, best of `reps` after one untimed pass.
// Returns bytes/s counting 3 arrays (STREAM convention: no write-allocate traffic).
double measure_cpu_triad(int threads, std::size_t bytes_per_array, int reps);

// C = A * B with cblas_sgemm, n x n x n, `threads` BLAS threads, best of `reps` after
// one warm-up. Returns FLOP/s (2 n^3); 0 and a reason in *note when built without BLAS.
double measure_cpu_sgemm(int threads, int n, int reps, std::string* note);

// GPU counterparts (ceilings_cuda.cu); 0 and a reason in *note without a GPU or on error.
double measure_gpu_triad(std::size_t bytes_per_array, int reps, std::string* note);
double measure_gpu_sgemm(int n, int reps, std::string* note);

// Fills every ceiling (GPU ones only when a GPU is present). `quick` uses smaller
// sizes (for smoke tests; the numbers are then not ceilings).
Ceilings measure_ceilings(int threads, bool quick);

}  // namespace kvscope::bench
