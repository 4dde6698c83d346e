#include "common/enum_names.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(EnumNamesTest, EveryNameParsesBackToItsValue) {
  for (Tier t : {Tier::kGpu, Tier::kHost, Tier::kDisk}) {
    EXPECT_EQ(*ParseTier(TierName(t)), t);
  }
  for (AttentionKind a :
       {AttentionKind::kMha, AttentionKind::kMqa, AttentionKind::kGqa, AttentionKind::kMla}) {
    EXPECT_EQ(*ParseAttention(AttentionName(a)), a);
  }
  for (KvDtype d : {KvDtype::kBf16, KvDtype::kFp16, KvDtype::kFp8, KvDtype::kInt8}) {
    EXPECT_EQ(*ParseDtype(DtypeName(d)), d);
  }
}

TEST(EnumNamesTest, ParsingIgnoresLetterCase) {
  EXPECT_EQ(*ParseTier("HOST"), Tier::kHost);
  EXPECT_EQ(*ParseAttention("Mla"), AttentionKind::kMla);
  EXPECT_EQ(*ParseDtype("FP8"), KvDtype::kFp8);
}

TEST(EnumNamesTest, UnknownNameNamesTheFieldAndTheChoices) {
  absl::StatusOr<Tier> tier = ParseTier("ssd", "--tier");
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tier.status().message(), HasSubstr("--tier: expected gpu|host|disk, got 'ssd'"));
  EXPECT_THAT(ParseDtype("fp4").status().message(),
              HasSubstr("dtype: expected bf16|fp16|fp8|int8"));
  EXPECT_THAT(ParseAttention("").status().message(), HasSubstr("attention: expected"));
}

TEST(EnumNamesTest, ValueOutsideTheEnumHasAPlaceholderName) {
  EXPECT_EQ(TierName(static_cast<Tier>(77)), "?");
  EXPECT_EQ(DtypeName(static_cast<KvDtype>(0)), "?");
}

}  // namespace
}  // namespace kvcm
