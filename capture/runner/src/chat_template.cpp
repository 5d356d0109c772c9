// ChatML recognised by structure: the template is lexed into canonical tokens (tags, names, operators,
// string literals with adjacent `+` concatenations folded, `a.b` written a['b']) and compared with the
// canonical ChatML forms; text between tags must be whitespace that Jinja (with transformers' trim_blocks
// and lstrip_blocks, or `-` markers) drops.
#include "kvscope/runner/chat_template.hpp"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvscope/runner/error.hpp"

namespace kvscope::runner {
namespace {

struct Tok {
  bool literal = false;
  std::string text;  // the decoded value of a literal, else the token itself
  bool operator==(const Tok& o) const { return literal == o.literal && text == o.text; }
};

struct NotChatml {
  std::string why;
};

// Lexes the inside of one {{ }} or {% %} tag.
void lex_tag(const std::string& s, std::vector<Tok>& out) {
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (c == '\'' || c == '"') {
      std::string v;
      std::size_t k = i + 1;
      for (; k < s.size() && s[k] != c; ++k) {
        if (s[k] == '\\' && k + 1 < s.size()) {
          const char e = s[++k];
          v += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
        } else {
          v += s[k];
        }
      }
      if (k >= s.size()) throw NotChatml{"an unterminated string"};
      out.push_back({true, v});
      i = k + 1;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t k = i;
      while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
      const std::string name = s.substr(i, k - i);
      // a.b is a['b']
      if (!out.empty() && out.back().text == "." && !out.back().literal) {
        out.back() = {false, "["};
        out.push_back({true, name});
        out.push_back({false, "]"});
      } else {
        out.push_back({false, name});
      }
      i = k;
    } else if (i + 1 < s.size() && (s.substr(i, 2) == "!=" || s.substr(i, 2) == "==")) {
      out.push_back({false, s.substr(i, 2)});
      i += 2;
    } else {
      out.push_back({false, std::string(1, c)});
      ++i;
    }
  }
  // fold 'a' + 'b' into 'ab'
  std::vector<Tok> folded;
  for (const Tok& t : out) {
    const std::size_t n = folded.size();
    if (t.literal && n >= 2 && folded[n - 1] == Tok{false, "+"} && folded[n - 2].literal) {
      folded.pop_back();
      folded.back().text += t.text;
    } else {
      folded.push_back(t);
    }
  }
  out.swap(folded);
}

// The canonical token stream of a whole template.
std::vector<Tok> lex(const std::string& src) {
  std::vector<Tok> out;
  std::size_t i = 0;
  bool trim_next = false;    // the previous tag ended with '-'
  bool after_block = false;  // the previous tag was {% %} (trim_blocks drops one newline after it)
  while (i < src.size()) {
    const std::size_t open = src.find('{', i);
    std::size_t tag = std::string::npos;
    for (std::size_t k = open; k != std::string::npos && k + 1 < src.size(); k = src.find('{', k + 1)) {
      if (src[k + 1] == '{' || src[k + 1] == '%' || src[k + 1] == '#') {
        tag = k;
        break;
      }
    }
    std::string text = src.substr(i, (tag == std::string::npos ? src.size() : tag) - i);
    const bool block_next = tag != std::string::npos && src[tag + 1] != '{';
    const bool trim_before = tag != std::string::npos && tag + 2 < src.size() && src[tag + 2] == '-';
    // Jinja whitespace control: `-` strips all; trim_blocks drops the newline after a block tag;
    // lstrip_blocks drops spaces and tabs from a line start up to a block tag.
    if (trim_next)
      text.erase(0, text.find_first_not_of(" \t\r\n") == std::string::npos
                        ? text.size()
                        : text.find_first_not_of(" \t\r\n"));
    else if (after_block && !text.empty() && text[0] == '\n')
      text.erase(0, 1);
    if (trim_before) {
      const std::size_t last = text.find_last_not_of(" \t\r\n");
      text.erase(last == std::string::npos ? 0 : last + 1);
    } else if (block_next) {
      const std::size_t nl = text.find_last_not_of(" \t");
      if (nl == std::string::npos || text[nl] == '\n') text.erase(nl == std::string::npos ? 0 : nl + 1);
    }
    if (!text.empty()) throw NotChatml{"text outside the tags"};
    if (tag == std::string::npos) break;
    const char kind = src[tag + 1];
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const std::size_t end = src.find(close, tag + 2);
    if (end == std::string::npos) throw NotChatml{"an unterminated tag"};
    std::string inner = src.substr(tag + 2, end - tag - 2);
    if (!inner.empty() && inner.front() == '-') inner.erase(0, 1);
    trim_next = !inner.empty() && inner.back() == '-';
    if (trim_next) inner.pop_back();
    if (!inner.empty() && inner.back() == '+') inner.pop_back();  // {%+ / +%}: no trim
    if (kind != '#') {
      out.push_back({false, kind == '{' ? "{{" : "{%"});
      lex_tag(inner, out);
      out.push_back({false, close});
    }
    after_block = kind != '{';
    i = end + 2;
  }
  return out;
}

const std::string kSystemHead = "<|im_start|>system\n";
const std::string kSystemTail = "<|im_end|>\n";

std::vector<Tok> chatml(bool with_system) {
  std::string t = "{% for message in messages %}";
  if (with_system) {
    t += "{% if loop.first and messages[0]['role'] != 'system' %}{{ '\x01' }}{% endif %}";
  }
  t += "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  return lex(t);
}

}  // namespace

ChatTemplate ChatTemplate::parse(const std::string& source, const std::string& origin) {
  const auto refuse = [&](const std::string& why) {
    return RunnerError(ErrorKind::kModel,
                       origin + ": unsupported chat template (" + why +
                           "): only ChatML templates (<|im_start|>role\\ncontent<|im_end|>, "
                           "optionally with a default system prompt) are supported");
  };
  std::vector<Tok> got;
  try {
    got = lex(source);
  } catch (const NotChatml& e) {
    throw refuse(e.why);
  }
  for (const bool with_system : {true, false}) {
    const std::vector<Tok> want = chatml(with_system);
    if (want.size() != got.size()) continue;
    ChatTemplate t;
    t.injects_system_ = with_system;
    bool same = true;
    for (std::size_t k = 0; k < want.size() && same; ++k) {
      if (want[k].literal && want[k].text == "\x01") {
        const std::string& s = got[k].text;
        same = got[k].literal && s.size() >= kSystemHead.size() + kSystemTail.size() &&
               s.compare(0, kSystemHead.size(), kSystemHead) == 0 &&
               s.compare(s.size() - kSystemTail.size(), kSystemTail.size(), kSystemTail) == 0;
        if (same)
          t.default_system_prompt_ =
              s.substr(kSystemHead.size(), s.size() - kSystemHead.size() - kSystemTail.size());
      } else {
        same = want[k] == got[k];
      }
    }
    if (same) return t;
  }
  throw refuse("not the ChatML structure");
}

ChatTemplate ChatTemplate::load(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path jinja = fs::path(model_dir) / "chat_template.jinja";
  const fs::path config = fs::path(model_dir) / "tokenizer_config.json";
  std::error_code ec;
  if (fs::exists(jinja, ec)) {
    std::ifstream in(jinja, std::ios::binary);
    if (!in) throw RunnerError(ErrorKind::kModel, jinja.string() + ": cannot open chat template");
    std::stringstream ss;
    ss << in.rdbuf();
    return parse(ss.str(), jinja.string());
  }
  std::ifstream in(config);
  if (!in) {
    throw RunnerError(ErrorKind::kModel, model_dir +
                                             ": no chat template (neither chat_template.jinja nor "
                                             "tokenizer_config.json)");
  }
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw RunnerError(ErrorKind::kModel, config.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("chat_template")) {
    throw RunnerError(ErrorKind::kModel, config.string() + ": no chat_template");
  }
  const nlohmann::json& t = j["chat_template"];
  if (t.is_string()) return parse(t.get<std::string>(), config.string());
  if (t.is_array()) {  // [{"name": ..., "template": ...}]: the one named "default"
    for (const auto& e : t) {
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
          e["template"].is_string()) {
        return parse(e["template"].get<std::string>(), config.string());
      }
    }
  }
  throw RunnerError(ErrorKind::kModel, config.string() +
                                           ": chat_template is neither a string nor a list with a "
                                           "\"default\" template");
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string out;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    if (i == 0 && injects_system_ && messages[0].role != "system") {
      out += kSystemHead + default_system_prompt_ + kSystemTail;
    }
    out += "<|im_start|>" + messages[i].role + "\n" + messages[i].content + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace kvscope::runner
