#include "kvscope/cli/options.hpp"

#include <iostream>

namespace po = boost::program_options;

namespace kvscope::cli {

std::optional<int> parse_options(const std::string& program, const std::vector<std::string>& args,
                                 const po::options_description& opts, po::variables_map& vm,
                                 const std::string& epilog,
                                 const po::positional_options_description* positional) {
  try {
    // Without a positional description Boost would silently drop bare arguments ("kvsim sweep -t a.h5
    // junk"); an empty one makes each of them an error.
    const po::positional_options_description none;
    po::store(po::command_line_parser(args).options(opts).positional(positional ? *positional : none).run(),
              vm);
    if (vm.count("help")) {
      std::cout << opts << epilog;
      return kExitOk;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << program << ": " << e.what() << " (see " << program << " --help)\n";
    return kExitError;
  }
  return std::nullopt;
}

int fail(const std::string& program, const std::string& message) {
  std::cerr << program << ": " << message << "\n";
  return kExitError;
}

int missing(const std::string& program, const std::string& what) {
  return fail(program, "missing " + what + " (see " + program + " --help)");
}

}  // namespace kvscope::cli
