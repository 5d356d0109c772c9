// The stage registry: declarations, presets as compositions, parameters and errors from the
// declarations, decode support derived from them, and the selection / execution split.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "kvscope/sim/engine.hpp"
#include "kvscope/sim/policy.hpp"
#include "kvscope/sim/stages.hpp"
#include "scratch.hpp"
#include "tiny_trace.hpp"

namespace fs = std::filesystem;
using namespace kvscope;
using namespace kvscope::sim;

namespace {

std::string tiny_trace() {
  return kvscope::testing::tiny_trace("stages", 36, 20, 4, 3);
}

PolicySpec from_ini(const std::string& body) {
  const std::string path = (kvscope::testing::scratch_dir() / "stages.ini").string();
  {
    std::ofstream f(path);
    f << body;
  }
  PolicyRegistry reg;
  reg.load_ini(path);
  return reg.get("x");
}

std::string ini_error(const std::string& body) {
  try {
    from_ini(body);
  } catch (const PolicyError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Stages, EveryKindHasMethodsWithUniqueNamesAndValidDeclarations) {
  std::set<std::string> keys;
  for (StageKind k : kStageKinds) {
    const auto infos = stage_infos(k);
    ASSERT_FALSE(infos.empty()) << stage_kind_name(k);
    std::set<std::string> names;
    for (const StageInfo* i : infos) {
      EXPECT_TRUE(names.insert(i->name).second) << "duplicate " << i->name;
      EXPECT_FALSE(i->meaning.empty()) << i->name;
      EXPECT_FALSE(i->source.empty()) << i->name;
      for (const ParamDecl& d : i->params) {
        EXPECT_FALSE(d.meaning.empty()) << d.name;
        EXPECT_FALSE(d.source.empty()) << d.name;
        EXPECT_EQ(find_parameter(d.name)->default_text, d.default_text) << d.name;
        // The declared default is a valid value of the parameter.
        PolicySpec p;
        EXPECT_NO_THROW(p.set(d.name, d.default_text)) << d.name;
        keys.insert(d.name);
      }
    }
    // The "none"-like default of each kind exists.
    EXPECT_NE(find_stage_info(k, k == StageKind::kAllocator  ? "uniform"
                                 : k == StageKind::kExecutor ? "evict"
                                                             : "none"),
              nullptr);
  }
  // Every stage parameter is an INI key.
  std::set<std::string> ini;
  for (const auto& [k, _] : policy_parameters()) ini.insert(k);
  for (const auto& k : keys) EXPECT_TRUE(ini.count(k)) << k;
}

TEST(Stages, PresetsAreCompositionsOfNamedStages) {
  PolicyRegistry reg;
  const PolicySpec h2o = reg.get("h2o");
  EXPECT_EQ(h2o.stages.head_merge, "none");
  EXPECT_EQ(h2o.stages.scorer, "h2o");
  EXPECT_EQ(h2o.stages.allocator, "uniform");
  EXPECT_EQ(h2o.stages.executor, "evict");
  EXPECT_EQ(h2o.stages.quantizer, "none");
  EXPECT_FLOAT_EQ(h2o.recent_fraction, 0.5f);
  const PolicySpec lookm = reg.get("look-m");
  EXPECT_EQ(lookm.stages.executor, "merge-evicted");
  EXPECT_EQ(lookm.stages.allocator, "vision-only");
  EXPECT_FLOAT_EQ(lookm.params.real("merge_threshold"), 0.5f);
  EXPECT_EQ(lookm.params.integer("merge_window"), 64);
  EXPECT_EQ(lookm.params.text("snap_pool"), "max");
  EXPECT_EQ(lookm.params.integer("snap_window"), 32);  // the declared default
  const PolicySpec uc = reg.get("unicache-realtime-chat");
  EXPECT_EQ(uc.stages.head_merge, "cosine");
  EXPECT_EQ(uc.stages.quantizer, "int8-head");
  ASSERT_TRUE(uc.key_quant.has_value());
  EXPECT_EQ(uc.key_quant->granularity, kernels::Granularity::kPerHead);
  EXPECT_FLOAT_EQ(uc.params.real("head_merge_threshold"), 0.85f);
  EXPECT_FLOAT_EQ(unicache_config(uc).rate_offset, -0.05f);
  // A composition replaces the quantizer stage.
  const PolicySpec q = reg.get("unicache+int4");
  EXPECT_EQ(q.stages.quantizer, "int4");
  EXPECT_EQ(q.key_quant->bits, 4);
  EXPECT_FALSE(reg.get("full").compress_tokens);
  EXPECT_EQ(reg.get("kivi2").stages.quantizer, "kivi2");
}

TEST(Stages, IniParametersAndErrorsComeFromTheDeclarations) {
  const PolicySpec p = from_ini(
      "[policy x]\nbase = h2o\nscorer = snapkv\nsnap_window = 16\nsnap_pool = max\n"
      "allocator = pyramid\npyramid_spread = 0.25\n");
  EXPECT_EQ(p.stages.scorer, "snapkv");
  EXPECT_EQ(p.params.integer("snap_window"), 16);
  EXPECT_EQ(p.params.integer("snap_kernel"), 7);
  EXPECT_FLOAT_EQ(p.params.real("pyramid_spread"), 0.25f);
  // An unknown stage name lists the registered ones of that kind.
  std::string e = ini_error("[policy x]\nbase = h2o\nscorer = snapkv2\n");
  EXPECT_NE(e.find("scorer: 'snapkv2' is not one of none, recency, h2o, snapkv"), std::string::npos) << e;
  e = ini_error("[policy x]\nbase = h2o\nallocator = funnel\n");
  EXPECT_NE(e.find("is not one of uniform, pyramid"), std::string::npos) << e;
  // Declared types and ranges.
  e = ini_error("[policy x]\nbase = snapkv\nsnap_kernel = 4\n");
  EXPECT_NE(e.find("snap_kernel: must be odd"), std::string::npos) << e;
  e = ini_error("[policy x]\nbase = pyramidkv\npyramid_spread = 2\n");
  EXPECT_NE(e.find("pyramid_spread: 2 is outside [0, 1]"), std::string::npos) << e;
  e = ini_error("[policy x]\nbase = h2o\nseed = 1.5\n");
  EXPECT_NE(e.find("seed: '1.5' is not a whole number"), std::string::npos) << e;
  // The unknown-parameter error lists pipeline and stage keys.
  e = ini_error("[policy x]\nbase = h2o\nsnap_windo = 3\n");
  for (const char* want : {"unknown parameter 'snap_windo'", "sinks", "snap_window", "pyramid_spread",
                           "unicache.w_a", "merge_window", "head_merge_threshold"}) {
    EXPECT_NE(e.find(want), std::string::npos) << want << " in " << e;
  }
}

TEST(Stages, DecodeSupportIsWhatEachStageDeclares) {
  const std::pair<StageKind, const char*> keys[] = {{StageKind::kHeadMerge, "head_merge"},
                                                    {StageKind::kScorer, "scorer"},
                                                    {StageKind::kAllocator, "allocator"},
                                                    {StageKind::kExecutor, "executor"},
                                                    {StageKind::kQuantizer, "quant"}};
  for (const auto& [kind, key] : keys) {
    for (const StageInfo* i : stage_infos(kind)) {
      PolicySpec p = PolicyRegistry().get("h2o");
      p.set(key, i->name);
      p.mode = PolicyMode::kDecode;
      // A head merge without a decode mode is accepted: decode mode runs the kv heads unmerged.
      if (i->decode || kind == StageKind::kHeadMerge) {
        EXPECT_NO_THROW(check_decode_support(p, "t")) << key << " " << i->name;
      } else {
        try {
          check_decode_support(p, "t");
          ADD_FAILURE() << key << " " << i->name << " accepted in decode mode";
        } catch (const PolicyError& e) {
          EXPECT_NE(std::string(e.what()).find(std::string("does not support its ") + stage_kind_name(kind) +
                                               " '" + i->name + "'"),
                    std::string::npos)
              << e.what();
        }
      }
    }
  }
  // The supported list in the message is the declared one.
  try {
    PolicyRegistry().get("vision-stride~decode");
    ADD_FAILURE() << "vision-stride~decode accepted";
  } catch (const PolicyError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "it supports scorers none, recency, h2o, snapkv, tova, knorm, random, unicache, keydiff"),
              std::string::npos)
        << e.what();
  }
  // Every UniCache preset runs in decode mode; adaptive is refused with its reason.
  for (const char* name : {"unicache~decode", "unicache-long-video~decode", "unicache-doc-qa~decode",
                           "unicache-realtime-chat~decode:4"})
    EXPECT_NO_THROW(PolicyRegistry().get(name)) << name;
  try {
    PolicyRegistry().get("adaptive~decode");
    ADD_FAILURE() << "adaptive~decode accepted";
  } catch (const PolicyError& e) {
    EXPECT_NE(std::string(e.what()).find("does not support adaptive budgets (the adaptive rate replaces the "
                                         "point's budget, which decode mode needs as its cap"),
              std::string::npos)
        << e.what();
  }
}

TEST(Stages, ListingNamesEveryStageAndParameter) {
  const std::string text = stage_listing_text(), md = stage_tables_markdown();
  for (StageKind k : kStageKinds)
    for (const StageInfo* i : stage_infos(k)) {
      EXPECT_NE(text.find(i->name), std::string::npos) << i->name;
      EXPECT_NE(md.find("`" + i->name + "`"), std::string::npos) << i->name;
    }
  for (const auto& [key, _] : policy_parameters())
    EXPECT_NE(md.find("| `" + key + "` |"), std::string::npos) << key;
}

TEST(Stages, SelectionThenExecutionIsTheRun) {
  trace::TraceReader reader(tiny_trace());
  TraceContext ctx = TraceContext::from_reader(reader);
  PolicyRegistry reg;
  for (const char* name : {"h2o", "look-m", "unicache", "hybridkv", "snapkv+int4"}) {
    const PolicySpec p = reg.get(name);
    for (int layer = 0; layer < ctx.geometry.num_layers; ++layer) {
      LayerData L(layer, reader.read_layer(layer), reader.read_decode_layer(layer), ctx);
      std::vector<std::string> w1, w2;
      const LayerSelection sel = select_on_layer(p, 0.4, L, ctx, w1);
      // Plain data: per working head, ascending distinct kept ids within the budget.
      ASSERT_EQ(static_cast<int>(sel.cluster.size()), ctx.geometry.num_kv_heads);
      ASSERT_EQ(static_cast<int>(sel.counts.size()), sel.working_heads);
      for (int w = 0; w < sel.working_heads; ++w) {
        const int K = sel.counts[static_cast<std::size_t>(w)];
        ASSERT_LE(K, sel.k);
        for (int s = 0; s < K; ++s) {
          const int t = sel.kept[static_cast<std::size_t>(w) * sel.k + s];
          ASSERT_GE(t, 0);
          ASSERT_LT(t, ctx.T);
          if (s) {
            ASSERT_GT(t, sel.kept[static_cast<std::size_t>(w) * sel.k + s - 1]);
          }
        }
      }
      EXPECT_EQ(sel.importance.empty(), p.stages.executor == "evict" || sel.keep_all) << name;
      const LayerResult a = execute_selection(p, sel, L, ctx);
      const LayerResult b = run_policy_on_layer(p, 0.4, L, ctx, w2);
      EXPECT_EQ(w1, w2);
      ASSERT_EQ(a.heads.size(), b.heads.size());
      for (std::size_t h = 0; h < a.heads.size(); ++h) {
        EXPECT_EQ(a.heads[h].quality.output_error, b.heads[h].quality.output_error)
            << name << " layer " << layer;
        EXPECT_EQ(a.heads[h].bytes_kept.total(), b.heads[h].bytes_kept.total());
        EXPECT_EQ(a.heads[h].kept, b.heads[h].kept);
      }
    }
  }
}
