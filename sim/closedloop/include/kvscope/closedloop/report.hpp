// Closed-loop results: stdout table, CSV and HDF5 (docs/results-format.md "Closed-loop results").
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "kvscope/closedloop/evaluate.hpp"

namespace kvscope::closedloop {

struct EvalRunInfo {
  std::string model;  // model directory
  int samples = 0, max_new = 0;
  unsigned long long seed = 0;
  double reference_seconds = 0;  // uncompressed reference runs
  std::string task;              // text task (docs/tasks.md); "" for the tiny VLM's heldout.json
  int length = 0;                // the task's requested tokens
  bool question_in_context = false;  // text tasks: QuestionSetting::kInContext
};

void write_table(std::ostream& os, const std::vector<PointStats>& points);
// Both write to PATH.tmp and rename; throw std::runtime_error naming the file.
void write_csv(const std::string& path, const std::vector<PointStats>& points);
void write_hdf5(const std::string& path, const EvalRunInfo& info, const std::vector<PointStats>& points);
// One row per point x sample: sample (heldout index), family, policy, budget, generated (tokens joined by
// spaces, "<eos>" included when produced), expected (dataset answer), correct (0/1). PATH.tmp + rename.
void write_answers(const std::string& path, const std::vector<HeldoutSample>& samples,
                   const std::vector<PointStats>& points);

// Sets the OpenMP thread count of the runner and the simulator kernels (n >= 1).
void set_threads(int n);

}  // namespace kvscope::closedloop
