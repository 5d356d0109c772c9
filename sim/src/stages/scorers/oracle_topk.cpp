// oracle-topk: the query-aware bound, not a policy. Scores each context token by the attention it
// receives from the trace's own evaluation (decode) queries in the full cache: summed over the
// decode steps and the G query heads of the kv head (LayerData::decode_attention_mass, [Hkv, T]).
// No real policy has these queries when it compresses; kvsim sweep reports this scorer at every
// budget as the bound of eviction scorers (docs/policies.md "Bound and search rows").
#include "../stage.hpp"

namespace kvscope::sim::stages {
namespace {

class OracleTopK final : public Scorer {
 public:
  using Scorer::Scorer;
  void prepare_float(LayerData& d, const PolicySpec&, const TraceContext&) const override {
    d.decode_attention_mass();
  }
  void score(const LayerView& v, std::vector<float>& out) const override { out = v.data.decode_attention_mass(); }
};

}  // namespace

std::unique_ptr<Stage> make_scorer_oracle_topk() {
  StageInfo info{StageKind::kScorer,
                 "oracle-topk",
                 "BOUND, not a policy: per layer and kv head the tokens with the most attention from the trace's "
                 "own evaluation queries (uniform budget, nothing forced)",
                 "query-aware oracle (docs/policies.md, Bound and search rows in sweeps)",
                 false,  // in decode mode the evaluation queries are the future: nothing to bound with
                 {}};
  info.preset = true;
  return std::make_unique<OracleTopK>(std::move(info));
}

}  // namespace kvscope::sim::stages
