// kvcap import-gguf: converts a LLaMA-family GGUF file into a Hugging Face model folder by running
// kvscope.gguf_import (capture/python) in kvscope's Python environment.
#pragma once

#include <string>
#include <vector>

namespace kvscope::cli {

// Runs `kvcap import-gguf` with the arguments after the command name. Returns the exit status: 0 written,
// 2 bad input or a file that cannot be converted (one line on stderr, no folder left behind).
int import_gguf_command(const std::vector<std::string>& args);

}  // namespace kvscope::cli
