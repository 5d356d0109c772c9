// kvcap run: greedy generation with the reference runner, captured into a trace through the C API.
#pragma once

#include <string>
#include <vector>

namespace kvscope::cli {

// Runs `kvcap run` with the arguments after the command name. Returns the exit status: 0 done, 2 bad input
// or a failed run (one line on stderr, no trace left behind that claims to be complete).
int run_command(const std::vector<std::string>& args);

}  // namespace kvscope::cli
