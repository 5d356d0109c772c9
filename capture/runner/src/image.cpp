// Procedural scenes (spec "Scenes", bit-exact with the Python dataset) and PNG loading via stb_image.
#include "kvscope/runner/image.hpp"

#include <array>
#include <cstdlib>
#include <memory>

#include "kvscope/runner/error.hpp"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#include <stb/stb_image.h>

namespace kvscope::runner {
namespace {

constexpr int kSize = 64, kCells = 4, kCell = 16;
constexpr std::array<std::array<std::uint8_t, 3>, 5> kColors = {
    {{220, 40, 40}, {40, 190, 60}, {50, 90, 230}, {230, 210, 40}, {235, 235, 235}}};

bool painted(int shape, int x, int y) {
  const bool box = x >= 3 && x <= 12 && y >= 3 && y <= 12;
  switch (shape) {
    case 0:
      return box;
    case 1:
      return (2 * x - 15) * (2 * x - 15) + (2 * y - 15) * (2 * y - 15) <= 121;
    case 2:
      return y >= 3 && y <= 12 && std::abs(2 * x - 15) <= y - 2;
    case 3:
      return box && ((x >= 6 && x <= 9) || (y >= 6 && y <= 9));
  }
  return false;
}

}  // namespace

std::uint64_t SplitMix64::next() {
  state_ += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = state_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

const char* shape_name(int shape) {
  static const char* const kNames[] = {"square", "circle", "triangle", "cross"};
  return shape >= 0 && shape < 4 ? kNames[shape] : "?";
}

const char* color_name(int color) {
  static const char* const kNames[] = {"red", "green", "blue", "yellow", "white"};
  return color >= 0 && color < 5 ? kNames[color] : "?";
}

Scene render_scene(std::uint64_t seed) {
  SplitMix64 rng(seed);
  Scene scene;
  const int count = 1 + static_cast<int>(rng.uniform(6));
  std::array<int, kCells * kCells> cells{};
  for (int i = 0; i < kCells * kCells; ++i) cells[static_cast<std::size_t>(i)] = i;
  for (int i = 0; i < count; ++i) {
    const int j = i + static_cast<int>(rng.uniform(static_cast<std::uint64_t>(16 - i)));
    std::swap(cells[static_cast<std::size_t>(i)], cells[static_cast<std::size_t>(j)]);
  }
  for (int i = 0; i < count; ++i) {
    SceneObject o;
    o.row = cells[static_cast<std::size_t>(i)] / kCells;
    o.col = cells[static_cast<std::size_t>(i)] % kCells;
    bool clash = true;
    while (clash) {
      o.shape = static_cast<int>(rng.uniform(4));
      o.color = static_cast<int>(rng.uniform(5));
      clash = false;
      for (const auto& prev : scene.objects)
        clash = clash || (prev.shape == o.shape && prev.color == o.color);
    }
    scene.objects.push_back(o);
  }
  Image& img = scene.image;
  img.width = img.height = kSize;
  img.rgb.assign(static_cast<std::size_t>(kSize * kSize * 3), 16);
  for (const auto& o : scene.objects) {
    const auto& rgb = kColors[static_cast<std::size_t>(o.color)];
    for (int y = 0; y < kCell; ++y) {
      for (int x = 0; x < kCell; ++x) {
        if (!painted(o.shape, x, y)) continue;
        const std::size_t px = static_cast<std::size_t>((o.row * kCell + y) * kSize + o.col * kCell + x) * 3;
        for (int c = 0; c < 3; ++c)
          img.rgb[px + static_cast<std::size_t>(c)] = rgb[static_cast<std::size_t>(c)];
      }
    }
  }
  return scene;
}

Image load_image(const std::string& path, int expected_width, int expected_height) {
  int w = 0, h = 0, channels = 0;
  std::unique_ptr<stbi_uc, void (*)(void*)> pixels(stbi_load(path.c_str(), &w, &h, &channels, 3),
                                                   stbi_image_free);
  if (!pixels) {
    throw RunnerError(ErrorKind::kInput, path + ": cannot read image (" + stbi_failure_reason() + ")");
  }
  if (w != expected_width || h != expected_height) {
    throw RunnerError(ErrorKind::kInput, path + ": image is " + std::to_string(w) + "x" + std::to_string(h) +
                                             ", the model expects " + std::to_string(expected_width) + "x" +
                                             std::to_string(expected_height) + " RGB");
  }
  Image img;
  img.width = w;
  img.height = h;
  img.rgb.assign(pixels.get(), pixels.get() + static_cast<std::size_t>(w) * h * 3);
  return img;
}

}  // namespace kvscope::runner
