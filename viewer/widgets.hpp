// Drawing helpers shared by kvview's panels: modality colours, colour maps, number formatting,
// plot frames. Header-only, ImGui only (no model access).
#pragma once

#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvscope::viewer::widgets {

inline const char* modality_name(int m) {
  static const char* names[] = {"text", "vision", "audio", "special"};
  return m >= 0 && m < 4 ? names[m] : "?";
}

inline ImU32 modality_color(int m, float alpha = 1.0f) {
  static const ImVec4 c[] = {
      {0.30f, 0.60f, 0.95f, 1}, {0.95f, 0.55f, 0.20f, 1}, {0.40f, 0.80f, 0.40f, 1}, {0.75f, 0.45f, 0.85f, 1}};
  ImVec4 v = m >= 0 && m < 4 ? c[m] : ImVec4(0.5f, 0.5f, 0.5f, 1);
  v.w = alpha;
  return ImGui::ColorConvertFloat4ToU32(v);
}

// Sequential colour map for x in [0, 1] (dark blue -> teal -> yellow), viridis-like.
inline ImVec4 heat(float x) {
  x = std::clamp(std::isfinite(x) ? x : 0.0f, 0.0f, 1.0f);
  const ImVec4 stops[] = {{0.07f, 0.04f, 0.25f, 1},
                          {0.20f, 0.35f, 0.55f, 1},
                          {0.15f, 0.62f, 0.55f, 1},
                          {0.55f, 0.80f, 0.30f, 1},
                          {0.99f, 0.90f, 0.15f, 1}};
  const float f = x * 4.0f;
  const int i = std::min(3, static_cast<int>(f));
  const float t = f - static_cast<float>(i);
  const ImVec4 a = stops[i], b = stops[i + 1];
  return ImVec4(a.x + (b.x - a.x) * t, a.y + (b.y - a.y) * t, a.z + (b.z - a.z) * t, 1);
}
inline ImU32 heat_u32(float x) { return ImGui::ColorConvertFloat4ToU32(heat(x)); }

// Diverging map for x in [-1, 1]: blue (negative) - black - red (positive).
inline ImVec4 diverging(float x) {
  x = std::clamp(std::isfinite(x) ? x : 0.0f, -1.0f, 1.0f);
  return x >= 0 ? ImVec4(0.1f + 0.9f * x, 0.1f, 0.1f, 1)
                : ImVec4(0.1f, 0.1f + 0.3f * -x, 0.1f + 0.9f * -x, 1);
}

inline std::string bytes_text(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::abs(b) >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

inline std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// "L12", "h3": a short prefix and a number (also sidesteps GCC 12's -Wrestrict false positive on
// "x" + std::string).
inline std::string label(const char* prefix, long long n) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%s%lld", prefix, n);
  return buf;
}

// A plot area of the remaining width: data (x0..x1, y0..y1) maps into the inner rectangle.
struct PlotFrame {
  ImVec2 min, max;  // inner rectangle in screen space
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  ImVec2 to_screen(double x, double y) const {
    const double fx = x1 > x0 ? (x - x0) / (x1 - x0) : 0.5;
    const double fy = y1 > y0 ? (y - y0) / (y1 - y0) : 0.5;
    return ImVec2(min.x + static_cast<float>(fx) * (max.x - min.x),
                  max.y - static_cast<float>(fy) * (max.y - min.y));
  }
};

// Reserves `size` (width <= 0: all available), draws axes with 5 ticks and labels, returns the frame.
inline PlotFrame plot_frame(const char* id, ImVec2 size, double x0, double x1, double y0, double y1,
                            const char* xlabel, const char* ylabel) {
  ImDrawList* dl = ImGui::GetWindowDrawList();
  if (size.x <= 0) size.x = ImGui::GetContentRegionAvail().x;
  const ImVec2 p = ImGui::GetCursorScreenPos();
  ImGui::InvisibleButton(id, size);
  PlotFrame f;
  f.min = ImVec2(p.x + 60, p.y + 10);
  f.max = ImVec2(p.x + size.x - 15, p.y + size.y - 40);
  f.x0 = x0, f.x1 = x1, f.y0 = y0, f.y1 = y1;
  dl->AddRectFilled(f.min, f.max, IM_COL32(25, 25, 30, 255));
  dl->AddRect(f.min, f.max, IM_COL32(120, 120, 120, 255));
  for (int i = 0; i <= 4; ++i) {
    const double x = x0 + (x1 - x0) * i / 4.0, y = y0 + (y1 - y0) * i / 4.0;
    const ImVec2 sx = f.to_screen(x, y0), sy = f.to_screen(x0, y);
    dl->AddLine(ImVec2(sx.x, f.min.y), ImVec2(sx.x, f.max.y), IM_COL32(60, 60, 60, 255));
    dl->AddLine(ImVec2(f.min.x, sy.y), ImVec2(f.max.x, sy.y), IM_COL32(60, 60, 60, 255));
    dl->AddText(ImVec2(sx.x - 12, f.max.y + 4), IM_COL32(200, 200, 200, 255), fmt("%.3g", x).c_str());
    dl->AddText(ImVec2(p.x + 2, sy.y - 7), IM_COL32(200, 200, 200, 255), fmt("%.3g", y).c_str());
  }
  dl->AddText(ImVec2((f.min.x + f.max.x) / 2 - 40, f.max.y + 20), IM_COL32(230, 230, 230, 255), xlabel);
  dl->AddText(ImVec2(f.min.x + 4, f.min.y + 2), IM_COL32(230, 230, 230, 255), ylabel);
  return f;
}

// Colour legend for the modalities.
inline void modality_legend() {
  for (int m = 0; m < 4; ++m) {
    if (m) ImGui::SameLine();
    ImGui::ColorButton(modality_name(m), ImGui::ColorConvertU32ToFloat4(modality_color(m)),
                       ImGuiColorEditFlags_NoTooltip, ImVec2(12, 12));
    ImGui::SameLine();
    ImGui::TextUnformatted(modality_name(m));
  }
}

// A distinct colour for the i-th series.
inline ImU32 series_color(int i) {
  const float h = std::fmod(0.13f + 0.61803f * static_cast<float>(i), 1.0f);
  float r, g, b;
  ImGui::ColorConvertHSVtoRGB(h, 0.65f, 0.95f, r, g, b);
  return ImGui::ColorConvertFloat4ToU32(ImVec4(r, g, b, 1));
}

}  // namespace kvscope::viewer::widgets
