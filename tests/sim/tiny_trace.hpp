// A small synthetic trace (kvcap synth's "tiny" preset) for simulator tests, written once per process and
// name into the process scratch directory (scratch.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "kvscope/synth/synth.hpp"
#include "scratch.hpp"

namespace kvscope::testing {

// NAME.h5 with `image_tokens` vision tokens (one image), `text` text tokens and `decode` decode steps
// (evaluation queries), generated from `seed`. The same name must always be asked for with the same shape.
inline const std::string& tiny_trace(const std::string& name, int image_tokens, int text, int decode,
                                     std::uint64_t seed) {
  static std::mutex mutex;
  static std::map<std::string, std::string> made;  // name -> path
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = made.find(name);
  if (it == made.end()) {
    const std::string path = (scratch_dir() / (name + ".h5")).string();
    synth::SynthOptions o;
    o.preset = "tiny";
    o.image_tokens = image_tokens;
    o.text = text;
    o.decode = decode;
    o.seed = seed;
    synth::write_synthetic_trace(o, path);
    it = made.emplace(name, path).first;
  }
  return it->second;
}

}  // namespace kvscope::testing
