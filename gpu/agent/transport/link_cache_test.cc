#include "gpu/agent/transport/link_cache.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/fake_block_link.h"

namespace kvcm {
namespace {

using testing::FakeBlockLink;
using testing::FakeWire;

constexpr absl::Duration kShort = absl::Milliseconds(50);
constexpr absl::Duration kLong = absl::Seconds(5);

// A connector that counts its calls and makes fake links on one shared wire (so that
// `wire->destroyed` counts dropped links).
struct CountingConnector {
  std::shared_ptr<FakeWire> wire = std::make_shared<FakeWire>();
  std::atomic<int> calls{0};
  absl::Status fail;  // returned instead of a link when not OK

  LinkCache::Connector Get() {
    return [this](const std::string& /*peer*/, uint64_t /*link_id*/,
                  const std::atomic<bool>&) -> absl::StatusOr<std::unique_ptr<BlockLink>> {
      ++calls;
      if (!fail.ok()) return fail;
      return std::unique_ptr<BlockLink>(std::make_unique<FakeBlockLink>(wire, 0, 64));
    };
  }
};

TEST(LinkCacheTest, PullLinksAreMadeOnceAndLeasedOneTransferAtATime) {
  CountingConnector c;
  LinkCache cache({}, c.Get());
  EXPECT_EQ(cache.LeasePull("10.0.0.1:1", kShort).status().code(), absl::StatusCode::kNotFound);
  uint64_t id = 0;
  {
    absl::StatusOr<LinkCache::Lease> lease = cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong);
    ASSERT_TRUE(lease.ok()) << lease.status();
    id = lease->link_id();
    EXPECT_NE(id, 0u);
    EXPECT_EQ(lease->peer_agent_id(), "gpu-1");
    // Held: a second transfer waits, here in vain.
    EXPECT_EQ(cache.LeasePull("10.0.0.1:1", kShort).status().code(),
              absl::StatusCode::kDeadlineExceeded);
  }
  absl::StatusOr<LinkCache::Lease> again = cache.LeasePull("10.0.0.1:1", kShort);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->link_id(), id);
  EXPECT_EQ(c.calls, 1);
  EXPECT_EQ(cache.pull_links(), 1u);
}

TEST(LinkCacheTest, ABrokenLinkIsDroppedAndAStaleOneReplacedOnce) {
  CountingConnector c;
  LinkCache cache({}, c.Get());
  uint64_t first = 0;
  {
    absl::StatusOr<LinkCache::Lease> lease = cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong);
    ASSERT_TRUE(lease.ok());
    first = lease->link_id();
  }
  // The server did not know `first`: it is replaced by a new link.
  uint64_t second = 0;
  {
    absl::StatusOr<LinkCache::Lease> lease = cache.ConnectPull("10.0.0.1:1", "gpu-1", first, kLong);
    ASSERT_TRUE(lease.ok());
    second = lease->link_id();
    EXPECT_GT(second, first);
    EXPECT_EQ(c.wire->destroyed, 1);
  }
  // A second pull that saw `first` fail too finds `second` and makes no third link.
  {
    absl::StatusOr<LinkCache::Lease> lease = cache.ConnectPull("10.0.0.1:1", "gpu-1", first, kLong);
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(lease->link_id(), second);
    lease->MarkBroken();
  }
  EXPECT_EQ(c.calls, 2);
  EXPECT_EQ(c.wire->destroyed, 2);  // the broken one was dropped (aborted)
  EXPECT_EQ(cache.pull_links(), 0u);
  EXPECT_EQ(cache.LeasePull("10.0.0.1:1", kShort).status().code(), absl::StatusCode::kNotFound);
}

TEST(LinkCacheTest, ConcurrentPullsConnectOnce) {
  absl::Notification release;
  std::atomic<int> calls{0};
  auto wire = std::make_shared<FakeWire>();
  LinkCache cache({},
                  [&](const std::string&, uint64_t,
                      const std::atomic<bool>&) -> absl::StatusOr<std::unique_ptr<BlockLink>> {
                    ++calls;
                    release.WaitForNotification();
                    return std::unique_ptr<BlockLink>(std::make_unique<FakeBlockLink>(wire, 0, 64));
                  });
  std::atomic<uint64_t> ids[2] = {0, 0};
  std::thread a([&] { ids[0] = cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong)->link_id(); });
  while (calls.load() == 0) absl::SleepFor(absl::Milliseconds(1));
  std::thread b([&] { ids[1] = cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong)->link_id(); });
  absl::SleepFor(kShort);  // b waits for a's connect instead of making its own
  release.Notify();
  a.join();
  b.join();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(ids[0].load(), ids[1].load());
}

TEST(LinkCacheTest, BoundedByMaxLinksDroppingTheLeastRecentlyUsedIdleLink) {
  CountingConnector c;
  LinkCache cache({.max_links = 2}, c.Get());
  ASSERT_TRUE(cache.ConnectPull("10.0.0.1:1", "a", 0, kLong).ok());
  ASSERT_TRUE(cache.ConnectPull("10.0.0.2:1", "b", 0, kLong).ok());
  ASSERT_TRUE(cache.LeasePull("10.0.0.1:1", kShort).ok());  // "a" is now the most recent
  ASSERT_TRUE(cache.ConnectPull("10.0.0.3:1", "c", 0, kLong).ok());
  EXPECT_EQ(cache.pull_links(), 2u);
  EXPECT_EQ(c.wire->destroyed, 1);
  EXPECT_EQ(cache.LeasePull("10.0.0.2:1", kShort).status().code(), absl::StatusCode::kNotFound);
  // Every link busy: no room.
  absl::StatusOr<LinkCache::Lease> held_a = cache.LeasePull("10.0.0.1:1", kShort);
  absl::StatusOr<LinkCache::Lease> held_c = cache.LeasePull("10.0.0.3:1", kShort);
  ASSERT_TRUE(held_a.ok() && held_c.ok());
  EXPECT_EQ(cache.ConnectPull("10.0.0.4:1", "d", 0, kLong).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c.calls, 3);
}

TEST(LinkCacheTest, AConnectorErrorLeavesNoEntry) {
  CountingConnector c;
  c.fail = absl::DeadlineExceededError("the peer never joined");
  LinkCache cache({}, c.Get());
  EXPECT_EQ(cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cache.pull_links(), 0u);
  c.fail = absl::OkStatus();
  EXPECT_TRUE(cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong).ok());
}

TEST(LinkCacheTest, ServedLinksWaitForTheirJoinAndAreKeyedByPullerAndId) {
  LinkCache cache({}, CountingConnector().Get());
  auto wire = std::make_shared<FakeWire>();
  absl::Notification joined;
  ASSERT_TRUE(
      cache
          .OfferServed("gpu-0", 7,
                       [&](const std::atomic<bool>&) -> absl::StatusOr<std::unique_ptr<BlockLink>> {
                         joined.WaitForNotification();
                         return std::unique_ptr<BlockLink>(
                             std::make_unique<FakeBlockLink>(wire, 1, 64));
                       })
          .ok());
  // Still joining: a lease waits, here in vain; then succeeds once joined.
  EXPECT_EQ(cache.LeaseServed("gpu-0", 7, kShort).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  std::thread later([&] {
    absl::SleepFor(kShort);
    joined.Notify();
  });
  absl::StatusOr<LinkCache::Lease> lease = cache.LeaseServed("gpu-0", 7, kLong);
  later.join();
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->peer_agent_id(), "gpu-0");
  EXPECT_EQ(cache.LeaseServed("gpu-0", 8, kShort).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.LeaseServed("gpu-9", 7, kShort).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.OfferServed("gpu-0", 7, nullptr).code(), absl::StatusCode::kAlreadyExists);
}

TEST(LinkCacheTest, AFailedJoinLeavesNothingAndANewerOfferDropsTheIdleOlderLink) {
  LinkCache cache({}, CountingConnector().Get());
  auto wire = std::make_shared<FakeWire>();
  auto ok_join = [&](const std::atomic<bool>&) -> absl::StatusOr<std::unique_ptr<BlockLink>> {
    return std::unique_ptr<BlockLink>(std::make_unique<FakeBlockLink>(wire, 1, 64));
  };
  ASSERT_TRUE(
      cache
          .OfferServed("gpu-0", 1,
                       [](const std::atomic<bool>&) -> absl::StatusOr<std::unique_ptr<BlockLink>> {
                         return absl::DeadlineExceededError("ncclCommInitRank timed out");
                       })
          .ok());
  EXPECT_EQ(cache.LeaseServed("gpu-0", 1, kLong).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(cache.OfferServed("gpu-0", 2, ok_join).ok());
  ASSERT_TRUE(cache.LeaseServed("gpu-0", 2, kLong).ok());
  ASSERT_TRUE(cache.OfferServed("gpu-5", 9, ok_join).ok());  // another puller's link stays
  ASSERT_TRUE(cache.LeaseServed("gpu-5", 9, kLong).ok());
  ASSERT_TRUE(cache.OfferServed("gpu-0", 3, ok_join).ok());
  EXPECT_EQ(cache.LeaseServed("gpu-0", 2, kShort).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(cache.LeaseServed("gpu-0", 3, kLong).ok());
  EXPECT_TRUE(cache.LeaseServed("gpu-5", 9, kLong).ok());
  EXPECT_EQ(cache.served_links(), 2u);
  EXPECT_EQ(wire->destroyed, 1);
}

TEST(LinkCacheTest, CancelAllCancelsLinksAndRefusesLeases) {
  CountingConnector c;
  LinkCache cache({}, c.Get());
  absl::StatusOr<LinkCache::Lease> lease = cache.ConnectPull("10.0.0.1:1", "gpu-1", 0, kLong);
  ASSERT_TRUE(lease.ok());
  std::thread waiter([&] {
    // Waits for the link held above; CancelAll ends the wait.
    EXPECT_EQ(cache.LeasePull("10.0.0.1:1", kLong).status().code(), absl::StatusCode::kCancelled);
  });
  absl::SleepFor(kShort);
  cache.CancelAll();
  waiter.join();
  // The held link's operations now fail at once.
  EXPECT_EQ(lease->link().Recv(8, kLong, nullptr).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(cache.OfferServed("gpu-0", 1, nullptr).code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace kvcm

namespace kvcm {
namespace {

TEST(ValidateLinkOfferTest, RefusesMalformedOffersNamingTheField) {
  const LinkOffer good{.from_agent_id = "gpu-0",
                       .link_id = 9,
                       .unique_id = std::string(128, 'x'),
                       .rank = 1,
                       .peer_rank = 0,
                       .nranks = 2};
  EXPECT_TRUE(ValidateLinkOffer(good).ok());
  auto with = [&](auto change) {
    LinkOffer o = good;
    change(o);
    return ValidateLinkOffer(o);
  };
  EXPECT_THAT(with([](LinkOffer& o) { o.from_agent_id.clear(); }).message(),
              ::testing::HasSubstr("from_agent_id"));
  EXPECT_THAT(with([](LinkOffer& o) { o.link_id = 0; }).message(), ::testing::HasSubstr("link_id"));
  EXPECT_THAT(with([](LinkOffer& o) { o.unique_id.pop_back(); }).message(),
              ::testing::HasSubstr("unique_id"));
  EXPECT_THAT(with([](LinkOffer& o) { o.nranks = 3; }).message(), ::testing::HasSubstr("ranks"));
  EXPECT_THAT(with([](LinkOffer& o) { o.peer_rank = 1; }).message(), ::testing::HasSubstr("ranks"));
  EXPECT_EQ(with([](LinkOffer& o) { o.rank = 2; }).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
