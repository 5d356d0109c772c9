// The stage registry's public face: which stage methods exist, what each declares (parameters
// with type, default, range, meaning and source; decode-time support), and the listings built
// from those declarations (kvsim --help, `kvsim stages`, the tables of docs/policies.md).
// The stage interfaces themselves are internal (sim/src/stages/stage.hpp).
#pragma once

#include <string>
#include <vector>

namespace kvscope::sim {

enum class StageKind { kHeadMerge, kScorer, kAllocator, kExecutor, kQuantizer };
constexpr StageKind kStageKinds[] = {StageKind::kHeadMerge, StageKind::kScorer, StageKind::kAllocator,
                                     StageKind::kExecutor, StageKind::kQuantizer};
const char* stage_kind_name(StageKind kind);  // "head merge", "scorer", "allocator", "executor", "quantizer"
const char* stage_kind_key(
    StageKind kind);  // the INI key selecting it: head_merge, scorer, allocator, executor, quant

enum class ParamType { kInt, kFloat, kBool, kChoice, kText, kBudget };

// One parameter, declared once by the stage (or the pipeline) that reads it.
struct ParamDecl {
  std::string name;
  ParamType type = ParamType::kFloat;
  std::string default_text;          // as the docs print it; parsed like an INI value
  double lo = 0, hi = 0;             // inclusive range (kInt, kFloat)
  std::vector<std::string> choices;  // kChoice
  std::string meaning;               // one line
  std::string source;                // paper / section, or "kvscope"
  bool odd = false;                  // kInt: must be odd
};

struct StageInfo {
  StageKind kind = StageKind::kScorer;
  std::string name;     // registered name, e.g. "snapkv"
  std::string meaning;  // one line
  std::string source;   // paper / section
  bool decode = false;  // works in decode-time mode (~decode)
  std::vector<ParamDecl> params;
  // Scorers: also a preset of the same name (this scorer, uniform allocator, evict executor, the
  // declared defaults), so that `--policies NAME` works without an INI file.
  bool preset = false;
};

// Every registered stage of a kind, in registration order (sim/src/stages/registry.cpp).
std::vector<const StageInfo*> stage_infos(StageKind kind);
// nullptr when no stage of that kind has that name.
const StageInfo* find_stage_info(StageKind kind, const std::string& name);
// The pipeline's own parameters (base, description, forced set, mode, stage selectors).
const std::vector<ParamDecl>& pipeline_parameters();
// The declaration of a parameter key (pipeline or any stage), nullptr if none declares it.
const ParamDecl* find_parameter(const std::string& key);

// `kvsim stages`: every stage with its parameters, as plain text (--help) or as the markdown
// tables of docs/policies.md (between the "stage tables" markers; a test compares them).
std::string stage_listing_text();
std::string stage_tables_markdown();

}  // namespace kvscope::sim
