// Token roles in the replay (docs/metrics.md "Query sets", docs/trace-format.md section 2a): which decode
// steps form the answer's and the question's query sets, and the question moved into the compressed
// context (kvsim --question-in-context).
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/sweep.hpp"

namespace kvscope::sim {

const char* query_set_name(int set) { return set == kAnswerQueries ? "answer" : "question"; }

namespace {
std::uint8_t role_of_set(int set) {
  return static_cast<std::uint8_t>(set == kAnswerQueries ? trace::Role::kAnswer : trace::Role::kQuestion);
}
}  // namespace

bool TraceContext::in_query_set(int set, int s) const {
  // No roles (or a step beyond them, e.g. a live cache's): an answer step.
  if (static_cast<std::size_t>(s) >= step_role.size()) return set == kAnswerQueries;
  return step_role[static_cast<std::size_t>(s)] == role_of_set(set);
}

int TraceContext::query_set_steps(int set) const {
  if (query_steps_for == S) return query_steps[static_cast<std::size_t>(set)];
  int n = 0;
  for (int s = 0; s < S; ++s) n += in_query_set(set, s) ? 1 : 0;
  return n;
}

void TraceContext::count_query_sets() {
  query_steps_for = -1;
  for (int set = 0; set < kQuerySets; ++set)
    query_steps[static_cast<std::size_t>(set)] = query_set_steps(set);
  query_steps_for = S;
}

int move_question_into_context(TraceContext& ctx, const trace::TraceReader& reader) {
  const std::string where = reader.path() + ": --question-in-context: ";
  if (!reader.has_roles()) {
    throw std::runtime_error(where +
                             "the trace records no token roles (/decode/tokens/role); capture it with "
                             "kvcap run --task (docs/capture.md)");
  }
  const auto answer = static_cast<std::uint8_t>(trace::Role::kAnswer);
  int n = 0;
  while (n < ctx.S && ctx.step_role[static_cast<std::size_t>(n)] != answer) ++n;
  bool question = false;
  for (int s = 0; s < n; ++s)
    question |=
        ctx.step_role[static_cast<std::size_t>(s)] == static_cast<std::uint8_t>(trace::Role::kQuestion);
  if (!question) {
    throw std::runtime_error(where +
                             "no question step before the first answer step (the question was "
                             "prefilled with the context: nothing to move)");
  }
  if (n == ctx.S)
    throw std::runtime_error(where + "no answer step after the question: nothing left to evaluate");
  const trace::DecodeTokens& dt = reader.decode_tokens();
  const std::int32_t segment = ctx.segment.empty() ? 0 : ctx.segment.back();
  for (int s = 0; s < n; ++s) {
    const auto i = static_cast<std::size_t>(s);
    ctx.modality.push_back(static_cast<std::uint8_t>(kernels::Modality::kText));  // decode tokens are text
    ctx.position.push_back(dt.position[i]);
    ctx.grid_row.push_back(-1);
    ctx.grid_col.push_back(-1);
    ctx.segment.push_back(segment);
    ctx.role.push_back(ctx.step_role[i]);
  }
  ctx.step_role.erase(ctx.step_role.begin(), ctx.step_role.begin() + n);
  ctx.tokens[static_cast<std::size_t>(kernels::Modality::kText)] += n;
  ctx.T += n;
  ctx.S -= n;
  ctx.steps_in_context = n;
  ctx.neighbours.clear();
  ctx.count_query_sets();
  // modality_all ([T + S]) is unchanged: context modalities then text, with T + S the same.
  return n;
}

namespace {
// [H, a, D] and [H, b, D] -> [H, a + n, D] and [H, b - n, D]: the first n rows of `second` move to the end
// of `first`, head by head.
void move_rows(trace::Tensor& first, trace::Tensor& second, std::size_t n) {
  const std::size_t H = first.shape[0], a = first.shape[1], b = second.shape[1], D = first.shape[2];
  const std::size_t eb = kernels::dtype_bytes(first.dtype), row = D * eb;
  std::vector<std::byte> f(H * (a + n) * row), s(H * (b - n) * row);
  for (std::size_t h = 0; h < H; ++h) {
    std::memcpy(&f[h * (a + n) * row], &first.data[h * a * row], a * row);
    std::memcpy(&f[(h * (a + n) + a) * row], &second.data[h * b * row], n * row);
    std::memcpy(&s[h * (b - n) * row], &second.data[(h * b + n) * row], (b - n) * row);
  }
  first.data = std::move(f);
  second.data = std::move(s);
  first.shape[1] = a + n;
  second.shape[1] = b - n;
}
}  // namespace

LayerData read_layer_data(const trace::TraceReader& reader, int layer, TraceContext& ctx) {
  trace::LayerTensors prefill = reader.read_layer(layer), decode = reader.read_decode_layer(layer);
  if (ctx.steps_in_context > 0) {
    const auto n = static_cast<std::size_t>(ctx.steps_in_context);
    move_rows(prefill.q, decode.q, n);
    move_rows(prefill.k, decode.k, n);
    move_rows(prefill.v, decode.v, n);
  }
  LayerData data(layer, std::move(prefill), std::move(decode), ctx);
  // Stored aggregates are of the trace's own context: not of one the question was moved into.
  if (ctx.aggregates && ctx.aggregates->num_tokens == ctx.T) {
    try {
      data.set_stored_aggregates(reader.read_attention_aggregates(layer, *ctx.aggregates), *ctx.aggregates);
    } catch (const trace::TraceError& e) {
      ctx.aggregates_absent = std::string("/aggregates unreadable: ") + e.what();
      ctx.aggregate_warnings.push_back(std::string(e.what()) + "; stored aggregates ignored from layer " +
                                       std::to_string(layer) + " on, recomputing");
      ctx.aggregates.reset();
    }
  }
  return data;
}

void finish_query_sets(SweepOutput& out, const std::string& source) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (PointResult& pt : out.points) {
    auto finish = [&](Quality& q, const std::string& at) {
      for (int k = 0; k < kQuerySets; ++k) {
        QuerySetQuality& qs = q.query_sets[static_cast<std::size_t>(k)];
        if (out.query_set_steps[static_cast<std::size_t>(k)] == 0) {
          qs = QuerySetQuality{nan, nan, nan, nan};
          continue;
        }
        for (double v : {qs.output_error, qs.attention_recall, qs.kl, qs.entropy_delta}) {
          if (!std::isfinite(v)) {
            throw std::runtime_error(source + ": " + pt.policy + "@" + pt.budget + ": " + at +
                                     "a metric of the " + query_set_name(k) +
                                     " queries is not finite; no results are written");
          }
        }
      }
    };
    for (LayerResult& l : pt.layers) {
      const std::string at = "layer " + std::to_string(l.layer) + ", ";
      for (HeadResult& h : l.heads) finish(h.quality, at + "kv head " + std::to_string(h.kv_head) + ": ");
      finish(l.total.quality, at);
    }
    finish(pt.total.quality, "");
  }
}

}  // namespace kvscope::sim
