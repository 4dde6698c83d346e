#include "server/core/eviction_history.h"

#include "gtest/gtest.h"

namespace kvcm {
namespace {

PageHash Page(uint64_t n) { return PageHash{n, ~n}; }

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

TEST(EvictionHistoryTest, ARunIsFoundWithinTheWindowAndForgottenAfterIt) {
  EvictionHistory h(absl::Seconds(10));
  h.Record(Page(1), {.at = kT0, .pages = 3, .hits = 2});
  ASSERT_NE(h.FindRecent(Page(1), kT0 + absl::Seconds(10)), nullptr);
  EXPECT_EQ(h.FindRecent(Page(1), kT0 + absl::Seconds(10))->pages, 3u);
  EXPECT_EQ(h.FindRecent(Page(1), kT0 + absl::Seconds(11)), nullptr);  // past, not yet forgotten
  EXPECT_EQ(h.FindRecent(Page(2), kT0), nullptr);
  h.Forget(kT0 + absl::Seconds(10));
  EXPECT_EQ(h.size(), 1u);
  h.Forget(kT0 + absl::Seconds(11));
  EXPECT_TRUE(h.empty());
}

TEST(EvictionHistoryTest, TakeRemovesTheRunAndItsLaterForgetIsHarmless) {
  EvictionHistory h(absl::Seconds(10));
  h.Record(Page(1), {.at = kT0, .pages = 1, .hits = 7, .policy_tag = 3});
  std::optional<EvictionHistory::Run> run = h.Take(Page(1));
  ASSERT_TRUE(run.has_value());
  EXPECT_EQ(run->hits, 7u);
  EXPECT_EQ(run->policy_tag, 3);
  EXPECT_FALSE(h.Take(Page(1)).has_value());
  h.Forget(kT0 + absl::Minutes(1));
  EXPECT_TRUE(h.empty());
}

TEST(EvictionHistoryTest, ARunRecordedAgainKeepsItsNewerEntryWhenTheOlderExpires) {
  EvictionHistory h(absl::Seconds(10));
  h.Record(Page(1), {.at = kT0, .pages = 1});
  h.Record(Page(1), {.at = kT0 + absl::Seconds(8), .pages = 2});
  h.Forget(kT0 + absl::Seconds(12));  // the first entry's time: the newer run stays
  ASSERT_NE(h.FindRecent(Page(1), kT0 + absl::Seconds(12)), nullptr);
  EXPECT_EQ(h.FindRecent(Page(1), kT0 + absl::Seconds(12))->pages, 2u);
  h.Forget(kT0 + absl::Seconds(19));
  EXPECT_TRUE(h.empty());
}

TEST(EvictionHistoryTest, AZeroWindowRecordsNothing) {
  EvictionHistory h(absl::ZeroDuration());
  EXPECT_FALSE(h.enabled());
  h.Record(Page(1), {.at = kT0, .pages = 1});
  EXPECT_TRUE(h.empty());
}

}  // namespace
}  // namespace kvcm
