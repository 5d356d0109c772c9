// kvbench's pure logic (kernels/bench/kvbench_report.hpp): backend and bound of a
// benchmark, throughput and fraction of ceiling, grouping by family (registration
// markers), the exact-name filters handed to Google Benchmark (POSIX extended
// regexes) and the formatting.
#include <gtest/gtest.h>
#include <regex.h>

#include <cmath>
#include <string>
#include <vector>

#include "../../kernels/bench/kvbench_report.hpp"

namespace kb = kvscope::bench;

namespace {

kb::Ceilings test_ceilings() {
  kb::Ceilings c;
  c.cpu_threads = 2;
  c.cpu_triad_bytes_per_s = 4e9;
  c.cpu_sgemm_flops_per_s = 1e11;
  c.gpu_triad_bytes_per_s = 4e12;
  c.gpu_sgemm_flops_per_s = 5e13;
  return c;
}

TEST(BenchUtil, BackendIsAPathComponent) {
  EXPECT_EQ(kb::backend_of("BM_quantize_int8/cpu/T:576/real_time"), kb::Backend::kCpu);
  EXPECT_EQ(kb::backend_of("BM_quantize_int8/cuda/T:576/manual_time"), kb::Backend::kCuda);
  EXPECT_EQ(kb::backend_of("BM_copy/gpu"), kb::Backend::kCuda);
  EXPECT_EQ(kb::backend_of("BM_cudagraph_like/cpu"), kb::Backend::kCpu);  // substring is not a component
  EXPECT_EQ(kb::backend_of("BM_plain"), kb::Backend::kCpu);
  EXPECT_EQ(kb::backend_of("BM_x/cuda"), kb::Backend::kCuda);  // last component
}

TEST(BenchUtil, BoundIsTheLabelsFirstWord) {
  EXPECT_EQ(kb::bound_of("mem"), kb::Bound::kMem);
  EXPECT_EQ(kb::bound_of("compute"), kb::Bound::kCompute);
  EXPECT_EQ(kb::bound_of("mem T=576"), kb::Bound::kMem);
  EXPECT_EQ(kb::bound_of(""), kb::Bound::kNone);
  EXPECT_EQ(kb::bound_of("memory"), kb::Bound::kNone);
}

TEST(BenchUtil, MemRowUsesTriadOfItsBackend) {
  const kb::Ceilings c = test_ceilings();
  // 1 GB per iteration in 0.5 s -> 2 GB/s = 50% of the 4 GB/s CPU triad.
  kb::RunRow r = kb::make_row("BM_q/cpu/T:576", "mem", 1e9, 0, 0.5, 0, c);
  EXPECT_DOUBLE_EQ(r.throughput, 2e9);
  EXPECT_DOUBLE_EQ(r.ceiling, 4e9);
  EXPECT_DOUBLE_EQ(r.fraction, 0.5);
  r = kb::make_row("BM_q/cuda/T:576", "mem", 1e9, 0, 1e-3, 0, c);
  EXPECT_DOUBLE_EQ(r.ceiling, 4e12);
  EXPECT_DOUBLE_EQ(r.fraction, 0.25);
}

TEST(BenchUtil, ComputeRowUsesSgemmOfItsBackend) {
  const kb::Ceilings c = test_ceilings();
  kb::RunRow r = kb::make_row("BM_eval/cpu", "compute", 123.0, 3e10, 1.0, 0, c);
  EXPECT_DOUBLE_EQ(r.throughput, 3e10);  // FLOP, not bytes
  EXPECT_DOUBLE_EQ(r.ceiling, 1e11);
  EXPECT_DOUBLE_EQ(r.fraction, 0.3);
  r = kb::make_row("BM_eval/cuda", "compute", 0, 1e10, 1e-3, 0, c);
  EXPECT_DOUBLE_EQ(r.fraction, 1e13 / 5e13);
}

TEST(BenchUtil, FallbackRateMissingCeilingAndUnlabelled) {
  kb::Ceilings c = test_ceilings();
  // No per-iteration bytes: the benchmark's own bytes_per_second is used.
  kb::RunRow r = kb::make_row("BM_q/cpu", "mem", 0, 0, 0.1, 1e9, c);
  EXPECT_DOUBLE_EQ(r.throughput, 1e9);
  EXPECT_DOUBLE_EQ(r.fraction, 0.25);
  // No ceiling measured: fraction is NaN, shown as "-".
  c.cpu_triad_bytes_per_s = 0;
  r = kb::make_row("BM_q/cpu", "mem", 1e9, 0, 1.0, 0, c);
  EXPECT_DOUBLE_EQ(r.throughput, 1e9);
  EXPECT_TRUE(std::isnan(r.fraction));
  // No label: no bound, no throughput.
  r = kb::make_row("BM_q/cpu", "", 1e9, 1e9, 1.0, 5.0, c);
  EXPECT_EQ(r.bound, kb::Bound::kNone);
  EXPECT_EQ(r.throughput, 0.0);
  EXPECT_TRUE(std::isnan(r.fraction));
}

TEST(BenchUtil, FamiliesFollowRegistrationMarkers) {
  // Registration order: a stray benchmark, then two files with their markers.
  const std::vector<std::string> all = {"BM_stray/cpu",
                                        "kvbench_family:head_merge",
                                        "BM_merge_heads/cpu/T:576",
                                        "BM_merge_heads/cuda/T:576",
                                        "kvbench_family:merge",
                                        "BM_merge_tokens/cpu/T:576",
                                        "BM_merge_tokens/cpu/T:2048"};
  // Everything selected (listing with the user's filter includes markers too).
  std::vector<kb::FamilyGroup> g = kb::group_by_family(all, all);
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g[0].family, "head_merge");  // names do not decide: BM_merge_heads is in head_merge
  EXPECT_EQ(g[0].names, (std::vector<std::string>{"BM_merge_heads/cpu/T:576", "BM_merge_heads/cuda/T:576"}));
  EXPECT_EQ(g[1].family, "merge");
  EXPECT_EQ(g[1].names,
            (std::vector<std::string>{"BM_merge_tokens/cpu/T:576", "BM_merge_tokens/cpu/T:2048"}));
  EXPECT_EQ(g[2].family, "other");  // before any marker: last
  EXPECT_EQ(g[2].names, (std::vector<std::string>{"BM_stray/cpu"}));
  // A filtered selection keeps only the selected names and drops empty families.
  g = kb::group_by_family(all, {"BM_merge_tokens/cpu/T:2048", "BM_unknown"});
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].family, "merge");
  EXPECT_EQ(g[0].names, (std::vector<std::string>{"BM_merge_tokens/cpu/T:2048"}));
  EXPECT_EQ(g[1].family, "other");
  EXPECT_TRUE(kb::group_by_family(all, {}).empty());
  EXPECT_TRUE(kb::is_family_marker("kvbench_family:x"));
  EXPECT_FALSE(kb::is_family_marker("BM_kvbench_family:x"));
}

TEST(BenchUtil, ExactNamesRegexMatchesOnlyThoseNames) {
  const std::vector<std::string> names = {"BM_copy_layer/cpu/T:576/real_time", "BM_odd(x)+[y]*.?{2}|^$\\z",
                                          "BM_copy_layer/cuda/T:576/manual_time"};
  // Google Benchmark 1.7 compiles filters as POSIX extended regexes and searches;
  // checked here with the C library's POSIX ERE engine.
  const std::string spec = kb::exact_names_regex(names);
  regex_t re;
  ASSERT_EQ(regcomp(&re, spec.c_str(), REG_EXTENDED | REG_NOSUB), 0) << spec;
  auto matches = [&re](const std::string& s) { return regexec(&re, s.c_str(), 0, nullptr, 0) == 0; };
  for (const auto& n : names) EXPECT_TRUE(matches(n)) << n << " vs " << spec;
  for (const std::string n : {"BM_copy_layer/cpu/T:5767/real_time", "BM_copy_layer/cpu/T:576",
                              "XBM_copy_layer/cpu/T:576/real_time", "BM_odd(x)+[y]*.?{2}|^$", "BM_oddx+y"}) {
    EXPECT_FALSE(matches(n)) << n << " vs " << spec;
  }
  regfree(&re);
}

TEST(BenchUtil, TableShowsFractionAndSkips) {
  const kb::Ceilings c = test_ceilings();
  std::vector<kb::RunRow> rows = {kb::make_row("BM_q/cpu/T:576", "mem", 1e9, 0, 0.5, 0, c),
                                  kb::make_row("BM_q/cuda/T:576", "mem", 0, 0, 0, 0, c)};
  rows[1].error = "no GPU";
  const std::string t = kb::format_table(rows);
  EXPECT_NE(t.find("BM_q/cpu/T:576"), std::string::npos) << t;
  EXPECT_NE(t.find("2.0 GB/s"), std::string::npos) << t;
  EXPECT_NE(t.find("4.0 GB/s"), std::string::npos) << t;
  EXPECT_NE(t.find("50.0%"), std::string::npos) << t;
  EXPECT_NE(t.find("skipped: no GPU"), std::string::npos) << t;
  const std::string ce = kb::format_ceilings(c);
  EXPECT_NE(ce.find("100 GFLOP/s"), std::string::npos) << ce;
  EXPECT_NE(ce.find("4000 GB/s"), std::string::npos) << ce;
}

TEST(BenchUtil, RateAndJsonFormatting) {
  EXPECT_EQ(kb::format_rate(2e9, kb::Bound::kMem), "2.0 GB/s");
  EXPECT_EQ(kb::format_rate(1.5e12, kb::Bound::kCompute), "1500 GFLOP/s");
  EXPECT_EQ(kb::format_rate(0, kb::Bound::kMem), "-");
  EXPECT_EQ(kb::format_rate(std::nan(""), kb::Bound::kMem), "-");
  EXPECT_EQ(kb::json_escape("a\"b\\c\n"), "a\\\"b\\\\c\\u000a");
  EXPECT_EQ(kb::json_number(std::nan("")), "null");
  EXPECT_EQ(kb::json_number(0.25), "0.25");
}

}  // namespace
