// Attention: evaluation queries x keys (context, then decode keys) of one query head of the
// selected layer: full, compressed and their difference, each one OpenGL texture. Long contexts are
// max-pooled to the texture width so attention sinks stay visible; modality boundaries are marked;
// mouse wheel zooms, dragging pans (all three maps together).
#include <GL/gl.h>
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "view.hpp"
#include "widgets.hpp"

namespace kvscope::viewer {
namespace {

namespace w = widgets;

constexpr int kMaxColumns = 2048;

class AttentionPanel : public Panel {
 public:
  ~AttentionPanel() override {
    if (textures_[0]) glDeleteTextures(3, textures_);
  }
  const char* name() const override { return "attention"; }
  const char* title() const override { return "Attention"; }

  void draw(ViewContext& ctx) override {
    std::string why;
    const std::optional<LayerRequest> req = selected_layer_request(ctx.model, ctx.sel, &why);
    if (!req) {
      ImGui::TextWrapped("%s", why.c_str());
      return;
    }
    const std::shared_ptr<const LayerOutcome> out = ctx.jobs.get(*req);
    if (!out) {
      ImGui::TextDisabled("recomputing layer %d...", req->layer);
      return;
    }
    if (!out->error.empty() || out->S == 0) {
      ImGui::TextColored(ImVec4(1, 0.4f, 0.4f, 1), "%s",
                         out->error.empty() ? "the trace has no evaluation queries" : out->error.c_str());
      return;
    }
    const int group = std::max(1, ctx.model.geometry().group_size());
    const int qh = std::clamp(ctx.sel.kv_head * group + ctx.sel.q_in_group, 0, out->Hq - 1);
    if (out != uploaded_ || qh != uploaded_head_) upload(out, qh);
    ImGui::Text(
        "%s @ keep %.3f, layer %d, query head %d (kv head %d): %d queries x %d keys, %d key(s) per column "
        "(max-pooled)",
        req->policy.name.c_str(), req->keep, req->layer, qh, qh / group, out->S, out->T + out->S, pool_);
    ImGui::TextDisabled(
        "Rows: evaluation queries. Columns: context keys then decode keys. Colour: sqrt(attention / "
        "row max); difference red = gained, blue = lost. Wheel: zoom, drag: pan, double-click: reset.");

    const ImVec2 avail = ImGui::GetContentRegionAvail();
    const float h = std::max(40.0f, (avail.y - 3 * 22) / 3);
    const char* labels[] = {"full", "compressed (approximate: representative keys of surviving slots)",
                            "difference (compressed - full)"};
    for (int k = 0; k < 3; ++k) {
      ImGui::TextUnformatted(labels[k]);
      const ImVec2 p = ImGui::GetCursorScreenPos();
      const float width = avail.x - 10;
      const float u0 = pan_, u1 = pan_ + 1.0f / zoom_;
      ImGui::Image(reinterpret_cast<ImTextureID>(static_cast<std::intptr_t>(textures_[k])), ImVec2(width, h),
                   ImVec2(u0, 0), ImVec2(u1, 1));
      interact(ctx, *out, qh, p, width, h);
      // Modality boundaries (and the context / decode boundary) as vertical lines.
      ImDrawList* dl = ImGui::GetWindowDrawList();
      const trace::Tokens& tok = ctx.model.tokens();
      const int N = out->T + out->S;
      auto key_x = [&](int key) { return p.x + ((static_cast<float>(key) / N) - u0) / (u1 - u0) * width; };
      dl->PushClipRect(p, ImVec2(p.x + width, p.y + h), true);
      for (int t = 1; t <= out->T; ++t) {
        const bool boundary = t == out->T || tok.modality[t] != tok.modality[t - 1];
        if (boundary) {
          const float x = key_x(t);
          dl->AddLine(ImVec2(x, p.y), ImVec2(x, p.y + h),
                      t == out->T ? IM_COL32(255, 255, 255, 200)
                                  : w::modality_color(t < out->T ? tok.modality[t] : 0));
        }
      }
      dl->PopClipRect();
    }
  }

 private:
  void interact(ViewContext& ctx, const LayerOutcome& out, int qh, ImVec2 p, float width, float h) {
    if (!ImGui::IsItemHovered() || ctx.headless) return;
    ImGuiIO& io = ImGui::GetIO();
    const float fx = std::clamp((io.MousePos.x - p.x) / width, 0.0f, 1.0f);
    const float u = pan_ + fx / zoom_;
    if (io.MouseWheel != 0) {
      zoom_ = std::clamp(zoom_ * (io.MouseWheel > 0 ? 1.25f : 0.8f), 1.0f, 512.0f);
      pan_ = u - fx / zoom_;  // keep the key under the cursor in place
    }
    if (ImGui::IsMouseDragging(ImGuiMouseButton_Left)) pan_ -= io.MouseDelta.x / width / zoom_;
    if (ImGui::IsMouseDoubleClicked(0)) zoom_ = 1, pan_ = 0;
    pan_ = std::clamp(pan_, 0.0f, 1.0f - 1.0f / zoom_);
    const int N = out.T + out.S;
    const int key = std::clamp(static_cast<int>(u * N), 0, N - 1);
    const int s = std::clamp(static_cast<int>((io.MousePos.y - p.y) / h * out.S), 0, out.S - 1);
    const std::size_t i = (static_cast<std::size_t>(qh) * out.S + s) * N + key;
    const trace::Tokens& tok = ctx.model.tokens();
    ImGui::SetTooltip("query %d, key %d (%s)\nfull %.5f\ncompressed %.5f", s, key,
                      key < out.T ? w::modality_name(tok.modality[key]) : "decode", out.attn_full[i],
                      out.attn_compressed[i]);
  }

  void upload(const std::shared_ptr<const LayerOutcome>& outcome, int qh) {
    const LayerOutcome& out = *outcome;
    if (!textures_[0]) glGenTextures(3, textures_);
    const int N = out.T + out.S, S = out.S;
    pool_ = (N + kMaxColumns - 1) / kMaxColumns;
    const int cols = (N + pool_ - 1) / pool_;
    std::vector<float> pooled[2];
    for (int k = 0; k < 2; ++k) {
      const std::vector<float>& src = k == 0 ? out.attn_full : out.attn_compressed;
      pooled[k].assign(static_cast<std::size_t>(S) * cols, 0.0f);
      for (int s = 0; s < S; ++s) {
        const float* row = &src[(static_cast<std::size_t>(qh) * S + s) * N];
        for (int j = 0; j < N; ++j) {
          float& cell = pooled[k][static_cast<std::size_t>(s) * cols + j / pool_];
          cell = std::max(cell, row[j]);
        }
      }
    }
    for (int k = 0; k < 3; ++k) {
      std::vector<std::uint32_t> rgba(static_cast<std::size_t>(S) * cols);
      for (int s = 0; s < S; ++s) {
        float row_max = 1e-12f;
        for (int c = 0; c < cols; ++c) {
          row_max = std::max({row_max, pooled[0][static_cast<std::size_t>(s) * cols + c],
                              pooled[1][static_cast<std::size_t>(s) * cols + c]});
        }
        for (int c = 0; c < cols; ++c) {
          const std::size_t i = static_cast<std::size_t>(s) * cols + c;
          const ImVec4 v =
              k < 2 ? w::heat(std::sqrt(pooled[k][i] / row_max))
                    : w::diverging(std::copysign(std::sqrt(std::abs(pooled[1][i] - pooled[0][i]) / row_max),
                                                 pooled[1][i] - pooled[0][i]));
          rgba[i] = ImGui::ColorConvertFloat4ToU32(v);  // ImU32 is ABGR in memory order RGBA on little-endian
        }
      }
      glBindTexture(GL_TEXTURE_2D, textures_[k]);
      glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_MIN_FILTER, GL_NEAREST);
      glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_MAG_FILTER, GL_NEAREST);
      glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_WRAP_S, GL_CLAMP_TO_EDGE);
      glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_WRAP_T, GL_CLAMP_TO_EDGE);
      glPixelStorei(GL_UNPACK_ALIGNMENT, 4);
      glTexImage2D(GL_TEXTURE_2D, 0, GL_RGBA, cols, S, 0, GL_RGBA, GL_UNSIGNED_BYTE, rgba.data());
    }
    uploaded_ = outcome;
    uploaded_head_ = qh;
  }

  GLuint textures_[3] = {0, 0, 0};
  std::shared_ptr<const LayerOutcome> uploaded_;
  int uploaded_head_ = -1;
  int pool_ = 1;
  float zoom_ = 1, pan_ = 0;
};

}  // namespace

std::unique_ptr<Panel> make_attention_panel() { return std::make_unique<AttentionPanel>(); }

}  // namespace kvscope::viewer
