// `kvsim run` and `kvsim sweep`: replay a trace through policies and report.
#pragma once

#include <string>
#include <vector>

namespace kvscope::sim {
// argv0_line: the whole command line, stored in the results files.
int run_sweep_command(const std::string& command, const std::vector<std::string>& args, const std::string& argv_line);
}  // namespace kvscope::sim
