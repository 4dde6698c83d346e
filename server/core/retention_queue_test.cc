#include "server/core/retention_queue.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

using Entry = RetentionQueue::Entry;

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);
const int64_t kT0Ms = absl::ToUnixMillis(kT0);

// Distinct keys; never dereferenced.
RadixNode* Node(uintptr_t n) { return reinterpret_cast<RadixNode*>(n * 64); }

// What a sweep would visit now, oldest first, without removing anything.
std::vector<Entry> Pass(const RetentionQueue& q, int64_t cutoff_ms) {
  std::vector<Entry> out;
  for (std::optional<Entry> e = q.First(cutoff_ms); e.has_value(); e = q.Next(*e, cutoff_ms)) {
    out.push_back(*e);
  }
  return out;
}

TEST(RetentionQueueTest, WithoutALimitNothingIsQueuedOrPast) {
  RetentionQueue q;
  EXPECT_FALSE(q.limited());
  EXPECT_EQ(q.max_age(), absl::InfiniteDuration());
  EXPECT_EQ(q.CutoffMs(kT0), INT64_MIN);
  q.Add({kT0Ms, Node(1), 0});
  EXPECT_EQ(q.size(), 0u);
  EXPECT_FALSE(q.First(INT64_MAX).has_value());
}

TEST(RetentionQueueTest, OnlyTheFirstLimitAsksForTheReplicasHeld) {
  RetentionQueue q;
  EXPECT_FALSE(q.SetMaxAge(absl::InfiniteDuration()));
  EXPECT_TRUE(q.SetMaxAge(absl::Minutes(10)));
  EXPECT_FALSE(q.SetMaxAge(absl::Minutes(5)));  // tightened: already queued
  EXPECT_EQ(q.max_age(), absl::Minutes(5));
  // Age >= limit is past it: committed at or before now - limit.
  EXPECT_EQ(q.CutoffMs(kT0), kT0Ms - 5 * 60'000);
}

TEST(RetentionQueueTest, APassVisitsThoseAtOrBeforeTheCutoffOldestFirst) {
  RetentionQueue q;
  q.SetMaxAge(absl::Seconds(1));
  q.Add({300, Node(1), 0});
  q.Add({100, Node(2), 1});
  q.Add({100, Node(2), 0});
  q.Add({200, Node(3), 0});
  q.Add({400, Node(4), 0});
  EXPECT_EQ(q.size(), 5u);
  EXPECT_EQ(Pass(q, 300),
            (std::vector<Entry>{
                {100, Node(2), 0}, {100, Node(2), 1}, {200, Node(3), 0}, {300, Node(1), 0}}));
  EXPECT_TRUE(Pass(q, 99).empty());
  q.Remove({100, Node(2), 1});
  q.Remove({999, Node(9), 0});  // not queued: nothing
  EXPECT_EQ(q.size(), 4u);
}

TEST(RetentionQueueTest, APausedPassGoesOnWhereItStoppedEvenIfThatEntryLeft) {
  RetentionQueue q;
  q.SetMaxAge(absl::Seconds(1));
  for (int64_t t = 1; t <= 5; ++t) q.Add({t * 100, Node(t), 0});
  q.Pause({300, Node(3), 0});
  EXPECT_EQ(q.First(1000)->committed_ms, 300);
  q.Remove({300, Node(3), 0});  // removed meanwhile: the key still says where
  EXPECT_EQ(q.First(1000)->committed_ms, 400);
  // Next after an entry that left the queue is the one after its key.
  EXPECT_EQ(q.Next({300, Node(3), 0}, 1000)->committed_ms, 400);
  q.EndPass();
  EXPECT_EQ(q.First(1000)->committed_ms, 100);
}

}  // namespace
}  // namespace kvcm
