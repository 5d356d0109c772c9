// Writes the hand-made sample results (tests/sim/sample_results.hpp) as results.csv and
// results.h5 into a directory, for results_interop.py (pandas / h5py, as docs/results-format.md says).
#include <exception>
#include <filesystem>
#include <iostream>

#include "sim/sample_results.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: write_sample_results DIR\n";
    return 2;
  }
  try {
    const std::filesystem::path dir = argv[1];
    std::filesystem::create_directories(dir);
    const auto points = kvscope::testing::sample_points();
    const auto meta = kvscope::testing::sample_meta();
    kvscope::sim::write_csv((dir / "results.csv").string(), points, meta);
    kvscope::sim::write_hdf5((dir / "results.h5").string(), points, meta);
    std::cout << kvscope::sim::format_table(points);
  } catch (const std::exception& e) {
    std::cerr << "write_sample_results: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
