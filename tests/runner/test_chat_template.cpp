// ChatTemplate: ChatML recognised by structure (SmolLM2's template with its default system prompt, the
// plain form, whitespace-control variants), rendered as HF's apply_chat_template renders it (the
// comparison with HF itself is ctest bpe_vs_hf); anything else refused naming the file.
#include <unistd.h>

#include <fstream>

#include "kvscope/runner/chat_template.hpp"
#include "kvscope/runner/error.hpp"
#include "runner_test_util.hpp"
#include "scratch.hpp"

namespace kvscope::runner {
namespace {

namespace fs = std::filesystem;

// This test's folder in the process's scratch directory (removed when the process exits).
struct TempDir {
  fs::path path =
      kvscope::testing::scratch_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
};

// SmolLM2-135M-Instruct's chat_template.jinja
const std::string kSmol =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const std::string kSys =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

TEST(ChatTemplate, SmolLm2DefaultSystemPrompt) {
  const ChatTemplate t = ChatTemplate::parse(kSmol, "chat_template.jinja");
  EXPECT_EQ(t.default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(t.render({{"user", "Hi"}}, false), kSys + "<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_EQ(t.render({{"user", "Hi"}}, true),
            kSys + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.render({{"system", "S"}, {"user", "U"}}, true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.render({{"user", "a"}, {"assistant", "b"}, {"user", "c"}}, false),
            kSys +
                "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_"
                "end|>\n");
  EXPECT_EQ(t.render({}, true), "<|im_start|>assistant\n");
}

TEST(ChatTemplate, OtherSpellingsOfChatml) {
  // escapes instead of raw newlines, double quotes, attribute access, whitespace control, a changed prompt
  const std::string escaped =
      "{%- for message in messages -%}\n  {%- if loop.first and messages[0].role != \"system\" -%}\n"
      "    {{- \"<|im_start|>system\\n\" + \"Be brief.\" + \"<|im_end|>\\n\" -}}\n  {%- endif -%}\n"
      "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' -}}\n{%- endfor "
      "-%}\n"
      "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n";
  const ChatTemplate t = ChatTemplate::parse(escaped, "x.jinja");
  EXPECT_EQ(t.default_system_prompt(), "Be brief.");
  EXPECT_EQ(t.render({{"user", "Hi"}}, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  // the plain form: no system prompt injected; trim_blocks / lstrip_blocks newlines and indentation
  const std::string plain =
      "{% for message in messages %}\n{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + "
      "'\n'}}{% endfor %}\n  {% if add_generation_prompt %}\n{{ '<|im_start|>assistant\n' }}{% endif %}\n";
  const ChatTemplate p = ChatTemplate::parse(plain, "plain.jinja");
  EXPECT_EQ(p.default_system_prompt(), "");
  EXPECT_EQ(p.render({{"user", "Hi"}}, true), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, RefusesOtherTemplates) {
  const std::vector<std::string> bad = {
      // Llama-2 style
      "{% for message in messages %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endfor %}",
      // ChatML with text outside the tags (would be output)
      kSmol + "\nextra",
      // indentation before {{ is output (lstrip_blocks strips it only before {% %})
      "{% for message in messages %}\n    {{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + '\n'}}{% endfor %}",
      // a different condition
      "{% for message in messages %}{% if loop.last %}{{ '<|im_start|>system\nX<|im_end|>\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
      // content before role
      "{% for message in messages %}{{'<|im_start|>' + message['content'] + '\n' + message['role'] + "
      "'<|im_end|>' + "
      "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
      "{{ 'unterminated }}",
      "",
  };
  for (const auto& src : bad) {
    try {
      ChatTemplate::parse(src, "bad.jinja");
      ADD_FAILURE() << "accepted: " << src;
    } catch (const RunnerError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kModel);
      const std::string msg = e.what();
      EXPECT_NE(msg.find("bad.jinja"), std::string::npos) << msg;
      EXPECT_NE(msg.find("only ChatML"), std::string::npos) << msg;
    }
  }
}

TEST(ChatTemplate, LoadsFromTheModelFolder) {
  TempDir dir;
  // tokenizer_config.json's chat_template when there is no chat_template.jinja
  std::ofstream(dir.path / "tokenizer_config.json") << nlohmann::json{{"chat_template", kSmol}}.dump();
  EXPECT_EQ(ChatTemplate::load(dir.path.string()).render({{"user", "Hi"}}, false),
            kSys + "<|im_start|>user\nHi<|im_end|>\n");
  // chat_template.jinja wins
  std::ofstream(dir.path / "chat_template.jinja")
      << "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
         "'<|im_end|>' + "
         "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  EXPECT_EQ(ChatTemplate::load(dir.path.string()).default_system_prompt(), "");
  fs::remove(dir.path / "chat_template.jinja");
  std::ofstream(dir.path / "tokenizer_config.json") << R"({"bos_token": "<s>"})";
  EXPECT_THROW(ChatTemplate::load(dir.path.string()), RunnerError);
  fs::remove(dir.path / "tokenizer_config.json");
  try {
    ChatTemplate::load(dir.path.string());
    ADD_FAILURE() << "a folder without a template was accepted";
  } catch (const RunnerError& e) {
    EXPECT_NE(std::string(e.what()).find("no chat template"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, RealModel) {
  const fs::path dir = testing::smollm2_dir();
  if (!fs::exists(dir / "chat_template.jinja"))
    GTEST_SKIP() << "no model at " << dir << " (run scripts/setup)";
  EXPECT_EQ(ChatTemplate::load(dir.string()).default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
}

}  // namespace
}  // namespace kvscope::runner
