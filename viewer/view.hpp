// kvview's GUI: one View owning one Panel per view (panel_*.cpp), a shared Selection and the
// background layer jobs. Panels read the Model only through its const getters.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layer_jobs.hpp"
#include "model.hpp"

namespace kvscope::viewer {

// What every panel shows: one (policy, budget) point, one layer and one head.
struct Selection {
  int point = -1;              // row of Model::points(), -1 when there are no results
  std::string policy = "h2o";  // used when there is no results file (or for the what-if panel)
  double keep = 0.3;           // keep fraction of that policy
  int layer = 0;
  int kv_head = 0;
  int q_in_group = 0;  // query head within the kv head's group (attention view)
};

class View;

struct ViewContext {
  const Model& model;
  Selection& sel;
  LayerJobs& jobs;
  bool headless = false;  // screenshot mode: deterministic hover-free rendering
};

class Panel {
 public:
  virtual ~Panel() = default;
  virtual const char* name() const = 0;   // view name for --view
  virtual const char* title() const = 0;  // tab label
  virtual void draw(ViewContext& ctx) = 0;
};

// Factories, one per panel file.
std::unique_ptr<Panel> make_overview_panel();
std::unique_ptr<Panel> make_tokens_panel();
std::unique_ptr<Panel> make_budgets_panel();
std::unique_ptr<Panel> make_attention_panel();
std::unique_ptr<Panel> make_quality_panel();
std::unique_ptr<Panel> make_collapse_panel();
std::unique_ptr<Panel> make_timeline_panel();
std::unique_ptr<Panel> make_whatif_panel();

// The request that recomputes the selected layer with the selected point's policy and keep
// fraction (nullopt when the policy is unknown to the registry, e.g. alloc-search rows).
std::optional<LayerRequest> selected_layer_request(const Model& model, const Selection& sel,
                                                   std::string* why);

class View {
 public:
  View(const Model& model, bool headless);
  // Draws the whole window (selection bar, tabs). Call between ImGui::NewFrame and Render.
  void draw(float width, float height);
  // Selects the tab of a view by name; false if unknown.
  bool focus(const std::string& name);
  // Loading or recomputing: a screenshot waits until this is false.
  bool busy() const;
  static std::vector<std::string> view_names();
  // Selection to apply once loading is done: "POLICY@BUDGET" (empty: first Pareto point), layer and
  // kv head (-1: keep the default). selection_error() says what could not be applied.
  void preselect(std::string point, int layer, int kv_head);
  const std::string& selection_error() const { return selection_error_; }
  // The first error of a layer recomputation the shown view asked for (e.g. the layer's tensors
  // cannot be read: NaN, a missing external file), "" if none.
  const std::string& layer_error() const { return jobs_.first_error(); }

 private:
  void draw_selection_bar();
  void draw_status();
  void on_ready();

  const Model& model_;
  LayerJobs jobs_;
  Selection sel_;
  bool headless_;
  bool initialised_ = false;
  std::vector<std::unique_ptr<Panel>> panels_;
  std::string pre_point_, selection_error_;
  int pre_layer_ = -1, pre_kv_head_ = -1;
  int focus_ = -1;  // panel to select on the next frame
  int frames_focused_ = 0;
};

}  // namespace kvscope::viewer
