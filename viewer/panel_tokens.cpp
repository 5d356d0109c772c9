// Token map: the context coloured by modality, each image as its patch grid, and for the selected
// policy, budget, layer and kv head which tokens are kept, merged (and into which) or evicted, with
// the quantization bits. Recomputed in the background with run_policy_on_layer(record_tokens).
#include <imgui.h>

#include <algorithm>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

struct Cell {
  ImVec2 a, b;
  int token;
};

class TokensPanel : public Panel {
 public:
  const char* name() const override { return "tokens"; }
  const char* title() const override { return "Token map"; }

  void draw(ViewContext& ctx) override {
    std::string why;
    const std::optional<LayerRequest> req = selected_layer_request(ctx.model, ctx.sel, &why);
    if (!req) {
      ImGui::TextWrapped("%s", why.c_str());
      return;
    }
    const std::shared_ptr<const LayerOutcome> out = ctx.jobs.get(*req);
    ImGui::Text("%s, keep %.3f, layer %d, kv head %d", req->policy.name.c_str(), req->keep, req->layer,
                ctx.sel.kv_head);
    if (!out) {
      ImGui::SameLine();
      ImGui::TextDisabled("  recomputing the layer...");
      draw_map(ctx, nullptr);
      return;
    }
    if (!out->error.empty()) {
      ImGui::TextColored(ImVec4(1, 0.4f, 0.4f, 1), "%s", out->error.c_str());
      return;
    }
    const int kv = std::clamp(ctx.sel.kv_head, 0, static_cast<int>(out->result.token_maps.size()) - 1);
    const sim::TokenMap* map = kv >= 0 ? &out->result.token_maps[kv] : nullptr;
    if (map && kv < static_cast<int>(out->result.heads.size())) {
      const sim::HeadResult& h = out->result.heads[kv];
      std::string counts;
      for (int m = 0; m < sim::kModalities; ++m) {
        if (!h.tokens[m]) continue;
        counts += std::string(w::modality_name(m)) + ": " + std::to_string(h.kept[m]) + " kept, " +
                  std::to_string(h.merged[m]) + " merged, " + std::to_string(h.evicted[m]) + " evicted   ";
      }
      ImGui::TextUnformatted(counts.c_str());
      // Timings stay out of headless screenshots so that they are reproducible.
      ImGui::Text(
          "keys %s; output error %.4f, recall %.3f%s",
          map->quant_bits ? w::label("quantized to bits: ", map->quant_bits).c_str() : "full precision",
          h.quality.output_error, h.quality.attention_recall,
          ctx.headless ? "" : w::fmt(" (recomputed in %.2f s)", out->seconds).c_str());
    }
    draw_map(ctx, map);
  }

 private:
  // Lays out the context: runs of text/audio/special tokens wrap as rows of small cells, each image
  // segment is a block laid out on its patch grid.
  void draw_map(ViewContext& ctx, const sim::TokenMap* map) {
    const trace::Tokens& tok = ctx.model.tokens();
    const int T = static_cast<int>(tok.size());
    ImDrawList* dl = ImGui::GetWindowDrawList();
    ImGui::TextDisabled("bright: kept   dim + stripe: merged   dark: evicted   hover a token for details");
    const ImVec2 o = ImGui::GetCursorScreenPos();
    const float width = ImGui::GetContentRegionAvail().x;
    cells_.clear();
    float x = o.x, y = o.y;
    const float seq = 11.0f;
    int t = 0;
    while (t < T) {
      const bool grid = tok.modality[t] == 1 && tok.grid_row[t] >= 0;
      int end = t + 1;
      while (end < T && tok.segment[end] == tok.segment[t] &&
             (tok.modality[end] == 1 && tok.grid_row[end] >= 0) == grid) {
        ++end;
      }
      if (grid) {
        int rows = 0, cols = 0;
        for (int i = t; i < end; ++i) {
          rows = std::max(rows, tok.grid_row[i] + 1);
          cols = std::max(cols, tok.grid_col[i] + 1);
        }
        const float cell = std::clamp(std::min(width * 0.5f / cols, 480.0f / rows), 4.0f, 24.0f);
        if (x > o.x) x = o.x, y += seq + 4;
        for (int i = t; i < end; ++i) {
          const ImVec2 a(x + tok.grid_col[i] * cell, y + tok.grid_row[i] * cell);
          cells_.push_back({a, ImVec2(a.x + cell - 1, a.y + cell - 1), i});
        }
        y += rows * cell + 6;
      } else {
        for (int i = t; i < end; ++i) {
          if (x + seq > o.x + width) x = o.x, y += seq + 1;
          cells_.push_back({ImVec2(x, y), ImVec2(x + seq - 1, y + seq - 1), i});
          x += seq;
        }
        x += seq;  // gap between segments
      }
      t = end;
    }
    const float total_h = (x > o.x ? y + seq : y) - o.y + 4;
    ImGui::InvisibleButton("##tokens", ImVec2(width, std::max(total_h, 10.0f)));
    const bool hovered_area = ImGui::IsItemHovered() && !ctx.headless;
    const ImVec2 mouse = ImGui::GetIO().MousePos;
    int hovered = -1;
    for (const Cell& c : cells_) {
      const int m = tok.modality[c.token];
      const int state = map && c.token < static_cast<int>(map->state.size()) ? map->state[c.token] : 1;
      if (state == 1) {
        dl->AddRectFilled(c.a, c.b, w::modality_color(m));
      } else if (state == 2) {
        dl->AddRectFilled(c.a, c.b, w::modality_color(m, 0.35f));
        dl->AddLine(ImVec2(c.a.x, c.b.y), ImVec2(c.b.x, c.a.y), w::modality_color(m));
      } else {
        dl->AddRectFilled(c.a, c.b, IM_COL32(35, 35, 40, 255));
        dl->AddRect(c.a, c.b, w::modality_color(m, 0.3f));
      }
      if (hovered_area && mouse.x >= c.a.x && mouse.x <= c.b.x && mouse.y >= c.a.y && mouse.y <= c.b.y) {
        hovered = c.token;
        dl->AddRect(c.a, c.b, IM_COL32(255, 255, 255, 255), 0, 0, 2);
      }
    }
    if (hovered >= 0) tooltip(ctx, map, hovered, dl);
  }

  void tooltip(const ViewContext& ctx, const sim::TokenMap* map, int t, ImDrawList* dl) const {
    const trace::Tokens& tok = ctx.model.tokens();
    std::string text = "token " + std::to_string(t) + "  " + w::modality_name(tok.modality[t]) +
                       ", position " + std::to_string(tok.position[t]) + ", segment " +
                       std::to_string(tok.segment[t]);
    if (tok.grid_row[t] >= 0)
      text += "\npatch row " + std::to_string(tok.grid_row[t]) + ", col " + std::to_string(tok.grid_col[t]);
    if (tok.token_id[t] >= 0) text += "\ntoken id " + std::to_string(tok.token_id[t]);
    if (!tok.text.empty() && !tok.text[t].empty()) text += "  '" + tok.text[t] + "'";
    if (map) {
      static const char* states[] = {"evicted", "kept", "merged"};
      const int state = map->state[t];
      text += std::string("\n") + states[std::clamp(state, 0, 2)];
      if (map->slot[t] >= 0) {
        const int rep = map->slot_token[map->slot[t]];
        text += " (slot " + std::to_string(map->slot[t]) +
                (state == 2 ? ", into token " + std::to_string(rep) : "") + ")";
        if (state == 2) {  // line to the token it was merged into
          const Cell* from = find(t);
          const Cell* to = find(rep);
          if (from && to) {
            dl->AddLine(ImVec2((from->a.x + from->b.x) / 2, (from->a.y + from->b.y) / 2),
                        ImVec2((to->a.x + to->b.x) / 2, (to->a.y + to->b.y) / 2),
                        IM_COL32(255, 255, 255, 255), 2);
          }
        }
      }
      if (!map->score.empty()) text += "\nselection score " + w::fmt("%.5g", map->score[t]);
      if (map->quant_bits) text += "\nkey bits " + std::to_string(map->quant_bits);
    }
    ImGui::SetTooltip("%s", text.c_str());
  }

  const Cell* find(int token) const {
    for (const Cell& c : cells_) {
      if (c.token == token) return &c;
    }
    return nullptr;
  }

  std::vector<Cell> cells_;
};

}  // namespace

std::unique_ptr<Panel> make_tokens_panel() { return std::make_unique<TokensPanel>(); }

}  // namespace kvscope::viewer
