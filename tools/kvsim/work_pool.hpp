// The processes of a dataset sweep: the MPI ranks when kvsim runs under mpirun or srun in a build with
// MPI (KVSCOPE_HAVE_MPI), else this process alone. Work units are handed out dynamically; their results
// (opaque byte strings) are consumed on rank 0 in unit order, each as soon as the units before it are
// (docs/datasets.md "MPI").
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace kvscope::sim {

class WorkPool {
 public:
  // Initialises MPI when this process was started by an MPI launcher (OMPI_COMM_WORLD_SIZE, PMI_SIZE or
  // PMIX_RANK in the environment). Throws std::runtime_error when the launcher started several processes
  // but this kvsim was built without MPI (each would sweep everything and write the same file).
  WorkPool();
  ~WorkPool();  // waits for every rank (without spinning), then finalises MPI
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool root() const { return rank_ == 0; }
  static bool built_with_mpi();

  // Runs work(u) once for every unit u in [0, n) on some rank, units handed out one at a time to the rank
  // that asks next (rank 0 works too, in a thread of its own, with `threads` CPU threads). On rank 0,
  // on_result(u, result) is called for each result as it arrives (serialised; it must not use HDF5: the
  // work may be running) and returns false to hand out no further unit (a failed unit without
  // --skip-bad). consume(u, result) then takes the results in unit order, u = 0, 1, 2, ..., each once
  // and never at the same time as work() on this rank (it may use HDF5): from the thread that runs work
  // between two of its units, and after the last unit. A result is kept only until it is consumed, so
  // rank 0 holds the results that arrived ahead of an earlier unit still running (about one per rank),
  // never all of them. The units consumed are a prefix: all n, or fewer when on_result stopped the run.
  void run(std::size_t n, int threads, const std::function<std::string(std::size_t)>& work,
           const std::function<bool(std::size_t, const std::string&)>& on_result,
           const std::function<void(std::size_t, std::string&&)>& consume);

  // Files rank 0 is writing (the .partial names): removed if the process is terminated by SIGTERM or
  // SIGINT (mpirun's answer to a rank that died), with one line on stderr.
  static void set_partial_files(const std::vector<std::string>& paths);

 private:
  int rank_ = 0, size_ = 1;
  bool mpi_ = false;
};

}  // namespace kvscope::sim
