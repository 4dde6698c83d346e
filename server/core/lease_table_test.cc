#include "server/core/lease_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(LeaseTableTest, FindsLiveLeasesOfTheirTreeOnly) {
  RadixTree tree(nullptr), other(nullptr);
  LeaseTable table(absl::Minutes(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PinId id = table.Add(tree.root(), t0 + absl::Seconds(5));
  ASSERT_TRUE(table.Find(id, &tree).ok());
  EXPECT_EQ(table.Find(id, &other).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.Find(id + 1, &tree).status().code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, ExpiresInOrderAndRemembersExpiredIds) {
  RadixTree tree(nullptr);
  LeaseTable table(absl::Seconds(60));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PinId late = table.Add(tree.root(), t0 + absl::Seconds(10));
  PinId early = table.Add(tree.root(), t0 + absl::Seconds(5));
  std::vector<PinId> expired;
  auto collect = [&](const Lease& l) { expired.push_back(l.id); };

  table.Expire(t0 + absl::Seconds(4), collect);
  EXPECT_TRUE(expired.empty());
  table.Expire(t0 + absl::Seconds(10), collect);
  EXPECT_EQ(expired, (std::vector<PinId>{early, late}));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.Find(early, &tree).status().code(), absl::StatusCode::kAborted);

  // After the memory window an expired id is simply unknown.
  table.Expire(t0 + absl::Seconds(80), collect);
  EXPECT_EQ(table.Find(early, &tree).status().code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, RenewMovesExpiry) {
  RadixTree tree(nullptr);
  LeaseTable table(absl::Seconds(60));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PinId id = table.Add(tree.root(), t0 + absl::Seconds(5));
  table.SetExpiry(*table.Find(id, &tree), t0 + absl::Seconds(50));
  int n = 0;
  table.Expire(t0 + absl::Seconds(30), [&](const Lease&) { ++n; });
  EXPECT_EQ(n, 0);
  table.Erase(id);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.Find(id, &tree).status().code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, PinIdsCannotBeGuessedFromEachOther) {
  RadixTree tree(nullptr);
  LeaseTable table(absl::Seconds(60));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::vector<PinId> ids;
  for (int i = 0; i < 64; ++i) ids.push_back(table.Add(tree.root(), t0 + absl::Seconds(5)));
  int high = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_NE(ids[i], 0u);
    if (i > 0) {
      // Neither the next nor the previous id of another pin.
      EXPECT_NE(ids[i], ids[i - 1] + 1);
      EXPECT_NE(ids[i] + 1, ids[i - 1]);
    }
    high += ids[i] >> 63;
  }
  EXPECT_GT(high, 0) << "ids use all 64 bits, not a counter's low ones";
  EXPECT_LT(high, 64);
  // A neighbour of a live id is not a pin.
  EXPECT_EQ(table.Find(ids[0] + 1, &tree).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcm
