// Kernel timeline: the trace's /profile ranges (NVTX or steady-clock, one row per nesting depth)
// and CUPTI kernel / memcpy records (one row per stream), zoomable, with hover details and
// per-name statistics.
#include <imgui.h>

#include <algorithm>
#include <limits>
#include <map>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

struct Stat {
  int count = 0;
  double total = 0, min = std::numeric_limits<double>::max(), max = 0;
};

std::string ns_text(double ns) {
  if (ns >= 1e9) return w::fmt("%.3f s", ns / 1e9);
  if (ns >= 1e6) return w::fmt("%.3f ms", ns / 1e6);
  if (ns >= 1e3) return w::fmt("%.2f us", ns / 1e3);
  return w::fmt("%.0f ns", ns);
}

class TimelinePanel : public Panel {
 public:
  const char* name() const override { return "timeline"; }
  const char* title() const override { return "Kernel timeline"; }

  void draw(ViewContext& ctx) override {
    if (!ctx.model.has_trace()) {
      ImGui::TextUnformatted("No trace loaded.");
      return;
    }
    const trace::Profile& prof = ctx.model.profile();
    if (prof.ranges.empty() && prof.kernels.empty()) {
      ImGui::TextWrapped("This trace has no /profile records (capture with kvcap run --profile).");
      return;
    }
    std::int64_t t0 = std::numeric_limits<std::int64_t>::max(), t1 = std::numeric_limits<std::int64_t>::min();
    int max_depth = 0;
    std::vector<std::int64_t> streams;
    for (const auto& r : prof.ranges)
      t0 = std::min(t0, r.start_ns), t1 = std::max(t1, r.end_ns), max_depth = std::max(max_depth, r.depth);
    for (const auto& k : prof.kernels) {
      t0 = std::min(t0, k.start_ns), t1 = std::max(t1, k.end_ns);
      if (std::find(streams.begin(), streams.end(), k.stream) == streams.end()) streams.push_back(k.stream);
    }
    const double span = std::max<double>(1.0, static_cast<double>(t1 - t0));
    if (view1_ <= view0_) view0_ = 0, view1_ = span;
    ImGui::Text("%zu ranges, %zu kernel/memcpy records over %s. Wheel: zoom, drag: pan, double-click: reset.",
                prof.ranges.size(), prof.kernels.size(), ns_text(span).c_str());

    const float row_h = 20, label_w = 110;
    const int rows = (prof.ranges.empty() ? 0 : max_depth + 1) + static_cast<int>(streams.size());
    const ImVec2 p = ImGui::GetCursorScreenPos();
    const float width = ImGui::GetContentRegionAvail().x;
    const float height = 22 + rows * row_h;
    ImGui::InvisibleButton("##timeline", ImVec2(width, height));
    const bool hovered = ImGui::IsItemHovered() && !ctx.headless;
    ImDrawList* dl = ImGui::GetWindowDrawList();
    const float x0 = p.x + label_w, xw = width - label_w - 4;
    auto to_x = [&](std::int64_t ns) {
      return x0 + static_cast<float>((static_cast<double>(ns - t0) - view0_) / (view1_ - view0_)) * xw;
    };
    ImGuiIO& io = ImGui::GetIO();
    if (hovered) {
      const double at = view0_ + (io.MousePos.x - x0) / xw * (view1_ - view0_);
      if (io.MouseWheel != 0) {
        const double f = io.MouseWheel > 0 ? 0.8 : 1.25;
        view0_ = at - (at - view0_) * f;
        view1_ = at + (view1_ - at) * f;
      }
      if (ImGui::IsMouseDragging(ImGuiMouseButton_Left)) {
        const double d = io.MouseDelta.x / xw * (view1_ - view0_);
        view0_ -= d;
        view1_ -= d;
      }
      if (ImGui::IsMouseDoubleClicked(0)) view0_ = 0, view1_ = span;
    }
    dl->AddRectFilled(ImVec2(x0, p.y), ImVec2(x0 + xw, p.y + height), IM_COL32(25, 25, 30, 255));
    for (int i = 0; i <= 5; ++i) {  // time axis
      const double ns = view0_ + (view1_ - view0_) * i / 5.0;
      const float x = x0 + xw * static_cast<float>(i) / 5.0f;
      dl->AddLine(ImVec2(x, p.y), ImVec2(x, p.y + height), IM_COL32(60, 60, 60, 255));
      dl->AddText(ImVec2(x + 2, p.y + 2), IM_COL32(180, 180, 180, 255), ns_text(ns).c_str());
    }
    dl->PushClipRect(ImVec2(x0, p.y), ImVec2(x0 + xw, p.y + height), true);
    std::string tip;
    auto bar = [&](int row, std::int64_t s, std::int64_t e, const std::string& name, ImU32 color,
                   const std::string& detail) {
      const float y = p.y + 22 + row * row_h;
      const ImVec2 a(to_x(s), y), b(std::max(to_x(e), to_x(s) + 1.0f), y + row_h - 2);
      if (b.x < x0 || a.x > x0 + xw) return;
      dl->AddRectFilled(a, b, color);
      if (b.x - a.x > 40)
        dl->AddText(ImVec2(std::max(a.x, x0) + 2, a.y + 2), IM_COL32(0, 0, 0, 255), name.c_str());
      if (hovered && io.MousePos.x >= a.x && io.MousePos.x <= b.x && io.MousePos.y >= a.y &&
          io.MousePos.y <= b.y) {
        tip = name + "\n" + ns_text(static_cast<double>(e - s)) + "  (start +" +
              ns_text(static_cast<double>(s - t0)) + ")" + detail;
      }
    };
    for (const auto& r : prof.ranges) {
      bar(r.depth, r.start_ns, r.end_ns, r.name, w::series_color(r.depth + 3),
          "\nrange, depth " + std::to_string(r.depth));
    }
    const int first_stream_row = prof.ranges.empty() ? 0 : max_depth + 1;
    for (const auto& k : prof.kernels) {
      const int row = first_stream_row +
                      static_cast<int>(std::find(streams.begin(), streams.end(), k.stream) - streams.begin());
      std::string detail =
          "\n" + k.kind + ", stream " + std::to_string(k.stream) + ", device " + std::to_string(k.device);
      if (k.kind == "kernel") {
        detail += "\ngrid " + std::to_string(k.grid[0]) + "x" + std::to_string(k.grid[1]) + "x" +
                  std::to_string(k.grid[2]) + ", block " + std::to_string(k.block[0]) + "x" +
                  std::to_string(k.block[1]) + "x" + std::to_string(k.block[2]);
      } else {
        detail.append("\n").append(w::bytes_text(static_cast<double>(k.bytes)));
      }
      bar(row, k.start_ns, k.end_ns, k.name,
          k.kind == "kernel" ? IM_COL32(120, 200, 120, 255) : IM_COL32(220, 180, 80, 255), detail);
    }
    dl->PopClipRect();
    for (int d = 0; d <= max_depth && !prof.ranges.empty(); ++d) {
      dl->AddText(ImVec2(p.x, p.y + 24 + d * row_h), IM_COL32(220, 220, 220, 255),
                  w::label("ranges d", d).c_str());
    }
    for (std::size_t s = 0; s < streams.size(); ++s) {
      dl->AddText(ImVec2(p.x, p.y + 24 + (first_stream_row + static_cast<int>(s)) * row_h),
                  IM_COL32(220, 220, 220, 255), w::label("stream ", streams[s]).c_str());
    }
    if (!tip.empty()) ImGui::SetTooltip("%s", tip.c_str());
    stats(prof);
  }

 private:
  static void stats(const trace::Profile& prof) {
    std::map<std::string, Stat> by_name;
    auto add = [&](const std::string& n, std::int64_t s, std::int64_t e) {
      Stat& st = by_name[n];
      const double d = static_cast<double>(e - s);
      ++st.count;
      st.total += d;
      st.min = std::min(st.min, d);
      st.max = std::max(st.max, d);
    };
    for (const auto& r : prof.ranges) add("[range] " + r.name, r.start_ns, r.end_ns);
    for (const auto& k : prof.kernels) add(k.name, k.start_ns, k.end_ns);
    std::vector<std::pair<std::string, Stat>> rows(by_name.begin(), by_name.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.total > b.second.total; });
    ImGui::Spacing();
    if (!ImGui::BeginTable("stats", 6,
                           ImGuiTableFlags_Borders | ImGuiTableFlags_SizingFixedFit | ImGuiTableFlags_ScrollY,
                           ImVec2(0, ImGui::GetContentRegionAvail().y))) {
      return;
    }
    ImGui::TableSetupScrollFreeze(0, 1);
    for (const char* h : {"name", "count", "total", "mean", "min", "max"}) ImGui::TableSetupColumn(h);
    ImGui::TableHeadersRow();
    for (const auto& [n, st] : rows) {
      ImGui::TableNextRow();
      ImGui::TableNextColumn();
      ImGui::TextUnformatted(n.c_str());
      ImGui::TableNextColumn();
      ImGui::Text("%d", st.count);
      for (double v : {st.total, st.total / st.count, st.min, st.max}) {
        ImGui::TableNextColumn();
        ImGui::TextUnformatted(ns_text(v).c_str());
      }
    }
    ImGui::EndTable();
  }

  double view0_ = 0, view1_ = 0;  // visible window, ns after the first record
};

}  // namespace

std::unique_ptr<Panel> make_timeline_panel() { return std::make_unique<TimelinePanel>(); }

}  // namespace kvscope::viewer
