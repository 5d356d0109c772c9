// Overview: model geometry, tokens per modality and segment, full KV bytes per modality, and the
// swept points with memory saved and error (click a row to select the point).
#include <imgui.h>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

class OverviewPanel : public Panel {
 public:
  const char* name() const override { return "overview"; }
  const char* title() const override { return "Overview"; }

  void draw(ViewContext& ctx) override {
    const Model& m = ctx.model;
    if (m.has_trace()) draw_trace(m);
    if (m.has_results()) draw_results(ctx);
  }

 private:
  static void draw_trace(const Model& m) {
    const sim::TraceSummary& s = m.summary();
    const trace::ModelGeometry& g = m.geometry();
    ImGui::Text("Model %s%s: %d layers, %d query heads, %d kv heads, head dim %d, %s", g.model_name.c_str(),
                s.header.synthetic ? " (synthetic)" : "", g.num_layers, g.num_q_heads, g.num_kv_heads,
                g.head_dim, kernels::dtype_name(s.header.dtype));
    ImGui::Text("%zu context tokens, %zu evaluation queries; full KV cache %s (%s per layer, %s per token)",
                s.num_tokens, s.num_decode_steps,
                w::bytes_text(static_cast<double>(s.kv_bytes_total)).c_str(),
                w::bytes_text(static_cast<double>(s.kv_bytes_per_layer)).c_str(),
                w::bytes_text(static_cast<double>(s.kv_bytes_per_token)).c_str());

    // The context as one strip, coloured by modality, in token order.
    const trace::Tokens& tok = m.tokens();
    ImDrawList* dl = ImGui::GetWindowDrawList();
    const ImVec2 p = ImGui::GetCursorScreenPos();
    const float width = ImGui::GetContentRegionAvail().x;
    const std::size_t T = tok.size();
    for (std::size_t t = 0; t < T; ++t) {
      const float x0 = p.x + width * static_cast<float>(t) / static_cast<float>(T);
      const float x1 = p.x + width * static_cast<float>(t + 1) / static_cast<float>(T);
      dl->AddRectFilled(ImVec2(x0, p.y), ImVec2(std::max(x1, x0 + 1), p.y + 18),
                        w::modality_color(tok.modality[t]));
    }
    ImGui::Dummy(ImVec2(width, 20));
    w::modality_legend();

    if (ImGui::BeginTable("modalities", 4, ImGuiTableFlags_Borders | ImGuiTableFlags_SizingFixedFit)) {
      ImGui::TableSetupColumn("modality");
      ImGui::TableSetupColumn("tokens");
      ImGui::TableSetupColumn("full KV bytes / layer");
      ImGui::TableSetupColumn("full KV bytes, all layers");
      ImGui::TableHeadersRow();
      for (int mod = 0; mod < kernels::kNumModalities; ++mod) {
        if (s.tokens_per_modality[mod] == 0) continue;
        const double b = static_cast<double>(s.kv_bytes_per_layer_modality[mod]);
        ImGui::TableNextRow();
        ImGui::TableNextColumn();
        ImGui::TextColored(ImGui::ColorConvertU32ToFloat4(w::modality_color(mod)), "%s",
                           w::modality_name(mod));
        ImGui::TableNextColumn();
        ImGui::Text("%zu", s.tokens_per_modality[mod]);
        ImGui::TableNextColumn();
        ImGui::TextUnformatted(w::bytes_text(b).c_str());
        ImGui::TableNextColumn();
        ImGui::TextUnformatted(w::bytes_text(b * g.num_layers).c_str());
      }
      ImGui::EndTable();
    }
    if (ImGui::TreeNodeEx("Segments", ImGuiTreeNodeFlags_DefaultOpen)) {
      if (ImGui::BeginTable("segments", 4, ImGuiTableFlags_Borders | ImGuiTableFlags_SizingFixedFit)) {
        ImGui::TableSetupColumn("segment");
        ImGui::TableSetupColumn("tokens");
        ImGui::TableSetupColumn("per modality");
        ImGui::TableSetupColumn("patch grid");
        ImGui::TableHeadersRow();
        for (const sim::SegmentSummary& seg : s.segments) {
          ImGui::TableNextRow();
          ImGui::TableNextColumn();
          ImGui::Text("%d", seg.segment);
          ImGui::TableNextColumn();
          ImGui::Text("%zu-%zu", seg.first_token, seg.last_token);
          ImGui::TableNextColumn();
          std::string per;
          for (int mod = 0; mod < kernels::kNumModalities; ++mod) {
            if (!seg.tokens[mod]) continue;
            if (!per.empty()) per += ", ";
            per.append(w::modality_name(mod)).append(" ").append(std::to_string(seg.tokens[mod]));
          }
          ImGui::TextUnformatted(per.c_str());
          ImGui::TableNextColumn();
          if (seg.grid_rows > 0) ImGui::Text("%d x %d", seg.grid_rows, seg.grid_cols);
        }
        ImGui::EndTable();
      }
      ImGui::TreePop();
    }
  }

  static void draw_results(ViewContext& ctx) {
    const Model& m = ctx.model;
    ImGui::Separator();
    ImGui::Text("Results: %zu points from %s", m.points().size(), m.results_meta().command_line.c_str());
    const ImGuiTableFlags flags = ImGuiTableFlags_Borders | ImGuiTableFlags_RowBg |
                                  ImGuiTableFlags_SizingFixedFit | ImGuiTableFlags_ScrollY;
    if (!ImGui::BeginTable("points", 8, flags, ImVec2(0, ImGui::GetContentRegionAvail().y))) return;
    ImGui::TableSetupScrollFreeze(0, 1);
    for (const char* h :
         {"policy", "budget", "memory saved", "bytes ratio", "output error", "recall", "KL", "flags"}) {
      ImGui::TableSetupColumn(h);
    }
    ImGui::TableHeadersRow();
    for (std::size_t i = 0; i < m.points().size(); ++i) {
      const sim::PointResult& p = m.points()[i];
      ImGui::TableNextRow();
      ImGui::TableNextColumn();
      const std::string label = p.policy + (p.pareto ? " *" : "") + "##" + std::to_string(i);
      if (ImGui::Selectable(label.c_str(), ctx.sel.point == static_cast<int>(i),
                            ImGuiSelectableFlags_SpanAllColumns)) {
        ctx.sel.point = static_cast<int>(i);
      }
      ImGui::TableNextColumn();
      ImGui::TextUnformatted(p.budget.c_str());
      ImGui::TableNextColumn();
      ImGui::Text("%.1f %%", 100.0 * (1.0 - p.bytes_ratio()));
      ImGui::TableNextColumn();
      ImGui::Text("%.3f", p.bytes_ratio());
      ImGui::TableNextColumn();
      ImGui::Text("%.4f", p.total.quality.output_error);
      ImGui::TableNextColumn();
      ImGui::Text("%.3f", p.total.quality.attention_recall);
      ImGui::TableNextColumn();
      ImGui::Text("%.4f", p.total.quality.kl);
      ImGui::TableNextColumn();
      std::string f;
      for (const sim::CollapseFlag& flag : p.flags) {
        if (!f.empty()) f += ' ';
        f += sim::flag_short_name(flag.mode);
      }
      ImGui::TextUnformatted(f.c_str());
    }
    ImGui::EndTable();
  }
};

}  // namespace

std::unique_ptr<Panel> make_overview_panel() { return std::make_unique<OverviewPanel>(); }

}  // namespace kvscope::viewer
