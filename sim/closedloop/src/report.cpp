// Closed-loop results: table, CSV, HDF5 (kvscope/closedloop/report.hpp).
#include "kvscope/closedloop/report.hpp"

#include <hdf5.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace kvscope::closedloop {

namespace {

const char* kModalityNames[4] = {"text", "vision", "audio", "special"};
const char* kFamilyColumns[4] = {"fine_grained", "counting", "two_image", "text_only"};

std::string fmt(double x, int prec) {
  if (std::isnan(x)) return "nan";
  std::ostringstream s;
  s << std::fixed << std::setprecision(prec) << x;
  return s.str();
}

// Numeric columns shared by the CSV and the HDF5 file.
struct Column {
  std::string name;
  std::function<double(const PointStats&)> get;
};

std::vector<Column> columns() {
  std::vector<Column> c = {
      {"samples", [](const PointStats& p) { return static_cast<double>(p.samples); }},
      {"keep", [](const PointStats& p) { return p.keep; }},
      {"accuracy", [](const PointStats& p) { return p.accuracy; }},
  };
  for (int f = 0; f < 4; ++f)
    c.push_back({std::string("accuracy_") + kFamilyColumns[f],
                 [f](const PointStats& p) { return p.family_accuracy[static_cast<std::size_t>(f)]; }});
  for (int f = 0; f < 4; ++f)
    c.push_back({std::string("samples_") + kFamilyColumns[f], [f](const PointStats& p) {
                   return static_cast<double>(p.family_samples[static_cast<std::size_t>(f)]);
                 }});
  c.push_back({"kl", [](const PointStats& p) { return p.kl; }});
  c.push_back({"agreement", [](const PointStats& p) { return p.agreement; }});
  c.push_back({"bytes_end", [](const PointStats& p) { return p.bytes_end; }});
  for (int m = 0; m < 4; ++m)
    c.push_back({std::string("bytes_end_") + kModalityNames[m],
                 [m](const PointStats& p) { return p.bytes_end_modality[static_cast<std::size_t>(m)]; }});
  c.push_back({"bytes_peak", [](const PointStats& p) { return p.bytes_peak; }});
  c.push_back({"bytes_full_end", [](const PointStats& p) { return p.bytes_full_end; }});
  c.push_back({"bytes_ratio", [](const PointStats& p) { return p.bytes_ratio; }});
  c.push_back({"bytes_match", [](const PointStats& p) { return p.bytes_match ? 1.0 : 0.0; }});
  c.push_back({"warned_samples", [](const PointStats& p) { return static_cast<double>(p.warnings); }});
  c.push_back({"seconds", [](const PointStats& p) { return p.seconds; }});
  c.push_back(
      {"samples_per_s", [](const PointStats& p) { return p.seconds > 0 ? p.samples / p.seconds : 0.0; }});
  return c;
}

void check_h5(bool ok, const std::string& path, const char* what) {
  if (!ok) throw std::runtime_error(path + ": HDF5 error writing " + what);
}

}  // namespace

void write_table(std::ostream& os, const std::vector<PointStats>& points) {
  os << std::left << std::setw(22) << "policy" << std::setw(8) << "budget" << std::right << std::setw(7)
     << "acc" << std::setw(7) << "fine" << std::setw(7) << "count" << std::setw(7) << "two" << std::setw(7)
     << "text" << std::setw(9) << "KL" << std::setw(7) << "same" << std::setw(11) << "bytes" << std::setw(7)
     << "ratio" << std::setw(10) << "vision B" << std::setw(9) << "smp/s"
     << "\n";
  for (const auto& p : points) {
    os << std::left << std::setw(22) << p.policy << std::setw(8) << p.budget << std::right << std::setw(7)
       << fmt(p.accuracy, 3);
    for (double a : p.family_accuracy) os << std::setw(7) << fmt(a, 3);
    os << std::setw(9) << fmt(p.kl, 4) << std::setw(7) << fmt(p.agreement, 2) << std::setw(11)
       << fmt(p.bytes_end, 0) << std::setw(7) << fmt(p.bytes_ratio, 3) << std::setw(10)
       << fmt(p.bytes_end_modality[1], 0) << std::setw(9)
       << fmt(p.seconds > 0 ? p.samples / p.seconds : 0.0, 1) << (p.bytes_match ? "" : "  BYTES MISMATCH")
       << "\n";
  }
}

void write_csv(const std::string& path, const std::vector<PointStats>& points) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    if (!f) throw std::runtime_error("cannot write " + path);
    const auto cols = columns();
    f << "policy,budget";
    for (const auto& c : cols) f << "," << c.name;
    f << "\n" << std::setprecision(10);
    for (const auto& p : points) {
      f << p.policy << "," << p.budget;
      for (const auto& c : cols) f << "," << c.get(p);
      f << "\n";
    }
    if (!f) throw std::runtime_error("cannot write " + path);
  }
  std::filesystem::rename(tmp, path);
}

void write_hdf5(const std::string& path, const EvalRunInfo& info, const std::vector<PointStats>& points) {
  const std::string tmp = path + ".tmp";
  const hid_t file = H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  check_h5(file >= 0, path, "the file");
  const hsize_t n = points.size();
  const hid_t space = H5Screate_simple(1, &n, nullptr);
  const hid_t str = H5Tcopy(H5T_C_S1);
  H5Tset_size(str, H5T_VARIABLE);
  H5Tset_cset(str, H5T_CSET_UTF8);
  const hid_t group = H5Gcreate2(file, "closed_loop", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  bool ok = group >= 0;
  auto string_attr = [&](const char* name, const std::string& value) {
    const hid_t s = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(group, name, str, s, H5P_DEFAULT, H5P_DEFAULT);
    const char* v = value.c_str();
    ok = ok && a >= 0 && H5Awrite(a, str, &v) >= 0;
    H5Aclose(a);
    H5Sclose(s);
  };
  auto int_attr = [&](const char* name, long long value) {
    const hid_t s = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(group, name, H5T_NATIVE_LLONG, s, H5P_DEFAULT, H5P_DEFAULT);
    ok = ok && a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &value) >= 0;
    H5Aclose(a);
    H5Sclose(s);
  };
  string_attr("model", info.model);
  string_attr("creator", "kvcap eval");
  int_attr("samples", info.samples);
  int_attr("max_new", info.max_new);
  int_attr("seed", static_cast<long long>(info.seed));
  if (!info.task.empty()) {
    string_attr("task", info.task);
    int_attr("length", info.length);
    int_attr("question_in_context", info.question_in_context ? 1 : 0);
  }
  auto strings = [&](const char* name, const std::function<const std::string&(const PointStats&)>& get) {
    std::vector<const char*> v;
    for (const auto& p : points) v.push_back(get(p).c_str());
    const hid_t d = H5Dcreate2(group, name, str, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ok = ok && d >= 0 && (n == 0 || H5Dwrite(d, str, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) >= 0);
    H5Dclose(d);
  };
  strings("policy", [](const PointStats& p) -> const std::string& { return p.policy; });
  strings("budget", [](const PointStats& p) -> const std::string& { return p.budget; });
  for (const auto& c : columns()) {
    std::vector<double> v;
    for (const auto& p : points) v.push_back(c.get(p));
    const hid_t d =
        H5Dcreate2(group, c.name.c_str(), H5T_NATIVE_DOUBLE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ok = ok && d >= 0 &&
         (n == 0 || H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) >= 0);
    H5Dclose(d);
  }
  H5Gclose(group);
  H5Tclose(str);
  H5Sclose(space);
  ok = H5Fclose(file) >= 0 && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw std::runtime_error(path + ": HDF5 error while writing the results");
  }
  std::filesystem::rename(tmp, path);
}

namespace {
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}
}  // namespace

void write_answers(const std::string& path, const std::vector<HeldoutSample>& samples,
                   const std::vector<PointStats>& points) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    if (!f) throw std::runtime_error("cannot write " + path);
    f << "sample,family,policy,budget,generated,expected,correct\n";
    for (const auto& p : points) {
      for (std::size_t i = 0; i < p.generated.size() && i < samples.size(); ++i) {
        const HeldoutSample& s = samples[i];
        const bool correct = i < p.correct.size() ? p.correct[i] != 0 : p.generated[i] == s.answer + " <eos>";
        f << s.index << "," << kFamilies[static_cast<std::size_t>(s.family)] << "," << csv_field(p.policy)
          << "," << csv_field(p.budget) << "," << csv_field(p.generated[i]) << "," << csv_field(s.answer)
          << "," << (correct ? 1 : 0) << "\n";
      }
    }
    if (!f) throw std::runtime_error("cannot write " + path);
  }
  std::filesystem::rename(tmp, path);
}

void set_threads(int n) {
  if (n >= 1) omp_set_num_threads(n);
}

}  // namespace kvscope::closedloop
