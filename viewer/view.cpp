#include "view.hpp"

#include <imgui.h>

#include <algorithm>

#include "widgets.hpp"

namespace kvscope::viewer {

std::optional<LayerRequest> selected_layer_request(const Model& model, const Selection& sel,
                                                   std::string* why) {
  static const sim::PolicyRegistry registry;
  if (!model.has_trace()) {
    if (why) *why = "no trace loaded: token-level views need the trace (kvview TRACE ...)";
    return std::nullopt;
  }
  LayerRequest req;
  std::string name = sel.policy;
  req.keep = sel.keep;
  if (sel.point >= 0 && sel.point < static_cast<int>(model.points().size())) {
    const sim::PointResult& p = model.points()[static_cast<std::size_t>(sel.point)];
    name = p.policy;
    req.keep = p.budget_value;
  }
  try {
    req.policy = registry.get(name);
  } catch (const std::exception& e) {
    if (why) *why = "cannot recompute '" + name + "': " + e.what();
    return std::nullopt;
  }
  req.layer = std::clamp(sel.layer, 0, std::max(0, model.geometry().num_layers - 1));
  return req;
}

View::View(const Model& model, bool headless) : model_(model), jobs_(model), headless_(headless) {
  panels_.push_back(make_overview_panel());
  panels_.push_back(make_tokens_panel());
  panels_.push_back(make_budgets_panel());
  panels_.push_back(make_attention_panel());
  panels_.push_back(make_quality_panel());
  panels_.push_back(make_collapse_panel());
  panels_.push_back(make_timeline_panel());
  panels_.push_back(make_whatif_panel());
}

std::vector<std::string> View::view_names() {
  return {"overview", "tokens", "budgets", "attention", "quality", "collapse", "timeline", "whatif"};
}

bool View::focus(const std::string& name) {
  for (std::size_t i = 0; i < panels_.size(); ++i) {
    if (name == panels_[i]->name()) {
      focus_ = static_cast<int>(i);
      frames_focused_ = 0;
      return true;
    }
  }
  return false;
}

bool View::busy() const { return model_.state() == LoadState::kLoading || jobs_.busy(); }

void View::on_ready() {
  initialised_ = true;
  // Start on the first Pareto point that is a policy (not a bound or search row), else the first point.
  const auto& pts = model_.points();
  for (std::size_t i = 0; i < pts.size(); ++i) {
    if (pts[i].pareto && pts[i].kind == "policy" && pts[i].budget != "-") {
      sel_.point = static_cast<int>(i);
      break;
    }
  }
  if (sel_.point < 0 && !pts.empty()) sel_.point = 0;
  if (model_.has_trace()) sel_.layer = model_.geometry().num_layers / 2;
  if (!pre_point_.empty()) {
    const std::size_t at = pre_point_.rfind('@');
    const int found =
        at == std::string::npos ? -1 : model_.find_point(pre_point_.substr(0, at), pre_point_.substr(at + 1));
    if (found >= 0) {
      sel_.point = found;
    } else {
      selection_error_ = "--point: no point '" + pre_point_ + "' in " + model_.results_path() +
                         " (give POLICY@BUDGET as in the Overview table, e.g. h2o@0.2)";
    }
  }
  const int L = model_.has_trace() ? model_.geometry().num_layers : model_.results_meta().num_layers;
  const int H = model_.has_trace() ? model_.geometry().num_kv_heads : model_.results_meta().num_kv_heads;
  if (pre_layer_ >= 0) {
    if (pre_layer_ < L)
      sel_.layer = pre_layer_;
    else
      selection_error_ =
          "--layer: " + std::to_string(pre_layer_) + " is not below " + std::to_string(L) + " layers";
  }
  if (pre_kv_head_ >= 0) {
    if (pre_kv_head_ < H)
      sel_.kv_head = pre_kv_head_;
    else
      selection_error_ =
          "--kv-head: " + std::to_string(pre_kv_head_) + " is not below " + std::to_string(H) + " kv heads";
  }
}

void View::preselect(std::string point, int layer, int kv_head) {
  pre_point_ = std::move(point);
  pre_layer_ = layer;
  pre_kv_head_ = kv_head;
}

namespace {

// "label [widget]": the selection bar reads left to right.
void label_before(const char* label, float width) {
  ImGui::AlignTextToFramePadding();
  ImGui::TextUnformatted(label);
  ImGui::SameLine();
  ImGui::SetNextItemWidth(width);
}

}  // namespace

void View::draw_selection_bar() {
  const auto& pts = model_.points();
  if (!pts.empty()) {
    label_before("point", 260);
    const std::string cur = sel_.point >= 0 ? pts[sel_.point].policy + " @ " + pts[sel_.point].budget : "-";
    if (ImGui::BeginCombo("##point", cur.c_str())) {
      for (std::size_t i = 0; i < pts.size(); ++i) {
        const std::string label = pts[i].policy + " @ " + pts[i].budget + (pts[i].pareto ? "  *" : "");
        if (ImGui::Selectable(label.c_str(), sel_.point == static_cast<int>(i))) {
          sel_.point = static_cast<int>(i);
        }
      }
      ImGui::EndCombo();
    }
  } else {
    label_before("policy", 200);
    if (ImGui::BeginCombo("##policy", sel_.policy.c_str())) {
      for (const std::string& n : model_.registry_policies()) {
        if (ImGui::Selectable(n.c_str(), n == sel_.policy)) sel_.policy = n;
      }
      ImGui::EndCombo();
    }
    ImGui::SameLine();
    label_before("keep", 120);
    float keep = static_cast<float>(sel_.keep);
    if (ImGui::SliderFloat("##keep", &keep, 0.05f, 1.0f, "%.2f")) sel_.keep = keep;
  }
  if (model_.has_trace()) {
    const trace::ModelGeometry& g = model_.geometry();
    ImGui::SameLine(0, 20);
    label_before("layer", 160);
    ImGui::SliderInt("##layer", &sel_.layer, 0, std::max(0, g.num_layers - 1));
    ImGui::SameLine(0, 20);
    label_before("kv head", 120);
    ImGui::SliderInt("##kv head", &sel_.kv_head, 0, std::max(0, g.num_kv_heads - 1));
    ImGui::SameLine(0, 20);
    label_before("query in group", 100);
    ImGui::SliderInt("##q in group", &sel_.q_in_group, 0, std::max(0, g.group_size() - 1));
  }
}

void View::draw_status() {
  switch (model_.state()) {
    case LoadState::kIdle:
      ImGui::TextWrapped("No file. Open one with: kvview TRACE.h5 [--results RESULTS.h5]");
      break;
    case LoadState::kLoading:
      ImGui::Text("Loading: %s", model_.status().c_str());
      ImGui::ProgressBar(model_.progress(), ImVec2(400, 0));
      break;
    case LoadState::kFailed:
      ImGui::PushStyleColor(ImGuiCol_Text, ImVec4(1.0f, 0.35f, 0.3f, 1));
      ImGui::TextWrapped("Error: %s", model_.error().c_str());
      ImGui::PopStyleColor();
      break;
    case LoadState::kReady:
      break;
  }
}

void View::draw(float width, float height) {
  jobs_.poll();
  ImGui::SetNextWindowPos(ImVec2(0, 0));
  ImGui::SetNextWindowSize(ImVec2(width, height));
  ImGui::Begin("kvview", nullptr,
               ImGuiWindowFlags_NoTitleBar | ImGuiWindowFlags_NoResize | ImGuiWindowFlags_NoMove |
                   ImGuiWindowFlags_NoCollapse | ImGuiWindowFlags_NoBringToFrontOnFocus);
  if (model_.state() != LoadState::kReady) {
    draw_status();
    ImGui::End();
    return;
  }
  if (!initialised_) on_ready();
  if (!selection_error_.empty())
    ImGui::TextColored(ImVec4(1.0f, 0.35f, 0.3f, 1), "%s", selection_error_.c_str());
  ImGui::Text("%s%s%s", model_.has_trace() ? model_.trace_path().c_str() : "(no trace)",
              model_.has_results() ? "  |  " : "", model_.results_path().c_str());
  draw_selection_bar();
  ImGui::Separator();
  ViewContext ctx{model_, sel_, jobs_, headless_};
  if (ImGui::BeginTabBar("views")) {
    for (std::size_t i = 0; i < panels_.size(); ++i) {
      const ImGuiTabItemFlags flags =
          focus_ == static_cast<int>(i) && frames_focused_ < 2 ? ImGuiTabItemFlags_SetSelected : 0;
      if (ImGui::BeginTabItem(panels_[i]->title(), nullptr, flags)) {
        ImGui::BeginChild(panels_[i]->name());
        panels_[i]->draw(ctx);
        ImGui::EndChild();
        ImGui::EndTabItem();
      }
    }
    ++frames_focused_;
    ImGui::EndTabBar();
  }
  ImGui::End();
}

}  // namespace kvscope::viewer
