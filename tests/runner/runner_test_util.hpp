// Shared helpers of the runner suites: fixture locations and the Python reference file
// (layout: capture/python/kvscope/tinyvlm/export_reference.py).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvscope/runner/image.hpp"
#include "kvscope/runner/model.hpp"
#include "kvscope/runner/safetensors.hpp"

namespace kvscope::runner::testing {

inline std::filesystem::path source_dir() {
  const char* s = std::getenv("KVSCOPE_SOURCE_DIR");
  return s ? std::filesystem::path(s) : std::filesystem::path(KVSCOPE_TEST_SOURCE_DIR);
}

inline std::filesystem::path binary_dir() {
  const char* s = std::getenv("KVSCOPE_BINARY_DIR");
  return s ? std::filesystem::path(s) : std::filesystem::path(KVSCOPE_TEST_BINARY_DIR);
}

// The random-init fixtures (always present) and the trained model (when it has been committed).
inline std::vector<std::string> fixture_names() { return {"none", "linear", "ntk"}; }
inline std::filesystem::path fixture_dir(const std::string& name) {
  return source_dir() / "tests" / "data" / ("tinyvlm-random-" + name);
}
inline std::filesystem::path trained_dir() { return source_dir() / "traces" / "models" / "tiny-shapes"; }
inline bool trained_present() {
  return std::filesystem::exists(trained_dir() / "model.safetensors") &&
         std::filesystem::exists(trained_dir() / "reference.safetensors");
}

// The real pretrained model scripts/setup imports: $KVSCOPE_CACHE, else
// ${XDG_CACHE_HOME:-$HOME/.cache}/kvscope,
// + /models/smollm2-135m-instruct (as scripts/lib/env.sh resolves it).
inline std::filesystem::path smollm2_dir() {
  std::filesystem::path cache;
  if (const char* c = std::getenv("KVSCOPE_CACHE"); c && *c) {
    cache = c;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    cache = std::filesystem::path(x) / "kvscope";
  } else {
    const char* home = std::getenv("HOME");
    cache = std::filesystem::path(home ? home : "/") / ".cache" / "kvscope";
  }
  return cache / "models" / "smollm2-135m-instruct";
}
inline bool smollm2_present() {
  const std::filesystem::path d = smollm2_dir();
  return std::filesystem::exists(d / "model.safetensors") && std::filesystem::exists(d / "tokenizer.json") &&
         std::filesystem::exists(d / "config.json");
}
#define KVSCOPE_SKIP_WITHOUT_SMOLLM2()                                                                 \
  if (!::kvscope::runner::testing::smollm2_present())                                                  \
  GTEST_SKIP() << "no imported SmolLM2-135M-Instruct at " << ::kvscope::runner::testing::smollm2_dir() \
               << " (run scripts/setup to import it)"

// Every model directory with a reference file: the fixtures, then the trained model when present.
inline std::vector<std::filesystem::path> reference_model_dirs() {
  std::vector<std::filesystem::path> dirs;
  for (const auto& n : fixture_names()) dirs.push_back(fixture_dir(n));
  if (trained_present()) dirs.push_back(trained_dir());
  return dirs;
}

struct ReferenceSample {
  std::string family, question;
  std::vector<std::uint64_t> image_seeds;
  std::vector<std::int64_t> input_ids;
  std::vector<Image> images;
  std::vector<float> logits;            // [T, V]
  std::vector<std::int64_t> generated;  // [G]
  std::vector<float> step_logits;       // [G, V]
  std::vector<float> q0, k0, v0;        // layer-0 prefill q [Hq,T,Dh], k/v [Hkv,T,Dh]
};

inline nlohmann::json metadata_json(const SafetensorsFile& f, const std::string& key) {
  return nlohmann::json::parse(f.metadata().at(key));
}

inline std::vector<ReferenceSample> load_samples(const SafetensorsFile& f) {
  const nlohmann::json meta = metadata_json(f, "samples");
  std::vector<ReferenceSample> out;
  for (std::size_t i = 0; i < meta.size(); ++i) {
    ReferenceSample s;
    const std::string p = "sample." + std::to_string(i) + ".";
    s.family = meta[i]["family"].get<std::string>();
    s.question = meta[i]["question"].get<std::string>();
    for (const auto& seed : meta[i]["image_seeds"]) s.image_seeds.push_back(seed.get<std::uint64_t>());
    s.input_ids = f.to_i64(p + "input_ids");
    if (f.contains(p + "images")) {
      const auto& info = f.info(p + "images");
      const std::vector<std::int64_t> pixels = f.to_i64(p + "images");
      const std::size_t per = 64 * 64 * 3;
      for (std::int64_t n = 0; n < info.shape[0]; ++n) {
        Image img;
        img.width = img.height = 64;
        for (std::size_t k = 0; k < per; ++k)
          img.rgb.push_back(static_cast<std::uint8_t>(pixels[n * per + k]));
        s.images.push_back(std::move(img));
      }
    }
    s.logits = f.to_f32(p + "logits");
    s.generated = f.to_i64(p + "generated");
    s.step_logits = f.to_f32(p + "step_logits");
    s.q0 = f.to_f32(p + "q_layer0");
    s.k0 = f.to_f32(p + "k_layer0");
    s.v0 = f.to_f32(p + "v_layer0");
    out.push_back(std::move(s));
  }
  return out;
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace kvscope::runner::testing
