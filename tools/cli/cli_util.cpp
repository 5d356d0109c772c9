#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#if defined(__GLIBC__)
#include <malloc.h>  // mallopt
#endif

#include "kvscope/cli/progress.hpp"
#include "kvscope/kernels/blas_runtime.hpp"

namespace kvscope::cli {

ProgressBar::ProgressBar(std::string label, std::size_t total, bool enabled)
    : label_(std::move(label)), total_(total), enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(std::size_t done) {
  last_done_ = done;
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_draw_).count();
  if ((tty_ && since >= 0.1) || (!tty_ && since >= 5.0)) {
    last_draw_ = now;
    draw(done, false);
  }
}

void ProgressBar::finish() {
  if (!enabled_ || finished_) return;
  finished_ = true;
  draw(last_done_, true);
}

void ProgressBar::draw(std::size_t done, bool final) {
  if (!tty_ && done == 0) return;  // a log gets no empty bar
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double frac = total_ ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(std::lround(frac * kWidth));
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::string eta = frac > 0 && frac < 1 ? "ETA " + format_seconds(elapsed * (1 - frac) / frac) : format_seconds(elapsed);
  if (tty_) {
    std::fprintf(stderr, "\r%s [%s] %zu/%zu %3.0f%% %s\033[K", label_.c_str(), bar.c_str(), done, total_, frac * 100,
                 eta.c_str());
    if (final) std::fputc('\n', stderr);
  } else {
    std::fprintf(stderr, "%s [%s] %zu/%zu %3.0f%% %s\n", label_.c_str(), bar.c_str(), done, total_, frac * 100,
                 eta.c_str());
  }
  std::fflush(stderr);
}

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(b) >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

std::string format_seconds(double s) {
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  } else {
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  }
  return buf;
}

}  // namespace kvscope::cli

namespace kvscope::cli {

void use_fast_blas_core(char** argv) { kernels::use_fast_blas_runtime(argv); }

void release_large_blocks_promptly() {
#if defined(__GLIBC__)
  constexpr int kLargeBlock = 4 << 20;
  mallopt(M_MMAP_THRESHOLD, kLargeBlock);
  mallopt(M_TRIM_THRESHOLD, kLargeBlock);
#endif
}

}  // namespace kvscope::cli

namespace kvscope::cli {
int max_threads() {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::min(4u * hw, 1024u));
}

std::string check_threads(long long n) {
  if (n < 0) return "--threads must not be negative, got " + std::to_string(n);
  if (n > max_threads()) {
    return "--threads " + std::to_string(n) + " is more than the maximum of " +
           std::to_string(max_threads()) + " (4 x the " +
           std::to_string(std::max(1u, std::thread::hardware_concurrency())) +
           " hardware threads, at most 1024)";
  }
  return "";
}
}  // namespace kvscope::cli
