// `kvsim plan`: the capacity planner's command line (see docs/planner.md).
#pragma once

#include <string>
#include <vector>

namespace kvscope::tools {

// Runs `kvsim plan` with the arguments after "plan". Returns the exit code:
// 0 on success (also for --help), 2 on bad input with one line on stderr.
int run_plan_command(const std::vector<std::string>& args);

}  // namespace kvscope::tools
