// Scenes: bit-exact against the Python dataset's rendering (reference.safetensors scene.* tensors).
#include <cstring>

#include "kvscope/runner/error.hpp"
#include "kvscope/runner/image.hpp"
#include "runner_test_util.hpp"

namespace kvscope::runner {
namespace {

TEST(SplitMix64, KnownSequence) {
  // Reference values of splitmix64 seeded with 0 (Vigna's published test vector).
  SplitMix64 rng(0);
  EXPECT_EQ(rng.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(rng.next(), 0x6E789E6AA1B965F4ull);
}

TEST(Scene, BitExactWithPythonReference) {
  SafetensorsFile ref((testing::fixture_dir("none") / "reference.safetensors").string());
  const auto seeds = testing::metadata_json(ref, "scene_seeds");
  ASSERT_EQ(seeds.size(), 10u);
  for (std::size_t j = 0; j < seeds.size(); ++j) {
    const std::uint64_t seed = seeds[j].get<std::uint64_t>();
    const Scene scene = render_scene(seed);
    const std::vector<std::int64_t> pixels = ref.to_i64("scene." + std::to_string(j) + ".image");
    ASSERT_EQ(pixels.size(), scene.image.rgb.size());
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < pixels.size(); ++i) mismatches += pixels[i] != scene.image.rgb[i];
    EXPECT_EQ(mismatches, 0u) << "seed " << seed;
    const std::vector<std::int64_t> objects = ref.to_i64("scene." + std::to_string(j) + ".objects");
    ASSERT_EQ(objects.size(), scene.objects.size() * 4) << "seed " << seed;
    for (std::size_t o = 0; o < scene.objects.size(); ++o) {
      EXPECT_EQ(objects[o * 4 + 0], scene.objects[o].row);
      EXPECT_EQ(objects[o * 4 + 1], scene.objects[o].col);
      EXPECT_EQ(objects[o * 4 + 2], scene.objects[o].shape);
      EXPECT_EQ(objects[o * 4 + 3], scene.objects[o].color);
    }
  }
}

TEST(Scene, SampleImagesAreTheScenesOfTheirSeeds) {
  SafetensorsFile ref((testing::fixture_dir("none") / "reference.safetensors").string());
  int checked = 0;
  for (const auto& s : testing::load_samples(ref)) {
    ASSERT_EQ(s.images.size(), s.image_seeds.size());
    for (std::size_t i = 0; i < s.images.size(); ++i) {
      EXPECT_EQ(render_scene(s.image_seeds[i]).image.rgb, s.images[i].rgb) << s.question;
      ++checked;
    }
  }
  EXPECT_GE(checked, 4);
}

TEST(Scene, ObjectsAreDistinctAndPainted) {
  for (std::uint64_t seed = 100; seed < 140; ++seed) {
    const Scene s = render_scene(seed);
    ASSERT_GE(s.objects.size(), 1u);
    ASSERT_LE(s.objects.size(), 6u);
    for (std::size_t a = 0; a < s.objects.size(); ++a) {
      for (std::size_t b = 0; b < a; ++b) {
        EXPECT_FALSE(s.objects[a].row == s.objects[b].row && s.objects[a].col == s.objects[b].col);
        EXPECT_FALSE(s.objects[a].shape == s.objects[b].shape && s.objects[a].color == s.objects[b].color);
      }
      // The centre pixel (7,7)... (8,8) of every shape is painted, so it is not background.
      const auto& o = s.objects[a];
      const std::size_t px = static_cast<std::size_t>(((o.row * 16 + 8) * 64) + o.col * 16 + 8) * 3;
      EXPECT_NE(s.image.rgb[px], 16) << "seed " << seed;
    }
  }
}

}  // namespace
}  // namespace kvscope::runner
