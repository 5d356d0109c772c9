// Headless capture: reads the current OpenGL back buffer and writes it as a PNG.
#pragma once

#include <cstdint>
#include <string>

namespace kvscope::viewer {

struct ImageStats {
  double mean = 0, stddev = 0;  // over all RGB samples, 0..255
  std::uint64_t hash = 0;       // FNV-1a of the RGB pixels, top row first
};

// Reads width x height pixels of the back buffer (call before swapping), flips them top-down and
// writes an RGB PNG. Returns false with *error set on failure.
bool write_screenshot(const std::string& path, int width, int height, ImageStats* stats, std::string* error);

}  // namespace kvscope::viewer
