// The chat template of a model folder (chat_template.jinja, else tokenizer_config.json's chat_template),
// rendered without a Jinja interpreter: the template is recognised by structure as ChatML
// (<|im_start|>ROLE\nCONTENT<|im_end|>\n per message, optionally with a default system prompt injected
// when the first message is not a system message, as SmolLM2's does) and rendered natively.
#pragma once

#include <string>
#include <vector>

namespace kvscope::runner {

struct ChatMessage {
  std::string role, content;
};

class ChatTemplate {
 public:
  // Throws RunnerError(kModel) naming the file when there is no template or it is not ChatML.
  static ChatTemplate load(const std::string& model_dir);
  // Parses template source (`origin` names it in errors). Throws RunnerError(kModel) unless it is ChatML.
  static ChatTemplate parse(const std::string& source, const std::string& origin);

  // What HF's apply_chat_template(messages, tokenize=False, add_generation_prompt=...) returns.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  // The system prompt the template adds when the first message is not "system" ("" when it adds none).
  const std::string& default_system_prompt() const { return default_system_prompt_; }

 private:
  bool injects_system_ = false;
  std::string default_system_prompt_;
};

}  // namespace kvscope::runner
