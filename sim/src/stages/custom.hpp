// Shared by the run-time stages (scorers/custom.cpp, allocators/custom.cpp): the layer as
// kvscope/sim/custom_stages.hpp describes it, and the registration of a run-time stage.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvscope/sim/custom_stages.hpp"
#include "stage.hpp"

namespace kvscope::sim::stages {

// The labels and geometry of `d`'s layer (tensors left nullptr).
CustomLayer custom_layer(const LayerData& d, const TraceContext& ctx);
// Checks a run-time stage's name and puts it into the registry.
void put_custom_stage(std::unique_ptr<Stage> stage);
// The registry's run-time part (registry.cpp): registry().find / all see these stages after the built-ins.
// put: adds, or replaces the run-time stage of the same kind and name; a built-in's name throws PolicyError.
void put_runtime_stage(std::unique_ptr<Stage> stage);
bool is_runtime_stage(StageKind kind, const std::string& name);

}  // namespace kvscope::sim::stages
