// Dataset manifests (docs/datasets.md): reading, writing, and lists / globs of traces.
#include "kvscope/trace/dataset.hpp"

#include <glob.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <system_error>

#include "kvscope/trace/untrusted.hpp"

namespace kvscope::trace {

namespace fs = std::filesystem;

const std::vector<std::string>& manifest_columns() {
  static const std::vector<std::string> cols = {"sample",           "trace",  "family",      "context_tokens",
                                                "decode_steps",     "images", "image_seeds", "question",
                                                "reference_answer", "answer", "correct",     "task",
                                                "length",           "seed",   "index",       "model",
                                                "capture_command"};
  return cols;
}

std::string Dataset::value(std::size_t i, const std::string& column) const {
  const auto it = std::find(columns.begin(), columns.end(), column);
  if (it == columns.end() || i >= samples.size()) return "";
  const auto k = static_cast<std::size_t>(it - columns.begin());
  return k < samples[i].values.size() ? samples[i].values[k] : "";
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos && (s.empty() || (s.front() != ' ' && s.back() != ' ')))
    return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

namespace {

// Splits RFC 4180 text into records of fields. Throws TraceError naming `file` and the line.
std::vector<std::vector<std::string>> parse_csv(const std::string& text, const std::string& file) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> row;
  std::string field;
  bool quoted = false, any = false;
  std::size_t line = 1, row_line = 1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        if (c == '\n') ++line;
        field += c;
      }
      continue;
    }
    if (c == '"' && field.empty()) {
      quoted = any = true;
    } else if (c == ',') {
      row.push_back(std::move(field));
      field.clear();
      any = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      if (any || !field.empty()) {
        row.push_back(std::move(field));
        rows.push_back(std::move(row));
        if (rows.size() > kMaxDatasetSamples + 1) {
          throw TraceError(ErrorKind::kFormat, file, "",
                           "more than " + std::to_string(kMaxDatasetSamples) + " samples");
        }
      }
      row.clear();
      field.clear();
      any = false;
      row_line = ++line;
    } else {
      field += c;
      any = true;
    }
  }
  if (quoted)
    throw TraceError(ErrorKind::kFormat, file, "",
                     "line " + std::to_string(row_line) + ": unterminated quote");
  if (any || !field.empty()) {
    row.push_back(std::move(field));
    rows.push_back(std::move(row));
  }
  return rows;
}

std::string stem_of(const std::string& path) { return fs::path(path).stem().string(); }

}  // namespace

Dataset read_manifest(const std::string& dir) {
  const std::string file = (fs::path(dir) / kManifestName).string();
  std::error_code ec;
  if (!fs::exists(file, ec))
    throw TraceError(ErrorKind::kIo, file, "", "no such file (a dataset directory has a manifest.csv)");
  require_regular_file(file);
  if (fs::file_size(file, ec) > kMaxManifestBytes)
    throw TraceError(ErrorKind::kFormat, file, "", "larger than 256 MiB: not a manifest");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw TraceError(ErrorKind::kIo, file, "", "cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.find('\0') != std::string::npos)
    throw TraceError(ErrorKind::kFormat, file, "", "binary data: not a CSV manifest");
  std::vector<std::vector<std::string>> rows = parse_csv(text, file);
  if (rows.empty()) throw TraceError(ErrorKind::kFormat, file, "", "empty (no header line)");
  Dataset ds;
  ds.source = dir;
  ds.has_manifest = true;
  ds.columns = rows.front();
  auto col = [&](const char* name) {
    const auto it = std::find(ds.columns.begin(), ds.columns.end(), name);
    if (it == ds.columns.end())
      throw TraceError(ErrorKind::kFormat, file, "", std::string("no '") + name + "' column in the header");
    return static_cast<std::size_t>(it - ds.columns.begin());
  };
  const std::size_t c_sample = col("sample"), c_trace = col("trace");
  std::set<std::string> seen;
  for (std::size_t r = 1; r < rows.size(); ++r) {
    const std::string where = "row " + std::to_string(r);
    if (rows[r].size() != ds.columns.size()) {
      throw TraceError(ErrorKind::kFormat, file, "",
                       where + ": " + std::to_string(rows[r].size()) + " fields, the header has " +
                           std::to_string(ds.columns.size()));
    }
    DatasetSample s;
    s.sample = rows[r][c_sample];
    s.trace = rows[r][c_trace];
    if (s.sample.empty()) throw TraceError(ErrorKind::kFormat, file, "", where + ": empty sample id");
    if (s.trace.empty()) throw TraceError(ErrorKind::kFormat, file, "", where + ": empty trace");
    if (!seen.insert(s.sample).second)
      throw TraceError(ErrorKind::kFormat, file, "", where + ": sample id '" + s.sample + "' appears twice");
    s.path = fs::path(s.trace).is_absolute() ? s.trace : (fs::path(dir) / s.trace).string();
    s.values = std::move(rows[r]);
    ds.samples.push_back(std::move(s));
  }
  if (ds.samples.empty()) throw TraceError(ErrorKind::kFormat, file, "", "no samples (only a header line)");
  return ds;
}

Dataset open_dataset(const std::string& spec) {
  std::error_code ec;
  if (fs::is_directory(spec, ec)) return read_manifest(spec);
  Dataset ds;
  ds.source = spec;
  ds.columns = {"sample", "trace"};
  std::vector<std::string> files;
  std::stringstream items(spec);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) throw TraceError(ErrorKind::kIo, spec, "", "empty item in the list of traces");
    if (item.find_first_of("*?[") != std::string::npos) {
      glob_t g{};
      const int rc = glob(item.c_str(), 0, nullptr, &g);
      std::vector<std::string> hits;
      for (std::size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) hits.emplace_back(g.gl_pathv[i]);
      globfree(&g);
      if (hits.empty()) throw TraceError(ErrorKind::kIo, item, "", "the pattern matches no file");
      std::sort(hits.begin(), hits.end());
      files.insert(files.end(), hits.begin(), hits.end());
    } else {
      if (fs::is_directory(item, ec))
        throw TraceError(ErrorKind::kIo, item, "", "a directory inside a list (give DIR alone, or DIR/*.h5)");
      files.push_back(item);
    }
    if (files.size() > kMaxDatasetSamples)
      throw TraceError(ErrorKind::kIo, spec, "",
                       "more than " + std::to_string(kMaxDatasetSamples) + " traces");
  }
  if (files.empty()) throw TraceError(ErrorKind::kIo, spec, "", "no trace given");
  std::map<std::string, int> count;
  for (const std::string& f : files) ++count[stem_of(f)];
  for (std::size_t i = 0; i < files.size(); ++i) {
    DatasetSample s;
    s.sample = stem_of(files[i]);
    if (count[s.sample] > 1) s.sample.append(1, '#').append(std::to_string(i));
    s.trace = s.path = files[i];
    s.values = {s.sample, s.trace};
    ds.samples.push_back(std::move(s));
  }
  return ds;
}

void write_manifest(const std::string& dir, const std::vector<std::string>& columns,
                    const std::vector<std::vector<std::string>>& rows) {
  const std::string file = (fs::path(dir) / kManifestName).string();
  const std::string partial = file + ".partial";
  {
    std::ofstream os(partial, std::ios::binary | std::ios::trunc);
    if (!os) throw TraceError(ErrorKind::kIo, file, "", "cannot create " + partial);
    for (std::size_t k = 0; k < columns.size(); ++k) os << (k ? "," : "") << csv_field(columns[k]);
    os << "\n";
    for (const auto& row : rows) {
      for (std::size_t k = 0; k < row.size(); ++k) os << (k ? "," : "") << csv_field(row[k]);
      os << "\n";
    }
    os.close();
    if (os.fail()) {
      std::remove(partial.c_str());
      throw TraceError(ErrorKind::kIo, file, "", "write failed (disk full?) on " + partial);
    }
  }
  std::error_code ec;
  fs::rename(partial, file, ec);
  if (ec) {
    std::remove(partial.c_str());
    throw TraceError(ErrorKind::kIo, file, "", "cannot rename " + partial + " to it: " + ec.message());
  }
}

}  // namespace kvscope::trace
