// The isolated pre-check of untrusted files (kvscope/trace/untrusted.hpp): non-regular files are
// refused without being opened; a check that crashes, hangs or allocates beyond the limit in its
// child becomes one TraceError naming the file and the object, in bounded time; errors raised in
// the child come back with their kind, object and message.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "kvscope/trace/untrusted.hpp"

namespace fs = std::filesystem;
using namespace kvscope::trace;

namespace {

class Untrusted : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvscope_untrusted_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    set_trusted_files(false);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const char* name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `check` isolated and returns the TraceError it raised (fails the test if none).
TraceError error_of(const std::function<void()>& check, const IsolationLimits& limits = {}) {
  try {
    run_isolated("t.h5", check, limits);
  } catch (const TraceError& e) {
    return e;
  }
  ADD_FAILURE() << "run_isolated did not throw";
  return TraceError(ErrorKind::kUsage, "", "", "no error");
}

TEST_F(Untrusted, NonRegularFilesAreRefusedWithoutOpeningThem) {
  const std::string fifo = path("pipe.h5");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& [file, what] :
       std::vector<std::pair<std::string, std::string>>{{fifo, "named pipe"},
                                                        {dir_.string(), "directory"},
                                                        {"/dev/null", "character device"},
                                                        {path("missing.h5"), "no such file"}}) {
    try {
      require_regular_file(file);
      ADD_FAILURE() << file << " accepted";
    } catch (const TraceError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kIo) << e.what();
      EXPECT_EQ(e.file(), file);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    // The full pre-check refuses them the same way, before any child starts.
    EXPECT_THROW(check_trace_file(file), TraceError);
    EXPECT_FALSE(validate_trace_isolated(file).ok);
  }
  // A socket too.
  const std::string sock = path("s.h5");
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, sock.c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_THROW(require_regular_file(sock), TraceError);
  ::close(fd);
  EXPECT_LT(seconds_since(t0), 2.0);
  // A regular file (and a link to one) passes.
  const std::string reg = path("r.h5");
  std::ofstream(reg) << "x";
  EXPECT_NO_THROW(require_regular_file(reg));
  fs::create_symlink(reg, path("link.h5"));
  EXPECT_NO_THROW(require_regular_file(path("link.h5")));
}

TEST_F(Untrusted, SuccessAndTraceErrorsComeBackFromTheChild) {
  EXPECT_NO_THROW(run_isolated("t.h5", [] {}));
  const TraceError e = error_of(
      [] { throw TraceError(ErrorKind::kShape, "t.h5", "/tokens/grid", "shape [3], expected [5, 2]"); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_EQ(e.file(), "t.h5");
  EXPECT_EQ(e.object(), "/tokens/grid");
  EXPECT_STREQ(e.what(), "t.h5: /tokens/grid: shape [3], expected [5, 2]");
  // Other exceptions become kCorrupt with their message.
  const TraceError o = error_of([] { throw std::runtime_error("odd"); });
  EXPECT_EQ(o.kind(), ErrorKind::kCorrupt);
  EXPECT_NE(std::string(o.what()).find("odd"), std::string::npos);
}

TEST_F(Untrusted, ACrashBecomesOneLineNamingTheObject) {
  const auto t0 = std::chrono::steady_clock::now();
  const TraceError e = error_of([] {
    note_object_being_read("/@format");
    note_object_being_read("/tokens/text");
    std::raise(SIGSEGV);
  });
  EXPECT_EQ(e.kind(), ErrorKind::kCorrupt);
  EXPECT_EQ(e.object(), "/tokens/text");
  EXPECT_STREQ(
      e.what(),
      "t.h5: /tokens/text: the HDF5 library crashed reading this object (signal 11): the file is corrupt");
  EXPECT_LT(seconds_since(t0), 5.0);
  // Before any object is named, the message is about the file.
  const TraceError f = error_of([] { std::abort(); });
  EXPECT_EQ(f.object(), "");
  EXPECT_STREQ(f.what(), "t.h5: the HDF5 library crashed reading the file (signal 6): the file is corrupt");
}

TEST_F(Untrusted, AnErrorRaisedBeforeACrashInTheCleanupIsReported) {
  // HDF5 can abort closing a file after an error: the error is the better message.
  const TraceError e = error_of([] {
    note_object_being_read("/tokens/text");
    note_failure(ErrorKind::kCorrupt, "t.h5", "/tokens/text", "H5Dread failed");
    std::abort();
  });
  EXPECT_STREQ(e.what(), "t.h5: /tokens/text: H5Dread failed");
  // An error recovered from before the next object does not stick.
  const TraceError f = error_of([] {
    note_failure(ErrorKind::kMissing, "t.h5", "/x", "absent");
    note_object_being_read("/y");
    std::raise(SIGSEGV);
  });
  EXPECT_EQ(f.object(), "/y");
  EXPECT_NE(std::string(f.what()).find("crashed"), std::string::npos);
}

TEST_F(Untrusted, AHangIsKilledAfterTheTimeLimit) {
  IsolationLimits limits;
  limits.seconds = 1.0;
  const auto t0 = std::chrono::steady_clock::now();
  const TraceError e = error_of(
      [] {
        note_object_being_read("/tokens/text");
        volatile unsigned long spins = 0;
        while (true) spins = spins + 1;
      },
      limits);
  const double took = seconds_since(t0);
  EXPECT_EQ(e.kind(), ErrorKind::kCorrupt);
  EXPECT_STREQ(e.what(),
               "t.h5: /tokens/text: reading this object did not finish within 1 s: the file is corrupt");
  EXPECT_GE(took, 0.9);
  EXPECT_LT(took, 4.0);
}

TEST_F(Untrusted, TheTimeLimitIsPerObject) {
  // Three objects of 0.4 s each under a 1 s limit: progress restarts the clock.
  IsolationLimits limits;
  limits.seconds = 1.0;
  EXPECT_NO_THROW(run_isolated(
      "t.h5",
      [] {
        for (int i = 0; i < 3; ++i) {
          note_object_being_read("/layers/00" + std::to_string(i) + "/q");
          ::usleep(400'000);
        }
      },
      limits));
}

TEST_F(Untrusted, AMemoryBlowUpIsStoppedAtTheLimit) {
  IsolationLimits limits;
  limits.memory_bytes = 256ull << 20;
  const auto t0 = std::chrono::steady_clock::now();
  const TraceError e = error_of(
      [] {
        note_object_being_read("/profile/kernels");
        // 8 GiB touched in 64 MiB blocks: refused by RLIMIT_AS at 256 MiB (bad_alloc), or killed
        // by the parent's resident-memory watch in sanitizer builds.
        std::vector<std::unique_ptr<char[]>> blocks;
        for (int i = 0; i < 128; ++i) {
          blocks.emplace_back(new char[64u << 20]);
          std::memset(blocks.back().get(), 1, 64u << 20);
        }
      },
      limits);
  EXPECT_EQ(e.kind(), ErrorKind::kCorrupt);
  EXPECT_STREQ(
      e.what(),
      "t.h5: /profile/kernels: reading this object needed more than 256 MiB of memory: the file is corrupt");
  EXPECT_LT(seconds_since(t0), 10.0);
  // The default is 1 GiB, and it is named so.
  const TraceError g = error_of([] { throw std::bad_alloc(); });
  EXPECT_STREQ(g.what(), "t.h5: reading the file needed more than 1 GiB of memory: the file is corrupt");
}

TEST_F(Untrusted, TheTrustedSwitchSkipsTheChild) {
  const std::string junk = path("junk.h5");
  std::ofstream(junk) << "not an HDF5 file";
  try {
    check_trace_file(junk);
    ADD_FAILURE() << "junk accepted by the isolated metadata pass";
  } catch (const TraceError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotHdf5) << e.what();
    EXPECT_EQ(e.file(), junk);
  }
  set_trusted_files(true);
  EXPECT_TRUE(trusted_files());
  EXPECT_NO_THROW(check_trace_file(junk));  // nothing parsed: the caller's own open will report it
  EXPECT_THROW(check_trace_file(path("pipe-less-missing.h5")), TraceError);  // stat still runs
  set_trusted_files(false);
}

TEST_F(Untrusted, ShippedTracePassesBothPasses) {
  const char* src = std::getenv("KVSCOPE_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  const std::string t = std::string(src) + "/traces/tiny-synth.h5";
  EXPECT_NO_THROW(check_trace_file(t));
  EXPECT_NO_THROW(check_trace_file(t, true));
  std::size_t calls = 0, last_total = 0;
  const ValidationReport r = validate_trace_isolated(t, [&](std::size_t, std::size_t total) {
    ++calls;
    last_total = total;
  });
  EXPECT_TRUE(r.ok) << r.message;
  EXPECT_NE(r.message.find("valid kvscope trace"), std::string::npos) << r.message;
  EXPECT_GT(r.num_tokens, 0u);
  EXPECT_GT(r.num_layers, 0);
  EXPECT_GT(calls, 0u);  // progress forwarded from the child
  EXPECT_GT(last_total, 0u);
}

}  // namespace
