// Tokeniser: the Python reference's tokenisation cases and errors, plus prompt layout and labels.
#include "kvscope/runner/error.hpp"
#include "kvscope/runner/tokenizer.hpp"
#include "runner_test_util.hpp"

namespace kvscope::runner {
namespace {

using testing::fixture_dir;

TEST(Tokenizer, SplitsPunctuationAndLowercases) {
  EXPECT_EQ(split_words("  The ball is RED.what\tcolor?.?  "),
            (std::vector<std::string>{"the", "ball", "is", "red", ".", "what", "color", "?", ".", "?"}));
  EXPECT_TRUE(split_words(" \t\n").empty());
}

TEST(Tokenizer, MatchesPythonReferenceCases) {
  for (const auto& name : testing::fixture_names()) {
    const Vocabulary vocab = Vocabulary::load((fixture_dir(name) / "vocab.json").string());
    SafetensorsFile ref((fixture_dir(name) / "reference.safetensors").string());
    const auto cases = testing::metadata_json(ref, "tokenization");
    ASSERT_GE(cases.size(), 5u);
    for (const auto& c : cases) {
      const auto ids = vocab.encode(c["text"].get<std::string>());
      EXPECT_EQ(ids, c["ids"].get<std::vector<std::int32_t>>()) << c["text"];
    }
    const auto errors = testing::metadata_json(ref, "tokenization_errors");
    ASSERT_GE(errors.size(), 1u);
    for (const auto& e : errors) {
      try {
        (void)vocab.encode(e["text"].get<std::string>());
        ADD_FAILURE() << "no error for " << e["text"];
      } catch (const RunnerError& err) {
        EXPECT_EQ(err.kind(), ErrorKind::kInput);
        const std::string msg = err.what();
        EXPECT_NE(msg.find("'" + e["unknown_word"].get<std::string>() + "'"), std::string::npos) << msg;
        EXPECT_NE(msg.find("vocab.json"), std::string::npos) << msg;
      }
    }
  }
}

TEST(Tokenizer, EmptyQuestionIsAnError) {
  const Vocabulary vocab = Vocabulary::load((fixture_dir("none") / "vocab.json").string());
  EXPECT_THROW((void)vocab.encode("   "), RunnerError);
  EXPECT_THROW((void)Vocabulary::load((fixture_dir("none") / "missing.json").string()), RunnerError);
}

TEST(Prompt, LayoutAndLabelsMatchReferenceInputIds) {
  const Model model = Model::load(fixture_dir("none").string());
  SafetensorsFile ref((fixture_dir("none") / "reference.safetensors").string());
  for (const auto& s : testing::load_samples(ref)) {
    const Prompt p = model.build_prompt(s.images, s.question);
    ASSERT_EQ(p.size(), static_cast<int>(s.input_ids.size())) << s.question;
    const int n_img = static_cast<int>(s.images.size());
    for (int t = 0; t < p.size(); ++t) {
      const TokenInfo& tok = p.tokens[static_cast<std::size_t>(t)];
      EXPECT_EQ(tok.token_id, s.input_ids[static_cast<std::size_t>(t)]) << "token " << t;
      EXPECT_EQ(tok.position, t);
      if (tok.token_id < 0) {
        EXPECT_EQ(tok.modality, 1);
        EXPECT_GE(tok.grid_row, 0);
        EXPECT_LT(tok.segment, n_img);
      } else if (tok.token_id <= 5) {
        EXPECT_EQ(tok.modality, 3) << "special token " << tok.token_id;
      } else {
        EXPECT_EQ(tok.modality, 0);
        EXPECT_EQ(tok.segment, n_img);
      }
    }
    if (n_img > 0) {  // first patch of the first image is (0,0) at index 2; the last is (7,7)
      EXPECT_EQ(p.tokens[2].grid_row, 0);
      EXPECT_EQ(p.tokens[65].grid_row, 7);
      EXPECT_EQ(p.tokens[65].grid_col, 7);
    }
  }
}

}  // namespace
}  // namespace kvscope::runner
