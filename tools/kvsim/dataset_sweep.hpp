// kvsim sweep --dataset: every trace of a dataset replayed over the sweep's points, spread over MPI ranks
// when run under mpirun / srun, with per-sample results and bootstrap aggregates (docs/datasets.md).
#pragma once

#include <boost/program_options.hpp>
#include <string>
#include <vector>

#include "kvscope/sim/sweep.hpp"

namespace kvscope::sim {

// The options kvsim sweep adds for datasets (--dataset, --by, --bootstrap, --seed, --top, --skip-bad,
// --policy-groups, --samples-csv).
void add_dataset_options(boost::program_options::options_description& opts);

// Runs the dataset sweep; returns the exit status (errors: one line on stderr, exit 2).
int run_dataset_sweep(const std::string& name, const boost::program_options::variables_map& vm,
                      const std::vector<SweepPoint>& points, const SweepOptions& options,
                      const std::string& argv_line, int threads);

}  // namespace kvscope::sim
