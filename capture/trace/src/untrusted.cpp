#include "kvscope/trace/untrusted.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "h5.hpp"
#include "kvscope/trace/reader.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define KVSCOPE_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVSCOPE_UNDER_ASAN 1
#endif
#endif
#ifndef KVSCOPE_UNDER_ASAN
#define KVSCOPE_UNDER_ASAN 0
#endif

namespace kvscope::trace {

namespace {

// One page shared (MAP_SHARED | MAP_ANONYMOUS, mapped before fork) between a check's child and
// its parent: what the child is reading, the error it raised before dying, its progress.
struct SharedState {
  std::atomic<std::uint64_t> objects_started;
  std::atomic<std::uint64_t> progress_done, progress_total;
  std::atomic<int> has_failure;
  int failure_kind;
  char object[1024];
  char failure_file[512];
  char failure_object[512];
  char failure_message[1536];
};
static_assert(sizeof(SharedState) <= 4096 * 2);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

SharedState* g_shared = nullptr;  // non-null only inside a check's child

void copy_into(char* dst, std::size_t cap, const std::string& s) {
  const std::size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

// The message of a TraceError without its "file: object: " prefix.
std::string raw_message(const TraceError& e) {
  std::string m = e.what();
  const std::string prefix = e.object().empty() ? e.file() + ": " : e.file() + ": " + e.object() + ": ";
  if (m.compare(0, prefix.size(), prefix) == 0) m.erase(0, prefix.size());
  return m;
}

std::string format_limit_bytes(std::uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) {
    std::snprintf(buf, sizeof buf, "%llu GiB", static_cast<unsigned long long>(b >> 30));
  } else if (b >= (1ull << 20)) {
    std::snprintf(buf, sizeof buf, "%.0f MiB", static_cast<double>(b) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(b));
  }
  return buf;
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s == std::floor(s) ? "%.0f" : "%.1f", s);
  return buf;
}

// Pages of /proc/PID/statm's field `field` (0 size, 1 resident); 0 when unreadable.
std::uint64_t statm_bytes(pid_t pid, int field) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/statm", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  unsigned long long v[2] = {0, 0};
  if (std::sscanf(buf, "%llu %llu", &v[0], &v[1]) != 2) return 0;
  return v[field] * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
}

// Wire format of the child's report: status byte, then kind, file, object, message, payload.
enum class Status : std::uint8_t { kOk = 0, kTraceError = 1, kMemory = 2, kOther = 3 };

void put_u32(std::string& out, std::uint32_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_str(std::string& out, const std::string& s) {
  put_u32(out, static_cast<std::uint32_t>(s.size()));
  out += s;
}
bool get_u32(const std::string& in, std::size_t& pos, std::uint32_t& v) {
  if (pos + sizeof v > in.size()) return false;
  std::memcpy(&v, in.data() + pos, sizeof v);
  pos += sizeof v;
  return true;
}
bool get_str(const std::string& in, std::size_t& pos, std::string& s) {
  std::uint32_t n = 0;
  if (!get_u32(in, pos, n) || pos + n > in.size()) return false;
  s.assign(in, pos, n);
  pos += n;
  return true;
}

void write_all(int fd, const std::string& data) {
  std::size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

[[noreturn]] void child_main(int out_fd, const std::function<std::string()>& check,
                             const IsolationLimits& limits, pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);  // the parent died before prctl
  const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd >= 0) {
    dup2(null_fd, STDIN_FILENO);
    dup2(null_fd, STDOUT_FILENO);
    // glibc's own abort messages ("free(): invalid size") or a sanitizer's report would be more
    // lines on the tool's stderr; KVSCOPE_ISOLATED_STDERR=1 keeps them (debugging).
    const char* keep = std::getenv("KVSCOPE_ISOLATED_STDERR");
    if (!(keep && std::strcmp(keep, "1") == 0)) dup2(null_fd, STDERR_FILENO);
  }
  // A crash is a plain signal to the parent, whatever handlers the caller (or a sanitizer
  // runtime, which would turn it into exit status 1) installed.
  for (const int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) signal(sig, SIG_DFL);
  const rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  if (!KVSCOPE_UNDER_ASAN) {
    // The child starts with the caller's mappings (libraries, thread stacks, heap): the limit is
    // on what the check adds.
    const std::uint64_t now = statm_bytes(getpid(), 0);
    if (now > 0) {
      const rlimit as{static_cast<rlim_t>(now + limits.memory_bytes),
                      static_cast<rlim_t>(now + limits.memory_bytes)};
      setrlimit(RLIMIT_AS, &as);
    }
  }
  h5::silence_errors();
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // also when the parent's once-flag was already set
  std::string report;
  try {
    const std::string payload = check();
    report.push_back(static_cast<char>(Status::kOk));
    put_u32(report, 0);
    put_str(report, "");
    put_str(report, "");
    put_str(report, "");
    put_str(report, payload);
  } catch (const TraceError& e) {
    report.clear();
    report.push_back(static_cast<char>(Status::kTraceError));
    put_u32(report, static_cast<std::uint32_t>(e.kind()));
    put_str(report, e.file());
    put_str(report, e.object());
    put_str(report, raw_message(e));
  } catch (const std::bad_alloc&) {
    report.clear();
    report.push_back(static_cast<char>(Status::kMemory));
  } catch (const std::exception& e) {
    report.clear();
    report.push_back(static_cast<char>(Status::kOther));
    put_u32(report, static_cast<std::uint32_t>(ErrorKind::kCorrupt));
    put_str(report, "");
    put_str(report, "");
    put_str(report, e.what());
  } catch (...) {
    report.clear();
    report.push_back(static_cast<char>(Status::kOther));
    put_u32(report, static_cast<std::uint32_t>(ErrorKind::kCorrupt));
    put_str(report, "");
    put_str(report, "");
    put_str(report, "unknown exception");
  }
  write_all(out_fd, report);
  _exit(0);
}

[[noreturn]] void fail_for(const std::string& path, const std::string& object,
                           const std::string& what_happened, const std::string& where_generic) {
  // "t.h5: /tokens/text: the HDF5 library crashed reading this object (signal 11): the file is corrupt"
  std::string msg = what_happened;
  const std::string subject = object.empty() ? where_generic : "this object";
  const std::size_t at = msg.find("{}");
  if (at != std::string::npos) msg.replace(at, 2, subject);
  throw TraceError(ErrorKind::kCorrupt, path, object, msg + ": the file is corrupt");
}

// run_isolated, returning the check's payload.
std::string run_isolated_payload(const std::string& path, const std::function<std::string()>& check,
                                 const IsolationLimits& limits,
                                 const std::function<void(std::size_t, std::size_t)>& progress) {
  void* mem = mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    throw TraceError(ErrorKind::kIo, path, "",
                     std::string("cannot map memory for the isolated check: ") + std::strerror(errno));
  }
  auto* shared = new (mem) SharedState();
  struct Unmap {
    void* p;
    ~Unmap() { munmap(p, sizeof(SharedState)); }
  } unmap{mem};
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    throw TraceError(ErrorKind::kIo, path, "",
                     std::string("cannot create a pipe for the isolated check: ") + std::strerror(errno));
  }
  const std::uint64_t parent_rss = statm_bytes(getpid(), 1);
  const pid_t parent = getpid();
  std::fflush(nullptr);  // nothing buffered is written twice (the child never flushes, but be sure)
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    throw TraceError(ErrorKind::kIo, path, "",
                     std::string("cannot start the isolated check: fork: ") + std::strerror(err));
  }
  if (pid == 0) {
    ::close(fds[0]);
    g_shared = shared;
    child_main(fds[1], check, limits, parent);
  }
  ::close(fds[1]);

  using clock = std::chrono::steady_clock;
  std::string data;
  std::uint64_t seen_objects = 0, seen_done = 0;
  auto last_start = clock::now();
  bool timed_out = false, over_memory = false, eof = false;
  char buf[4096];
  while (true) {
    const double since = std::chrono::duration<double>(clock::now() - last_start).count();
    const double left = limits.seconds - since;
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int wait_ms = static_cast<int>(std::min(20.0, std::ceil(left * 1000)));
    const int r = poll(&p, 1, wait_ms);
    if (r < 0 && errno != EINTR) break;
    if (r > 0) {
      const ssize_t n = ::read(fds[0], buf, sizeof buf);
      if (n == 0) {  // the child closed its end: it exited (or died)
        eof = true;
        break;
      }
      if (n > 0) data.append(buf, static_cast<std::size_t>(n));
      if (n < 0 && errno != EINTR && errno != EAGAIN) break;
    }
    const std::uint64_t started = shared->objects_started.load(std::memory_order_acquire);
    if (started != seen_objects) {
      seen_objects = started;
      last_start = clock::now();
    }
    if (progress) {
      const std::uint64_t done = shared->progress_done.load(std::memory_order_acquire);
      if (done != seen_done) {
        seen_done = done;
        progress(static_cast<std::size_t>(done), static_cast<std::size_t>(shared->progress_total.load()));
      }
    }
    const std::uint64_t rss = statm_bytes(pid, 1);
    if (rss > parent_rss && rss - parent_rss > limits.memory_bytes) {
      over_memory = true;
      break;
    }
  }
  ::close(fds[0]);
  if (!eof) kill(pid, SIGKILL);  // timed out, over memory, or the pipe failed: never wait on it
  int status = 0;
  pid_t w;
  do {
    w = waitpid(pid, &status, 0);
  } while (w < 0 && errno == EINTR);
  const std::string object = shared->object;
  if (timed_out) {
    fail_for(path, object, "reading {} did not finish within " + format_seconds(limits.seconds) + " s",
             "the file");
  }
  const std::string limit = format_limit_bytes(limits.memory_bytes);
  if (over_memory) fail_for(path, object, "reading {} needed more than " + limit + " of memory", "the file");
  std::size_t pos = 0;
  if (!data.empty()) {
    const auto st = static_cast<Status>(data[0]);
    pos = 1;
    if (st == Status::kMemory)
      fail_for(path, object, "reading {} needed more than " + limit + " of memory", "the file");
    std::uint32_t kind = 0;
    std::string file, obj, message, payload;
    if (get_u32(data, pos, kind) && get_str(data, pos, file) && get_str(data, pos, obj) &&
        get_str(data, pos, message)) {
      if (st == Status::kOk && get_str(data, pos, payload)) return payload;
      if (st == Status::kTraceError) throw TraceError(static_cast<ErrorKind>(kind), file, obj, message);
      if (st == Status::kOther) throw TraceError(ErrorKind::kCorrupt, path, object, message);
    }
  }
  // No complete report: the child died. An error it raised before dying (the crash came in the
  // cleanup that followed, e.g. HDF5 closing the file) is the better message.
  if (shared->has_failure.load(std::memory_order_acquire)) {
    throw TraceError(static_cast<ErrorKind>(shared->failure_kind), shared->failure_file,
                     shared->failure_object, shared->failure_message);
  }
  if (w == pid && WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    if (sig == SIGXCPU) {
      fail_for(path, object, "reading {} did not finish within its CPU time limit", "the file");
    }
    fail_for(path, object, "the HDF5 library crashed reading {} (signal " + std::to_string(sig) + ")",
             "the file");
  }
  if (w == pid && WIFEXITED(status)) {
    fail_for(path, object,
             "the check of {} ended abnormally (exit status " + std::to_string(WEXITSTATUS(status)) + ")",
             "the file");
  }
  fail_for(path, object, "the check of {} ended abnormally", "the file");
}

std::atomic<int> g_trusted{-1};

}  // namespace

void note_object_being_read(const std::string& object) {
  SharedState* s = g_shared;
  if (!s) return;
  copy_into(s->object, sizeof s->object, object);
  s->has_failure.store(0, std::memory_order_relaxed);
  s->objects_started.fetch_add(1, std::memory_order_release);
}

void note_progress(std::size_t done, std::size_t total) {
  SharedState* s = g_shared;
  if (!s) return;
  s->progress_total.store(total, std::memory_order_relaxed);
  s->progress_done.store(done, std::memory_order_release);
  s->objects_started.fetch_add(1, std::memory_order_release);
}

void note_failure(ErrorKind kind, const std::string& file, const std::string& object,
                  const std::string& message) {
  SharedState* s = g_shared;
  if (!s) return;
  s->failure_kind = static_cast<int>(kind);
  copy_into(s->failure_file, sizeof s->failure_file, file);
  copy_into(s->failure_object, sizeof s->failure_object, object);
  copy_into(s->failure_message, sizeof s->failure_message, message);
  s->has_failure.store(1, std::memory_order_release);
}

void require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    throw TraceError(ErrorKind::kIo, path, "",
                     err == ENOENT || err == ENOTDIR ? std::string("no such file") : std::strerror(err));
  }
  const char* what = S_ISDIR(st.st_mode)    ? "is a directory"
                     : S_ISFIFO(st.st_mode) ? "is a named pipe (FIFO)"
                     : S_ISCHR(st.st_mode)  ? "is a character device"
                     : S_ISBLK(st.st_mode)  ? "is a block device"
                     : S_ISSOCK(st.st_mode) ? "is a socket"
                     : S_ISREG(st.st_mode)  ? nullptr
                                            : "is not a regular file";
  if (what) throw TraceError(ErrorKind::kIo, path, "", std::string(what) + ", not a regular file");
}

void run_isolated(const std::string& path, const std::function<void()>& check,
                  const IsolationLimits& limits) {
  run_isolated_payload(path,
                       [&check] {
                         check();
                         return std::string();
                       },
                       limits, {});
}

namespace {
// Everything TraceReader can read except the bulk q/k/v tensors.
void metadata_pass(const std::string& path) {
  ReaderOptions o;
  o.require_complete = false;  // read as far as the file goes; the caller's own open decides
  TraceReader reader(path, o);
  for (int l = 0; l < reader.layers_present(); ++l) (void)reader.read_aggregates(l);
  (void)reader.read_profile();
}
}  // namespace

void check_trace_file(const std::string& path, bool full) {
  require_regular_file(path);
  if (trusted_files()) return;
  if (!full) {
    run_isolated(path, [&path] { metadata_pass(path); });
    return;
  }
  const ValidationReport r = validate_trace_isolated(path);
  if (!r.ok && !r.incomplete) {
    // validate_trace's message is what() of the TraceError it caught; keep it as it is.
    throw TraceError(r.kind, path, "",
                     r.message.rfind(path + ": ", 0) == 0 ? r.message.substr(path.size() + 2) : r.message);
  }
}

ValidationReport validate_trace_isolated(const std::string& path,
                                         const std::function<void(std::size_t, std::size_t)>& progress) {
  ValidationReport r;
  try {
    require_regular_file(path);
    if (trusted_files()) return validate_trace(path, progress);
    const std::string payload = run_isolated_payload(
        path,
        [&path] {
          const ValidationReport v =
              validate_trace(path, [](std::size_t d, std::size_t t) { note_progress(d, t); });
          std::string out;
          put_u32(out, (v.ok ? 1u : 0u) | (v.incomplete ? 2u : 0u));
          put_u32(out, static_cast<std::uint32_t>(v.kind));
          put_str(out, v.message);
          put_u32(out, static_cast<std::uint32_t>(v.num_layers));
          put_u32(out, static_cast<std::uint32_t>(v.layers_present));
          put_str(out, std::to_string(v.num_tokens));
          put_str(out, std::to_string(v.num_decode_steps));
          return out;
        },
        IsolationLimits{}, progress);
    std::size_t pos = 0;
    std::uint32_t flags = 0, kind = 0, layers = 0, present = 0;
    std::string tokens, steps;
    if (!get_u32(payload, pos, flags) || !get_u32(payload, pos, kind) || !get_str(payload, pos, r.message) ||
        !get_u32(payload, pos, layers) || !get_u32(payload, pos, present) || !get_str(payload, pos, tokens) ||
        !get_str(payload, pos, steps)) {
      throw TraceError(ErrorKind::kCorrupt, path, "", "the isolated check returned a truncated report");
    }
    r.ok = flags & 1u;
    r.incomplete = (flags & 2u) != 0;
    r.kind = static_cast<ErrorKind>(kind);
    r.num_layers = static_cast<int>(layers);
    r.layers_present = static_cast<int>(present);
    r.num_tokens = std::stoull(tokens);
    r.num_decode_steps = std::stoull(steps);
  } catch (const TraceError& e) {
    r = ValidationReport{};
    r.ok = false;
    r.kind = e.kind();
    r.incomplete = e.kind() == ErrorKind::kIncomplete;
    r.message = e.what();
  }
  return r;
}

bool trusted_files() {
  int v = g_trusted.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("KVSCOPE_TRUSTED_FILES");
    v = env && std::strcmp(env, "1") == 0 ? 1 : 0;
    int expected = -1;
    if (!g_trusted.compare_exchange_strong(expected, v)) v = expected;
  }
  return v == 1;
}

void set_trusted_files(bool trusted) { g_trusted.store(trusted ? 1 : 0, std::memory_order_relaxed); }

}  // namespace kvscope::trace
