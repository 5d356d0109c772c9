#include "screenshot.hpp"

#include <GL/gl.h>
#include <stb_image_write.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvscope::viewer {

bool write_screenshot(const std::string& path, int width, int height, ImageStats* stats, std::string* error) {
  if (width <= 0 || height <= 0) {
    *error = "empty framebuffer";
    return false;
  }
  const std::size_t row = static_cast<std::size_t>(width) * 3;
  std::vector<unsigned char> pixels(row * static_cast<std::size_t>(height));
  glReadBuffer(GL_BACK);
  glPixelStorei(GL_PACK_ALIGNMENT, 1);
  glReadPixels(0, 0, width, height, GL_RGB, GL_UNSIGNED_BYTE, pixels.data());
  if (const GLenum e = glGetError(); e != GL_NO_ERROR) {
    *error = "glReadPixels failed (GL error " + std::to_string(e) + ")";
    return false;
  }
  // OpenGL rows start at the bottom; PNG rows at the top.
  std::vector<unsigned char> flipped(pixels.size());
  for (int y = 0; y < height; ++y) {
    const std::size_t src = static_cast<std::size_t>(height - 1 - y) * row;
    std::copy(pixels.begin() + static_cast<std::ptrdiff_t>(src),
              pixels.begin() + static_cast<std::ptrdiff_t>(src + row),
              flipped.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(y) * row));
  }
  if (stats) {
    double sum = 0, sum2 = 0;
    std::uint64_t h = 1469598103934665603ull;
    for (unsigned char c : flipped) {
      sum += c;
      sum2 += static_cast<double>(c) * c;
      h = (h ^ c) * 1099511628211ull;
    }
    const double n = static_cast<double>(flipped.size());
    stats->mean = sum / n;
    stats->stddev = std::sqrt(std::max(0.0, sum2 / n - stats->mean * stats->mean));
    stats->hash = h;
  }
  if (!stbi_write_png(path.c_str(), width, height, 3, flipped.data(), static_cast<int>(row))) {
    *error = "cannot write " + path;
    return false;
  }
  return true;
}

}  // namespace kvscope::viewer
