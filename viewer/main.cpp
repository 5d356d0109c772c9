// kvview: Dear ImGui viewer for kvscope traces and simulation results (docs/viewer.md).
//   kvview [TRACE] [--results R]                       interactive window
//   kvview TRACE --results R --view NAME --screenshot out.png [--size WxH]   headless PNG
#define GLFW_INCLUDE_NONE
#include <GL/gl.h>
#include <GLFW/glfw3.h>
#include <imgui.h>
#include <imgui_impl_glfw.h>
#include <imgui_impl_opengl3.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvscope/cli/options.hpp"
#include "kvscope/trace/untrusted.hpp"
#include "model.hpp"
#include "screenshot.hpp"
#include "view.hpp"

namespace po = boost::program_options;
using kvscope::viewer::LoadState;

namespace {

constexpr int kExitUsage = 2;

struct Options {
  std::string trace, results, view = "overview", screenshot, point;
  int layer = -1, kv_head = -1;
  int width = 1280, height = 800;
  double timeout = 120;
  int bench_frames = 0;
};

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "kvview: " << msg << " (see kvview --help)\n";
  std::exit(kExitUsage);
}

Options parse(int argc, char** argv) {
  Options o;
  std::string size;
  std::string names;
  for (const std::string& n : kvscope::viewer::View::view_names()) names += (names.empty() ? "" : ", ") + n;
  po::options_description desc(
      "kvview: look at a kvscope trace and the results of kvsim sweep.\n\n"
      "Usage:\n  kvview [TRACE.h5] [--results RESULTS.h5]\n"
      "  kvview TRACE.h5 --results RESULTS.h5 --view NAME --screenshot OUT.png [--size WxH]\n\n"
      "Files load in the background; an unreadable file is reported in the window and on stderr.\n"
      "Headless mode renders one view once loading and recomputation are done, writes a PNG and prints\n"
      "'screenshot: FILE WxH mean=M stddev=S hash=H'. Exit codes: 0 ok, 1 no window / capture failed /\n"
      "--timeout reached, 2 bad arguments, a file that cannot be loaded, or a layer the view needs that\n"
      "cannot be read (one line on stderr). Input files are parsed first in an isolated child process\n"
      "(10 s per object, 1 GiB): a corrupt file is reported, never crashes or hangs kvview.\n\nOptions");
  desc.add_options()("help,h", "show this help")(
      "trace", po::value(&o.trace),
      "trace file (written by kvcap run or kvcap synth); also the first positional argument")(
      "results,r", po::value(&o.results), "results file written by kvsim sweep -o FILE.h5")(
      "view", po::value(&o.view),
      ("view to show first / to capture: " + names + " (default overview)").c_str())(
      "point", po::value(&o.point),
      "select this point first: POLICY@BUDGET, e.g. h2o@0.2 (default: first Pareto point)")(
      "layer", po::value(&o.layer), "select this layer first (default: the middle layer)")(
      "kv-head", po::value(&o.kv_head), "select this kv head first (default 0)")(
      "screenshot", po::value(&o.screenshot), "headless: render --view and write this PNG, then exit")(
      "size", po::value(&size), "window / screenshot size WxH (default 1280x800)")(
      "timeout", po::value(&o.timeout),
      "headless: give up after this many seconds of loading and recomputing, exit 1 (default 120)")(
      "trusted-files", kvscope::trace::kTrustedFilesHelp)(
      "bench-frames", po::value(&o.bench_frames),
      "headless: also time this many frames of the view after loading and print their mean and max");
  po::positional_options_description pos;
  pos.add("trace", 1);
  po::variables_map vm;
  const std::vector<std::string> args(argv + 1, argv + argc);
  const std::string epilog = "\nViews: " + names + "\n";
  if (const auto exit = kvscope::cli::parse_options("kvview", args, desc, vm, epilog, &pos)) std::exit(*exit);
  if (vm.count("trusted-files")) kvscope::trace::set_trusted_files(true);
  const auto views = kvscope::viewer::View::view_names();
  if (std::find(views.begin(), views.end(), o.view) == views.end()) {
    usage_error("--view: unknown view '" + o.view + "'; valid: " + names);
  }
  if (!size.empty()) {
    int w = 0, h = 0;
    char extra = 0;
    if (std::sscanf(size.c_str(), "%dx%d%c", &w, &h, &extra) != 2 || w < 200 || h < 150 || w > 8192 ||
        h > 8192) {
      usage_error("--size: '" + size + "' is not WxH with 200 <= W, 150 <= H, both <= 8192");
    }
    o.width = w;
    o.height = h;
  }
  if (o.timeout <= 0) usage_error("--timeout must be positive");
  if (vm.count("layer") && o.layer < 0) usage_error("--layer must be >= 0");
  if (vm.count("kv-head") && o.kv_head < 0) usage_error("--kv-head must be >= 0");
  if (o.bench_frames < 0) usage_error("--bench-frames must be >= 0");
  if (o.screenshot.empty() && o.bench_frames > 0) usage_error("--bench-frames needs --screenshot");
  return o;
}

// Headless --timeout, enforced whatever the loading thread is doing: a loader stuck inside a
// library call cannot be interrupted, so at the deadline this thread prints one line and ends
// the process with _exit (exit 1), without waiting for the loader.
class Watchdog {
 public:
  explicit Watchdog(double seconds)
      : thread_([this, seconds] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return disarmed_; }))
            return;
          char line[160];
          const int n = std::snprintf(
              line, sizeof line, "kvview: still loading or recomputing after %g s; no screenshot\n", seconds);
          if (n > 0) (void)!::write(STDERR_FILENO, line, static_cast<std::size_t>(n));
          ::_exit(1);
        }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    disarm();
    thread_.join();
  }
  void disarm() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      disarmed_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool disarmed_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

void glfw_error(int code, const char* message) {
  std::cerr << "kvview: GLFW error " << code << ": " << message << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  const bool headless = !opt.screenshot.empty();
  std::unique_ptr<Watchdog> watchdog;
  if (headless) watchdog = std::make_unique<Watchdog>(opt.timeout);

  kvscope::viewer::Model model;
  if (!opt.trace.empty() || !opt.results.empty()) model.load(opt.trace, opt.results);

  glfwSetErrorCallback(glfw_error);
  if (!glfwInit()) {
    std::cerr << "kvview: cannot initialise GLFW (no display? try xvfb-run -a)\n";
    return 1;
  }
  glfwWindowHint(GLFW_CONTEXT_VERSION_MAJOR, 3);
  glfwWindowHint(GLFW_CONTEXT_VERSION_MINOR, 0);
  if (headless) glfwWindowHint(GLFW_VISIBLE, GLFW_FALSE);
  GLFWwindow* window = glfwCreateWindow(opt.width, opt.height, "kvview", nullptr, nullptr);
  if (!window) {
    std::cerr << "kvview: cannot create an OpenGL 3 window\n";
    glfwTerminate();
    return 1;
  }
  glfwMakeContextCurrent(window);
  glfwSwapInterval(headless ? 0 : 1);

  IMGUI_CHECKVERSION();
  ImGui::CreateContext();
  ImGui::GetIO().IniFilename = nullptr;  // no imgui.ini next to the user's files
  ImGui::StyleColorsDark();
  ImGui_ImplGlfw_InitForOpenGL(window, true);
  ImGui_ImplOpenGL3_Init("#version 130");

  int exit_code = 0;
  bool error_reported = false;
  {
    kvscope::viewer::View view(model, headless);
    view.focus(opt.view);
    view.preselect(opt.point, opt.layer, opt.kv_head);
    int idle_frames = 0, bench_done = -1;
    double bench_sum = 0, bench_max = 0;
    while (!glfwWindowShouldClose(window)) {
      if (headless) {
        glfwPollEvents();
      } else {
        glfwWaitEventsTimeout(view.busy() ? 0.03 : 0.25);
      }
      const auto t0 = std::chrono::steady_clock::now();
      const bool busy_before = view.busy();
      ImGui_ImplOpenGL3_NewFrame();
      ImGui_ImplGlfw_NewFrame();
      ImGui::NewFrame();
      int fw = 0, fh = 0;
      glfwGetFramebufferSize(window, &fw, &fh);
      view.draw(static_cast<float>(fw), static_cast<float>(fh));
      ImGui::Render();
      glViewport(0, 0, fw, fh);
      glClearColor(0.08f, 0.08f, 0.1f, 1.0f);
      glClear(GL_COLOR_BUFFER_BIT);
      ImGui_ImplOpenGL3_RenderDrawData(ImGui::GetDrawData());
      glFinish();
      const double frame_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

      if (!error_reported && (model.state() == LoadState::kFailed || !view.selection_error().empty() ||
                              (headless && !view.layer_error().empty()))) {
        std::cerr << "kvview: "
                  << (model.state() == LoadState::kFailed ? model.error()
                      : !view.selection_error().empty()   ? view.selection_error()
                                                          : view.layer_error())
                  << "\n";
        error_reported = true;
      }
      if (headless) {
        const bool settled = model.state() != LoadState::kLoading && !busy_before && !view.busy();
        idle_frames = settled ? idle_frames + 1 : 0;
        if (bench_done >= 0) {
          bench_sum += frame_ms;
          bench_max = std::max(bench_max, frame_ms);
          if (++bench_done == opt.bench_frames) break;
        } else if (idle_frames >= 3) {
          kvscope::viewer::ImageStats stats;
          std::string err;
          if (!kvscope::viewer::write_screenshot(opt.screenshot, fw, fh, &stats, &err)) {
            std::cerr << "kvview: " << opt.screenshot << ": " << err << "\n";
            exit_code = 1;
            break;
          }
          std::printf("screenshot: %s %dx%d mean=%.3f stddev=%.3f hash=%016llx\n", opt.screenshot.c_str(), fw,
                      fh, stats.mean, stats.stddev, static_cast<unsigned long long>(stats.hash));
          watchdog->disarm();  // loading is over; --bench-frames are not limited
          if (error_reported) exit_code = kExitUsage;
          if (opt.bench_frames == 0 || exit_code) break;
          bench_done = 0;
        }
      }
      glfwSwapBuffers(window);
    }
    if (bench_done > 0) {
      std::printf("frames: %d view=%s mean=%.2f ms max=%.2f ms\n", bench_done, opt.view.c_str(),
                  bench_sum / bench_done, bench_max);
    }
  }
  ImGui_ImplOpenGL3_Shutdown();
  ImGui_ImplGlfw_Shutdown();
  ImGui::DestroyContext();
  glfwDestroyWindow(window);
  glfwTerminate();
  model.wait();
  return exit_code;
}
