#include "gpu/agent/transport/tcp/handshake_budget.h"

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::UnorderedElementsAre;
using Verdict = HandshakeBudget::Verdict;

const absl::Time kT0 = absl::FromUnixSeconds(1'000);
const absl::Time kLater = kT0 + absl::Seconds(1);

TEST(HandshakeBudgetTest, ThePerAddressCapRefusesTheNewConnection) {
  HandshakeBudget b(/*max_total=*/8, /*max_per_peer=*/2);
  EXPECT_EQ(b.Admit(1, 7, kLater).verdict, Verdict::kAdmitted);
  EXPECT_EQ(b.Admit(2, 7, kLater).verdict, Verdict::kAdmitted);
  const HandshakeBudget::Admission third = b.Admit(3, 7, kLater);
  EXPECT_EQ(third.verdict, Verdict::kRefusedPerPeer);
  EXPECT_EQ(third.evicted, -1);
  EXPECT_EQ(b.pending_from(7), 2u);
  EXPECT_TRUE(b.Remove(1));
  EXPECT_FALSE(b.Remove(1));
  EXPECT_EQ(b.Admit(3, 7, kLater).verdict, Verdict::kAdmitted);
}

// The documented worst case at the defaults: 10 attacker addresses at 8 pending each want
// 80 of 64. A peer's first handshake displaces the oldest of a heaviest address, and no
// amount of attacker churn from those 10 addresses displaces it.
TEST(HandshakeBudgetTest, TenAttackerAddressesNeverDisplaceAPeersFirstHandshake) {
  HandshakeBudget b(64, 8);
  int next_fd = 100;
  std::vector<int> attacker_fds;
  for (int round = 0; round < 8; ++round) {
    for (uint32_t address = 1; address <= 10; ++address) {
      const HandshakeBudget::Admission a = b.Admit(next_fd, address, kLater);
      if (a.verdict == Verdict::kAdmitted) attacker_fds.push_back(next_fd);
      ++next_fd;
    }
  }
  EXPECT_EQ(b.pending(), 64u);
  constexpr uint32_t kPeer = 99;
  const HandshakeBudget::Admission peer = b.Admit(1, kPeer, kLater);
  ASSERT_EQ(peer.verdict, Verdict::kAdmitted);
  ASSERT_GE(peer.evicted, 100) << "displaced an attacker's handshake";
  std::erase(attacker_fds, peer.evicted);
  // Churn: the attacker closes pending connections at random and reopens from any of its
  // addresses, many times over.
  std::mt19937 rng(35);
  for (int i = 0; i < 10'000; ++i) {
    if (i % 2 == 0 && !attacker_fds.empty()) {
      const size_t k = rng() % attacker_fds.size();
      EXPECT_TRUE(b.Remove(attacker_fds[k]));
      attacker_fds.erase(attacker_fds.begin() + static_cast<std::ptrdiff_t>(k));
    }
    const int fd = next_fd++;
    const HandshakeBudget::Admission a = b.Admit(fd, 1 + static_cast<uint32_t>(rng() % 10), kLater);
    ASSERT_NE(a.evicted, 1) << "the peer's handshake was displaced at churn " << i;
    if (a.evicted >= 0) std::erase(attacker_fds, a.evicted);
    if (a.verdict == Verdict::kAdmitted) attacker_fds.push_back(fd);
  }
  EXPECT_EQ(b.pending_from(kPeer), 1u);
  // More concurrent handshakes of the peer get in too: 63 attacker handshakes over 10
  // addresses put 7 on one of them, 62 at least 7, ..., 59 at least 6.
  for (int k = 2; k <= 5; ++k) {
    EXPECT_EQ(b.Admit(k, kPeer, kLater).verdict, Verdict::kAdmitted) << k;
  }
  EXPECT_EQ(b.pending_from(kPeer), 5u);
}

TEST(HandshakeBudgetTest, AFullBudgetRefusesAnAddressNoLighterThanTheHeaviest) {
  HandshakeBudget b(4, 4);
  ASSERT_EQ(b.Admit(1, 7, kLater).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(2, 7, kLater).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(3, 8, kLater).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(4, 8, kLater).verdict, Verdict::kAdmitted);
  // 8 holds 2, as many as the heaviest: displacing 7's would only swap who holds more.
  EXPECT_EQ(b.Admit(5, 8, kLater).verdict, Verdict::kRefusedFull);
  // A new address displaces the oldest of the heaviest (7 and 8 tie: fd 1 is oldest).
  const HandshakeBudget::Admission a = b.Admit(6, 9, kLater);
  EXPECT_EQ(a.verdict, Verdict::kAdmitted);
  EXPECT_EQ(a.evicted, 1);
  // Now 8 is the heaviest (2): the next new address takes 8's oldest.
  EXPECT_EQ(b.Admit(7, 10, kLater).evicted, 3);
}

// As many attacker addresses as the budget, one pending each: the oldest loses to a new
// address, so a peer's handshake lives until max_total newer ones arrive.
TEST(HandshakeBudgetTest, WithOnePendingPerAddressTheOldestLosesToANewAddress) {
  HandshakeBudget b(3, 4);
  ASSERT_EQ(b.Admit(1, 1, kLater).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(2, 2, kLater).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(3, 3, kLater).verdict, Verdict::kAdmitted);
  EXPECT_EQ(b.Admit(4, 4, kLater).evicted, 1);
  EXPECT_EQ(b.Admit(5, 5, kLater).evicted, 2);
  EXPECT_EQ(b.Admit(6, 6, kLater).evicted, 3);
  EXPECT_EQ(b.Admit(7, 4, kLater).verdict, Verdict::kRefusedFull);  // 4 holds one already
}

TEST(HandshakeBudgetTest, TakeExpiredRemovesThoseDue) {
  HandshakeBudget b(8, 4);
  ASSERT_EQ(b.Admit(1, 7, kT0).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(2, 7, kLater).verdict, Verdict::kAdmitted);
  ASSERT_EQ(b.Admit(3, 8, kT0).verdict, Verdict::kAdmitted);
  EXPECT_THAT(b.TakeExpired(kT0), UnorderedElementsAre(1, 3));
  EXPECT_EQ(b.pending(), 1u);
  EXPECT_EQ(b.pending_from(8), 0u);
  EXPECT_FALSE(b.Remove(3));
  EXPECT_THAT(b.TakeExpired(kLater), UnorderedElementsAre(2));
}

}  // namespace
}  // namespace kvcm
