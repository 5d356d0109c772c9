// The stage registry: every built-in stage method, listed once here (an explicit list, so that
// no registration can be dropped by the linker from the static library), and the listings built
// from their declarations. Adding a method: one file under <kind>/ plus one line below.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "custom.hpp"
#include "kvscope/sim/policy.hpp"
#include "stage.hpp"

namespace kvscope::sim::stages {

// Every built-in stage, in listing order within its kind: X(<kind>_<method>) names the factory
// make_<kind>_<method>() that the method's file defines. Adding a method = one entry here.
// clang-format off
#define KVSCOPE_BUILTIN_STAGES(X)                                                                          \
  X(head_merge_none) X(head_merge_cosine)                                                                  \
  X(scorer_none) X(scorer_recency) X(scorer_h2o) X(scorer_snapkv) X(scorer_tova) X(scorer_knorm)           \
  X(scorer_random) X(scorer_vision_stride) X(scorer_unicache)                                              \
  X(scorer_keydiff) X(scorer_expected_attention) X(scorer_oracle_topk)                                     \
  X(allocator_uniform) X(allocator_pyramid) X(allocator_hybrid) X(allocator_vision_only)                   \
  X(allocator_unicache) X(allocator_explicit)                                                              \
  X(executor_evict) X(executor_merge_evicted) X(executor_unicache)                                         \
  X(quantizer_none) X(quantizer_int8) X(quantizer_int8_head) X(quantizer_int4) X(quantizer_kivi2)
// clang-format on

#define KVSCOPE_DECLARE_STAGE(n) std::unique_ptr<Stage> make_##n();
KVSCOPE_BUILTIN_STAGES(KVSCOPE_DECLARE_STAGE)
#undef KVSCOPE_DECLARE_STAGE

namespace {

Registry build_registry() {
  Registry r;
#define KVSCOPE_ADD_STAGE(n) r.add(make_##n());
  KVSCOPE_BUILTIN_STAGES(KVSCOPE_ADD_STAGE)
#undef KVSCOPE_ADD_STAGE
  return r;
}

std::size_t kind_index(StageKind k) { return static_cast<std::size_t>(k); }

std::vector<std::unique_ptr<Stage>>& runtime_stages() {
  static std::vector<std::unique_ptr<Stage>> s;
  return s;
}
const Registry* g_builtin = nullptr;  // registry(), once built

}  // namespace

void Registry::add(std::unique_ptr<Stage> stage) {
  const StageInfo& info = stage->info();
  if (find(info.kind, info.name)) throw std::logic_error("stage registered twice: " + info.name);
  // A parameter declared by several stages (merge_window) must be declared alike.
  for (const auto& d : info.params) {
    for (const auto& list : stages_)
      for (const auto& s : list)
        for (const auto& o : s->info().params)
          if (o.name == d.name &&
              (o.default_text != d.default_text || o.type != d.type || o.lo != d.lo || o.hi != d.hi)) {
            throw std::logic_error("parameter " + d.name + " declared differently by " + s->info().name +
                                   " and " + info.name);
          }
  }
  stages_[kind_index(info.kind)].push_back(std::move(stage));
}

const Stage* Registry::find(StageKind kind, const std::string& name) const {
  for (const auto& s : stages_[kind_index(kind)])
    if (s->info().name == name) return s.get();
  if (this == g_builtin) {  // the run-time stages (put_runtime_stage) join the built-in registry
    for (const auto& s : runtime_stages())
      if (s->info().kind == kind && s->info().name == name) return s.get();
  }
  return nullptr;
}

std::vector<const Stage*> Registry::all(StageKind kind) const {
  std::vector<const Stage*> out;
  for (const auto& s : stages_[kind_index(kind)]) out.push_back(s.get());
  if (this == g_builtin) {
    for (const auto& s : runtime_stages())
      if (s->info().kind == kind) out.push_back(s.get());
  }
  return out;
}

const Registry& registry() {
  static const Registry r = build_registry();
  g_builtin = &r;
  return r;
}

// ---- run-time stages (custom.hpp): kept apart from the built-ins, found after them by registry()
void put_runtime_stage(std::unique_ptr<Stage> stage) {
  const StageInfo& info = stage->info();
  if (registry().find(info.kind, info.name) && !is_runtime_stage(info.kind, info.name)) {
    throw PolicyError(std::string("cannot register ") + stage_kind_name(info.kind) + " '" + info.name +
                      "': a built-in " + stage_kind_name(info.kind) + " has that name");
  }
  for (auto& s : runtime_stages()) {
    if (s->info().kind == info.kind && s->info().name == info.name) {
      s = std::move(stage);
      return;
    }
  }
  runtime_stages().push_back(std::move(stage));
}

bool is_runtime_stage(StageKind kind, const std::string& name) {
  for (const auto& s : runtime_stages())
    if (s->info().kind == kind && s->info().name == name) return true;
  return false;
}

namespace {
template <typename T>
const T& stage_of(StageKind kind, const std::string& name) {
  const Stage* s = registry().find(kind, name);
  if (!s) throw std::logic_error(std::string("no ") + stage_kind_name(kind) + " named '" + name + "'");
  return static_cast<const T&>(*s);
}
}  // namespace

const HeadMerge& head_merge_of(const PolicySpec& p) {
  return stage_of<HeadMerge>(StageKind::kHeadMerge, p.stages.head_merge);
}
const Scorer& scorer_of(const PolicySpec& p) { return stage_of<Scorer>(StageKind::kScorer, p.stages.scorer); }
const Allocator& allocator_of(const PolicySpec& p) {
  return stage_of<Allocator>(StageKind::kAllocator, p.stages.allocator);
}
const Executor& executor_of(const PolicySpec& p) {
  return stage_of<Executor>(StageKind::kExecutor, p.stages.executor);
}
const Quantizer& quantizer_of(const PolicySpec& p) {
  return stage_of<Quantizer>(StageKind::kQuantizer, p.stages.quantizer);
}
const Executor& evict_executor() { return stage_of<Executor>(StageKind::kExecutor, "evict"); }
const HeadMerge& no_head_merge() { return stage_of<HeadMerge>(StageKind::kHeadMerge, "none"); }

LayerView::LayerView(const PolicySpec& p, LayerData& d, TraceContext& c)
    : policy(p),
      data(d),
      ctx(c),
      layer(d.layer()),
      num_layers(c.geometry.num_layers),
      kv_heads(c.geometry.num_kv_heads),
      q_heads(c.geometry.num_q_heads),
      group(c.geometry.group_size()),
      head_dim(c.geometry.head_dim),
      T(c.T),
      S(c.S) {
  tokens.count = c.T;
  tokens.modality = c.modality.data();
  tokens.position = c.position.data();
  tokens.grid_row = c.grid_row.data();
  tokens.grid_col = c.grid_col.data();
  tokens.per_modality = c.tokens;
}

Rows LayerView::context_keys(int h) const {
  const std::size_t stride =
      (static_cast<std::size_t>(T) + static_cast<std::size_t>(S)) * static_cast<std::size_t>(head_dim);
  return Rows{data.k_all().data() + static_cast<std::size_t>(h) * stride, T, head_dim};
}

Rows LayerView::context_values(int h) const {
  const std::size_t stride =
      (static_cast<std::size_t>(T) + static_cast<std::size_t>(S)) * static_cast<std::size_t>(head_dim);
  return Rows{data.v_all().data() + static_cast<std::size_t>(h) * stride, T, head_dim};
}

ParamDecl int_param(std::string name, std::string def, double lo, double hi, std::string meaning,
                    std::string source) {
  ParamDecl d;
  d.name = std::move(name);
  d.type = ParamType::kInt;
  d.default_text = std::move(def);
  d.lo = lo;
  d.hi = hi;
  d.meaning = std::move(meaning);
  d.source = std::move(source);
  return d;
}

ParamDecl float_param(std::string name, std::string def, double lo, double hi, std::string meaning,
                      std::string source) {
  ParamDecl d = int_param(std::move(name), std::move(def), lo, hi, std::move(meaning), std::move(source));
  d.type = ParamType::kFloat;
  return d;
}

ParamDecl bool_param(std::string name, std::string def, std::string meaning, std::string source) {
  ParamDecl d = int_param(std::move(name), std::move(def), 0, 0, std::move(meaning), std::move(source));
  d.type = ParamType::kBool;
  return d;
}

ParamDecl choice_param(std::string name, std::string def, std::vector<std::string> choices,
                       std::string meaning, std::string source) {
  ParamDecl d = int_param(std::move(name), std::move(def), 0, 0, std::move(meaning), std::move(source));
  d.type = ParamType::kChoice;
  d.choices = std::move(choices);
  return d;
}

}  // namespace kvscope::sim::stages

namespace kvscope::sim {

const char* stage_kind_name(StageKind k) {
  switch (k) {
    case StageKind::kHeadMerge:
      return "head merge";
    case StageKind::kScorer:
      return "scorer";
    case StageKind::kAllocator:
      return "allocator";
    case StageKind::kExecutor:
      return "executor";
    case StageKind::kQuantizer:
      return "quantizer";
  }
  return "?";
}

const char* stage_kind_key(StageKind k) {
  switch (k) {
    case StageKind::kHeadMerge:
      return "head_merge";
    case StageKind::kScorer:
      return "scorer";
    case StageKind::kAllocator:
      return "allocator";
    case StageKind::kExecutor:
      return "executor";
    case StageKind::kQuantizer:
      return "quant";
  }
  return "?";
}

std::vector<const StageInfo*> stage_infos(StageKind kind) {
  std::vector<const StageInfo*> out;
  for (const auto* s : stages::registry().all(kind)) out.push_back(&s->info());
  return out;
}

const StageInfo* find_stage_info(StageKind kind, const std::string& name) {
  const auto* s = stages::registry().find(kind, name);
  return s ? &s->info() : nullptr;
}

const ParamDecl* find_parameter(const std::string& key) {
  for (const auto& d : pipeline_parameters())
    if (d.name == key) return &d;
  for (StageKind k : kStageKinds)
    for (const auto* s : stages::registry().all(k))
      for (const auto& d : s->info().params)
        if (d.name == key) return &d;
  return nullptr;
}

namespace {

std::string type_text(const ParamDecl& d) {
  std::ostringstream o;
  for (StageKind k : kStageKinds) {  // a stage selector: the registered names of its kind
    if (d.name != stage_kind_key(k)) continue;
    const auto infos = stage_infos(k);
    for (std::size_t i = 0; i < infos.size(); ++i) o << (i ? ", " : "") << "`" << infos[i]->name << "`";
    if (k == StageKind::kHeadMerge) o << " (or a boolean)";
    return o.str();
  }
  switch (d.type) {
    case ParamType::kInt:
      o << "whole, " << d.lo << " … " << d.hi << (d.odd ? ", odd" : "");
      break;
    case ParamType::kFloat:
      o << d.lo << " … " << d.hi;
      break;
    case ParamType::kBool:
      o << "bool";
      break;
    case ParamType::kChoice:
      for (std::size_t i = 0; i < d.choices.size(); ++i) o << (i ? ", " : "") << "`" << d.choices[i] << "`";
      break;
    case ParamType::kText:
      o << "text";
      break;
    case ParamType::kBudget:
      o << "a budget (`0.3`, `512tok`, `64MiB`)";
      break;
  }
  return o.str();
}

// Presets whose value of `key` differs from the declared default: "h2o: 0.5; snapkv, pyramidkv: 32".
std::string presets_that_differ(const ParamDecl& d) {
  static const PolicyRegistry reg;
  std::map<std::string, std::vector<std::string>> by_value;
  std::vector<std::string> order;
  for (const auto& [name, p] : reg.presets()) {
    std::string v;
    if (p.params.has(d.name))
      v = p.params.text(d.name);
    else if (d.name == "head_merge")
      v = p.stages.head_merge;
    else if (d.name == "scorer")
      v = p.stages.scorer;
    else if (d.name == "allocator")
      v = p.stages.allocator;
    else if (d.name == "executor")
      v = p.stages.executor;
    else if (d.name == "quant")
      v = p.stages.quantizer;
    else if (d.name == "sinks" && p.sinks != 0)
      v = std::to_string(p.sinks);
    else if (d.name == "recent" && p.recent != 0)
      v = std::to_string(p.recent);
    else if (d.name == "recent_fraction" && p.recent_fraction != 0.0f) {
      std::ostringstream o;
      o << p.recent_fraction;
      v = o.str();
    } else if (d.name == "adaptive" && p.adaptive)
      v = "true";
    if (v.empty() || v == d.default_text) continue;
    if (!by_value.count(v)) order.push_back(v);
    by_value[v].push_back(name);
  }
  std::string out;
  for (const auto& v : order) {
    std::string names;
    for (const auto& n : by_value[v]) names += (names.empty() ? "" : ", ") + n;
    out += (out.empty() ? "" : "; ") + names + ": " + v;
  }
  return out;
}

}  // namespace

std::string stage_listing_text() {
  std::ostringstream o;
  o << "Stages (a policy is one of each kind; INI keys head_merge, scorer, allocator, executor, quant):\n";
  for (StageKind k : kStageKinds) {
    o << "  " << stage_kind_name(k) << ":\n";
    for (const auto* i : stage_infos(k)) {
      o << "    " << i->name << std::string(i->name.size() < 16 ? 16 - i->name.size() : 1, ' ') << i->meaning
        << (i->decode ? " [~decode]" : "") << "\n";
      for (const auto& d : i->params) {
        o << "      " << d.name << " = " << d.default_text << "  (" << type_text(d) << ") " << d.meaning
          << "\n";
      }
    }
  }
  o << "  pipeline parameters:\n";
  for (const auto& d : pipeline_parameters()) {
    o << "      " << d.name << (d.default_text.empty() ? "" : " = " + d.default_text) << "  (" << type_text(d)
      << ") " << d.meaning << "\n";
  }
  return o.str();
}

std::string stage_tables_markdown() {
  std::ostringstream o;
  o << "<!-- generated by `kvsim stages --markdown` from the stage declarations; checked by the test "
       "policies_doc_tables -->\n\n";
  o << "| kind (INI key) | method | meaning | `~decode` | source |\n|---|---|---|---|---|\n";
  for (StageKind k : kStageKinds) {
    for (const auto* i : stage_infos(k)) {
      o << "| " << stage_kind_name(k) << " (`" << stage_kind_key(k) << "`) | `" << i->name << "` | "
        << i->meaning << " | " << (i->decode ? "yes" : "no") << " | " << i->source << " |\n";
    }
  }
  o << "\n| key | read by | default | range | meaning | presets that differ | source |\n"
       "|---|---|---|---|---|---|---|\n";
  auto row = [&](const ParamDecl& d, const std::string& owner) {
    o << "| `" << d.name << "` | " << owner << " | "
      << (d.default_text.empty() ? "—" : "`" + d.default_text + "`") << " | " << type_text(d) << " | "
      << d.meaning << " | " << presets_that_differ(d) << " | " << d.source << " |\n";
  };
  for (const auto& d : pipeline_parameters()) row(d, "pipeline");
  std::set<std::string> seen;
  for (StageKind k : kStageKinds) {
    for (const auto* i : stage_infos(k)) {
      for (const auto& d : i->params) {
        if (seen.count(d.name)) continue;
        seen.insert(d.name);
        std::string owners;
        for (const auto* j : stage_infos(k))
          for (const auto& e : j->params)
            if (e.name == d.name) owners += (owners.empty() ? "" : ", ") + std::string("`") + j->name + "`";
        row(d, std::string(stage_kind_name(k)) + " " + owners);
      }
    }
  }
  return o.str();
}

}  // namespace kvscope::sim
