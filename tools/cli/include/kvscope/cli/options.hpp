// Option parsing shared by every subcommand of kvcap, kvsim and kvview (Boost.Program_options): --help,
// bad options and missing values handled the same way everywhere.
#pragma once

#include <boost/program_options.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kvscope::cli {

// Exit statuses of the command-line programs: done, and bad input (one line on stderr).
constexpr int kExitOk = 0;
constexpr int kExitError = 2;

// Parses a subcommand's arguments into `vm`. Returns the status to exit with, or nullopt to go on:
//   --help / -h: prints `opts` and then `epilog` to stdout and returns kExitOk, before required
//                options are checked (so `kvcap synth --help` works without -o);
//   an unknown option, a bad or missing value, a missing required option, a bare argument that no
//                positional option takes: prints
//                "PROGRAM: WHAT (see PROGRAM --help)" on stderr and returns kExitError.
// `opts` must define "help,h". `positional` names the options that bare arguments fill, if any.
std::optional<int> parse_options(
    const std::string& program, const std::vector<std::string>& args,
    const boost::program_options::options_description& opts, boost::program_options::variables_map& vm,
    const std::string& epilog = "",
    const boost::program_options::positional_options_description* positional = nullptr);

// Prints "PROGRAM: MESSAGE" on stderr and returns kExitError.
int fail(const std::string& program, const std::string& message);
// Prints "PROGRAM: missing WHAT (see PROGRAM --help)" on stderr and returns kExitError.
int missing(const std::string& program, const std::string& what);

}  // namespace kvscope::cli
