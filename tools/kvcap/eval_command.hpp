// `kvcap eval`: closed-loop evaluation of policies on held-out samples (eval_command.cpp).
#pragma once

#include <string>
#include <vector>

namespace kvscope::cli {

// Returns the exit status: 0 done, 2 bad input (one line on stderr).
int eval_command(const std::vector<std::string>& args);
// `kvcap tasks`: long-context task prompts as JSON lines (tasks_command.cpp).
int tasks_command(const std::vector<std::string>& args);

}  // namespace kvscope::cli
