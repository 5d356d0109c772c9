// What-if: edit the selected policy's parameters (keep fraction, forced sinks / recent tokens,
// UniCache weights, rates and thresholds, PyramidKV / HybridKV shares) and see the selected layer
// recomputed by the simulator library on a worker thread; the UI keeps drawing meanwhile.
#include <imgui.h>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

struct Summary {
  double bytes_ratio = 1, error = 0, recall = 1;
  sim::PerModalityCount kept{}, tokens{};
};

Summary summarize(const sim::LayerResult& r) {
  Summary s;
  const double full = static_cast<double>(r.total.bytes_full.total());
  s.bytes_ratio = full > 0 ? static_cast<double>(r.total.bytes_kept.total()) / full : 1;
  s.error = r.total.quality.output_error;
  s.recall = r.total.quality.attention_recall;
  s.kept = r.total.kept;
  s.tokens = r.total.tokens;
  return s;
}

class WhatIfPanel : public Panel {
 public:
  const char* name() const override { return "whatif"; }
  const char* title() const override { return "What-if"; }

  void draw(ViewContext& ctx) override {
    std::string why;
    const std::optional<LayerRequest> base = selected_layer_request(ctx.model, ctx.sel, &why);
    if (!base) {
      ImGui::TextWrapped("%s", why.c_str());
      return;
    }
    if (base->key() != base_key_) {  // a new selection resets the edits
      base_key_ = base->key();
      edited_ = *base;
      ++generation_;
    }
    ImGui::BeginGroup();
    ImGui::Text("Edit %s (layer %d)", base->policy.name.c_str(), base->layer);
    bool changed = false;
    ImGui::PushItemWidth(220);
    float keep = static_cast<float>(edited_.keep);
    if (ImGui::SliderFloat("keep fraction", &keep, 0.02f, 1.0f, "%.3f")) edited_.keep = keep, changed = true;
    sim::PolicySpec& p = edited_.policy;
    changed |= ImGui::SliderInt("sinks", &p.sinks, 0, 64);
    changed |= ImGui::SliderInt("recent", &p.recent, 0, 256);
    changed |= ImGui::SliderFloat("recent fraction", &p.recent_fraction, 0.0f, 0.9f, "%.2f");
    // Stage parameters are edited through the same declared-parameter path as an INI file.
    auto slider = [&](const char* label, const char* key, float lo, float hi) {
      float x = p.params.real(key);
      if (!ImGui::SliderFloat(label, &x, lo, hi, "%.2f")) return false;
      p.set(key, std::to_string(x), "what-if");
      return true;
    };
    bool merge_heads = p.stages.head_merge != "none";
    if (ImGui::Checkbox("head merge", &merge_heads)) {
      p.set("head_merge", merge_heads ? "true" : "false", "what-if");
      changed = true;
    }
    changed |= slider("head merge threshold", "head_merge_threshold", 0.5f, 1.0f);
    if (p.stages.allocator == "pyramid") changed |= slider("pyramid spread", "pyramid_spread", 0.0f, 1.0f);
    if (p.stages.allocator == "hybrid") changed |= slider("hybrid text share", "hybrid_text_share", 0.0f, 1.0f);
    if (p.stages.executor == "merge-evicted") changed |= slider("merge threshold", "merge_threshold", 0.0f, 1.0f);
    if (p.stages.scorer == "unicache" || p.stages.allocator == "unicache") {
      ImGui::Separator();
      ImGui::TextUnformatted("UniCache score s = w_a a + w_c c - w_d d + w_r r");
      changed |= slider("w_a attention", "unicache.w_a", 0.0f, 1.0f);
      changed |= slider("w_c cross-modal", "unicache.w_c", 0.0f, 1.0f);
      changed |= slider("w_d redundancy", "unicache.w_d", 0.0f, 1.0f);
      changed |= slider("w_r recency", "unicache.w_r", 0.0f, 1.0f);
      changed |= slider("rate shallow", "unicache.rate_shallow", 0.0f, 0.95f);
      changed |= slider("rate deep", "unicache.rate_deep", 0.0f, 0.95f);
      changed |= slider("vision cap", "unicache.vision_cap", 0.0f, 0.95f);
      changed |= slider("text cap", "unicache.text_cap", 0.0f, 0.95f);
      changed |= slider("merge threshold", "unicache.merge_threshold", 0.0f, 1.0f);
      changed |= slider("align threshold", "unicache.align_threshold", 0.0f, 1.0f);
    }
    ImGui::PopItemWidth();
    if (ImGui::Button("reset")) edited_ = *base, changed = true;
    if (changed) ++generation_;
    ImGui::EndGroup();

    edited_.tag = "whatif#" + std::to_string(generation_);
    edited_.layer = base->layer;
    const std::shared_ptr<const LayerOutcome> before = ctx.jobs.get(*base);
    const std::shared_ptr<const LayerOutcome> after = ctx.jobs.get(edited_);
    ImGui::SameLine(0, 30);
    ImGui::BeginGroup();
    show("selected policy", before.get(), ctx.headless);
    ImGui::Spacing();
    show("edited", after.get(), ctx.headless);
    if (before && after && before->error.empty() && after->error.empty()) {
      const Summary a = summarize(before->result), b = summarize(after->result);
      ImGui::Spacing();
      ImGui::Text("change: memory %+.1f %% of full, output error %+.4f, recall %+.3f",
                  100 * (b.bytes_ratio - a.bytes_ratio), b.error - a.error, b.recall - a.recall);
      // Bars: bytes ratio and output error, before (grey) and after (colour).
      ImDrawList* dl = ImGui::GetWindowDrawList();
      const double emax = std::max({a.error, b.error, 1e-9});
      const char* names[] = {"bytes ratio", "output error"};
      const double vals[2][2] = {{a.bytes_ratio, b.bytes_ratio}, {a.error / emax, b.error / emax}};
      for (int k = 0; k < 2; ++k) {
        const ImVec2 o = ImGui::GetCursorScreenPos();
        dl->AddText(o, IM_COL32(220, 220, 220, 255), names[k]);
        dl->AddRectFilled(ImVec2(o.x + 100, o.y),
                          ImVec2(o.x + 100 + 300 * static_cast<float>(vals[k][0]), o.y + 8),
                          IM_COL32(150, 150, 150, 255));
        dl->AddRectFilled(ImVec2(o.x + 100, o.y + 9),
                          ImVec2(o.x + 100 + 300 * static_cast<float>(vals[k][1]), o.y + 17),
                          w::series_color(k));
        ImGui::Dummy(ImVec2(410, 22));
      }
    }
    ImGui::EndGroup();
  }

 private:
  static void show(const char* label, const LayerOutcome* out, bool headless) {
    if (!out) {
      ImGui::Text("%s: recomputing...", label);
      return;
    }
    if (!out->error.empty()) {
      ImGui::TextColored(ImVec4(1, 0.4f, 0.4f, 1), "%s: %s", label, out->error.c_str());
      return;
    }
    const Summary s = summarize(out->result);
    ImGui::Text("%s: bytes ratio %.4f (saved %.1f %%), output error %.5f, recall %.4f%s", label,
                s.bytes_ratio, 100 * (1 - s.bytes_ratio), s.error, s.recall,
                headless ? "" : w::fmt("  [%.2f s]", out->seconds).c_str());
    std::string kept;
    for (int m = 0; m < sim::kModalities; ++m) {
      if (s.tokens[m]) {
        kept += std::string(w::modality_name(m)) + " " + std::to_string(s.kept[m]) + "/" +
                std::to_string(s.tokens[m]) + "  ";
      }
    }
    ImGui::Text("  kept slots (all kv heads): %s", kept.c_str());
    for (const std::string& warning : out->warnings) ImGui::TextDisabled("  warning: %s", warning.c_str());
  }

  std::string base_key_;
  LayerRequest edited_;
  int generation_ = 0;
};

}  // namespace

std::unique_ptr<Panel> make_whatif_panel() { return std::make_unique<WhatIfPanel>(); }

}  // namespace kvscope::viewer
