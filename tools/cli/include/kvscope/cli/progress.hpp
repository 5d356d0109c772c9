// A progress bar with ETA on stderr for the command-line tools. On a terminal
// it redraws one line; otherwise it prints a line at most every few seconds.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace kvscope::cli {

class ProgressBar {
 public:
  ProgressBar(std::string label, std::size_t total, bool enabled = true);
  ~ProgressBar();
  void update(std::size_t done);
  void finish();  // completes the line (called by the destructor)

 private:
  std::string label_;
  std::size_t total_;
  bool enabled_, tty_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
  std::size_t last_done_ = 0;
  void draw(std::size_t done, bool final);
};

// "12.3 MiB", "1.50 GiB" (binary units).
std::string format_bytes(double bytes);
// "1m05s", "3.2s".
std::string format_seconds(double s);

}  // namespace kvscope::cli

namespace kvscope::cli {
// kernels::use_fast_blas_runtime(argv) with the command-line tools' defaults (passive OpenMP
// waits, silent): see kvscope/kernels/blas_runtime.hpp.
void use_fast_blas_core(char** argv);

// Makes freed large buffers go back to the system at once (glibc; a no-op elsewhere): blocks of
// 4 MiB and more get their own mapping, and the heap top is trimmed above 4 MiB free. glibc's
// default raises both thresholds to the largest block freed so far (up to 32 MiB), after which a
// tool that allocates and frees a layer's tensors per layer keeps the freed space resident
// (about 10 MB in kvsim sweep on llava-1.5-7b, docs/perf.md).
void release_large_blocks_promptly();

// Largest value a --threads flag accepts: 4 x the hardware threads (std::thread::hardware_concurrency,
// 1 if unknown), at most 1024. More threads only oversubscribe the cores, and each costs a stack:
// 10,000 take gigabytes and 65,536 crash inside libgomp.
int max_threads();
// "" when 0 <= n <= max_threads(), else the one-line reason ("--threads 65536 is more than ...").
std::string check_threads(long long n);
}  // namespace kvscope::cli
