// CSV results: one row per point x layer x modality, with "all" rows for the aggregates.
// Column meanings: docs/results-format.md.
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <system_error>
#include <utility>

#include "kvscope/sim/report.hpp"

namespace kvscope::sim {

namespace {

// Shortest text that reads back to the same double ("nan", "inf" for non-finite values).
std::string num(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
std::string num(std::int64_t v) { return std::to_string(v); }

// RFC 4180 quoting where needed (policy names come from user INI files).
std::string quoted(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos &&
      (s.empty() || (s.front() != ' ' && s.back() != ' '))) {
    return s;
  }
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

double ratio(std::int64_t kept, std::int64_t full) {
  return full ? static_cast<double>(kept) / static_cast<double>(full) : 1.0;
}

// Flag mode names, ';'-separated: all of them (layer < 0) or those naming `layer`.
std::string flag_names(const PointResult& p, int layer) {
  std::string out;
  for (const CollapseFlag& f : p.flags) {
    bool involved = layer < 0;
    for (int l : f.layers) involved = involved || l == layer;
    if (!involved) continue;
    if (!out.empty()) out += ';';
    out += f.mode;
  }
  return out;
}

// Rows of one aggregate (a layer or the whole point): one per reported modality, then "all".
// Appended columns of traces with roles (results-format 1.2): the four metrics on each query set.
std::string query_set_columns(const Quality& q) {
  std::string out;
  for (const QuerySetQuality& s : q.query_sets) {
    for (double v : {s.output_error, s.attention_recall, s.kl, s.entropy_delta})
      out.append(",").append(num(v));
  }
  return out;
}

// Appended columns (results-format 1.3): the fidelity proxies (docs/metrics.md "Proxies").
std::string proxy_columns(const Quality& q) {
  std::string out;
  for (int i = 0; i < kNumProxies; ++i) out.append(",").append(num(proxy_value(q.proxies, i)));
  return out;
}

void write_rows(std::ostream& os, const PointResult& p, const std::string& layer_name, const HeadResult& r,
                const std::string& flags, const std::vector<int>& modalities, bool query_sets) {
  const Quality& q = r.quality;
  const std::string prefix = quoted(p.policy) + "," + quoted(p.budget) + "," + layer_name + ",";
  // Appended columns (results-format 1.1): the decode-step cache of the layer / point, then the mode;
  // (1.2) the kind of row (policy, bound, search).
  const std::string suffix = std::string(p.pareto ? ",1," : ",0,")
                                 .append(num(p.budget_value))
                                 .append(",")
                                 .append(num(r.bytes_full_end))
                                 .append(",")
                                 .append(num(r.bytes_end))
                                 .append(",")
                                 .append(num(r.bytes_peak))
                                 .append(",")
                                 .append(quoted(p.mode))
                                 .append(",")
                                 .append(quoted(p.kind))
                                 .append(query_sets ? query_set_columns(q) : std::string())
                                 .append(proxy_columns(q))
                                 .append("\n");
  for (int m : modalities) {
    const std::int64_t full = r.bytes_full_modality[m], kept = r.bytes_kept_modality[m];
    os << prefix << kernels::modality_name(m) << ',' << num(full) << ',' << num(kept) << ','
       << num(ratio(kept, full)) << ',' << num(q.output_error) << ',' << num(q.recall_modality[m]) << ','
       << num(q.kl) << ',' << num(q.entropy_delta) << ',' << quoted(flags) << ',' << num(r.tokens[m]) << ','
       << num(r.kept[m]) << ',' << num(r.merged[m]) << ',' << num(r.evicted[m]) << ','
       << num(q.share_before[m]) << ',' << num(q.share_after[m]) << suffix;
  }
  std::int64_t tokens = 0, kept = 0, merged = 0, evicted = 0;
  double share_before = 0, share_after = 0;
  for (int m = 0; m < kModalities; ++m) {
    tokens += r.tokens[m];
    kept += r.kept[m];
    merged += r.merged[m];
    evicted += r.evicted[m];
    share_before += q.share_before[m];
    share_after += q.share_after[m];
  }
  const std::int64_t full = r.bytes_full.total(), kept_bytes = r.bytes_kept.total();
  os << prefix << "all," << num(full) << ',' << num(kept_bytes) << ',' << num(ratio(kept_bytes, full)) << ','
     << num(q.output_error) << ',' << num(q.attention_recall) << ',' << num(q.kl) << ','
     << num(q.entropy_delta) << ',' << quoted(flags) << ',' << num(tokens) << ',' << num(kept) << ','
     << num(merged) << ',' << num(evicted) << ',' << num(share_before) << ',' << num(share_after) << suffix;
}

// Writes `path` through `body` into path + ".partial", renamed when complete; throws ReportError
// (leaving no file) on failure.
void write_file_atomically(const std::string& path, const std::function<void(std::ostream&)>& body) {
  const std::string partial = path + ".partial";
  {
    std::ofstream os(partial, std::ios::binary | std::ios::trunc);
    if (!os) throw ReportError(path, "cannot create " + partial);
    body(os);
    os.close();  // sets failbit when the final flush fails
    if (os.fail()) {
      std::remove(partial.c_str());
      throw ReportError(path, "write failed (disk full?) on " + partial);
    }
  }
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) {
    std::remove(partial.c_str());
    throw ReportError(path, "cannot rename " + partial + " to it: " + ec.message());
  }
}

}  // namespace

void write_csv(std::ostream& os, const std::vector<PointResult>& points, const ResultsMeta& meta) {
  const std::vector<int> modalities = reported_modalities(points, meta);
  os << "policy,budget,layer,modality,bytes_full,bytes_kept,bytes_ratio,output_error,attention_recall,kl,"
        "entropy_delta,flags,tokens,kept,merged,evicted,share_before,share_after,pareto,budget_value,"
        "bytes_full_end,bytes_end,bytes_peak,mode,kind";
  if (meta.has_roles) {
    for (int k = 0; k < kQuerySets; ++k) {
      const std::string set = query_set_name(k);
      os << ",output_error_" << set << ",attention_recall_" << set << ",kl_" << set << ",entropy_delta_"
         << set;
    }
  }
  for (int i = 0; i < kNumProxies; ++i) os << ',' << proxy_name(i);
  os << "\n";
  for (const PointResult& p : points) {
    for (const LayerResult& l : p.layers) {
      write_rows(os, p, std::to_string(l.layer), l.total, flag_names(p, l.layer), modalities, meta.has_roles);
    }
    write_rows(os, p, "all", p.total, flag_names(p, -1), modalities, meta.has_roles);
  }
}

std::string format_csv(const std::vector<PointResult>& points, const ResultsMeta& meta) {
  std::ostringstream os;
  write_csv(os, points, meta);
  return os.str();
}

void write_csv(const std::string& path, const std::vector<PointResult>& points, const ResultsMeta& meta) {
  write_file_atomically(path, [&](std::ostream& os) { write_csv(os, points, meta); });
}

ResultsColumn& ResultsTable::add(std::string column, ResultsColumn::Type type, std::string description) {
  ResultsColumn c;
  c.name = std::move(column);
  c.type = type;
  c.description = std::move(description);
  columns.push_back(std::move(c));
  return columns.back();
}

ResultsColumn* ResultsTable::find(const std::string& column) {
  return const_cast<ResultsColumn*>(std::as_const(*this).find(column));
}

const ResultsColumn* ResultsTable::find(const std::string& column) const {
  for (const ResultsColumn& c : columns)
    if (c.name == column) return &c;
  return nullptr;
}

ResultsTable ResultsTable::materialized() const {
  if (!stream) return *this;
  ResultsTable out;
  out.name = name;
  out.description = description;
  out.columns = columns;
  stream([&](const ResultsTable& block) {
    for (std::size_t k = 0; k < out.columns.size(); ++k) {
      ResultsColumn& c = out.columns[k];
      const ResultsColumn& b = block.columns[k];
      c.f64.insert(c.f64.end(), b.f64.begin(), b.f64.end());
      c.i64.insert(c.i64.end(), b.i64.begin(), b.i64.end());
      c.str.insert(c.str.end(), b.str.begin(), b.str.end());
    }
  });
  return out;
}

void write_table_csv(const std::string& path, const ResultsTable& table) {
  write_file_atomically(path, [&](std::ostream& os) {
    for (std::size_t k = 0; k < table.columns.size(); ++k)
      os << (k ? "," : "") << quoted(table.columns[k].name);
    os << "\n";
    auto rows = [&](const ResultsTable& t) {
      const std::size_t n = t.rows();
      for (std::size_t r = 0; r < n; ++r) {
        for (std::size_t k = 0; k < t.columns.size(); ++k) {
          const ResultsColumn& c = t.columns[k];
          if (k) os << ',';
          if (c.type == ResultsColumn::Type::kF64)
            os << num(c.f64[r]);
          else if (c.type == ResultsColumn::Type::kI64)
            os << num(c.i64[r]);
          else
            os << quoted(c.str[r]);
        }
        os << '\n';
      }
    };
    if (table.stream)
      table.stream(rows);
    else
      rows(table);
  });
}

}  // namespace kvscope::sim
