// Input images: procedural scenes (bit-exact with the Python dataset) and PNG files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvscope::runner {

struct Image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> rgb;  // [height, width, 3], row-major
};

// splitmix64 as in the spec; uniform(n) = next() % n.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  std::uint64_t uniform(std::uint64_t n) { return next() % n; }

 private:
  std::uint64_t state_;
};

struct SceneObject {
  int row = 0, col = 0, shape = 0, color = 0;  // shape: 0 square, 1 circle, 2 triangle, 3 cross
};

struct Scene {
  std::vector<SceneObject> objects;
  Image image;  // 64x64
};

Scene render_scene(std::uint64_t seed);
const char* shape_name(int shape);
const char* color_name(int color);

// Loads a PNG (or any format stb_image reads) as RGB and checks its size. Throws RunnerError(kInput) naming
// the file (and the actual and expected sizes).
Image load_image(const std::string& path, int expected_width, int expected_height);

}  // namespace kvscope::runner
