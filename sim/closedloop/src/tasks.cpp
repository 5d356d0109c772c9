// Long-context tasks (kvscope/closedloop/tasks.hpp, docs/tasks.md).
#include "kvscope/closedloop/tasks.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

namespace kvscope::closedloop {

namespace fs = std::filesystem;

namespace {

// splitmix64 (the same generator as the runner's scenes), local so the module needs no runner code.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t uniform(std::uint64_t n) { return next() % n; }
  double unit() { return static_cast<double>(next() >> 11) / 9007199254740992.0; }  // [0, 1)
  template <class T, std::size_t N>
  const T& pick(const std::array<T, N>& a) {
    return a[uniform(N)];
  }

 private:
  std::uint64_t state_;
};

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  Rng r(a ^ (b + 0x632BE59BD9B4E019ull + (a << 6) + (a >> 2)));
  return r.next();
}

std::uint64_t sample_seed(const std::string& task, int length, std::uint64_t seed, int index) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the task name
  for (unsigned char c : task) h = (h ^ c) * 1099511628211ull;
  return mix(mix(mix(h, seed), static_cast<std::uint64_t>(length)), static_cast<std::uint64_t>(index));
}

bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }

std::string five_digits(Rng& rng) { return std::to_string(10000 + rng.uniform(90000)); }

constexpr std::array<const char*, 32> kFirstNames = {
    "Marta",  "Jonas", "Amelia", "Tobias", "Nadia", "Oskar", "Helena", "Rafael", "Ingrid", "Mateo", "Leila",
    "Victor", "Sofia", "Anton",  "Clara",  "Emil",  "Freya", "Hugo",   "Iris",   "Julian", "Kira",  "Lukas",
    "Mira",   "Nils",  "Olga",   "Pablo",  "Rosa",  "Samir", "Tessa",  "Ulrich", "Vera",   "Walter"};
constexpr std::array<const char*, 32> kLastNames = {
    "Lindqvist", "Moreau",   "Castillo", "Novak",   "Okafor",   "Brennan", "Haddad", "Kowalski",
    "Ferreira",  "Yamamoto", "Petrov",   "Delgado", "Andersen", "Rossi",   "Muller", "Schmidt",
    "Dubois",    "Nakamura", "Jensen",   "Romano",  "Silva",    "Horvath", "Larsen", "Fischer",
    "Moretti",   "Kaplan",   "Bauer",    "Ivanova", "Costa",    "Weber",   "Tanaka", "Olsen"};
constexpr std::array<const char*, 16> kCities = {
    "Lisbon", "Oslo",  "Madrid", "Vienna",  "Dublin", "Prague", "Athens",  "Berlin",
    "Warsaw", "Cairo", "Lima",   "Nairobi", "Seoul",  "Sydney", "Toronto", "Helsinki"};
constexpr std::array<const char*, 12> kColours = {"green",   "purple",    "orange", "yellow",
                                                  "blue",    "pink",      "silver", "violet",
                                                  "crimson", "turquoise", "brown",  "golden"};
constexpr std::array<const char*, 12> kInstruments = {"violin", "cello",     "trumpet",  "flute",
                                                      "piano",  "harp",      "clarinet", "guitar",
                                                      "drums",  "saxophone", "banjo",    "accordion"};
constexpr std::array<const char*, 12> kAnimals = {"tiger",    "penguin", "dolphin",  "giraffe",
                                                  "elephant", "otter",   "falcon",   "zebra",
                                                  "koala",    "panda",   "squirrel", "owl"};
constexpr std::array<const char*, 24> kObjects = {
    "lamp",   "window", "bicycle", "kettle",  "mirror", "garden", "ladder", "basket",
    "candle", "wallet", "bridge",  "compass", "anchor", "helmet", "violin", "teapot",
    "rocket", "saddle", "tunnel",  "lantern", "pillow", "hammer", "statue", "carpet"};
constexpr std::array<const char*, 24> kVariables = {
    "Falcon", "Juniper", "Cobalt", "Meadow", "Granite", "Harbor",  "Willow",  "Ember",
    "Quartz", "Maple",   "Orbit",  "Pebble", "Raven",   "Saffron", "Thistle", "Velvet",
    "Walnut", "Zephyr",  "Amber",  "Birch",  "Cedar",   "Delta",   "Fjord",   "Glacier"};

struct Fact {
  std::string text;
  double depth = 0;  // relative position among the haystack sentences
};

// One drawn task instance: the facts to hide, the question, the answer.
struct Instance {
  std::string intro, question, prefix, answer;
  std::vector<Fact> facts;  // in the order they must appear (depths ascending)
};

Instance draw_instance(const std::string& task, Rng& rng) {
  Instance in;
  if (task == "passkey") {
    in.answer = five_digits(rng);
    in.intro = "There is a pass key hidden in the text below. Find it and remember it.";
    in.facts.push_back({"The pass key is " + in.answer + ".", rng.unit()});
    in.question = "What is the pass key? It is a five-digit number.";
    in.prefix = "The pass key is";
  } else if (task == "needle") {
    const std::string name = std::string(rng.pick(kFirstNames)) + " " + rng.pick(kLastNames);
    const int kind = static_cast<int>(rng.uniform(4));
    const char* attr = kind == 0 ? "city" : kind == 1 ? "colour" : kind == 2 ? "instrument" : "animal";
    in.answer = kind == 0   ? rng.pick(kCities)
                : kind == 1 ? rng.pick(kColours)
                : kind == 2 ? rng.pick(kInstruments)
                            : rng.pick(kAnimals);
    const std::string subject = name + "'s favourite " + attr;
    // Common nouns take "the" (in the fact and the pre-filled answer: the model says "the owl", not "owl").
    const std::string is = kind >= 2 ? " is the" : " is";
    in.intro = "The text below contains a fact about a person. Find it and remember it.";
    in.facts.push_back({subject + is + " " + in.answer + ".", rng.unit()});
    in.question = "What is " + subject + "?";
    in.prefix = subject + is;
  } else if (task == "multikey") {
    std::vector<std::string> objects;
    while (objects.size() < 4) {
      const std::string o = rng.pick(kObjects);
      if (std::find(objects.begin(), objects.end(), o) == objects.end()) objects.push_back(o);
    }
    std::vector<std::string> numbers;
    while (numbers.size() < 4) {
      const std::string v = five_digits(rng);
      if (std::find(numbers.begin(), numbers.end(), v) == numbers.end()) numbers.push_back(v);
    }
    const std::size_t asked = rng.uniform(4);
    in.intro = "The text below contains special numbers for several objects. Find them and remember them.";
    for (std::size_t i = 0; i < 4; ++i)
      in.facts.push_back(
          {"The special number for the " + objects[i] + " is " + numbers[i] + ".", rng.unit()});
    in.answer = numbers[asked];
    in.question = "What is the special number for the " + objects[asked] + "?";
    in.prefix = "The special number for the " + objects[asked] + " is";
  } else if (task == "varupdate") {
    const std::string var = rng.pick(kVariables);
    in.answer = five_digits(rng);
    std::string old;
    do old = five_digits(rng);
    while (old == in.answer);
    const double d0 = rng.unit(), d1 = rng.unit();
    in.intro = "The text below assigns values to variables. Find them and remember them.";
    // The first value, then (deeper) the change: the answer is the value after the change.
    in.facts.push_back({"The value of variable " + var + " is " + old + ".", std::min(d0, d1)});
    in.facts.push_back(
        {"Then the value of variable " + var + " is changed to " + in.answer + ".", std::max(d0, d1)});
    in.question = "What is the value of variable " + var + " now?";
    in.prefix = "The value of variable " + var + " is now";
  } else {  // vartrack
    std::vector<std::string> vars;
    while (vars.size() < 3) {
      const std::string v = rng.pick(kVariables);
      if (std::find(vars.begin(), vars.end(), v) == vars.end()) vars.push_back(v);
    }
    std::string other;
    in.answer = five_digits(rng);
    do other = five_digits(rng);
    while (other == in.answer);
    const double d0 = rng.unit(), d1 = rng.unit(), d2 = rng.unit();
    in.intro = "The text below assigns values to variables. Find them and remember them.";
    // vars[0] = answer; vars[2] = other (distractor); vars[1] = vars[0], after vars[0].
    in.facts.push_back({"The value of variable " + vars[0] + " is " + in.answer + ".", std::min(d0, d1)});
    in.facts.push_back({"The value of variable " + vars[2] + " is " + other + ".", d2});
    in.facts.push_back(
        {"Variable " + vars[1] + " has the same value as variable " + vars[0] + ".", std::max(d0, d1)});
    in.question = "What is the value of variable " + vars[1] + "?";
    in.prefix = "The value of variable " + vars[1] + " is";
  }
  std::stable_sort(in.facts.begin(), in.facts.end(),
                   [](const Fact& a, const Fact& b) { return a.depth < b.depth; });
  return in;
}

std::vector<std::string> split_sentences(const std::string& raw) {
  std::string text;
  text.reserve(raw.size());
  bool space = false;
  for (char c : raw) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isspace(u) || u < 0x20) {
      space = !text.empty();
      continue;
    }
    if (space) text += ' ';
    space = false;
    text += c;
  }
  std::vector<std::string> out;
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if ((c == '.' || c == '?' || c == '!') && (i + 1 == text.size() || text[i + 1] == ' ')) {
      std::string s = text.substr(start, i + 1 - start);
      if (s.size() >= 20 && s.size() <= 600) out.push_back(std::move(s));
      start = i + 2;
    }
  }
  return out;
}

}  // namespace

std::string task_names_list() {
  std::string s;
  for (const char* n : kTaskNames) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

void check_task_name(const std::string& name) {
  for (const char* n : kTaskNames)
    if (name == n) return;
  throw TaskError("unknown task '" + name + "' (valid: " + task_names_list() + ")");
}

std::vector<std::string> default_haystack_paths() { return {"/usr/share/common-licenses"}; }

Haystack load_haystack(const std::vector<std::string>& paths) {
  Haystack h;
  std::set<fs::path> seen;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (!fs::exists(p, ec)) {
      throw TaskError("haystack " + p +
                      " not found (the license texts come with Debian's base-files package; or pass "
                      "--haystack FILE|DIR)");
    }
    std::vector<fs::path> files;
    if (fs::is_directory(p, ec)) {
      for (const auto& e : fs::directory_iterator(p, ec))
        if (e.is_regular_file(ec)) files.push_back(e.path());
      std::sort(files.begin(), files.end());
    } else {
      files.emplace_back(p);
    }
    for (const fs::path& f : files) {
      const fs::path canon = fs::canonical(f, ec);
      if (ec || !seen.insert(canon).second) continue;
      std::ifstream in(f, std::ios::binary);
      if (!in) throw TaskError("haystack " + f.string() + ": cannot be read");
      std::stringstream ss;
      ss << in.rdbuf();
      std::vector<std::string> s = split_sentences(ss.str());
      h.sentences.insert(h.sentences.end(), std::make_move_iterator(s.begin()),
                         std::make_move_iterator(s.end()));
      h.files.push_back(canon.string());
    }
  }
  if (h.sentences.empty()) {
    std::string joined;
    for (const auto& p : paths) joined += (joined.empty() ? "" : ", ") + p;
    throw TaskError("haystack " + joined + ": no sentences of prose");
  }
  return h;
}

int approx_token_count(const std::string& text) { return static_cast<int>((text.size() * 5 + 23) / 24); }

int count_word(const std::string& text, const std::string& word) {
  if (word.empty()) return 0;
  int n = 0;
  for (std::size_t pos = text.find(word); pos != std::string::npos; pos = text.find(word, pos + 1)) {
    const bool left = pos == 0 || !is_word_char(text[pos - 1]);
    const std::size_t end = pos + word.size();
    const bool right = end == text.size() || !is_word_char(text[end]);
    n += (left && right) ? 1 : 0;
  }
  return n;
}

bool answer_matches(const std::string& generated, const std::string& answer) {
  std::size_t i = 0;
  while (i < generated.size() && std::isspace(static_cast<unsigned char>(generated[i]))) ++i;
  if (answer.empty() || generated.compare(i, answer.size(), answer) != 0) return false;
  const std::size_t end = i + answer.size();
  return end == generated.size() || !is_word_char(generated[end]);
}

std::vector<TaskSample> make_task_samples(const std::string& task, int length, int samples,
                                          std::uint64_t seed, const Haystack& haystack,
                                          const TokenCounter& count) {
  check_task_name(task);
  if (length < kMinTaskLength || length > kMaxTaskLength) {
    throw TaskError("task length " + std::to_string(length) + " out of range (" +
                    std::to_string(kMinTaskLength) + " .. " + std::to_string(kMaxTaskLength) + " tokens)");
  }
  if (samples < 1) throw TaskError("task samples must be >= 1");
  const std::vector<std::string>& S = haystack.sentences;
  if (S.empty()) throw TaskError("task haystack is empty");
  const std::size_t N = S.size();

  std::vector<TaskSample> out;
  out.reserve(static_cast<std::size_t>(samples));
  for (int index = 0; index < samples; ++index) {
    Rng rng(sample_seed(task, length, seed, index));
    const std::size_t start = rng.uniform(N);
    auto sentence = [&](std::size_t i) -> const std::string& { return S[(start + i) % N]; };
    bool done = false;
    for (int attempt = 0; attempt < 64 && !done; ++attempt) {
      const Instance in = draw_instance(task, rng);
      // The user message with n whole haystack sentences (facts inserted at their depths) and the first
      // `words` words of sentence n.
      auto compose = [&](std::size_t n, std::size_t words) {
        std::string hay;
        std::size_t f = 0;
        auto add = [&](const std::string& s) {
          if (!hay.empty()) hay += ' ';
          hay += s;
        };
        for (std::size_t i = 0; i <= n; ++i) {
          while (f < in.facts.size() &&
                 static_cast<std::size_t>(in.facts[f].depth * static_cast<double>(n) + 0.5) <= i)
            add(in.facts[f++].text);
          if (i == n) break;
          add(sentence(i));
        }
        while (f < in.facts.size()) add(in.facts[f++].text);
        if (words > 0) {
          std::istringstream ws(sentence(n));
          std::string w;
          for (std::size_t k = 0; k < words && ws >> w; ++k) add(w);
        }
        return in.intro + "\n\n" + hay + "\n\n" + in.question;
      };
      if (count(compose(0, 0)) > length)
        throw TaskError("task " + task + ": question alone exceeds the length");
      // Largest n (then words) with count <= length; n < N (the haystack is not repeated).
      std::size_t lo = 0, hi = N - 1;
      if (count(compose(hi, 0)) <= length) {
        throw TaskError("task haystack too small: " + std::to_string(N) + " sentences hold fewer than " +
                        std::to_string(length) + " tokens");
      }
      while (hi - lo > 1) {
        const std::size_t mid = (lo + hi) / 2;
        (count(compose(mid, 0)) <= length ? lo : hi) = mid;
      }
      std::size_t wlo = 0, whi = 1;
      {
        std::istringstream ws(sentence(lo));
        std::string w;
        while (ws >> w) ++whi;
      }
      while (whi - wlo > 1) {
        const std::size_t mid = (wlo + whi) / 2;
        (count(compose(lo, mid)) <= length ? wlo : whi) = mid;
      }
      const std::string user = compose(lo, wlo);
      if (count_word(user, in.answer) != 1) continue;  // the answer also occurs in the prose: redraw
      TaskSample s;
      s.task = task;
      s.length = length;
      s.seed = seed;
      s.index = index;
      s.user = user;
      s.question = in.question;
      s.context_char = in.intro.size() + 2;
      s.question_char = user.size() - in.question.size();
      s.answer_prefix = in.prefix;
      s.answer = in.answer;
      for (std::size_t pos = user.find(in.answer); pos != std::string::npos;
           pos = user.find(in.answer, pos + 1)) {
        const std::size_t end = pos + in.answer.size();
        if ((pos == 0 || !is_word_char(user[pos - 1])) && (end == user.size() || !is_word_char(user[end]))) {
          s.needle_char = pos;
          break;
        }
      }
      s.needle_token = count(user.substr(0, s.needle_char));
      s.depth = static_cast<double>(s.needle_char) / static_cast<double>(user.size());
      s.tokens = count(user);
      out.push_back(std::move(s));
      done = true;
    }
    if (!done) throw TaskError("task " + task + ": no answer unique in the prose after 64 draws");
  }
  return out;
}

}  // namespace kvscope::closedloop
