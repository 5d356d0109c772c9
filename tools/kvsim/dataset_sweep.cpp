#include "dataset_sweep.hpp"

#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include "kvscope/cli/progress.hpp"
#include "kvscope/sim/dataset.hpp"
#include "kvscope/sim/info.hpp"
#include "kvscope/sim/report.hpp"
#include "kvscope/sim/results_reader.hpp"
#include "kvscope/trace/dataset.hpp"
#include "kvscope/trace/untrusted.hpp"
#include "work_pool.hpp"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace kvscope::sim {

namespace {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in && !in.eof()) throw std::runtime_error(path + ": cannot read back the unit's results");
  return ss.str();
}

// A temporary directory of this process, removed with everything in it by the destructor.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "kvsim-dataset-XXXXXX").string();
    if (!mkdtemp(pattern.data()))
      throw std::runtime_error("cannot create a temporary directory in " +
                               fs::temp_directory_path().string());
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

}  // namespace

void add_dataset_options(po::options_description& opts) {
  opts.add_options()(
      "dataset", po::value<std::string>(),
      "replay every trace of a dataset instead of --trace: a directory with manifest.csv (kvcap run "
      "--samples), "
      "or a comma-separated list of traces and globs (DIR/*.h5); results per sample and aggregated "
      "(docs/datasets.md); spread over the ranks under mpirun / srun")(
      "by", po::value<std::string>()->default_value(""),
      "with --dataset: also aggregate per group of samples: family, length (power-of-two buckets of context "
      "tokens) or any manifest column, comma-separated")(
      "bootstrap", po::value<int>()->default_value(1000),
      "with --dataset: bootstrap resamples of the confidence intervals (0 = none; at most 100000)")(
      "seed", po::value<unsigned long long>()->default_value(0), "with --dataset: bootstrap seed")(
      "confidence", po::value<double>()->default_value(0.95, "0.95"), "with --dataset: interval level")(
      "top", po::value<int>()->default_value(3),
      "with --dataset: policies listed per budget in the summary (lowest mean output error first, among "
      "those whose bytes are within the budget)")(
      "skip-bad",
      "with --dataset: a trace that cannot be replayed is recorded as failed (/samples status) and the rest "
      "completes (default: the sweep fails naming it)")(
      "policy-groups", po::value<int>()->default_value(1),
      "with --dataset: work units are trace x policy group; split the policies into this many groups (the "
      "bound and search rows get a unit of their own)")("samples-csv", po::value<std::string>(),
                                                        "with --dataset: write the per-sample table (one row "
                                                        "per sample x point x layer x modality) to this CSV; "
                                                        "--csv writes the aggregate table");
}

int run_dataset_sweep(const std::string& name, const po::variables_map& vm,
                      const std::vector<SweepPoint>& points, const SweepOptions& options,
                      const std::string& argv_line, int threads) {
  auto fail = [&](const std::string& msg) {
    std::cerr << name << ": " << trace::one_line(msg) << "\n";
    return 2;
  };
  std::unique_ptr<WorkPool> pool;
  try {
    pool = std::make_unique<WorkPool>();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  WorkPool& wp = *pool;
  for (const char* single : {"trace", "layers", "explain"}) {
    if (vm.count(single)) return fail(std::string("--") + single + " is for one trace, not with --dataset");
  }
  const int resamples = vm["bootstrap"].as<int>(), top = vm["top"].as<int>(),
            groups = vm["policy-groups"].as<int>();
  const double confidence = vm["confidence"].as<double>();
  if (resamples < 0 || resamples > 100000) return fail("--bootstrap must be in 0..100000");
  if (top < 1 || top > 1000) return fail("--top must be in 1..1000");
  if (!(confidence > 0 && confidence < 1)) return fail("--confidence must be in (0, 1)");
  if (groups < 1 || groups > 1000) return fail("--policy-groups must be in 1..1000");
  const std::vector<std::string> by = split_list(vm["by"].as<std::string>());
  // Wall and CPU seconds (this process, all its threads) of each phase: on a shared machine the CPU
  // seconds are the figure that compares across loads.
  struct Stamp {
    double wall = 0, cpu = 0;
    static Stamp now() {
      timespec ts{};
      clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
      return {std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(),
              static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec)};
    }
  };
  auto since = [](const Stamp& a) {
    const Stamp b = Stamp::now();
    return Stamp{b.wall - a.wall, b.cpu - a.cpu};
  };
  Stamp t = Stamp::now();
  Stamp t_manifest, t_units, t_gather, t_aggregate, t_write;
  trace::Dataset dataset;
  try {
    dataset = trace::open_dataset(vm["dataset"].as<std::string>());
    t_manifest = since(t);
    check_groupings(dataset, by);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  const bool skip_bad = vm.count("skip-bad") != 0;

  // Policy groups: contiguous runs of the points' distinct policies (all budgets of a policy together).
  std::vector<std::string> names;
  for (const SweepPoint& p : points)
    if (std::find(names.begin(), names.end(), p.policy.name) == names.end()) names.push_back(p.policy.name);
  const std::size_t G = std::min<std::size_t>(static_cast<std::size_t>(groups), names.size());
  const std::size_t per = (names.size() + G - 1) / G;
  std::vector<std::vector<SweepPoint>> group_points(G);
  for (const SweepPoint& p : points) {
    const auto k =
        static_cast<std::size_t>(std::find(names.begin(), names.end(), p.policy.name) - names.begin());
    group_points[k / per].push_back(p);
  }
  const bool extra = G > 1 && (options.bound.enabled || options.alloc_search.enabled);
  const std::size_t units_per_sample = G + (extra ? 1 : 0);
  const std::size_t S = dataset.samples.size(), U = S * units_per_sample;

  std::unique_ptr<TempDir> tmp;
  try {
    tmp = std::make_unique<TempDir>();
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  // One work unit: sample u / units_per_sample, group u % units_per_sample, as a results file's bytes.
  auto work = [&](std::size_t u) -> std::string {
    const trace::DatasetSample& s = dataset.samples[u / units_per_sample];
    const std::size_t g = u % units_per_sample;
    try {
      trace::check_trace_file(s.path);
      trace::TraceReader reader(s.path);
      require_replayable(reader, name);
      SweepOptions so = options;
      so.progress = nullptr;
      std::vector<SweepPoint> pts;
      if (g < G) {
        pts = group_points[g];
        if (G > 1) so.bound.enabled = so.alloc_search.enabled = false;
      } else {
        pts = points;
        so.extra_rows_only = true;
      }
      const SweepOutput out = run_sweep(reader, pts, so);
      std::string warnings;
      for (const auto& w : out.warnings) warnings.append(trace::one_line(w)).append(1, '\n');
      const ResultsMeta meta = sweep_results_meta(summarize(reader), out, argv_line);
      const std::string file = tmp->file("unit-" + std::to_string(u) + ".h5");
      write_hdf5(file, out.points, meta);
      // 'K', the warnings' length (8 bytes), the warnings, the results file.
      const std::uint64_t wn = warnings.size();
      std::string bytes(1, 'K');
      bytes.append(reinterpret_cast<const char*>(&wn), sizeof wn).append(warnings).append(read_bytes(file));
      fs::remove(file);
      return bytes;
    } catch (const std::exception& e) {
      return std::string(1, 'E').append(trace::one_line(e.what()));
    }
  };
  BootstrapOptions bo;
  bo.resamples = resamples;
  bo.seed = vm["seed"].as<unsigned long long>();
  bo.confidence = confidence;
  std::unique_ptr<DatasetAggregator> agg;
  if (wp.root()) agg = std::make_unique<DatasetAggregator>(dataset, by, bo, options.thresholds);
  std::unique_ptr<cli::ProgressBar> bar;
  if (wp.root()) bar = std::make_unique<cli::ProgressBar>(name, U, !vm.count("quiet"));
  std::size_t received = 0;
  // Samples from their units, folded into the aggregates as soon as every unit before them has arrived
  // (consume: in unit order, never while this rank's work runs, so it may use HDF5); a unit's bytes
  // and its decoded points are dropped once folded.
  std::map<std::string, std::pair<std::string, int>> warned;  // point -> (first warning, samples)
  SampleResult pending;                                       // the sample whose units are being consumed
  std::string first_failure;  // without --skip-bad: the first failed sample, in sample order
  auto consume = [&](std::size_t u, std::string&& bytes) {
    const Stamp start = Stamp::now();
    timespec c0{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    const std::size_t i = u / units_per_sample, g = u % units_per_sample;
    SampleResult& r = pending;
    if (g == 0) {
      r = SampleResult{};
      r.ok = true;
    }
    if (bytes.empty() || bytes[0] == 'E') {
      if (r.ok) r.error = bytes.empty() ? "not run (the sweep stopped)" : bytes.substr(1);
      r.ok = false;
    } else if (r.ok) {
      try {
        std::uint64_t wn = 0;
        if (bytes.size() < 1 + sizeof wn) throw std::runtime_error("a truncated unit result");
        std::memcpy(&wn, bytes.data() + 1, sizeof wn);
        const std::size_t head = 1 + sizeof wn + static_cast<std::size_t>(wn);
        if (wn > bytes.size() || head > bytes.size()) throw std::runtime_error("a truncated unit result");
        std::stringstream ws(bytes.substr(1 + sizeof wn, static_cast<std::size_t>(wn)));
        for (std::string w; std::getline(ws, w);) {
          // One line per point (the text before the first ':'), with the number of samples that had it.
          const std::string key = w.substr(0, w.find(':'));
          auto [it, fresh] = warned.emplace(key, std::make_pair(dataset.samples[i].sample + ": " + w, 0));
          ++it->second.second;
        }
        const std::string file = tmp->file("read-" + std::to_string(i) + "-" + std::to_string(g) + ".h5");
        {
          std::ofstream os(file, std::ios::binary | std::ios::trunc);
          os.write(bytes.data() + head, static_cast<std::streamsize>(bytes.size() - head));
          if (!os) throw std::runtime_error("cannot write " + file + " (disk full?)");
        }
        std::string().swap(bytes);
        ResultsMeta meta;
        std::vector<PointResult> pts;
        try {
          pts = read_results_hdf5(file, &meta);
        } catch (...) {
          fs::remove(file);
          throw;
        }
        fs::remove(file);
        if (g == 0) r.meta = meta;
        for (auto& p : pts) r.points.push_back(std::move(p));
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("reading back the results of sample ") +
                                 dataset.samples[i].sample + ": " + e.what());
      }
    }
    if (g + 1 == units_per_sample) {
      if (!r.ok && !skip_bad && first_failure.empty()) {
        first_failure = "sample " + dataset.samples[i].sample + ": " + r.error +
                        " (--skip-bad records it as failed and completes the rest)";
      }
      if (first_failure.empty()) agg->add(std::move(r));
      r = SampleResult{};
    }
    const Stamp end = Stamp::now();
    timespec c1{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    t_gather.wall += end.wall - start.wall;
    t_gather.cpu +=
        static_cast<double>(c1.tv_sec - c0.tv_sec) + 1e-9 * static_cast<double>(c1.tv_nsec - c0.tv_nsec);
  };
  t = Stamp::now();
  try {
    wp.run(
        U, threads, work,
        [&](std::size_t, const std::string& r) {
          bar->update(++received);
          return skip_bad || r.empty() || r[0] != 'E';
        },
        consume);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  if (!wp.root()) return 0;
  bar->finish();
  t_units = since(t);
  if (!first_failure.empty()) return fail(first_failure);
  if (agg->added() != S) return fail("the sweep stopped before every sample was replayed");
  for (const auto& [key, w] : warned) {
    std::cerr << name << ": warning: " << w.first
              << (w.second > 1 ? " (and in " + std::to_string(w.second - 1) + " more samples)"
                               : std::string())
              << "\n";
  }
  try {
    t = Stamp::now();
    DatasetResults dr = agg->finish();
    dr.meta.command_line = argv_line;
    t_aggregate = since(t);
    std::cout << format_dataset_summary(dr, top);
    if (const ResultsTable* samples = dr.tables.empty() ? nullptr : &dr.tables.front()) {
      const ResultsColumn *status = samples->find("status"), *error = samples->find("error");
      for (std::size_t i = 0; status && error && i < S; ++i) {
        if (status->str[i] != "ok")
          std::cout << "failed: sample " << dataset.samples[i].sample << ": " << error->str[i] << "\n";
      }
    }
    t = Stamp::now();
    std::vector<std::string> partial;
    for (const char* o : {"output", "csv", "samples-csv"})
      if (vm.count(o)) partial.push_back(vm[o].as<std::string>() + ".partial");
    WorkPool::set_partial_files(partial);
    if (vm.count("output")) {
      write_hdf5(vm["output"].as<std::string>(), dr.points, dr.meta, dr.tables);
      std::cout << "\nresults: " << vm["output"].as<std::string>() << "\n";
    }
    for (const ResultsTable& t : dr.tables) {
      if (t.name == "aggregate" && vm.count("csv")) {
        write_table_csv(vm["csv"].as<std::string>(), t);
        std::cout << "csv (aggregates): " << vm["csv"].as<std::string>() << "\n";
      }
      if (t.name == "sample_points" && vm.count("samples-csv")) {
        write_table_csv(vm["samples-csv"].as<std::string>(), t);
        std::cout << "csv (per sample): " << vm["samples-csv"].as<std::string>() << "\n";
      }
    }
    WorkPool::set_partial_files({});
    t_write = since(t);
    char line[400];
    std::snprintf(
        line, sizeof line,
        "time: %zu units on %d rank%s in %.3f s (rank 0: %.3f CPU-s); serial on rank 0: manifest %.3f s "
        "(%.3f CPU-s), gather %.3f s (%.3f), aggregate %.3f s (%.3f), write %.3f s (%.3f)\n",
        U, wp.size(), wp.size() == 1 ? "" : "s", t_units.wall, t_units.cpu, t_manifest.wall, t_manifest.cpu,
        t_gather.wall, t_gather.cpu, t_aggregate.wall, t_aggregate.cpu, t_write.wall, t_write.cpu);
    std::cout << line;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return 0;
}

}  // namespace kvscope::sim
