// Dynamic work distribution over MPI ranks (or one process): see work_pool.hpp.
//
// Protocol (MPI): every rank other than 0 sends a request (tag kTagResult: int64 unit of the result it
// carries, -1 for none, then the result's bytes) and receives the next unit (tag kTagWork: int64, -1 =
// stop). Rank 0's main thread only serves these messages (polling with MPI_Iprobe and a short sleep,
// so it takes no core from the work) while a thread of rank 0 works on units too.
#include "work_pool.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "kvscope/kernels/common.hpp"

#ifdef KVSCOPE_HAVE_MPI
#include <mpi.h>
#endif

namespace kvscope::sim {

namespace {

// Files to remove when terminated (fixed buffers: the handler may only call async-signal-safe functions).
constexpr int kMaxPartial = 4;
char g_partial[kMaxPartial][4096];
int g_rank = 0;

[[maybe_unused]] void on_terminate(int sig) {
  for (auto& p : g_partial)
    if (p[0]) unlink(p);
  char msg[200];
  const char* head = "kvsim sweep: rank ";
  std::size_t n = 0;
  for (const char* c = head; *c; ++c) msg[n++] = *c;
  char digits[12];
  int k = 0, r = g_rank;
  do {
    digits[k++] = static_cast<char>('0' + r % 10);
    r /= 10;
  } while (r && k < 11);
  while (k) msg[n++] = digits[--k];
  const char* tail = ": terminated (another rank died or the job was cancelled); no results file written\n";
  for (const char* c = tail; *c && n < sizeof msg - 1; ++c) msg[n++] = *c;
  if (write(STDERR_FILENO, msg, n) < 0) {
  }
  _exit(128 + sig);
}

[[maybe_unused]] long env_long(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : -1;
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

#ifdef KVSCOPE_HAVE_MPI
constexpr int kTagResult = 17, kTagWork = 18;
#endif

}  // namespace

bool WorkPool::built_with_mpi() {
#ifdef KVSCOPE_HAVE_MPI
  return true;
#else
  return false;
#endif
}

WorkPool::WorkPool() {
  if (!launched_by_mpi()) return;
#ifdef KVSCOPE_HAVE_MPI
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (provided < MPI_THREAD_FUNNELED) {
    MPI_Finalize();
    throw std::runtime_error("the MPI library does not support MPI_THREAD_FUNNELED");
  }
  mpi_ = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  g_rank = rank_;
  std::signal(SIGTERM, on_terminate);
  std::signal(SIGINT, on_terminate);
#else
  const long size = std::max(env_long("OMPI_COMM_WORLD_SIZE"), env_long("PMI_SIZE"));
  if (size > 1) {
    throw std::runtime_error("started as one of " + std::to_string(size) +
                             " MPI processes, but this kvsim was built without MPI (install libopenmpi-dev "
                             "and rebuild, or run it without mpirun / srun)");
  }
#endif
}

WorkPool::~WorkPool() {
#ifdef KVSCOPE_HAVE_MPI
  if (!mpi_) return;
  // Ranks other than 0 wait here while rank 0 aggregates and writes: a non-blocking barrier polled
  // with a sleep, so that waiting takes no core.
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  int done = 0;
  while (!done) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  MPI_Finalize();
#endif
}

void WorkPool::set_partial_files(const std::vector<std::string>& paths) {
  for (int i = 0; i < kMaxPartial; ++i) {
    const std::string p = i < static_cast<int>(paths.size()) ? paths[static_cast<std::size_t>(i)] : "";
    if (p.size() >= sizeof g_partial[i]) continue;
    std::memcpy(g_partial[i], p.c_str(), p.size() + 1);
  }
}

void WorkPool::run(std::size_t n, int threads, const std::function<std::string(std::size_t)>& work,
                   const std::function<bool(std::size_t, const std::string&)>& on_result,
                   const std::function<void(std::size_t, std::string&&)>& consume) {
  (void)threads;  // used by rank 0's work thread under MPI
  if (!mpi_ || size_ == 1) {
    for (std::size_t u = 0; u < n; ++u) {
      std::string r = work(u);
      const bool go_on = on_result(u, r);
      consume(u, std::move(r));
      if (!go_on) break;
    }
    return;
  }
#ifdef KVSCOPE_HAVE_MPI
  if (!root()) {
    std::int64_t done = -1;
    std::string payload;
    // Rank 0 waits for this rank's next request: a rank that cannot go on must end the job, not return.
    struct AbortOnThrow {
      ~AbortOnThrow() {
        if (std::uncaught_exceptions()) MPI_Abort(MPI_COMM_WORLD, 2);
      }
    } abort_on_throw;
    while (true) {
      std::string msg(sizeof done, '\0');
      std::memcpy(msg.data(), &done, sizeof done);
      msg += payload;
      payload.clear();
      payload.shrink_to_fit();
      if (msg.size() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
        std::fprintf(stderr, "kvsim sweep: rank %d: the result of work unit %lld is larger than 2 GiB\n",
                     rank_, static_cast<long long>(done));
        throw std::runtime_error("the result of a work unit is larger than 2 GiB");
      }
      MPI_Send(msg.data(), static_cast<int>(msg.size()), MPI_BYTE, 0, kTagResult, MPI_COMM_WORLD);
      std::int64_t unit = -1;
      MPI_Recv(&unit, 1, MPI_INT64_T, 0, kTagWork, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      if (unit < 0) break;
      payload = work(static_cast<std::size_t>(unit));
      done = unit;
    }
    return;
  }
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<std::size_t, std::string> arrived;  // results not yet consumed, by unit
  std::size_t consumed = 0;                    // units consumed (only the consuming thread moves it)
  auto deliver = [&](std::size_t u, std::string r) {
    std::lock_guard<std::mutex> lock(mu);
    if (!on_result(u, r)) stop = true;
    arrived.emplace(u, std::move(r));
  };
  // Consumes the results that follow the last consumed one without a gap (never holding the lock
  // while consuming).
  auto consume_ready = [&] {
    while (true) {
      std::string r;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = arrived.find(consumed);
        if (it == arrived.end()) return;
        r = std::move(it->second);
        arrived.erase(it);
      }
      consume(consumed, std::move(r));
      ++consumed;
    }
  };
  auto claim = [&]() -> std::int64_t {
    if (stop) return -1;
    const std::size_t u = next++;
    return u < n ? static_cast<std::int64_t>(u) : -1;
  };
  std::exception_ptr local_error;
  std::thread local([&] {
    try {
      kernels::set_cpu_threads(threads);
      for (std::int64_t u = claim(); u >= 0; u = claim()) {
        deliver(static_cast<std::size_t>(u), work(static_cast<std::size_t>(u)));
        consume_ready();
      }
    } catch (...) {
      local_error = std::current_exception();
      stop = true;
    }
  });
  int active = size_ - 1;
  std::vector<char> buf;
  while (active > 0) {
    int flag = 0;
    MPI_Status st;
    MPI_Iprobe(MPI_ANY_SOURCE, kTagResult, MPI_COMM_WORLD, &flag, &st);
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    int count = 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    buf.resize(static_cast<std::size_t>(count));
    MPI_Recv(buf.data(), count, MPI_BYTE, st.MPI_SOURCE, kTagResult, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    std::int64_t unit = -1;
    if (count >= static_cast<int>(sizeof unit)) std::memcpy(&unit, buf.data(), sizeof unit);
    if (unit >= 0 && static_cast<std::size_t>(unit) < n)
      deliver(static_cast<std::size_t>(unit), std::string(buf.begin() + sizeof unit, buf.end()));
    const std::int64_t give = claim();
    MPI_Send(&give, 1, MPI_INT64_T, st.MPI_SOURCE, kTagWork, MPI_COMM_WORLD);
    if (give < 0) --active;
  }
  std::vector<char>().swap(buf);
  local.join();
  if (local_error) std::rethrow_exception(local_error);
  consume_ready();  // the results that arrived after rank 0's last unit
#endif
}

}  // namespace kvscope::sim
