// Quality curves: output error (or recall, KL) versus bytes ratio for every swept policy, the
// Pareto front highlighted, the oracle-topk rows (kind bound) drawn as the dashed bound and the
// alloc-search rows (kind search) dotted: neither is a policy. A dataset sweep's file (results 1.4) adds
// each point's bootstrap interval over the samples as a vertical bar. Click a point to select it everywhere.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

double metric(const sim::PointResult& p, int which) {
  const sim::Quality& q = p.total.quality;
  return which == 0 ? q.output_error : which == 1 ? q.attention_recall : q.kl;
}

// The interval of the plotted metric, or nullptr when the file has none for the point.
const sim::PointInterval* interval(const std::vector<sim::PointIntervals>& iv, std::size_t i, int which) {
  if (i >= iv.size() || iv[i].n == 0) return nullptr;
  return which == 0 ? &iv[i].output_error : which == 1 ? &iv[i].attention_recall : &iv[i].kl;
}

bool is_bound(const sim::PointResult& p) { return p.kind == "bound"; }
bool is_search(const sim::PointResult& p) { return p.kind == "search"; }

class QualityPanel : public Panel {
 public:
  const char* name() const override { return "quality"; }
  const char* title() const override { return "Quality curves"; }

  void draw(ViewContext& ctx) override {
    const auto& pts = ctx.model.points();
    if (pts.empty()) {
      ImGui::TextWrapped(
          "No results: run kvsim sweep --trace TRACE -o results.h5 and open it with --results.");
      return;
    }
    static const char* metrics[] = {"output error", "attention recall", "KL (nats)"};
    ImGui::SetNextItemWidth(200);
    ImGui::Combo("y axis", &metric_, metrics, 3);
    ImGui::SameLine();
    ImGui::TextDisabled(
        "x: bytes kept / full.  Thick white: Pareto front.  Dashed grey: oracle-topk bound (reads the "
        "evaluation "
        "queries).  Dotted: allocation search.");

    const auto& iv = ctx.model.point_intervals();
    if (!iv.empty()) {
      ImGui::TextDisabled("Bars: %lld %% bootstrap interval of the mean over %lld samples (%s).",
                          static_cast<long long>(std::llround(100 * ctx.model.results_meta().confidence)),
                          static_cast<long long>(ctx.model.results_meta().num_samples -
                                                 ctx.model.results_meta().failed_samples),
                          ctx.model.results_meta().dataset_source.c_str());
    }
    double ymax = 0, ymin = 0;
    for (std::size_t i = 0; i < pts.size(); ++i) {
      const double v = metric(pts[i], metric_);
      if (std::isfinite(v)) ymax = std::max(ymax, v);
      if (const sim::PointInterval* b = interval(iv, i, metric_); b && std::isfinite(b->hi))
        ymax = std::max(ymax, b->hi);
    }
    if (metric_ == 1) ymin = std::min(0.0, ymax), ymax = 1.0;
    ymax = ymax > 0 ? ymax * 1.05 : 1.0;

    // Series per policy, ordered by bytes ratio.
    std::map<std::string, std::vector<int>> series;
    for (std::size_t i = 0; i < pts.size(); ++i) series[pts[i].policy].push_back(static_cast<int>(i));
    for (auto& [name, idx] : series) {
      std::sort(idx.begin(), idx.end(),
                [&](int a, int b) { return pts[a].bytes_ratio() < pts[b].bytes_ratio(); });
    }

    const float legend_w = 220;
    const ImVec2 avail = ImGui::GetContentRegionAvail();
    const ImVec2 origin = ImGui::GetCursorScreenPos();
    const w::PlotFrame f = w::plot_frame("##quality", ImVec2(avail.x - legend_w, avail.y - 4), 0.0, 1.05,
                                         ymin, ymax, "bytes ratio (kept / full)", metrics[metric_]);
    ImDrawList* dl = ImGui::GetWindowDrawList();
    dl->PushClipRect(f.min, f.max, true);
    int color_index = 0;
    std::map<std::string, ImU32> colors;
    for (const auto& [name, idx] : series) {
      const bool bound = is_bound(pts[idx[0]]), search = is_search(pts[idx[0]]);
      const ImU32 c = bound ? IM_COL32(200, 200, 200, 255) : w::series_color(color_index++);
      colors[name] = c;
      for (std::size_t k = 1; k < idx.size(); ++k) {
        const ImVec2 a = f.to_screen(pts[idx[k - 1]].bytes_ratio(), metric(pts[idx[k - 1]], metric_));
        const ImVec2 b = f.to_screen(pts[idx[k]].bytes_ratio(), metric(pts[idx[k]], metric_));
        if (bound || search) {  // dashed (bound: 5 long dashes, thick) or dotted (search: 10 short ones)
          const int n = bound ? 10 : 20;
          for (int s = 0; s < n; s += 2) {
            const float t0 = s / static_cast<float>(n), t1 = (s + 1) / static_cast<float>(n);
            dl->AddLine(ImVec2(a.x + (b.x - a.x) * t0, a.y + (b.y - a.y) * t0),
                        ImVec2(a.x + (b.x - a.x) * t1, a.y + (b.y - a.y) * t1), c, bound ? 2.5f : 1.5f);
          }
        } else {
          dl->AddLine(a, b, c, 1.5f);
        }
      }
    }
    // Pareto front (policy points marked in the file), by bytes ratio.
    std::vector<int> front;
    for (std::size_t i = 0; i < pts.size(); ++i) {
      if (pts[i].pareto && pts[i].kind == "policy") front.push_back(static_cast<int>(i));
    }
    std::sort(front.begin(), front.end(),
              [&](int a, int b) { return pts[a].bytes_ratio() < pts[b].bytes_ratio(); });
    for (std::size_t k = 1; k < front.size(); ++k) {
      dl->AddLine(f.to_screen(pts[front[k - 1]].bytes_ratio(), metric(pts[front[k - 1]], metric_)),
                  f.to_screen(pts[front[k]].bytes_ratio(), metric(pts[front[k]], metric_)),
                  IM_COL32(255, 255, 255, 200), 3.5f);
    }
    // Points; hover and click.
    const ImVec2 mouse = ImGui::GetIO().MousePos;
    int hovered = -1;
    float best = 8.0f * 8.0f;
    for (std::size_t i = 0; i < pts.size(); ++i) {
      const ImVec2 s = f.to_screen(pts[i].bytes_ratio(), metric(pts[i], metric_));
      const ImU32 c = colors[pts[i].policy];
      if (const sim::PointInterval* b = interval(iv, i, metric_);
          b && std::isfinite(b->lo) && std::isfinite(b->hi)) {
        const ImVec2 lo = f.to_screen(pts[i].bytes_ratio(), b->lo),
                     hi = f.to_screen(pts[i].bytes_ratio(), b->hi);
        dl->AddLine(lo, hi, c, 1.5f);
        dl->AddLine(ImVec2(lo.x - 3, lo.y), ImVec2(lo.x + 3, lo.y), c, 1.5f);
        dl->AddLine(ImVec2(hi.x - 3, hi.y), ImVec2(hi.x + 3, hi.y), c, 1.5f);
      }
      dl->AddCircleFilled(s, pts[i].pareto ? 5.0f : 3.5f, c);
      if (pts[i].pareto) dl->AddCircle(s, 7.5f, IM_COL32(255, 255, 255, 255), 0, 1.5f);
      if (static_cast<int>(i) == ctx.sel.point) dl->AddCircle(s, 11.0f, IM_COL32(255, 60, 60, 255), 0, 2.5f);
      const float dx = s.x - mouse.x, dy = s.y - mouse.y;
      if (!ctx.headless && dx * dx + dy * dy < best) {
        best = dx * dx + dy * dy;
        hovered = static_cast<int>(i);
      }
    }
    dl->PopClipRect();
    if (hovered >= 0 && ImGui::IsItemHovered()) {
      const sim::PointResult& p = pts[hovered];
      ImGui::SetTooltip(
          "%s @ %s%s%s\nbytes ratio %.4f (saved %.1f %%)\noutput error %.5f\nrecall %.4f\nKL %.5f\n"
          "%zu collapse flags\nclick to select",
          p.policy.c_str(), p.budget.c_str(), p.pareto ? "  (Pareto)" : "",
          is_bound(p)    ? "  (bound, not a policy)"
          : is_search(p) ? "  (allocation search, not a policy)"
                         : "",
          p.bytes_ratio(), 100 * (1 - p.bytes_ratio()), p.total.quality.output_error,
          p.total.quality.attention_recall, p.total.quality.kl, p.flags.size());
      if (const sim::PointInterval* b = interval(iv, static_cast<std::size_t>(hovered), metric_)) {
        ImGui::SetTooltip(
            "%s @ %s%s\n%s %.5f, interval [%.5f, %.5f] over %lld samples\nbytes ratio %.4f\nclick to select",
            p.policy.c_str(), p.budget.c_str(), p.pareto ? "  (Pareto)" : "", metrics[metric_], b->mean,
            b->lo, b->hi, static_cast<long long>(iv[static_cast<std::size_t>(hovered)].n), p.bytes_ratio());
      }
      if (ImGui::IsItemClicked()) ctx.sel.point = hovered;
    }
    // Legend.
    ImGui::SetCursorScreenPos(ImVec2(origin.x + avail.x - legend_w + 8, origin.y));
    ImGui::BeginGroup();
    for (const auto& [name, c] : colors) {
      ImGui::ColorButton(("##" + name).c_str(), ImGui::ColorConvertU32ToFloat4(c),
                         ImGuiColorEditFlags_NoTooltip, ImVec2(12, 12));
      ImGui::SameLine();
      const int first = series[name][0];
      ImGui::Text("%s%s", name.c_str(),
                  is_bound(pts[first])    ? " (bound)"
                  : is_search(pts[first]) ? " (search)"
                                          : "");
    }
    if (ctx.sel.point >= 0) {
      const sim::PointResult& p = pts[ctx.sel.point];
      ImGui::Separator();
      ImGui::Text("selected: %s @ %s", p.policy.c_str(), p.budget.c_str());
      ImGui::Text("error %.4f  recall %.3f", p.total.quality.output_error, p.total.quality.attention_recall);
    }
    ImGui::EndGroup();
  }

 private:
  int metric_ = 0;
};

}  // namespace

std::unique_ptr<Panel> make_quality_panel() { return std::make_unique<QualityPanel>(); }

}  // namespace kvscope::viewer
