#include "common/model_spec.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

ModelSpec DeepSeekV3(KvDtype dtype = KvDtype::kBf16) {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .dtype = dtype};
}

ModelSpec Llama3_70B() {
  return ModelSpec{.attention = AttentionKind::kGqa,
                   .num_layers = 80,
                   .num_heads = 64,
                   .num_kv_heads = 8,
                   .head_dim = 128,
                   .dtype = KvDtype::kBf16};
}

TEST(ModelSpecTest, DeepSeekV3MlaBytes) {
  ModelSpec spec = DeepSeekV3();
  ASSERT_TRUE(spec.Validate().ok());
  EXPECT_EQ(spec.BytesPerTokenPerLayer(), 1152u);
  EXPECT_EQ(spec.BytesPerToken(), 70272u);
  EXPECT_EQ(spec.BytesPerPage(), 70272u * 64);
}

TEST(ModelSpecTest, DeepSeekV3Fp8UsesFlashMlaLayout) {
  EXPECT_EQ(DeepSeekV3(KvDtype::kFp8).BytesPerTokenPerLayer(), 656u);
}

TEST(ModelSpecTest, MlaIsAbout71TimesSmallerThanMhaShape) {
  // The same model with an MHA-shaped cache: K of nope 128 + rope 64, V of 128 per head.
  // 128 * (192 + 128) * 2 = 81,920 B per token and layer.
  const uint64_t mha_shaped = 128 * (192 + 128) * 2;
  EXPECT_EQ(mha_shaped, 81920u);
  EXPECT_NEAR(double(mha_shaped) / DeepSeekV3().BytesPerTokenPerLayer(), 71.1, 0.1);
}

TEST(ModelSpecTest, MhaShapedBytesForTheByteBlindArm) {
  ModelSpec v3 = DeepSeekV3();
  EXPECT_EQ(v3.MhaShapedBytesPerToken(), 81920u * 61);  // nope/v default to 512 / 4 = 128
  v3.qk_nope_head_dim = 64;
  v3.v_head_dim = 32;
  EXPECT_EQ(v3.MhaShapedBytesPerToken(), 128u * (64 + 64 + 32) * 2 * 61);
  EXPECT_EQ(Llama3_70B().MhaShapedBytesPerToken(), 2u * 64 * 128 * 2 * 80);
}

TEST(ModelSpecTest, GqaMhaMqaBytes) {
  EXPECT_EQ(Llama3_70B().BytesPerTokenPerLayer(), 2u * 8 * 128 * 2);
  EXPECT_EQ(Llama3_70B().BytesPerToken(), 327680u);
  ModelSpec mha{.attention = AttentionKind::kMha,
                .num_layers = 32,
                .num_heads = 32,
                .head_dim = 128,
                .dtype = KvDtype::kFp16};
  ASSERT_TRUE(mha.Validate().ok());
  EXPECT_EQ(mha.BytesPerTokenPerLayer(), 2u * 32 * 128 * 2);
  ModelSpec mqa{.attention = AttentionKind::kMqa,
                .num_layers = 2,
                .num_heads = 8,
                .num_kv_heads = 1,
                .head_dim = 64,
                .dtype = KvDtype::kInt8};
  ASSERT_TRUE(mqa.Validate().ok());
  EXPECT_EQ(mqa.BytesPerTokenPerLayer(), 2u * 64 + 2 * 4);  // int8 + one fp32 scale per head
}

TEST(ModelSpecTest, RejectsImpossibleGeometryNamingTheField) {
  ModelSpec spec = Llama3_70B();
  spec.num_kv_heads = 7;
  EXPECT_THAT(spec.Validate().message(), HasSubstr("num_kv_heads"));
  spec = Llama3_70B();
  spec.num_layers = 0;
  EXPECT_EQ(spec.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.Validate().message(), HasSubstr("num_layers"));
  spec = DeepSeekV3(KvDtype::kFp8);
  spec.kv_lora_rank = 500;
  EXPECT_THAT(spec.Validate().message(), HasSubstr("kv_lora_rank"));
  spec = DeepSeekV3();
  spec.page_size_tokens = 0;
  EXPECT_THAT(spec.Validate().message(), HasSubstr("page_size_tokens"));
  spec = DeepSeekV3();
  spec.attention = static_cast<AttentionKind>(9);
  EXPECT_THAT(spec.Validate().message(), HasSubstr("attention"));
}

TEST(ModelSpecTest, KvLayoutIsAtMost256PrintableBytes) {
  ModelSpec spec = DeepSeekV3();
  spec.kv_layout = std::string(ModelSpec::kMaxKvLayoutBytes, '~');
  EXPECT_TRUE(spec.Validate().ok());
  spec.kv_layout += " ";
  EXPECT_EQ(spec.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.Validate().message(), HasSubstr("spec.kv_layout must be at most 256 bytes"));
  spec.kv_layout = "vllm-cpu [block, 576] bf16";
  EXPECT_TRUE(spec.Validate().ok());
  spec.kv_layout[8] = '\n';
  EXPECT_THAT(spec.Validate().message(),
              HasSubstr("spec.kv_layout must be printable ASCII (0x20..0x7e); byte 8 is 0x0a"));
  EXPECT_EQ(spec.BytesPerPage(), DeepSeekV3().BytesPerPage()) << "a layout costs no bytes";
}

TEST(ModelSpecTest, AnEmptyLayoutIsCompatibleWithAnyOtherFieldsNot) {
  ModelSpec cpu = DeepSeekV3();
  cpu.kv_layout = "vllm-cpu/mla:[block,576]:bf16";
  ModelSpec flash = cpu;
  flash.kv_layout = "flash-mla:[block,576]:bf16";
  EXPECT_TRUE(cpu.CompatibleWith(cpu));
  EXPECT_TRUE(cpu.CompatibleWith(DeepSeekV3()));
  EXPECT_TRUE(DeepSeekV3().CompatibleWith(cpu));
  EXPECT_FALSE(cpu.CompatibleWith(flash));
  EXPECT_FALSE(cpu == DeepSeekV3());
  EXPECT_FALSE(cpu.CompatibleWith(DeepSeekV3(KvDtype::kFp8)));
  EXPECT_FALSE(DeepSeekV3(KvDtype::kFp8).CompatibleWith(cpu));
  EXPECT_THAT(cpu.DebugString(), HasSubstr("kv_layout=\"vllm-cpu/mla:[block,576]:bf16\""));
  EXPECT_THAT(DeepSeekV3().DebugString(), ::testing::Not(HasSubstr("kv_layout")));
}

}  // namespace
}  // namespace kvcm
