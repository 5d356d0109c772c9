// Whole-process behaviour: a C program (compiled as C) using the header writes a valid
// trace; a capture killed by abort() mid-run leaves a trace that validates as incomplete,
// naming what it contains; the shared object exports only the C API.
#include <cstdlib>
#include <string>

#include "capture_test_util.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/validate.hpp"

namespace kvscope::testing {
namespace {

TEST_F(CaptureTest, CProgramWritesValidTrace) {
  const std::string file = path("c.h5");
  const CommandResult e = run_command(std::string(C_PROGRAM) + " roundtrip " + file);
  ASSERT_EQ(e.signal, 0) << e.output;
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const trace::ValidationReport rep = trace::validate_trace(file);
  ASSERT_TRUE(rep.ok) << rep.message;
  const trace::TraceReader r(file);
  EXPECT_EQ(r.geometry().model_name, "c-program");
  EXPECT_EQ(r.num_decode_steps(), 2u);
  // value(l, which, h, t, d) = l*1000 + which*100 + h*10 + t + d/4, as the program wrote it
  const trace::LayerTensors t = r.read_layer(3);
  EXPECT_EQ(t.q.at((1 * 6 + 5) * 4 + 3), 3000.0f + 10 + 5 + 0.75f);
  EXPECT_EQ(t.v.at(2 * 4 + 1), 3200.0f + 2 + 0.25f);
  const trace::LayerTensors d = r.read_decode_layer(2);
  EXPECT_EQ(d.q.at((1 * 2 + 1) * 4 + 2), 2000.0f + 10 + 7 + 0.5f);  // head 1, step 1 (position 7), d 2
  EXPECT_EQ(r.tokens().grid_row[4], 1);
  EXPECT_EQ(r.decode_tokens().text, (std::vector<std::string>{"x", "x"}));
  EXPECT_FALSE(r.read_profile().ranges.empty());
}

TEST_F(CaptureTest, CrashMidCaptureLeavesIncompleteTrace) {
  const std::string file = path("crash.h5");
  const CommandResult e = run_command(std::string(C_PROGRAM) + " crash " + file);
  ASSERT_EQ(e.signal, SIGABRT) << "exit " << e.exit_code << ": " << e.output;
  const trace::ValidationReport rep = trace::validate_trace(file);
  EXPECT_FALSE(rep.ok);
  EXPECT_TRUE(rep.incomplete) << rep.message;
  EXPECT_EQ(rep.kind, trace::ErrorKind::kIncomplete);
  EXPECT_EQ(rep.num_tokens, 6u);
  EXPECT_EQ(rep.message,
            file +
                ": incomplete trace (complete = 0, its writer did not finish): contains 6 tokens, "
                "0 decode steps, 2 of 4 prefill layers and 0 decode layers; the data present is valid");
  // What the validator says, kvcap validate prints (exit 2).
  const CommandResult v = run_command(std::string(KVCAP_PATH) + " validate -q " + file);
  EXPECT_EQ(v.exit_code, 2);
  EXPECT_NE(v.output.find("incomplete trace"), std::string::npos) << v.output;
  // The layers present hold the program's values.
  trace::ReaderOptions opts;
  opts.require_complete = false;
  const trace::TraceReader r(file, opts);
  EXPECT_EQ(r.read_layer(1).k.at(4 * 5 + 2), 1100.0f + 5 + 0.5f);
}

TEST(CaptureLibrary, ExportsOnlyTheCApi) {
  const CommandResult e = run_command(std::string("nm -D --defined-only ") + CAPTURE_LIBRARY);
  ASSERT_EQ(e.exit_code, 0) << e.output;
  int api = 0;
  std::size_t pos = 0;
  while (pos < e.output.size()) {
    const std::size_t end = e.output.find('\n', pos);
    const std::string line = e.output.substr(pos, end - pos);
    pos = end == std::string::npos ? e.output.size() : end + 1;
    if (line.empty()) continue;
    const std::string sym = line.substr(line.rfind(' ') + 1);
    EXPECT_EQ(sym.rfind("kvscope_capture_", 0), 0u) << "exported symbol outside the C API: " << line;
    ++api;
  }
  EXPECT_EQ(api, 15);  // the functions of kvscope_capture.h
}

}  // namespace
}  // namespace kvscope::testing
