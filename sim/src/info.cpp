#include "kvscope/sim/info.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace kvscope::sim {

TraceSummary summarize(const trace::TraceReader& reader) {
  TraceSummary s;
  s.file = reader.path();
  s.header = reader.header();
  s.num_tokens = reader.num_tokens();
  s.num_decode_steps = reader.num_decode_steps();
  const trace::Tokens& t = reader.tokens();
  std::map<int, SegmentSummary> segs;
  for (std::size_t i = 0; i < t.size(); ++i) {
    const int m = t.modality[i];
    ++s.tokens_per_modality[static_cast<std::size_t>(m)];
    auto [it, fresh] = segs.try_emplace(t.segment[i]);
    SegmentSummary& seg = it->second;
    if (fresh) {
      seg.segment = t.segment[i];
      seg.first_token = i;
    }
    seg.last_token = i;
    ++seg.tokens[static_cast<std::size_t>(m)];
    if (m == static_cast<int>(kernels::Modality::kVision)) {
      seg.grid_rows = std::max(seg.grid_rows, t.grid_row[i] + 1);
      seg.grid_cols = std::max(seg.grid_cols, t.grid_col[i] + 1);
    }
  }
  for (auto& [_, seg] : segs) s.segments.push_back(seg);
  s.has_roles = reader.has_roles();
  for (std::uint8_t r : t.role) ++s.context_roles[r];
  for (std::uint8_t r : reader.decode_tokens().role) ++s.decode_roles[r];
  const auto& g = s.header.geometry;
  s.kv_bytes_per_layer = trace::kv_bytes_per_layer(g, s.header.dtype, s.num_tokens);
  for (int m = 0; m < kernels::kNumModalities; ++m) {
    s.kv_bytes_per_layer_modality[static_cast<std::size_t>(m)] =
        trace::kv_bytes_per_layer(g, s.header.dtype, s.tokens_per_modality[static_cast<std::size_t>(m)]);
  }
  s.kv_bytes_total = s.kv_bytes_per_layer * static_cast<std::uint64_t>(g.num_layers);
  s.kv_bytes_per_token = trace::kv_bytes_per_layer(g, s.header.dtype, 1) * static_cast<std::uint64_t>(g.num_layers);
  const trace::Profile p = reader.read_profile();
  s.profile_kernels = p.kernels.size();
  s.profile_ranges = p.ranges.size();
  s.has_profile = !p.kernels.empty() || !p.ranges.empty();
  return s;
}

namespace {
std::string bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}
}  // namespace

std::string format_summary(const TraceSummary& s) {
  std::ostringstream o;
  const auto& g = s.header.geometry;
  char line[256];
  o << "trace      " << s.file << "\n";
  o << "format     kvscope-trace v" << s.header.version_major << "." << s.header.version_minor
    << (s.header.synthetic ? "  SYNTHETIC (generated, not captured from a model)" : "  captured") << "\n";
  o << "model      " << (g.model_name.empty() ? "(unnamed)" : g.model_name) << "\n";
  auto or_unknown = [](const std::string& x) { return x.empty() ? std::string("(unknown)") : x; };
  o << "creator    " << or_unknown(s.header.creator) << ", created " << or_unknown(s.header.created) << ", device "
    << or_unknown(s.header.device) << "\n";
  std::snprintf(line, sizeof line,
                "geometry   %d layers, %d query heads, %d KV heads (GQA group %d), head_dim %d, rope_theta %g, %s\n",
                g.num_layers, g.num_q_heads, g.num_kv_heads, g.group_size(), g.head_dim, g.rope_theta,
                kernels::dtype_name(s.header.dtype));
  o << line;
  o << "tokens     " << s.num_tokens << " context, " << s.num_decode_steps
    << " decode steps (evaluation queries)\n";
  auto role_counts = [](const std::array<std::size_t, trace::kNumRoles>& c) {
    std::string out;
    for (int r = 0; r < trace::kNumRoles; ++r) {
      out += (r ? ", " : "") + std::to_string(c[static_cast<std::size_t>(r)]) + " " + trace::role_name(r);
    }
    return out;
  };
  o << "roles      " << (s.has_roles ? "" : "none recorded (defaults) ")
    << "context tokens: " << role_counts(s.context_roles) << "; decode steps: " << role_counts(s.decode_roles)
    << "\n\n";

  o << "tokens per modality\n";
  std::snprintf(line, sizeof line, "  %-9s %8s %8s %14s\n", "modality", "tokens", "share", "KV per layer");
  o << line;
  for (int m = 0; m < kernels::kNumModalities; ++m) {
    const auto n = s.tokens_per_modality[static_cast<std::size_t>(m)];
    std::snprintf(line, sizeof line, "  %-9s %8zu %7.1f%% %14s\n", kernels::modality_name(m), n,
                  s.num_tokens ? 100.0 * static_cast<double>(n) / static_cast<double>(s.num_tokens) : 0.0,
                  bytes(static_cast<double>(s.kv_bytes_per_layer_modality[static_cast<std::size_t>(m)])).c_str());
    o << line;
  }
  std::snprintf(line, sizeof line, "  %-9s %8zu %7.1f%% %14s\n", "all", s.num_tokens, 100.0,
                bytes(static_cast<double>(s.kv_bytes_per_layer)).c_str());
  o << line << "\n";

  o << "segments\n";
  std::snprintf(line, sizeof line, "  %-8s %-13s %7s %7s %7s %7s  %s\n", "segment", "tokens", "text", "vision",
                "audio", "special", "grid");
  o << line;
  for (const auto& seg : s.segments) {
    char range[32];
    std::snprintf(range, sizeof range, "%zu..%zu", seg.first_token, seg.last_token);
    std::string grid = seg.grid_rows > 0 ? std::to_string(seg.grid_rows) + "x" + std::to_string(seg.grid_cols) : "-";
    std::snprintf(line, sizeof line, "  %-8d %-13s %7zu %7zu %7zu %7zu  %s\n", seg.segment, range, seg.tokens[0],
                  seg.tokens[1], seg.tokens[2], seg.tokens[3], grid.c_str());
    o << line;
  }
  o << "\nKV cache (full, uncompressed; bytes = 2 x kv_heads x tokens x head_dim x "
    << kernels::dtype_bytes(s.header.dtype) << ")\n";
  std::snprintf(line, sizeof line, "  %-7s %14s %14s %14s %14s %14s\n", "layer", "text", "vision", "audio", "special",
                "all");
  o << line;
  for (int l = 0; l < g.num_layers; ++l) {
    const auto& pm = s.kv_bytes_per_layer_modality;
    std::snprintf(line, sizeof line, "  %-7d %14llu %14llu %14llu %14llu %14llu\n", l,
                  static_cast<unsigned long long>(pm[0]), static_cast<unsigned long long>(pm[1]),
                  static_cast<unsigned long long>(pm[2]), static_cast<unsigned long long>(pm[3]),
                  static_cast<unsigned long long>(s.kv_bytes_per_layer));
    o << line;
  }
  o << "  total   " << bytes(static_cast<double>(s.kv_bytes_total)) << " over " << g.num_layers << " layers ("
    << bytes(static_cast<double>(s.kv_bytes_per_token)) << " per token)\n";
  o << "\nprofile    " << s.profile_kernels << " kernel records, " << s.profile_ranges << " ranges\n";
  return o.str();
}

}  // namespace kvscope::sim
