// kvcap aggregate: the attention statistics every sweep reads from the O(T^2) prefill attention,
// computed once and stored in the trace (/aggregates, trace format 1.2).
#pragma once

#include <string>
#include <vector>

namespace kvscope::cli {

// `kvcap aggregate` (arguments after the subcommand). Returns the exit status.
int aggregate_command(const std::vector<std::string>& args);

}  // namespace kvscope::cli
