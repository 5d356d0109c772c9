// Budgets: where the selected point's memory went. Layer x modality heatmap of the kept ratio (and
// kept bytes on hover), per-head bars for the selected layer, and the allocation search (alloc-search:*)
// beside it.
#include <imgui.h>

#include <algorithm>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

class BudgetsPanel : public Panel {
 public:
  const char* name() const override { return "budgets"; }
  const char* title() const override { return "Budgets"; }

  void draw(ViewContext& ctx) override {
    const auto& pts = ctx.model.points();
    if (ctx.sel.point < 0 || ctx.sel.point >= static_cast<int>(pts.size())) {
      ImGui::TextWrapped("No point selected: open a results file (--results) and pick a point.");
      return;
    }
    const sim::PointResult& p = pts[ctx.sel.point];
    std::vector<int> mods;
    for (int m = 0; m < sim::kModalities; ++m) {
      if (p.total.tokens[m] > 0) mods.push_back(m);
    }
    ImGui::TextUnformatted(
        "Kept ratio = tokens kept as their own slot / context tokens, per layer and modality "
        "(all kv heads); bytes on hover, click a row to select the layer.");
    const int search = ctx.model.search_point_for(ctx.sel.point);
    const float avail = ImGui::GetContentRegionAvail().x;
    const float map_w = search >= 0 && search != ctx.sel.point ? avail * 0.33f : avail * 0.5f;
    heatmap("##selected", p, mods, map_w, ctx);
    if (search >= 0 && search != ctx.sel.point) {
      ImGui::SameLine();
      heatmap("##search", pts[search], mods, map_w, ctx);
    }
    ImGui::SameLine();
    head_bars(p, ctx);
  }

 private:
  static void heatmap(const char* id, const sim::PointResult& p, const std::vector<int>& mods, float width,
                      ViewContext& ctx) {
    ImGui::BeginGroup();
    ImGui::Text("%s @ %s  (bytes ratio %.3f)", p.policy.c_str(), p.budget.c_str(), p.bytes_ratio());
    const int L = static_cast<int>(p.layers.size());
    const float height = ImGui::GetContentRegionAvail().y - 30;
    const float cell_h = std::clamp(height / std::max(1, L), 3.0f, 24.0f);
    const float label_w = 40, cell_w = (width - label_w) / std::max<std::size_t>(1, mods.size());
    ImDrawList* dl = ImGui::GetWindowDrawList();
    const ImVec2 o = ImGui::GetCursorScreenPos();
    for (std::size_t c = 0; c < mods.size(); ++c) {
      dl->AddText(ImVec2(o.x + label_w + c * cell_w + 4, o.y), w::modality_color(mods[c]),
                  w::modality_name(mods[c]));
    }
    const float top = o.y + 18;
    ImGui::SetCursorScreenPos(ImVec2(o.x, top));
    ImGui::InvisibleButton(id, ImVec2(width, cell_h * L));
    const bool hovered = ImGui::IsItemHovered();
    const ImVec2 mouse = ImGui::GetIO().MousePos;
    for (int l = 0; l < L; ++l) {
      const sim::HeadResult& t = p.layers[l].total;
      const float y = top + l * cell_h;
      if (L <= 40 || l % 4 == 0) {
        dl->AddText(ImVec2(o.x, y), IM_COL32(180, 180, 180, 255), w::label("L", p.layers[l].layer).c_str());
      }
      for (std::size_t c = 0; c < mods.size(); ++c) {
        const int m = mods[c];
        const double ratio =
            t.tokens[m] ? static_cast<double>(t.kept[m]) / static_cast<double>(t.tokens[m]) : 0;
        const ImVec2 a(o.x + label_w + c * cell_w, y), b(a.x + cell_w - 1, y + cell_h - 1);
        dl->AddRectFilled(a, b, w::heat_u32(static_cast<float>(ratio)));
        if (cell_h >= 14) {
          dl->AddText(ImVec2(a.x + 4, a.y + 1),
                      ratio > 0.6 ? IM_COL32(0, 0, 0, 255) : IM_COL32(255, 255, 255, 255),
                      w::fmt("%.2f", ratio).c_str());
        }
        if (l == ctx.sel.layer) dl->AddRect(a, b, IM_COL32(255, 60, 60, 255), 0, 0, 2);
        if (hovered && !ctx.headless && mouse.x >= a.x && mouse.x < b.x && mouse.y >= a.y && mouse.y < b.y) {
          ImGui::SetTooltip(
              "layer %d, %s\nkept %lld, merged %lld, evicted %lld of %lld tokens (all heads)\n"
              "bytes kept %s of %s",
              p.layers[l].layer, w::modality_name(m), static_cast<long long>(t.kept[m]),
              static_cast<long long>(t.merged[m]), static_cast<long long>(t.evicted[m]),
              static_cast<long long>(t.tokens[m]),
              w::bytes_text(static_cast<double>(t.bytes_kept_modality[m])).c_str(),
              w::bytes_text(static_cast<double>(t.bytes_full_modality[m])).c_str());
          if (ImGui::IsMouseClicked(0)) ctx.sel.layer = l;
        }
      }
    }
    ImGui::EndGroup();
  }

  static void head_bars(const sim::PointResult& p, const ViewContext& ctx) {
    ImGui::BeginGroup();
    if (ctx.sel.layer < 0 || ctx.sel.layer >= static_cast<int>(p.layers.size())) {
      ImGui::TextUnformatted("no such layer");
      ImGui::EndGroup();
      return;
    }
    const sim::LayerResult& layer = p.layers[ctx.sel.layer];
    ImGui::Text("layer %d: bytes kept / full per kv head", layer.layer);
    ImGui::Text("(%d kv heads after head merging)", layer.merged_heads);
    ImDrawList* dl = ImGui::GetWindowDrawList();
    const float width = ImGui::GetContentRegionAvail().x - 10;
    for (const sim::HeadResult& h : layer.heads) {
      const double full = static_cast<double>(h.bytes_full.total());
      const double ratio = full > 0 ? static_cast<double>(h.bytes_kept.total()) / full : 0;
      const ImVec2 o = ImGui::GetCursorScreenPos();
      dl->AddRectFilled(ImVec2(o.x + 50, o.y), ImVec2(o.x + width, o.y + 14), IM_COL32(40, 40, 50, 255));
      // Stacked by modality: each modality's kept bytes as a share of the head's full bytes.
      float x = o.x + 50;
      for (int m = 0; m < sim::kModalities; ++m) {
        const float seg = full > 0 ? static_cast<float>(h.bytes_kept_modality[m] / full) * (width - 50) : 0;
        dl->AddRectFilled(ImVec2(x, o.y), ImVec2(x + seg, o.y + 14), w::modality_color(m));
        x += seg;
      }
      dl->AddText(o, h.kv_head == ctx.sel.kv_head ? IM_COL32(255, 90, 90, 255) : IM_COL32(220, 220, 220, 255),
                  w::label("h", h.kv_head).c_str());
      ImGui::Dummy(ImVec2(width, 14));
      ImGui::SameLine(width - 40);
      ImGui::Text("%.2f", ratio);
    }
    w::modality_legend();
    ImGui::EndGroup();
  }
};

}  // namespace

std::unique_ptr<Panel> make_budgets_panel() { return std::make_unique<BudgetsPanel>(); }

}  // namespace kvscope::viewer
