// Writes every bad-input case of tests/trace/bad_traces.hpp into a folder, one
// file per case, plus cases.tsv (name, file, expected message) for the CLI tests.
#include <filesystem>
#include <fstream>
#include <iostream>

#include "bad_traces.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_bad_traces DIR\n";
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  std::ofstream tsv(dir / "cases.tsv");
  for (const auto& c : kvscope::testing::bad_cases()) {
    const std::string path = (dir / (c.name + ".h5")).string();
    std::filesystem::remove(path);
    c.make(path);
    tsv << c.name << '\t' << path << '\t' << c.expect << '\n';
  }
  kvscope::testing::write_small_trace((dir / "good.h5").string());
  return 0;
}
