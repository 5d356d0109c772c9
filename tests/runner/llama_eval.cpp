// Test driver for the real-model tests (test_llama_vs_hf.py): runs our CPU runner on given token ids and
// writes what the Python side compares against Hugging Face.
//   llama_eval MODEL_DIR IDS_FILE OUT_DIR MAX_NEW
// IDS_FILE: one prompt per line, each whitespace-separated token ids. For prompt i (from 0) writes
// OUT_DIR/logits_<i>.npy (float32 [T, V], every position of the prefill) and OUT_DIR/greedy_<i>.txt (the
// greedy continuation's ids from the same prefill, at most MAX_NEW, ending with an EOS id when one was
// generated; none when MAX_NEW is 0). The model loads once. Exit 2 with one line on
// stderr on bad input.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "kvscope/runner/error.hpp"
#include "kvscope/runner/model.hpp"

namespace {

namespace fs = std::filesystem;
using kvscope::runner::Model;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A float32 C-order .npy of `rows` x `cols` values.
void write_npy(const fs::path& path, const std::vector<float>& data, long rows, long cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  const std::size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const std::uint16_t n = static_cast<std::uint16_t>(header.size());
  const char len[2] = {static_cast<char>(n & 0xff), static_cast<char>(n >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()),
            static_cast<std::streamsize>(data.size() * sizeof(float)));
  if (!out) throw std::runtime_error(path.string() + ": write failed");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: llama_eval MODEL_DIR IDS_FILE OUT_DIR MAX_NEW\n";
    return 2;
  }
  try {
    std::ifstream in(argv[2]);
    if (!in) throw std::runtime_error(std::string(argv[2]) + ": cannot open");
    std::vector<std::vector<std::int32_t>> prompts;
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      std::vector<std::int32_t> ids;
      for (long long v; ls >> v;) ids.push_back(static_cast<std::int32_t>(v));
      if (!ls.eof()) throw std::runtime_error(std::string(argv[2]) + ": not lines of integers");
      if (!ids.empty()) prompts.push_back(std::move(ids));
    }
    const int max_new = std::stoi(argv[4]);
    auto t0 = std::chrono::steady_clock::now();
    Model model = Model::load(argv[1]);
    std::printf("llama_eval: load %.2f s\n", seconds_since(t0));
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const kvscope::runner::Prompt prompt = model.build_prompt_from_ids(prompts[i]);
      // One prefill gives every position's logits and starts the greedy continuation.
      t0 = std::chrono::steady_clock::now();
      std::vector<float> logits;  // [T, V]
      kvscope::runner::GenerateOptions opt;
      opt.max_new = max_new;
      opt.prefill_logits = &logits;
      const kvscope::runner::Generation gen = model.generate(prompt, opt);
      std::printf("llama_eval: prompt %zu: %d tokens, prefill + %zu greedy tokens %.2f s\n", i, prompt.size(),
                  gen.tokens.size(), seconds_since(t0));
      const std::string n = std::to_string(i);
      write_npy(fs::path(argv[3]) / ("logits_" + n + ".npy"), logits, prompt.size(),
                model.config().vocab_size);
      std::ofstream greedy(fs::path(argv[3]) / ("greedy_" + n + ".txt"));
      for (std::int32_t id : gen.tokens) greedy << id << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "llama_eval: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
