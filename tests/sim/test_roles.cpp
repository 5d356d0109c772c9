// Token roles in the replay (docs/metrics.md "Query sets"): the answer's and the question's query sets, and
// the question moved into the compressed context (--question-in-context), on a synthetic trace given roles.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kvscope/sim/report.hpp"
#include "kvscope/sim/results_reader.hpp"
#include "kvscope/sim/sweep.hpp"
#include "kvscope/synth/synth.hpp"
#include "kvscope/trace/reader.hpp"
#include "kvscope/trace/writer.hpp"
#include "scratch.hpp"

namespace kvscope::sim {
namespace {

namespace fs = std::filesystem;
using trace::Role;

constexpr int kS = 6;  // decode steps of the base trace

std::string base_trace() {
  const std::string path = (testing::scratch_dir() / "roles_base.h5").string();
  if (!fs::exists(path)) {
    synth::SynthOptions o;
    o.preset = "tiny";
    o.decode = kS;
    o.dtype = trace::DType::kF32;
    synth::write_synthetic_trace(o, path + ".tmp");
    fs::rename(path + ".tmp", path);
  }
  return path;
}

trace::TensorView view(const trace::Tensor& t) {
  return {t.data.data(), t.dtype, {t.shape[0], t.shape[1], t.shape[2]}};
}

// Rows [from, to) of [H, n, D].
trace::Tensor rows(const trace::Tensor& t, std::size_t from, std::size_t to) {
  trace::Tensor out = t;
  const std::size_t H = t.shape[0], n = t.shape[1], row = t.shape[2] * kernels::dtype_bytes(t.dtype);
  out.shape[1] = to - from;
  out.data.resize(H * (to - from) * row);
  for (std::size_t h = 0; h < H; ++h)
    std::copy_n(&t.data[(h * n + from) * row], (to - from) * row, &out.data[h * (to - from) * row]);
  return out;
}
// [H, a, D] + [H, b, D] -> [H, a + b, D].
trace::Tensor concat(const trace::Tensor& x, const trace::Tensor& y) {
  trace::Tensor out = x;
  const std::size_t H = x.shape[0], a = x.shape[1], b = y.shape[1],
                    row = x.shape[2] * kernels::dtype_bytes(x.dtype);
  out.shape[1] = a + b;
  out.data.resize(H * (a + b) * row);
  for (std::size_t h = 0; h < H; ++h) {
    std::copy_n(&x.data[h * a * row], a * row, &out.data[h * (a + b) * row]);
    std::copy_n(&y.data[h * b * row], b * row, &out.data[(h * (a + b) + a) * row]);
  }
  return out;
}

// The base trace with decode roles `step_roles` (empty: none); with `prefill_steps` > 0 instead the first
// prefill_steps decode steps written as context tokens (text) and no roles: what --question-in-context
// must replay.
std::string derived(const std::string& name, const std::vector<std::uint8_t>& step_roles,
                    int prefill_steps = 0) {
  const std::string path = (testing::scratch_dir() / name).string();
  trace::TraceReader r(base_trace());
  const std::size_t T = r.num_tokens(), n = static_cast<std::size_t>(prefill_steps), S = kS - n;
  trace::TraceHeader h = r.header();
  h.version_minor = 0;
  trace::Tokens tok = r.tokens();
  const trace::DecodeTokens& dt = r.decode_tokens();
  tok.role.clear();
  if (!step_roles.empty()) tok.role.assign(T, static_cast<std::uint8_t>(Role::kContext));
  for (std::size_t i = 0; i < n; ++i) {
    tok.modality.push_back(0);
    tok.position.push_back(dt.position[i]);
    tok.token_id.push_back(dt.token_id[i]);
    tok.segment.push_back(tok.segment.back());
    tok.grid_row.push_back(-1);
    tok.grid_col.push_back(-1);
    if (!tok.text.empty()) tok.text.push_back(dt.text.empty() ? "" : dt.text[i]);
  }
  {
    trace::TraceWriter w(path, h, T + n, S);
    w.write_tokens(tok);
    std::vector<std::int32_t> id(dt.token_id.begin() + static_cast<std::ptrdiff_t>(n), dt.token_id.end());
    std::vector<std::int32_t> pos(dt.position.begin() + static_cast<std::ptrdiff_t>(n), dt.position.end());
    w.write_decode_tokens(id, pos, {}, step_roles);
    for (int l = 0; l < r.geometry().num_layers; ++l) {
      const trace::LayerTensors p = r.read_layer(l), d = r.read_decode_layer(l);
      const trace::Tensor q = concat(p.q, rows(d.q, 0, n)), k = concat(p.k, rows(d.k, 0, n)),
                          v = concat(p.v, rows(d.v, 0, n));
      w.write_layer(l, view(q), view(k), view(v));
      const trace::Tensor dq = rows(d.q, n, kS), dk = rows(d.k, n, kS), dv = rows(d.v, n, kS);
      w.write_decode_layer(l, view(dq), view(dk), view(dv));
    }
    w.close();
  }
  return path;
}

const std::vector<std::uint8_t> kRoles = {1, 1, 3, 2, 2, 2};  // question x2, template, answer x3

SweepOutput sweep(const std::string& path, const std::vector<std::string>& policies,
                  bool question_in_context) {
  PolicyRegistry reg;
  std::vector<PolicySpec> specs;
  for (const auto& p : policies) specs.push_back(reg.get(p));
  SweepOptions o;
  o.question_in_context = question_in_context;
  trace::TraceReader r(path);
  return run_sweep(r, make_sweep_points(specs, {parse_budget("0.3")}), o);
}

TEST(QuerySets, MeansOverTheAnswerAndQuestionStepsOnly) {
  const SweepOutput out = sweep(derived("roles_a.h5", kRoles), {"h2o", "full"}, false);
  EXPECT_TRUE(out.has_roles);
  EXPECT_EQ(out.query_set_steps[kAnswerQueries], 3);
  EXPECT_EQ(out.query_set_steps[kQuestionQueries], 2);
  EXPECT_EQ(static_cast<std::size_t>(out.context_tokens), trace::TraceReader(base_trace()).num_tokens());
  // Per kv head: all = (2 question + 1 template + 3 answer steps) / 6; so with the template step's error e_t,
  // 6 all = 2 question + 3 answer + e_t: check through a trace whose template step is an answer step.
  const SweepOutput same = sweep(derived("roles_a2.h5", {1, 1, 2, 2, 2, 2}), {"h2o"}, false);
  for (std::size_t l = 0; l < same.points[0].layers.size(); ++l) {
    for (const HeadResult& h : same.points[0].layers[l].heads) {
      const Quality& q = h.quality;
      const auto& a = q.query_sets[kAnswerQueries];
      const auto& qs = q.query_sets[kQuestionQueries];
      EXPECT_NEAR(q.output_error, (4 * a.output_error + 2 * qs.output_error) / 6, 1e-12);
      EXPECT_NEAR(q.attention_recall, (4 * a.attention_recall + 2 * qs.attention_recall) / 6, 1e-12);
      EXPECT_NEAR(q.kl, (4 * a.kl + 2 * qs.kl) / 6, 1e-12);
      EXPECT_NEAR(q.entropy_delta, (4 * a.entropy_delta + 2 * qs.entropy_delta) / 6, 1e-12);
    }
  }
  const Quality& h2o = out.points[0].total.quality;
  EXPECT_GT(h2o.output_error, 0.01);
  EXPECT_NE(h2o.query_sets[kAnswerQueries].output_error, h2o.output_error);  // a real subset
  EXPECT_NE(h2o.query_sets[kQuestionQueries].output_error, h2o.output_error);
  const Quality& full = out.points[1].total.quality;  // full budget: zero error on every set
  for (const auto& s : full.query_sets) {
    EXPECT_NEAR(s.output_error, 0, 1e-6);
    EXPECT_NEAR(s.attention_recall, 1, 1e-6);
  }
}

TEST(QuerySets, WithoutRolesEveryStepIsAnAnswerStepAndTheQuestionSetIsEmpty) {
  const SweepOutput out = sweep(base_trace(), {"h2o"}, false);
  EXPECT_FALSE(out.has_roles);
  EXPECT_EQ(out.query_set_steps[kAnswerQueries], kS);
  EXPECT_EQ(out.query_set_steps[kQuestionQueries], 0);
  for (const LayerResult& l : out.points[0].layers) {
    for (const HeadResult& h : l.heads) {
      EXPECT_NEAR(h.quality.query_sets[kAnswerQueries].output_error, h.quality.output_error, 1e-12);
      EXPECT_NEAR(h.quality.query_sets[kAnswerQueries].kl, h.quality.kl, 1e-12);
      EXPECT_TRUE(std::isnan(h.quality.query_sets[kQuestionQueries].output_error));
    }
  }
  EXPECT_TRUE(std::isnan(out.points[0].total.quality.query_sets[kQuestionQueries].attention_recall));
}

TEST(QuestionInContext, EqualsATraceWithTheQuestionPrefilled) {
  // The steps before the first answer step (question x2, template) join the context: the replay must be
  // exactly that of a trace whose prefill holds them and whose decode steps are the answer's.
  const std::vector<std::string> policies = {"h2o", "snapkv", "tova", "streamingllm", "full"};
  const SweepOutput moved = sweep(derived("roles_b.h5", kRoles), policies, true);
  const SweepOutput ref = sweep(derived("roles_b_ref.h5", {}, 3), policies, false);
  const std::size_t T = trace::TraceReader(base_trace()).num_tokens();
  EXPECT_EQ(moved.context_tokens, static_cast<int>(T) + 3);
  EXPECT_EQ(moved.decode_steps, kS - 3);
  EXPECT_EQ(moved.steps_in_context, 3);
  EXPECT_EQ(moved.query_set_steps[kAnswerQueries], 3);
  EXPECT_EQ(moved.query_set_steps[kQuestionQueries], 0);
  ASSERT_EQ(moved.points.size(), ref.points.size());
  for (std::size_t i = 0; i < ref.points.size(); ++i) {
    SCOPED_TRACE(ref.points[i].policy);
    const Quality& a = moved.points[i].total.quality;
    const Quality& b = ref.points[i].total.quality;
    EXPECT_DOUBLE_EQ(a.output_error, b.output_error);
    EXPECT_DOUBLE_EQ(a.attention_recall, b.attention_recall);
    EXPECT_DOUBLE_EQ(a.kl, b.kl);
    EXPECT_EQ(moved.points[i].total.bytes_kept.total(), ref.points[i].total.bytes_kept.total());
    EXPECT_DOUBLE_EQ(a.query_sets[kAnswerQueries].output_error, a.output_error);  // only answer steps left
    EXPECT_TRUE(std::isnan(a.query_sets[kQuestionQueries].output_error));
  }
  // The two settings differ (the question compressed or kept exact), and both are exact at full budget.
  const SweepOutput after = sweep(derived("roles_a.h5", kRoles), policies, false);
  EXPECT_NE(after.points[0].total.quality.query_sets[kAnswerQueries].output_error,
            moved.points[0].total.quality.query_sets[kAnswerQueries].output_error);
  EXPECT_NEAR(after.points.back().total.quality.output_error, 0, 1e-6);
  EXPECT_NEAR(moved.points.back().total.quality.output_error, 0, 1e-6);
}

TEST(QuestionInContext, RefusedInOneLineWithoutRolesOrWithoutAQuestion) {
  auto message = [](const std::string& path) {
    try {
      sweep(path, {"h2o"}, true);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::string none = message(base_trace());
  EXPECT_NE(none.find("--question-in-context: the trace records no token roles"), std::string::npos) << none;
  const std::string no_question = message(derived("roles_noq.h5", {2, 2, 2, 2, 2, 2}));
  EXPECT_NE(no_question.find("no question step before the first answer step"), std::string::npos)
      << no_question;
  const std::string no_answer = message(derived("roles_noa.h5", {1, 1, 1, 1, 1, 1}));
  EXPECT_NE(no_answer.find("no answer step after the question"), std::string::npos) << no_answer;
  for (const auto& m : {none, no_question, no_answer}) EXPECT_EQ(m.find('\n'), std::string::npos);
}

TEST(QuerySets, ResultsFilesCarryThemOnlyWhereTheTraceHasRoles) {
  const std::string trace_path = derived("roles_a.h5", kRoles);
  SweepOutput out = sweep(trace_path, {"h2o"}, false);
  trace::TraceReader r(trace_path);
  ResultsMeta meta = results_meta(summarize(r), "kvsim sweep");
  meta.has_roles = out.has_roles;
  for (int k = 0; k < kQuerySets; ++k)
    meta.query_set_steps[static_cast<std::size_t>(k)] = out.query_set_steps[static_cast<std::size_t>(k)];
  const std::string csv = (testing::scratch_dir() / "roles.csv").string();
  const std::string h5 = (testing::scratch_dir() / "roles.h5").string();
  write_csv(csv, out.points, meta);
  write_hdf5(h5, out.points, meta);
  std::ifstream in(csv);
  std::string header;
  std::getline(in, header);
  EXPECT_NE(
      header.find(",mode,kind,output_error_answer,attention_recall_answer,kl_answer,entropy_delta_answer,"
                  "output_error_question,attention_recall_question,kl_question,entropy_delta_question,"
                  "error_worst_query,"),
      std::string::npos)
      << header;
  ResultsMeta back;
  const std::vector<PointResult> pts = read_results_hdf5(h5, &back);
  EXPECT_TRUE(back.has_roles);
  EXPECT_EQ(back.query_set_steps[kAnswerQueries], 3);
  EXPECT_EQ(back.query_set_steps[kQuestionQueries], 2);
  ASSERT_EQ(pts.size(), 1u);
  EXPECT_EQ(pts[0].total.quality.query_sets[kAnswerQueries].output_error,
            out.points[0].total.quality.query_sets[kAnswerQueries].output_error);
  EXPECT_EQ(pts[0].layers[1].heads[0].quality.query_sets[kQuestionQueries].kl,
            out.points[0].layers[1].heads[0].quality.query_sets[kQuestionQueries].kl);
  // The table shows them when asked; a trace without roles keeps its CSV columns as before.
  TableOptions t;
  t.query_sets = true;
  EXPECT_NE(format_table(out.points, t).find("err_a"), std::string::npos);
  EXPECT_EQ(format_table(out.points).find("err_a"), std::string::npos);
  meta.has_roles = false;
  write_csv(csv, out.points, meta);
  std::ifstream in2(csv);
  std::getline(in2, header);
  EXPECT_EQ(header.find("answer"), std::string::npos) << header;
  EXPECT_NE(header.find(",mode,kind,error_worst_query,"), std::string::npos) << header;
}

TEST(TraceInfo, ShowsRoleCounts) {
  trace::TraceReader r(derived("roles_a.h5", kRoles));
  const std::string s = format_summary(summarize(r));
  EXPECT_NE(s.find("decode steps: 0 context, 2 question, 3 answer, 1 template"), std::string::npos) << s;
  trace::TraceReader old(base_trace());
  const std::string o = format_summary(summarize(old));
  EXPECT_NE(o.find("roles      none recorded (defaults)"), std::string::npos) << o;
}

}  // namespace
}  // namespace kvscope::sim
