// kvcap import-gguf: argument checks here, the conversion in Python (the PyPI gguf package reads and
// dequantizes), run as a child process in kvscope's Python environment.
#include "import_gguf_command.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "kvscope/cli/options.hpp"

namespace kvscope::cli {
namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;

constexpr const char* kProgram = "kvcap import-gguf";

int fail(const std::string& msg) { return cli::fail(kProgram, msg); }

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// KVSCOPE_PYTHON, else the environment scripts/setup makes for this checkout's requirements.lock
// (scripts/lib/env.sh resolves the same path).
std::string python_path() {
  if (const char* p = std::getenv("KVSCOPE_PYTHON"); p && *p) return p;
  const std::string home = env_or("HOME", "/nonexistent");
  const std::string cache = env_or("KVSCOPE_CACHE", env_or("XDG_CACHE_HOME", home + "/.cache") + "/kvscope");
  return cache + "/venv-" KVSCOPE_VENV_HASH "/bin/python";
}

po::options_description make_options() {
  po::options_description opts(
      "kvcap import-gguf FILE.gguf -o DIR [-q]\n\n"
      "Converts a LLaMA-family GGUF file (llama.cpp's format) into a Hugging Face model folder that\n"
      "kvcap run, kvcap eval and transformers' LlamaForCausalLM load: config.json, generation_config.json,\n"
      "model.safetensors (float32, dequantized), tokenizer.json, tokenizer_config.json, chat_template.jinja\n"
      "and kvscope-import.json (source file, SHA-256, tensor types). The q_proj/k_proj rows that llama.cpp\n"
      "permutes for its RoPE layout are permuted back. DIR is written as DIR.partial and renamed when\n"
      "complete; an existing DIR is replaced.\n\n"
      "Supported: architecture llama (LLaMA, SmolLM, Mistral-style GGUFs that declare 'llama'), tied or\n"
      "separate output embeddings, no RoPE scaling; tensor types F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,\n"
      "Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; tokenizer.ggml.model gpt2 (byte-level BPE)\n"
      "with pre-tokenizer gpt2 or smollm. Anything else is refused with one line naming it.\n\n"
      "Runs Python (module kvscope.gguf_import, packages gguf, numpy, safetensors) from the environment\n"
      "scripts/setup creates, or $KVSCOPE_PYTHON.\n\nOptions");
  opts.add_options()("help,h", "show this help")("input", po::value<std::string>(), "the .gguf file")(
      "output,o", po::value<std::string>(), "model folder to write")("quiet,q", "no progress on stderr");
  return opts;
}

}  // namespace

int import_gguf_command(const std::vector<std::string>& args) {
  const po::options_description opts = make_options();
  po::positional_options_description pos;
  pos.add("input", 1);
  po::variables_map vm;
  const std::string examples =
      "\nExample:\n"
      "  kvcap import-gguf SmolLM2-135M-Instruct.Q4_1.gguf -o ~/.cache/kvscope/models/smollm2\n"
      "  kvcap run --model ~/.cache/kvscope/models/smollm2 --chat --prompt \"Hello\" -o t.h5\n";
  if (const auto exit = parse_options(kProgram, args, opts, vm, examples, &pos)) return *exit;
  if (!vm.count("input")) return missing(kProgram, "the .gguf file");
  if (!vm.count("output")) return missing(kProgram, "-o DIR");
  const std::string in = vm["input"].as<std::string>(), out = vm["output"].as<std::string>();
  std::error_code ec;
  if (!fs::exists(in, ec)) return fail(in + ": no such file");
  if (!fs::is_regular_file(in, ec)) return fail(in + ": not a regular file");
  if (out.empty()) return fail("-o: empty folder name");
  const std::string python = python_path();
  if (access(python.c_str(), X_OK) != 0) {
    return fail("no Python environment at " + python +
                " (run scripts/setup, or set KVSCOPE_PYTHON to a python with gguf, numpy and safetensors)");
  }
  std::vector<std::string> argv_s = {python, "-m", "kvscope.gguf_import", in, "-o", out};
  if (vm.count("quiet")) argv_s.push_back("-q");
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::cout.flush();
  const pid_t pid = fork();
  if (pid < 0) return fail("cannot start Python (fork failed)");
  if (pid == 0) {
    const std::string path = env_or("PYTHONPATH", "");
    setenv("PYTHONPATH", (std::string(KVSCOPE_PYTHON_SOURCE) + (path.empty() ? "" : ":" + path)).c_str(), 1);
    for (const char* v : {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"}) setenv(v, "1", 1);
    execv(python.c_str(), argv.data());
    std::cerr << "kvcap import-gguf: cannot run " << python << "\n";
    _exit(kExitError);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return fail("lost the Python child process");
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status) == 0 ? kExitOk : kExitError;
  return fail("the converter was killed by signal " + std::to_string(WTERMSIG(status)));
}

}  // namespace kvscope::cli
