// Test tool for the comparison with Hugging Face (tests/runner/bpe_vs_hf.py):
//   bpe_tokenize_tool encode TOKENIZER_JSON FILE...   -> [{"ids": [...], "lossless": true}, ...] and the
//                                                        encoding time in seconds on stderr
//   bpe_tokenize_tool chat MODEL_DIR CONVERSATIONS_JSON -> [[render without, render with generation
//                                                        prompt], ...] for [[{"role", "content"}, ...], ...]
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvscope/runner/bpe_tokenizer.hpp"
#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/error.hpp"

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvscope::runner;
  if (argc < 3) {
    std::cerr
        << "usage: bpe_tokenize_tool encode TOKENIZER_JSON FILE... | chat MODEL_DIR CONVERSATIONS_JSON\n";
    return 2;
  }
  try {
    const std::string mode = argv[1];
    nlohmann::json out = nlohmann::json::array();
    if (mode == "encode") {
      const BpeTokenizer tok = BpeTokenizer::load(argv[2]);
      double seconds = 0;
      std::size_t bytes = 0;
      for (int i = 3; i < argc; ++i) {
        const std::string text = slurp(argv[i]);
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<std::int32_t> ids = tok.encode(text);
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bytes += text.size();
        out.push_back({{"ids", ids}, {"lossless", tok.decode(ids) == text}});
      }
      std::cerr << "encoded " << bytes << " bytes in " << seconds << " s\n";
    } else if (mode == "chat" && argc == 4) {
      const ChatTemplate chat = ChatTemplate::load(argv[2]);
      for (const auto& conv : nlohmann::json::parse(slurp(argv[3]))) {
        std::vector<ChatMessage> messages;
        for (const auto& m : conv)
          messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
        out.push_back({chat.render(messages, false), chat.render(messages, true)});
      }
    } else {
      std::cerr << "bpe_tokenize_tool: unknown mode " << mode << "\n";
      return 2;
    }
    std::cout << out.dump() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "bpe_tokenize_tool: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
