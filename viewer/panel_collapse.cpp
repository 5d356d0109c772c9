// Collapse modes: per-layer flags of the selected point (visual blindness, semantic drift,
// repetition, over-compression), the per-layer numbers behind them and the suggested fix.
#include <imgui.h>

#include <algorithm>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

constexpr const char* kModes[] = {"visual_blindness", "semantic_drift", "repetition", "over_compression"};

class CollapsePanel : public Panel {
 public:
  const char* name() const override { return "collapse"; }
  const char* title() const override { return "Collapse modes"; }

  void draw(ViewContext& ctx) override {
    const auto& pts = ctx.model.points();
    if (ctx.sel.point < 0 || ctx.sel.point >= static_cast<int>(pts.size())) {
      ImGui::TextWrapped("No point selected: open a results file (--results) and pick a point.");
      return;
    }
    const sim::PointResult& p = pts[ctx.sel.point];
    ImGui::Text("%s @ %s: %zu flag(s)", p.policy.c_str(), p.budget.c_str(), p.flags.size());

    // Grid: one row per mode, one column per layer; lit where the flag names the layer.
    ImDrawList* dl = ImGui::GetWindowDrawList();
    const int L = static_cast<int>(p.layers.size());
    const float label_w = 130, avail = ImGui::GetContentRegionAvail().x - label_w;
    const float cell = std::clamp(avail / std::max(1, L), 6.0f, 28.0f);
    const ImVec2 o = ImGui::GetCursorScreenPos();
    for (int m = 0; m < 4; ++m) {
      const float y = o.y + 16 + m * (cell + 2);
      dl->AddText(ImVec2(o.x, y), IM_COL32(220, 220, 220, 255), sim::flag_short_name(kModes[m]).c_str());
      for (int l = 0; l < L; ++l) {
        bool lit = false;
        for (const sim::CollapseFlag& f : p.flags) {
          lit |= f.mode == kModes[m] &&
                 std::find(f.layers.begin(), f.layers.end(), p.layers[l].layer) != f.layers.end();
        }
        const ImVec2 a(o.x + label_w + l * cell, y), b(a.x + cell - 2, a.y + cell - 2);
        dl->AddRectFilled(a, b, lit ? IM_COL32(230, 70, 60, 255) : IM_COL32(45, 45, 55, 255));
        if (l == ctx.sel.layer) dl->AddRect(a, b, IM_COL32(255, 255, 255, 255));
      }
    }
    for (int l = 0; l < L; l += std::max(1, L / 8)) {
      dl->AddText(ImVec2(o.x + label_w + l * cell, o.y), IM_COL32(160, 160, 160, 255),
                  w::label("L", p.layers[l].layer).c_str());
    }
    ImGui::Dummy(ImVec2(label_w + L * cell, 20 + 4 * (cell + 2)));

    // The per-layer numbers the flags are computed from.
    if (ImGui::BeginTable("layers", 6,
                          ImGuiTableFlags_Borders | ImGuiTableFlags_SizingFixedFit | ImGuiTableFlags_ScrollY,
                          ImVec2(0, std::min(260.0f, 24.0f + 19.0f * L)))) {
      ImGui::TableSetupScrollFreeze(0, 1);
      for (const char* h : {"layer", "output error", "recall", "vision recall", "text recall", "KL"}) {
        ImGui::TableSetupColumn(h);
      }
      ImGui::TableHeadersRow();
      for (int l = 0; l < L; ++l) {
        const sim::Quality& q = p.layers[l].total.quality;
        ImGui::TableNextRow();
        ImGui::TableNextColumn();
        if (ImGui::Selectable(std::to_string(p.layers[l].layer).c_str(), l == ctx.sel.layer,
                              ImGuiSelectableFlags_SpanAllColumns)) {
          ctx.sel.layer = l;
        }
        ImGui::TableNextColumn();
        ImGui::Text("%.4f", q.output_error);
        ImGui::TableNextColumn();
        ImGui::Text("%.3f", q.attention_recall);
        ImGui::TableNextColumn();
        ImGui::Text("%.3f", q.recall_modality[1]);
        ImGui::TableNextColumn();
        ImGui::Text("%.3f", q.recall_modality[0]);
        ImGui::TableNextColumn();
        ImGui::Text("%.4f", q.kl);
      }
      ImGui::EndTable();
    }
    ImGui::Spacing();
    if (p.flags.empty())
      ImGui::TextColored(ImVec4(0.5f, 0.9f, 0.5f, 1), "No collapse mode flagged for this point.");
    for (const sim::CollapseFlag& f : p.flags) {
      ImGui::TextColored(ImVec4(1.0f, 0.45f, 0.4f, 1), "%s  %s", f.mode.c_str(),
                         sim::format_layer_ranges(f.layers).c_str());
      ImGui::BulletText("evidence: %s", f.evidence.c_str());
      ImGui::BulletText("suggested fix: %s", f.suggested_fix.c_str());
    }
  }
};

}  // namespace

std::unique_ptr<Panel> make_collapse_panel() { return std::make_unique<CollapsePanel>(); }

}  // namespace kvscope::viewer
