// Shared pieces of the capture tests: a small geometry, a default configuration, token
// arrays, and a fixture with a per-test output directory.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "kvscope/capture/capture.hpp"
#include "kvscope_capture.h"
#include "scratch.hpp"

namespace kvscope::testing {

struct Geometry {
  int L = 3, Hq = 4, Hkv = 2, D = 8;
  std::int64_t T = 10;
};

inline kvscope_capture_config make_config(const Geometry& g, kvscope_dtype dtype) {
  kvscope_capture_config c = capture::default_config();
  c.num_layers = g.L;
  c.num_q_heads = g.Hq;
  c.num_kv_heads = g.Hkv;
  c.head_dim = g.D;
  c.rope_theta = 10000.0;
  c.model_name = "test-model";
  c.device = "cpu";
  c.dtype = dtype;
  c.max_decode_steps = 8;
  return c;
}

// Context tokens: 3 text, then vision patches on a 2-column grid, then text.
inline capture::TokenTable make_tokens(std::int64_t T, bool with_text) {
  capture::TokenTable t;
  for (std::int64_t i = 0; i < T; ++i) {
    const bool vision = i >= 3 && i < T - 2;
    t.modality.push_back(vision ? KVSCOPE_VISION : KVSCOPE_TEXT);
    t.position.push_back(static_cast<std::int32_t>(i));
    t.token_id.push_back(vision ? -1 : static_cast<std::int32_t>(100 + i));
    t.segment.push_back(vision ? 1 : 0);
    t.grid_row.push_back(vision ? static_cast<std::int32_t>((i - 3) / 2) : -1);
    t.grid_col.push_back(vision ? static_cast<std::int32_t>((i - 3) % 2) : -1);
    if (with_text) t.text.push_back(vision ? "" : (i == 0 ? "h\xc3\xa9llo" : "tok" + std::to_string(i)));
  }
  return t;
}

inline void set_tokens(kvscope_capture* c, const capture::TokenTable& t, int expect = KVSCOPE_OK) {
  std::vector<const char*> text;
  for (const auto& s : t.text) text.push_back(s.c_str());
  ASSERT_EQ(
      kvscope_capture_set_tokens(c, t.modality.data(), t.position.data(), t.token_id.data(), t.segment.data(),
                                 t.grid_row.data(), t.grid_col.data(), text.empty() ? nullptr : text.data()),
      expect)
      << kvscope_capture_last_error();
}

// Result of a shell command: exit status, or the signal that killed it, and stdout+stderr.
struct CommandResult {
  int exit_code = -1;
  int signal = 0;
  std::string output;
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return r;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) r.output.append(buf, n);
  const int st = pclose(f);
  if (WIFSIGNALED(st)) {
    r.signal = WTERMSIG(st);
  } else if (WIFEXITED(st)) {
    r.exit_code = WEXITSTATUS(st);
    if (r.exit_code > 128 && r.exit_code < 160) r.signal = r.exit_code - 128;  // killed, as reported by sh
  }
  return r;
}

class CaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    // Parameterised suites and tests have a '/' in their names: one directory level, not two.
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = kvscope::testing::scratch_dir(name);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

}  // namespace kvscope::testing
