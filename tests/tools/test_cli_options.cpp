// cli::parse_options: the --help / bad-option / required-option behaviour every subcommand shares.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <sstream>

#include "kvscope/cli/options.hpp"

namespace po = boost::program_options;
using kvscope::cli::parse_options;

namespace {

// Captures std::cout and std::cerr for the lifetime of the object.
class Captured {
 public:
  Captured() : out_(std::cout.rdbuf(o_.rdbuf())), err_(std::cerr.rdbuf(e_.rdbuf())) {}
  ~Captured() {
    std::cout.rdbuf(out_);
    std::cerr.rdbuf(err_);
  }
  std::string out() const { return o_.str(); }
  std::string err() const { return e_.str(); }

 private:
  std::ostringstream o_, e_;
  std::streambuf* out_;
  std::streambuf* err_;
};

po::options_description options() {
  po::options_description opts("prog sub FILE\n\nOptions");
  opts.add_options()("help,h", "show this help")("file", po::value<std::string>(), "input")(
      "count,n", po::value<int>()->default_value(3), "a number")(
      "output,o", po::value<std::string>()->required(), "output file");
  return opts;
}

}  // namespace

TEST(CliOptions, ParsesValuesAndPositionals) {
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  Captured c;
  const auto exit = parse_options("prog sub", {"in.h5", "-n", "7", "-o", "out.h5"}, options(), vm, "", &pos);
  EXPECT_FALSE(exit.has_value());
  EXPECT_EQ(vm["file"].as<std::string>(), "in.h5");
  EXPECT_EQ(vm["count"].as<int>(), 7);
  EXPECT_EQ(vm["output"].as<std::string>(), "out.h5");
  EXPECT_EQ(c.out(), "");
  EXPECT_EQ(c.err(), "");
}

TEST(CliOptions, HelpPrintsOptionsAndEpilogBeforeRequiredChecks) {
  po::variables_map vm;
  Captured c;
  const auto exit = parse_options("prog sub", {"--help"}, options(), vm, "\nExample:\n  prog sub a -o b\n");
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(*exit, kvscope::cli::kExitOk);  // -o is required, but --help still works
  EXPECT_NE(c.out().find("prog sub FILE"), std::string::npos);
  EXPECT_NE(c.out().find("--count"), std::string::npos);
  EXPECT_NE(c.out().find("Example:\n  prog sub a -o b\n"), std::string::npos);
  EXPECT_EQ(c.err(), "");
}

TEST(CliOptions, BadInputGivesOneLineAndExit2) {
  struct Case {
    std::vector<std::string> args;
    std::string what;
  };
  const std::vector<Case> cases = {
      {{"--bogus", "-o", "x"}, "unrecognised option '--bogus'"},
      {{"-n", "seven", "-o", "x"}, "('seven') for option '--count' is invalid"},
      {{"-n"}, "required"},  // missing value
      {{"-n", "1"}, "'--output' is required"},
      {{"extra", "-o", "x"}, "too many positional options"},
  };
  for (const Case& k : cases) {
    po::variables_map vm;
    Captured c;
    const auto exit = parse_options("prog sub", k.args, options(), vm);
    ASSERT_TRUE(exit.has_value()) << k.what;
    EXPECT_EQ(*exit, kvscope::cli::kExitError);
    const std::string err = c.err();
    EXPECT_EQ(err.rfind("prog sub: ", 0), 0u) << err;
    EXPECT_NE(err.find(k.what), std::string::npos) << err;
    EXPECT_NE(err.find("(see prog sub --help)\n"), std::string::npos) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
    EXPECT_EQ(c.out(), "");
  }
}

TEST(CliOptions, MissingAndFailMessages) {
  Captured c;
  EXPECT_EQ(kvscope::cli::missing("kvsim info", "FILE"), kvscope::cli::kExitError);
  EXPECT_EQ(kvscope::cli::fail("kvcap run", "--dtype 'x' is not one of float16"), kvscope::cli::kExitError);
  EXPECT_EQ(c.err(),
            "kvsim info: missing FILE (see kvsim info --help)\n"
            "kvcap run: --dtype 'x' is not one of float16\n");
}
