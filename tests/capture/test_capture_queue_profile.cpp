// Back-pressure of the bounded queue, profile ranges, and kvcap export-chrome on the result.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "capture_test_util.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/validate.hpp"

namespace kvscope::testing {
namespace {

std::uint64_t layer_bytes(const Geometry& g) {
  return static_cast<std::uint64_t>((g.Hq + 2 * g.Hkv) * g.T * g.D) * sizeof(float);
}

// Many layers through a queue that holds two of them: every tensor is written, the
// recording calls waited for the writer, and the bytes in flight never exceeded the bound.
TEST_F(CaptureTest, BackPressureKeepsQueueWithinBound) {
  Geometry g;
  g.L = 48;
  g.T = 40;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F16);
  cfg.queue_bytes = 2 * layer_bytes(g) + layer_bytes(g) / 2;  // 2.5 layers
  capture::Capture cap(path("t.h5"), cfg, g.T);
  cap.set_tokens(make_tokens(g.T, false));
  std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D)),
      kv(static_cast<std::size_t>(g.Hkv * g.T * g.D));
  for (int l = 0; l < g.L; ++l) {
    std::fill(q.begin(), q.end(), static_cast<float>(l));  // the caller reuses its buffers at once
    std::fill(kv.begin(), kv.end(), static_cast<float>(-l));
    cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D));
  }
  const kvscope_capture_stats s = cap.stats();
  cap.close();
  EXPECT_EQ(s.queue_bytes_bound, cfg.queue_bytes);
  EXPECT_LE(s.queue_bytes_peak, cfg.queue_bytes);
  EXPECT_GE(s.queue_bytes_peak, layer_bytes(g));
  EXPECT_GT(s.queue_waits, 0u) << "48 layers through a 2.5-layer queue never waited for the writer";
  const trace::TraceReader r(path("t.h5"));
  ASSERT_EQ(r.layers_present(), g.L);
  for (int l = 0; l < g.L; ++l) {
    const trace::LayerTensors t = r.read_layer(l);
    ASSERT_EQ(t.q.at(0), static_cast<float>(l));
    ASSERT_EQ(t.q.at(t.q.numel() - 1), static_cast<float>(l));
    ASSERT_EQ(t.v.at(t.v.numel() - 1), static_cast<float>(-l));
  }
}

// One call larger than the whole queue still goes through, alone.
TEST_F(CaptureTest, TensorLargerThanQueuePassesAlone) {
  const Geometry g;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F32);
  cfg.queue_bytes = 64;
  capture::Capture cap(path("t.h5"), cfg, g.T);
  cap.set_tokens(make_tokens(g.T, false));
  const std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D), 3.0f);
  const std::vector<float> kv(static_cast<std::size_t>(g.Hkv * g.T * g.D), 4.0f);
  for (int l = 0; l < g.L; ++l) {
    cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D));
  }
  const kvscope_capture_stats s = cap.stats();
  cap.close();
  EXPECT_EQ(s.queue_bytes_peak, layer_bytes(g));  // never two at once
  EXPECT_TRUE(trace::validate_trace(path("t.h5")).ok);
}

// A complete trace with user ranges (nested), capture-copy ranges and writer ranges.
std::string write_profiled_trace(const std::string& file, const Geometry& g) {
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F16);
  cfg.profile = 1;
  capture::Capture cap(file, cfg, g.T);
  cap.set_tokens(make_tokens(g.T, false));
  const std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D), 1.0f);
  const std::vector<float> kv(static_cast<std::size_t>(g.Hkv * g.T * g.D), 1.0f);
  cap.range_push("prefill");
  for (int l = 0; l < g.L; ++l) {
    cap.range_push(("layer " + std::to_string(l)).c_str());
    cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D));
    cap.range_pop();
  }
  cap.range_pop();
  cap.range_push("left open");  // ended by close
  cap.close();
  return file;
}

const trace::RangeRecord* find_range(const std::vector<trace::RangeRecord>& rs, const std::string& name) {
  auto it = std::find_if(rs.begin(), rs.end(), [&](const auto& r) { return r.name == name; });
  return it == rs.end() ? nullptr : &*it;
}

TEST_F(CaptureTest, RangesNestAndAreWritten) {
  const Geometry g;
  const trace::TraceReader r(write_profiled_trace(path("t.h5"), g));
  const trace::Profile p = r.read_profile();
  const auto* outer = find_range(p.ranges, "prefill");
  ASSERT_NE(outer, nullptr);
  EXPECT_EQ(outer->depth, 0);
  for (int l = 0; l < g.L; ++l) {
    const auto* layer = find_range(p.ranges, "layer " + std::to_string(l));
    ASSERT_NE(layer, nullptr) << l;
    EXPECT_EQ(layer->depth, 1);
    EXPECT_EQ(layer->thread, outer->thread);
    EXPECT_LE(outer->start_ns, layer->start_ns);
    EXPECT_LE(layer->start_ns, layer->end_ns);
    EXPECT_LE(layer->end_ns, outer->end_ns);
    const auto* copy = find_range(p.ranges, "capture/prefill layer 00" + std::to_string(l));
    ASSERT_NE(copy, nullptr) << l;
    EXPECT_EQ(copy->depth, 2);
    EXPECT_LE(layer->start_ns, copy->start_ns);
    EXPECT_LE(copy->end_ns, layer->end_ns);
    const auto* write = find_range(p.ranges, "capture/write layer " + std::to_string(l));
    ASSERT_NE(write, nullptr) << l;
    EXPECT_NE(write->thread, outer->thread);  // the writer thread
    EXPECT_GE(write->start_ns, copy->start_ns);
  }
  const auto* open = find_range(p.ranges, "left open");
  ASSERT_NE(open, nullptr);
  EXPECT_GE(open->end_ns, open->start_ns);
  EXPECT_TRUE(p.kernels.empty() || p.kernels.front().end_ns >= p.kernels.front().start_ns);
}

TEST_F(CaptureTest, ProfileOffWritesNoRanges) {
  const Geometry g;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F16);
  capture::Capture cap(path("t.h5"), cfg, g.T);
  cap.set_tokens(make_tokens(g.T, false));
  const std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D), 1.0f);
  const std::vector<float> kv(static_cast<std::size_t>(g.Hkv * g.T * g.D), 1.0f);
  cap.range_push("prefill");
  for (int l = 0; l < g.L; ++l) {
    cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                      capture::tensor(kv.data(), g.Hkv, g.T, g.D));
  }
  cap.range_pop();
  cap.close();
  const trace::Profile p = trace::TraceReader(path("t.h5")).read_profile();
  EXPECT_TRUE(p.ranges.empty());
  EXPECT_TRUE(p.kernels.empty());
}

TEST_F(CaptureTest, ExportChromeWritesJsonThatPythonLoads) {
  const Geometry g;
  const std::string trace_file = write_profiled_trace(path("t.h5"), g);
  const std::string json = path("t.json");
  const CommandResult ok =
      run_command(std::string(KVCAP_PATH) + " export-chrome " + trace_file + " -o " + json);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("wrote " + json + ": 11 ranges, 0 kernel/memcpy records"), std::string::npos)
      << ok.output;
  const CommandResult py = run_command(
      std::string(SYSTEM_PYTHON) + " " + CHECK_CHROME_PY + " " + json +
      " prefill 'layer 0' 'layer 2' 'capture/prefill layer 001' 'capture/write layer 2' 'left open'");
  EXPECT_EQ(py.exit_code, 0) << py.output;
  EXPECT_NE(py.output.find("ok: 11 X events"), std::string::npos) << py.output;

  const CommandResult help = run_command(std::string(KVCAP_PATH) + " export-chrome --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("Example:"), std::string::npos);
  EXPECT_NE(help.output.find("--output"), std::string::npos);
}

TEST_F(CaptureTest, ExportChromeErrors) {
  const Geometry g;
  kvscope_capture_config cfg = make_config(g, KVSCOPE_F16);  // profile off: no records
  {
    capture::Capture cap(path("noprof.h5"), cfg, g.T);
    cap.set_tokens(make_tokens(g.T, false));
    const std::vector<float> q(static_cast<std::size_t>(g.Hq * g.T * g.D), 1.0f);
    const std::vector<float> kv(static_cast<std::size_t>(g.Hkv * g.T * g.D), 1.0f);
    for (int l = 0; l < g.L; ++l) {
      cap.prefill_layer(l, capture::tensor(q.data(), g.Hq, g.T, g.D),
                        capture::tensor(kv.data(), g.Hkv, g.T, g.D),
                        capture::tensor(kv.data(), g.Hkv, g.T, g.D));
    }
    cap.close();
  }
  const std::string kvcap = KVCAP_PATH;
  const std::string json = path("out.json");
  CommandResult r = run_command(kvcap + " export-chrome " + path("noprof.h5") + " -o " + json);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.output, "kvcap export-chrome: " + path("noprof.h5") +
                          ": no /profile records (capture with profiling on, config.profile = 1)\n");
  r = run_command(kvcap + " export-chrome " + path("missing.h5") + " -o " + json);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find(path("missing.h5")), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  const std::string traced = write_profiled_trace(path("t.h5"), g);
  r = run_command(kvcap + " export-chrome " + traced + " -o " + path("no/dir/out.json"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find(path("no/dir/out.json") + ": cannot write"), std::string::npos) << r.output;
  r = run_command(kvcap + " export-chrome " + traced);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("missing -o/--output"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(json));
  // Nothing but the inputs in the directory: no temporary files left behind.
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 2u);
}

}  // namespace
}  // namespace kvscope::testing
