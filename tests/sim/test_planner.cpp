// Capacity planner: the seed's KV numbers, exact byte sizes, capacity arithmetic
// checked against an independent count, monotonicity and the error messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kvscope/sim/planner.hpp"

namespace kvscope::sim {
namespace {

constexpr std::int64_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

// A 7B GQA-8 model (Llama-3-8B-like geometry) as in seed 003.
ModelSpec gqa8_7b() { return generic_model(32, 8, 128, 7.0e9, 32); }

PlanInput llava_input(std::int64_t gpu) {
  PlanInput in;
  in.model = find_model_preset("llava-1.5-7b");
  in.gpu_mem_bytes = gpu;
  in.request.images = 1;
  in.request.image_tokens = 576;
  in.request.text_tokens = 64;
  in.request.output_tokens = 256;
  return in;
}

std::string error_of(const PlanInput& in) {
  try {
    plan(in);
  } catch (const PlanError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(PlannerBytes, SeedNumbersForGqa8Model) {
  const ModelSpec m = gqa8_7b();
  EXPECT_EQ(kv_bytes_per_token_layer(m, KvDType::kF16), 4 * KiB);  // 2 x 8 x 128 x 2
  EXPECT_EQ(kv_bytes_per_token(m, KvDType::kF16), 128 * KiB);
  RequestShape image{.images = 1, .image_tokens = 576};
  EXPECT_EQ(request_bytes(image, kv_bytes_per_token(m, KvDType::kF16), nullptr).request_bytes, 72 * MiB);
  RequestShape text8k{.text_tokens = 8192};
  EXPECT_EQ(request_bytes(text8k, kv_bytes_per_token(m, KvDType::kF16), nullptr).request_bytes, 1 * GiB);
}

TEST(PlannerBytes, LlavaIsMhaWith512KiBPerToken) {
  const ModelSpec& m = find_model_preset("llava-1.5-7b");
  EXPECT_EQ(m.kv_heads, 32);
  EXPECT_EQ(m.layers, 32);
  EXPECT_EQ(kv_bytes_per_token(m, KvDType::kF16), 512 * KiB);
  EXPECT_EQ(kv_bytes_per_token(m, KvDType::kBF16), 512 * KiB);
  EXPECT_EQ(kv_bytes_per_token(m, KvDType::kF32), 1024 * KiB);
  EXPECT_EQ(kv_bytes_per_token(m, KvDType::kInt8), 256 * KiB);
  EXPECT_EQ(kv_bytes_per_token(m, KvDType::kInt4), 128 * KiB);
  // Qwen2-VL-7B: 28 layers x 2 x 4 kv heads x 128 x 2 bytes.
  EXPECT_EQ(kv_bytes_per_token(find_model_preset("qwen2-vl-7b"), KvDType::kF16), 28 * 2 * 4 * 128 * 2);
}

TEST(PlannerBytes, WeightsPerDtype) {
  EXPECT_EQ(weights_bytes(1000, WeightsDType::kF16), 2000);
  EXPECT_EQ(weights_bytes(1000, WeightsDType::kInt8), 1000);
  // int4: 500 bytes of codes + 8 groups of 128 (the last one partial) x 2-byte scale.
  EXPECT_EQ(weights_bytes(1000, WeightsDType::kInt4), 500 + 8 * 2);
  EXPECT_EQ(weights_bytes(1001, WeightsDType::kInt4), 501 + 8 * 2);
  EXPECT_EQ(weights_bytes(7e9, WeightsDType::kF16), 14'000'000'000);
}

TEST(PlannerBytes, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("24GiB", "gpu-mem"), 24 * GiB);
  EXPECT_EQ(parse_byte_size("80GB", "gpu-mem"), 80'000'000'000);
  EXPECT_EQ(parse_byte_size("512MiB", "gpu-mem"), 512 * MiB);
  EXPECT_EQ(parse_byte_size("1.5gib", "gpu-mem"), 3 * GiB / 2);
  EXPECT_EQ(parse_byte_size("4096", "gpu-mem"), 4096);
  EXPECT_EQ(parse_byte_size("4096B", "gpu-mem"), 4096);
  EXPECT_EQ(parse_byte_size(" 2 KiB ", "gpu-mem"), 2048);
  EXPECT_EQ(parse_byte_size("1TB", "gpu-mem"), 1'000'000'000'000);
  for (const char* bad :
       {"", "GiB", "24XB", "24GiBs", "1.2.3GB", "-24GiB", "0", "0.5", "abc", "24 GiB x", "1e30TB"}) {
    EXPECT_THROW(parse_byte_size(bad, "gpu-mem"), PlanError) << "'" << bad << "'";
  }
  try {
    parse_byte_size("24QB", "gpu-mem");
    FAIL() << "no error";
  } catch (const PlanError& e) {
    EXPECT_EQ(e.parameter(), "gpu-mem");
    EXPECT_NE(std::string(e.what()).find("--gpu-mem"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("24QB"), std::string::npos) << e.what();
  }
}

TEST(PlannerCapacity, MatchesAnIndependentCount) {
  const PlanInput in = llava_input(80 * GiB);
  const PlanResult r = plan(in);
  const std::int64_t weights = 2 * 7'063'000'000;  // fp16 x 7.063e9 parameters
  EXPECT_EQ(r.weights_bytes, weights);
  EXPECT_EQ(r.reserve_bytes, 8 * GiB);
  EXPECT_EQ(r.kv_budget_bytes, 80 * GiB - 8 * GiB - weights);
  const std::int64_t per_request = (576 + 64 + 256) * 512 * KiB;
  EXPECT_EQ(r.full.request_bytes, per_request);
  EXPECT_EQ(r.full.prompt_bytes[1], 576 * 512 * KiB);
  EXPECT_EQ(r.full.prompt_bytes[0], 64 * 512 * KiB);
  EXPECT_EQ(r.full.output_bytes, 256 * 512 * KiB);
  EXPECT_EQ(r.full.max_requests, r.kv_budget_bytes / per_request);
  // The requests fit and one more would not.
  EXPECT_LE(r.full.max_requests * per_request, r.kv_budget_bytes);
  EXPECT_GT((r.full.max_requests + 1) * per_request, r.kv_budget_bytes);
  EXPECT_EQ(r.full.max_context_tokens, r.kv_budget_bytes / (512 * KiB));
  EXPECT_EQ(r.full.max_images, (r.kv_budget_bytes - (64 + 256) * 512 * KiB) / (576 * 512 * KiB));
  EXPECT_FALSE(r.compressed.has_value());
  EXPECT_DOUBLE_EQ(r.request_gain(), 1.0);
}

TEST(PlannerCapacity, MoreMemoryNeverFitsFewerRequests) {
  std::int64_t previous = -1;
  for (std::int64_t gib = 16; gib <= 160; gib += 8) {
    const PlanResult r = plan(llava_input(gib * GiB));
    EXPECT_GE(r.full.max_requests, previous) << gib << " GiB";
    EXPECT_GE(r.full.max_context_tokens, r.full.max_requests * r.full.request_bytes / r.kv_bytes_per_token);
    previous = r.full.max_requests;
  }
  EXPECT_GT(plan(llava_input(160 * GiB)).full.max_requests, plan(llava_input(24 * GiB)).full.max_requests);
}

TEST(PlannerCapacity, HalfTheBytesDoublesCapacity) {
  PlanInput in = llava_input(80 * GiB);
  in.compression = KeepRatios::uniform(0.5);
  in.compression->output = 0.5;
  const PlanResult r = plan(in);
  ASSERT_TRUE(r.compressed.has_value());
  EXPECT_EQ(r.compressed->request_bytes * 2, r.full.request_bytes);
  const std::int64_t n = r.full.max_requests, c = r.compressed->max_requests;
  EXPECT_GE(c, 2 * n);
  EXPECT_LE(c, 2 * n + 1);  // within the rounding of the floor
  EXPECT_GE(r.request_gain(), 2.0);
  EXPECT_LE(r.request_gain(), 2.0 + 1.0 / static_cast<double>(n) + 1e-12);
  EXPECT_EQ(r.compressed->max_context_tokens,
            2 * r.full.max_context_tokens + (r.kv_budget_bytes / (256 * KiB)) % 2);
}

TEST(PlannerCapacity, VisionOnlyCompressionTouchesOnlyVision) {
  PlanInput in = llava_input(40 * GiB);
  KeepRatios k;
  k.prompt[1] = 0.25;
  in.compression = k;
  const PlanResult r = plan(in);
  ASSERT_TRUE(r.compressed.has_value());
  EXPECT_EQ(r.compressed->prompt_bytes[1], 144 * 512 * KiB);
  EXPECT_EQ(r.compressed->prompt_bytes[0], r.full.prompt_bytes[0]);
  EXPECT_EQ(r.compressed->output_bytes, r.full.output_bytes);
  EXPECT_EQ(r.compressed->max_context_tokens, r.full.max_context_tokens);  // text-only context unchanged
  EXPECT_GE(r.compressed->max_images, 4 * r.full.max_images);
  EXPECT_GT(r.compressed->max_requests, r.full.max_requests);
}

TEST(PlannerCapacity, RatiosRoundUpToWholeBytes) {
  RequestShape one{.text_tokens = 3};
  KeepRatios k = KeepRatios::uniform(0.3);
  // 3 x 10 bytes x 0.3 = 9 exactly; 1 x 10 x 0.3 = 3; 7 x 10 x 0.3 = 21 (ceil, never under-counted).
  EXPECT_EQ(request_bytes(one, 10, &k).prompt_bytes[0], 9);
  k.prompt[0] = 0.33;
  EXPECT_EQ(request_bytes(one, 10, &k).prompt_bytes[0], 10);  // 9.9 -> 10
}

TEST(PlannerCapacity, Int4WeightsLeaveMoreRoomThanFp16) {
  PlanInput fp16 = llava_input(24 * GiB);
  PlanInput int4 = fp16;
  int4.weights = WeightsDType::kInt4;
  const PlanResult a = plan(fp16), b = plan(int4);
  EXPECT_LT(b.weights_bytes, a.weights_bytes / 3);
  EXPECT_GT(b.kv_budget_bytes, a.kv_budget_bytes);
  EXPECT_GT(b.full.max_requests, a.full.max_requests);
  EXPECT_GT(b.full.max_context_tokens, a.full.max_context_tokens);
}

TEST(PlannerErrors, WeightsLargerThanTheGpu) {
  const std::string e = error_of(llava_input(8 * GiB));
  EXPECT_NE(e.find("weights alone need 13.16 GiB"), std::string::npos) << e;
  EXPECT_NE(e.find("GPU has 8.00 GiB"), std::string::npos) << e;
  // Weights fit, but not with the reserve.
  PlanInput tight = llava_input(14 * GiB);
  tight.reserve_fraction = 0.2;
  EXPECT_NE(error_of(tight).find("leave no room for the KV cache"), std::string::npos) << error_of(tight);
}

TEST(PlannerErrors, BadInputsNameTheirParameter) {
  PlanInput in = llava_input(-1);
  EXPECT_NE(error_of(in).find("GPU memory must be positive"), std::string::npos) << error_of(in);
  in = llava_input(24 * GiB);
  in.compression = KeepRatios::uniform(0.0);
  EXPECT_NE(error_of(in).find("ratio must be in (0, 1]"), std::string::npos) << error_of(in);
  in.compression = KeepRatios::uniform(1.5);
  EXPECT_NE(error_of(in).find("ratio must be in (0, 1]"), std::string::npos) << error_of(in);
  in = llava_input(24 * GiB);
  in.request.text_tokens = -3;
  EXPECT_NE(error_of(in).find("text must be in [0, 2^40]"), std::string::npos) << error_of(in);
  in = llava_input(24 * GiB);
  in.reserve_fraction = 1.0;
  EXPECT_NE(error_of(in).find("reserve fraction"), std::string::npos) << error_of(in);
  in = llava_input(24 * GiB);
  in.request = RequestShape{};
  EXPECT_NE(error_of(in).find("no tokens"), std::string::npos) << error_of(in);
  EXPECT_THROW(generic_model(0, 8, 128, 7e9), PlanError);
  EXPECT_THROW(generic_model(32, 8, 128, 7e9, 12), PlanError);  // 12 query heads for 8 kv heads
  EXPECT_THROW(generic_model(32, 8, 128, 0), PlanError);
  EXPECT_THROW(parse_kv_dtype("fp8"), PlanError);
  EXPECT_THROW(parse_weights_dtype("int3"), PlanError);
}

TEST(PlannerErrors, UnknownPresetListsTheValidOnes) {
  try {
    find_model_preset("llama-9000");
    FAIL() << "no error";
  } catch (const PlanError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("llama-9000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("llava-1.5-7b"), std::string::npos) << msg;
    EXPECT_NE(msg.find("qwen2-vl-7b"), std::string::npos) << msg;
    EXPECT_EQ(e.parameter(), "model");
  }
}

TEST(PlannerReports, CsvAndJsonCarryTheExactNumbers) {
  PlanInput in = llava_input(80 * GiB);
  in.compression = KeepRatios::uniform(0.5);
  const PlanResult r = plan(in);
  const std::string csv = plan_csv(r);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 3);  // header + full + compressed
  EXPECT_NE(csv.find("\nfull,llava-1.5-7b,32,32,128,"), std::string::npos) << csv;
  EXPECT_NE(csv.find("," + std::to_string(r.compressed->max_requests) + ","), std::string::npos) << csv;
  const std::string json = plan_json(r);
  EXPECT_NE(json.find("\"kv_bytes_per_token\": 524288"), std::string::npos) << json;
  EXPECT_NE(json.find("\"max_requests\": " + std::to_string(r.full.max_requests)), std::string::npos) << json;
  const std::string table = format_plan(r);
  EXPECT_NE(table.find("max concurrent requests"), std::string::npos) << table;
  EXPECT_NE(table.find("with compression"), std::string::npos) << table;
}

}  // namespace
}  // namespace kvscope::sim
