// Scratch files of a test process: one directory under the system temp dir per process,
// removed with everything in it when the process exits, so a run of the suite leaves nothing
// behind (ctest runs every test case as its own process).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace kvscope::testing {

// TMPDIR/kvscope_test_PID/NAME (the process directory itself for an empty name), created on
// first use.
inline std::filesystem::path scratch_dir(const std::string& name = "") {
  namespace fs = std::filesystem;
  static const struct Root {
    fs::path path = fs::temp_directory_path() / ("kvscope_test_" + std::to_string(::getpid()));
    ~Root() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } root;
  const fs::path dir = name.empty() ? root.path : root.path / name;
  fs::create_directories(dir);
  return dir;
}

}  // namespace kvscope::testing
