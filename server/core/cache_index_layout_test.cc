// A namespace's kv_layout (RegisterModel): two engines whose specs are equal but whose pages'
// bytes are laid out differently must not share pages, so a namespace refuses a layout
// other than its own. An empty layout states none and is compatible with any; a namespace
// without one takes the first one stated.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/cache_index.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using Source = CacheIndex::NamespaceSource;

constexpr char kCpu[] = "vllm-cpu/mla:[block,576]:bf16";
constexpr char kFlash[] = "flash-mla:[block,656]:fp8-packed";

ModelSpec Mla(std::string layout = "") {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = 4,
                   .kv_layout = std::move(layout)};
}

class CacheIndexLayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(CacheIndexOptions{.hash_secret = HashKey{11, 22}});
  }

  // The stored spec's layout; "<none>" when the namespace is unknown.
  std::string StoredLayout() {
    absl::StatusOr<RegisterModelResult> ns = index_->GetNamespace(ns_);
    return ns.ok() ? ns->spec.kv_layout : "<none>";
  }

  std::unique_ptr<CacheIndex> index_;
  const NamespaceId ns_{"acme", "m"};
};

TEST_F(CacheIndexLayoutTest, AnotherLayoutIsRefusedNamingBothAndChangesNothing) {
  absl::StatusOr<RegisterModelResult> first = index_->RegisterModel(ns_, Mla(kCpu));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->created);
  EXPECT_EQ(first->spec, Mla(kCpu));

  absl::StatusOr<RegisterModelResult> other =
      index_->RegisterModel(ns_, Mla(kFlash), Source::kClient, absl::Seconds(30));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status().message(),
              HasSubstr(absl::StrCat("namespace acme/m is registered with kv_layout \"", kCpu,
                                     "\"; this spec has \"", kFlash, "\"")));
  absl::StatusOr<RegisterModelResult> stored = index_->GetNamespace(ns_);
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->spec, Mla(kCpu));
  EXPECT_EQ(stored->max_page_age, absl::ZeroDuration()) << "the refused call set a retention";
  // An agent's inventory and a reader are refused alike.
  EXPECT_EQ(index_->RegisterModel(ns_, Mla(kFlash), Source::kInventory).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index_->RegisterModel(ns_, Mla(kFlash), Source::kReader).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StoredLayout(), kCpu);
  EXPECT_EQ(index_->Stats().namespaces.size(), 1u);
}

TEST_F(CacheIndexLayoutTest, AnEmptyLayoutIsCompatibleAndAnswersTheStoredOne) {
  ASSERT_TRUE(index_->RegisterModel(ns_, Mla(kCpu)).ok());
  for (Source source : {Source::kClient, Source::kInventory, Source::kReader}) {
    absl::StatusOr<RegisterModelResult> unstated = index_->RegisterModel(ns_, Mla(), source);
    ASSERT_TRUE(unstated.ok()) << unstated.status();
    EXPECT_FALSE(unstated->created);
    EXPECT_EQ(unstated->spec, Mla(kCpu));
    EXPECT_EQ(unstated->hash_key, DeriveNamespaceKey(HashKey{11, 22}, "acme", "m"));
  }
  EXPECT_EQ(StoredLayout(), kCpu);
}

TEST_F(CacheIndexLayoutTest, ANamespaceWithoutALayoutTakesTheFirstStated) {
  ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
  EXPECT_EQ(StoredLayout(), "");
  // A reader may confirm with a layout but does not set it.
  absl::StatusOr<RegisterModelResult> read =
      index_->RegisterModel(ns_, Mla(kFlash), Source::kReader);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->spec.kv_layout, "");
  EXPECT_EQ(StoredLayout(), "");

  absl::StatusOr<RegisterModelResult> adopted = index_->RegisterModel(ns_, Mla(kCpu));
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_FALSE(adopted->created);
  EXPECT_EQ(adopted->spec, Mla(kCpu));
  EXPECT_EQ(StoredLayout(), kCpu);
  EXPECT_EQ(index_->Stats().namespaces[0].spec, Mla(kCpu));

  EXPECT_EQ(index_->RegisterModel(ns_, Mla(kFlash)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index_->RegisterModel(ns_, Mla())->spec, Mla(kCpu));
  EXPECT_EQ(StoredLayout(), kCpu);
}

TEST_F(CacheIndexLayoutTest, AnInventoryGivesItsLayoutToANamespaceWithout) {
  ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
  ASSERT_TRUE(index_->RegisterModel(ns_, Mla(kCpu), Source::kInventory).ok());
  EXPECT_EQ(StoredLayout(), kCpu);
}

TEST_F(CacheIndexLayoutTest, EveryOtherFieldStillMustBeEqual) {
  ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
  ModelSpec fp8 = Mla(kCpu);
  fp8.dtype = KvDtype::kFp8;
  absl::StatusOr<RegisterModelResult> other = index_->RegisterModel(ns_, fp8);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status().message(), HasSubstr("dtype=fp8"));
  EXPECT_EQ(StoredLayout(), "") << "a refused spec gave its layout";
}

TEST_F(CacheIndexLayoutTest, ALayoutTooLongOrNotPrintableIsInvalidArgument) {
  const std::string longest(ModelSpec::kMaxKvLayoutBytes, 'x');
  const std::string bad[] = {longest + "x", "tab\there", "del\x7f", "caf\xc3\xa9",
                             std::string("nul\0", 4)};
  for (const std::string& layout : bad) {
    absl::StatusOr<RegisterModelResult> r = index_->RegisterModel(ns_, Mla(layout));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << layout;
    EXPECT_THAT(r.status().message(), HasSubstr("spec.kv_layout")) << layout;
  }
  EXPECT_TRUE(index_->Stats().namespaces.empty());
  // Nor may a namespace without a layout take a bad one.
  ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
  EXPECT_EQ(index_->RegisterModel(ns_, Mla(bad[1])).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StoredLayout(), "");
  // 256 bytes of every printable character are fine.
  std::string printable;
  for (char c = 0x20; c <= 0x7e; ++c) printable += c;
  ASSERT_TRUE(index_->RegisterModel({"acme", "p"}, Mla(printable)).ok());
  ASSERT_TRUE(index_->RegisterModel({"acme", "l"}, Mla(longest)).ok());
}

}  // namespace
}  // namespace kvcm
