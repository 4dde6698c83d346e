#include "common/model_catalog.h"

#include <set>
#include <string>

#include "absl/strings/ascii.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr KvDtype kAllDtypes[] = {KvDtype::kBf16, KvDtype::kFp16, KvDtype::kFp8, KvDtype::kInt8};

// The catalogue spec of `name` in `dtype`; fails the test when there is none.
ModelSpec Spec(absl::string_view name, KvDtype dtype = KvDtype::kBf16) {
  absl::StatusOr<ModelSpec> spec = FindModel(name, dtype);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : ModelSpec{};
}

TEST(ModelCatalogTest, EveryEntryIsValidInEveryDtype) {
  ASSERT_GE(Catalog().size(), 8u);
  std::set<std::string> names;
  for (const CatalogModel& m : Catalog()) {
    const std::string name(m.name);
    EXPECT_TRUE(names.insert(name).second) << "duplicate " << name;
    EXPECT_EQ(name, absl::AsciiStrToLower(name));
    EXPECT_FALSE(m.family.empty()) << name;
    EXPECT_EQ(m.spec.dtype, KvDtype::kBf16) << name;
    EXPECT_EQ(m.spec.page_size_tokens, kDefaultPageSizeTokens) << name;
    for (KvDtype dtype : kAllDtypes) {
      ModelSpec spec = Spec(m.name, dtype);
      EXPECT_TRUE(spec.Validate().ok()) << name << ": " << spec.Validate();
      EXPECT_EQ(spec.dtype, dtype) << name;
    }
  }
}

TEST(ModelCatalogTest, DeepSeekV3AndR1Bf16) {
  // (kv_lora_rank 512 + rope 64) * 2 B = 1,152 B per token and layer; * 61 layers = 70,272.
  const ModelSpec v3 = Spec("deepseek-v3");
  EXPECT_EQ(v3.attention, AttentionKind::kMla);
  EXPECT_EQ(v3.BytesPerTokenPerLayer(), 1'152u);
  EXPECT_EQ(v3.BytesPerToken(), 70'272u);
  EXPECT_EQ(v3.BytesPerPage(), 70'272u * 64);  // 4,497,408 B per 64-token page
  EXPECT_EQ(Spec("deepseek-r1"), v3);
}

TEST(ModelCatalogTest, DeepSeekV3Fp8AndInt8) {
  // FlashMLA's FP8 layout: 512 fp8 + 512/128 = 4 fp32 scales + 64 bf16 rope
  // = 512 + 16 + 128 = 656 B per token and layer; * 61 = 40,016 B per token.
  const ModelSpec fp8 = Spec("deepseek-v3", KvDtype::kFp8);
  EXPECT_EQ(fp8.BytesPerTokenPerLayer(), 656u);
  EXPECT_EQ(fp8.BytesPerToken(), 40'016u);
  // int8: 512 int8 + one fp32 scale + 64 bf16 rope = 512 + 4 + 128 = 644; * 61 = 39,284.
  const ModelSpec int8 = Spec("deepseek-v3", KvDtype::kInt8);
  EXPECT_EQ(int8.BytesPerTokenPerLayer(), 644u);
  EXPECT_EQ(int8.BytesPerToken(), 39'284u);
}

TEST(ModelCatalogTest, DeepSeekV2AndV2Lite) {
  // Same latent as V3 (1,152 B per token and layer in bf16); V2 has 60 layers, V2-Lite 27.
  EXPECT_EQ(Spec("deepseek-v2").num_layers, 60u);
  EXPECT_EQ(Spec("deepseek-v2").BytesPerToken(), 1'152u * 60);  // 69,120
  const ModelSpec lite = Spec("deepseek-v2-lite");
  EXPECT_EQ(lite.num_layers, 27u);
  EXPECT_EQ(lite.num_heads, 16u);
  EXPECT_EQ(lite.BytesPerTokenPerLayer(), 1'152u);
  EXPECT_EQ(lite.BytesPerToken(), 31'104u);  // 1,152 * 27
  // With 16 heads its latent saves less: 16 * (128 + 64 + 128) * 2 B = 10,240 B per layer
  // MHA-shaped, 10,240 / 1,152 = 8.9 times the latent (V3: 71.1).
  EXPECT_DOUBLE_EQ(FootprintOf(lite).mha_shaped_ratio, 10'240.0 / 1'152.0);
}

TEST(ModelCatalogTest, GqaModels) {
  // Llama-3-8B: 2 (K and V) * 8 kv heads * 128 dims * 2 B = 4,096 B per token and layer;
  // * 32 layers = 131,072 B per token.
  const ModelSpec llama8b = Spec("llama-3-8b");
  EXPECT_EQ(llama8b.attention, AttentionKind::kGqa);
  EXPECT_EQ(llama8b.BytesPerTokenPerLayer(), 4'096u);
  EXPECT_EQ(llama8b.BytesPerToken(), 131'072u);
  // Llama-3-70B: the same 4,096 B per layer, 80 layers = 327,680 B per token.
  EXPECT_EQ(Spec("llama-3-70b").BytesPerToken(), 327'680u);
  // Mistral-7B: 8 kv heads of 128, 32 layers, like Llama-3-8B: 131,072 B per token.
  EXPECT_EQ(Spec("mistral-7b").BytesPerToken(), 131'072u);
  // int8 adds one fp32 scale per K and V head: 2*8*128*1 + 2*8*4 = 2,048 + 64 = 2,112 B
  // per token and layer; * 32 = 67,584 B per token.
  const ModelSpec int8 = Spec("llama-3-8b", KvDtype::kInt8);
  EXPECT_EQ(int8.BytesPerTokenPerLayer(), 2'112u);
  EXPECT_EQ(int8.BytesPerToken(), 67'584u);
  // fp8 has no scales in this accounting: 2,048 * 32 = 65,536.
  EXPECT_EQ(Spec("llama-3-8b", KvDtype::kFp8).BytesPerToken(), 65'536u);
}

TEST(ModelCatalogTest, MhaModel) {
  // Llama-2-7B: 2 * 32 heads * 128 dims * 2 B = 16,384 B per token and layer;
  // * 32 layers = 524,288 B (512 KiB) per token, 4x Llama-3-8B's GQA cache.
  const ModelSpec llama2 = Spec("llama-2-7b");
  EXPECT_EQ(llama2.attention, AttentionKind::kMha);
  EXPECT_EQ(llama2.BytesPerTokenPerLayer(), 16'384u);
  EXPECT_EQ(llama2.BytesPerToken(), 524'288u);
  EXPECT_EQ(Spec("llama-2-7b", KvDtype::kFp16).BytesPerToken(), 524'288u);
}

TEST(ModelCatalogTest, FootprintOfDeepSeekV3) {
  const KvFootprint f = FootprintOf(Spec("deepseek-v3"));
  EXPECT_EQ(f.bytes_per_token_per_layer, 1'152u);
  EXPECT_EQ(f.bytes_per_token, 70'272u);
  EXPECT_EQ(f.bytes_per_page, 4'497'408u);
  // floor(2^30 / 70,272) = floor(15,279.8) = 15,279 (70,272 * 15,279 = 1,073,685,888).
  EXPECT_EQ(f.tokens_per_gib, 15'279u);
  // MHA-shaped: 128 heads * (nope 128 + rope 64 + v 128) * 2 B = 81,920 B per layer;
  // 81,920 / 1,152 = 71.11.
  EXPECT_NEAR(f.mha_shaped_ratio, 71.1, 0.05);
  EXPECT_DOUBLE_EQ(f.mha_shaped_ratio, 81'920.0 / 1'152.0);
}

TEST(ModelCatalogTest, FootprintRatioOfGqaAndMha) {
  // GQA is num_heads / num_kv_heads times smaller than MHA-shaped: 32 / 8 = 4.
  const KvFootprint llama8b = FootprintOf(Spec("llama-3-8b"));
  EXPECT_DOUBLE_EQ(llama8b.mha_shaped_ratio, 4.0);
  EXPECT_EQ(llama8b.tokens_per_gib, 8'192u);  // 2^30 / 2^17
  EXPECT_DOUBLE_EQ(FootprintOf(Spec("llama-3-70b")).mha_shaped_ratio, 8.0);
  EXPECT_DOUBLE_EQ(FootprintOf(Spec("llama-2-7b")).mha_shaped_ratio, 1.0);
}

TEST(ModelCatalogTest, LookupIgnoresCase) {
  EXPECT_EQ(Spec("DeepSeek-V3"), Spec("deepseek-v3"));
  EXPECT_EQ(Spec("Llama-3-70B", KvDtype::kFp8), Spec("llama-3-70b", KvDtype::kFp8));
}

TEST(ModelCatalogTest, UnknownNameIsNotFoundListingTheKnownOnes) {
  absl::StatusOr<ModelSpec> spec = FindModel("gpt-5");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(spec.status().message(), HasSubstr("'gpt-5'"));
  for (const CatalogModel& m : Catalog()) {
    EXPECT_THAT(spec.status().message(), HasSubstr(std::string(m.name)));
  }
  EXPECT_EQ(FindModel("").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FindModel("deepseek").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcm
