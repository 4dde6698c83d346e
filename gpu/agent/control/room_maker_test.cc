#include "gpu/agent/control/room_maker.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kBlocks = 8;

// A pool with its committed pages, and a manager stand-in that "evicts" by freeing committed
// blocks from another thread after a delay, as the real manager's FreeBlocks commands reach
// the agent after MakeRoom answered. (The real path, through a ManagerServer, is
// tests/full_pool_test.cc.)
class RoomMakerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = MakeHostPool(SmallGqa(), kBlocks);
    epoch_ = std::make_unique<AgentEpoch>();
  }
  void TearDown() override {
    if (maker_ != nullptr) maker_->Stop();
    for (std::thread& t : frees_) t.join();
  }

  // Commits `n` blocks of the pool (cached pages), remembering them for the fake eviction.
  void Fill(uint32_t n) {
    absl::StatusOr<std::vector<BlockId>> ids = pool_->Allocate(n, epoch_->current(), &ns_);
    ASSERT_TRUE(ids.ok()) << ids.status();
    std::vector<CommitEntry> entries;
    for (BlockId id : *ids) {
      entries.push_back({.block = id, .page = PageHash{id + 1, 7}, .parent = PageHash{}});
      committed_.push_back(id);
    }
    ASSERT_TRUE(pool_->Commit(ns_, epoch_->current(), entries, "block_ids").ok());
  }

  // The fake manager: frees `blocks` committed blocks `delay` after answering.
  RoomMaker::MakeRoomFn EvictingManager(absl::Duration delay) {
    return [this, delay](const v1::MakeRoomRequest& req,
                         absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
      asks_.push_back(req);
      std::vector<BlockId> victims;
      for (uint32_t i = 0; i < req.blocks() && !committed_.empty(); ++i) {
        victims.push_back(committed_.front());
        committed_.erase(committed_.begin());
      }
      frees_.emplace_back([this, victims, delay] {
        absl::SleepFor(delay);
        EXPECT_TRUE(pool_->FreeCommitted(victims, epoch_->current(), "block_ids").ok());
      });
      v1::MakeRoomResponse resp;
      resp.set_evicted_pages(victims.size());
      return resp;
    };
  }

  void StartMaker(RoomMaker::MakeRoomFn fn, uint32_t wait_ms = 10'000, uint32_t max_waiting = 256) {
    maker_ = std::make_unique<RoomMaker>(
        pool_.get(), Tier::kGpu, "gpu-0", epoch_.get(), std::move(fn),
        RoomMakerOptions{.allocate_wait_ms = wait_ms, .max_waiting = max_waiting},
        RoomMakerObserver{
            .on_room_made = [this](absl::Duration, uint64_t pages) { room_pages_ += pages; },
            .on_failure = [this](AllocationFailure r) { failures_.push_back(r); }});
    maker_->Start();
  }

  // Allocate, waiting for the answer.
  absl::StatusOr<RoomMaker::Allocation> AllocateNow(uint32_t count, bool cache = true) {
    absl::Notification done;
    absl::StatusOr<RoomMaker::Allocation> out;
    RoomMaker::Request req{.count = count,
                           .owner_epoch = cache ? epoch_->current() : epoch_->current() + 1};
    if (cache) req.ns = ns_;
    maker_->Allocate(req, [&](absl::StatusOr<RoomMaker::Allocation> r) {
      out = std::move(r);
      done.Notify();
    });
    done.WaitForNotification();
    return out;
  }

  const NamespaceId ns_{"acme", "m"};
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<AgentEpoch> epoch_;
  std::unique_ptr<RoomMaker> maker_;
  std::vector<BlockId> committed_;
  std::vector<v1::MakeRoomRequest> asks_;
  std::vector<std::thread> frees_;
  std::atomic<uint64_t> room_pages_{0};
  std::vector<AllocationFailure> failures_;
};

TEST_F(RoomMakerTest, RoomAvailableNeverAsksTheManager) {
  StartMaker(EvictingManager(absl::ZeroDuration()));
  Fill(4);
  absl::StatusOr<RoomMaker::Allocation> a = AllocateNow(4);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->block_ids.size(), 4u);
  EXPECT_EQ(a->generations.size(), 4u);
  EXPECT_TRUE(asks_.empty());
}

TEST_F(RoomMakerTest, AShortPoolAsksForExactlyTheShortfallAndWaitsForTheFrees) {
  StartMaker(EvictingManager(absl::Milliseconds(100)));
  Fill(7);  // one free
  absl::StatusOr<RoomMaker::Allocation> a = AllocateNow(3);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->block_ids.size(), 3u);
  ASSERT_EQ(asks_.size(), 1u);
  EXPECT_EQ(asks_[0].blocks(), 2u);
  EXPECT_EQ(asks_[0].allocation_blocks(), 3u);
  EXPECT_EQ(asks_[0].agent_id(), "gpu-0");
  EXPECT_EQ(asks_[0].epoch(), epoch_->current());
  EXPECT_EQ(asks_[0].tier(), v1::TIER_GPU);
  EXPECT_EQ(asks_[0].namespace_().tenant(), "acme");
  EXPECT_EQ(room_pages_.load(), 2u);
  EXPECT_EQ(pool_->Stats().held_blocks, 0u);
  EXPECT_EQ(pool_->Stats().free_blocks, 0u);
}

// While an allocation waits for its evictions, a later one may not take the blocks they
// free: it queues behind (first come, first served) and gets room of its own.
TEST_F(RoomMakerTest, ALaterAllocationCannotTakeTheBlocksFreedForAWaitingOne) {
  StartMaker(EvictingManager(absl::Milliseconds(200)));
  Fill(8);
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification both;
  auto record = [&](int who) {
    return [&, who](absl::StatusOr<RoomMaker::Allocation> r) {
      EXPECT_TRUE(r.ok()) << who << ": " << r.status();
      bool last;
      {
        absl::MutexLock lock(&mu);
        order.push_back(who);
        last = order.size() == 2;
      }
      // Outside the lock: once notified, the test returns and destroys `mu`.
      if (last) both.Notify();
    };
  };
  maker_->Allocate({.count = 4, .owner_epoch = epoch_->current(), .ns = ns_}, record(1));
  absl::SleepFor(absl::Milliseconds(100));  // the first is waiting for its frees
  maker_->Allocate({.count = 2, .owner_epoch = epoch_->current(), .ns = ns_}, record(2));
  both.WaitForNotification();
  EXPECT_THAT(order, ::testing::ElementsAre(1, 2));
  ASSERT_EQ(asks_.size(), 2u);
  EXPECT_EQ(asks_[0].blocks(), 4u);
  EXPECT_EQ(asks_[1].blocks(), 2u);
  EXPECT_EQ(pool_->Stats().free_blocks, 0u);
  EXPECT_EQ(pool_->Stats().committed_blocks, 2u);  // exactly the two shortfalls evicted
}

TEST(BlockPoolHoldTest, HeldBlocksGoOnlyToTheAllocationThatHoldsThem) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  pool->SetHeld(3);
  absl::StatusOr<std::vector<BlockId>> other = pool->Allocate(2, 1);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(other.status().message(),
              HasSubstr("3 of those are held for an allocation waiting for room"));
  EXPECT_TRUE(pool->Allocate(1, 1).ok());  // beyond the held ones
  EXPECT_TRUE(pool->Allocate(3, 1, nullptr, nullptr, /*use_held=*/true).ok());
  pool->SetHeld(0);
  EXPECT_EQ(pool->Stats().held_blocks, 0u);
}

TEST_F(RoomMakerTest, NothingEvictableIsResourceExhaustedWithTheManagersReason) {
  StartMaker([](const v1::MakeRoomRequest&, absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
    return absl::ResourceExhaustedError("only 0 are evictable (9 bytes pinned)");
  });
  Fill(7);
  absl::StatusOr<RoomMaker::Allocation> a = AllocateNow(3);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(a.status().message(), HasSubstr("asked for 3 blocks, 1 of 8 are free"));
  EXPECT_THAT(a.status().message(), HasSubstr("9 bytes pinned"));
  EXPECT_EQ(pool_->Stats().free_blocks, 1u);  // nothing allocated
  EXPECT_EQ(pool_->Stats().held_blocks, 0u);
  EXPECT_THAT(failures_, ::testing::ElementsAre(AllocationFailure::kPinned));
}

TEST_F(RoomMakerTest, AQuotaRefusalIsReportedAsQuota) {
  StartMaker([](const v1::MakeRoomRequest&, absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
    return absl::ResourceExhaustedError("tenant acme is at tenant_max_bytes");
  });
  Fill(8);
  EXPECT_EQ(AllocateNow(1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(failures_, ::testing::ElementsAre(AllocationFailure::kQuota));
}

TEST_F(RoomMakerTest, FreesThatNeverArriveAreUnavailableByTheDeadline) {
  StartMaker(
      [](const v1::MakeRoomRequest& req, absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
        v1::MakeRoomResponse resp;
        resp.set_evicted_pages(req.blocks());  // says it evicted, but nothing is freed
        return resp;
      },
      /*wait_ms=*/200);
  Fill(8);
  const absl::Time start = absl::Now();
  absl::StatusOr<RoomMaker::Allocation> a = AllocateNow(2);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(a.status().message(), HasSubstr("not freed by the deadline"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_THAT(failures_, ::testing::ElementsAre(AllocationFailure::kFreeTimeout));
  EXPECT_EQ(pool_->Stats().held_blocks, 0u);
}

TEST_F(RoomMakerTest, AManagerThatCannotBeReachedIsUnavailable) {
  StartMaker([](const v1::MakeRoomRequest&, absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
    return absl::UnavailableError("connection refused");
  });
  Fill(8);
  EXPECT_EQ(AllocateNow(1).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(failures_, ::testing::ElementsAre(AllocationFailure::kManagerUnavailable));
}

TEST_F(RoomMakerTest, PrivateBlocksNeverMakeTheManagerEvict) {
  StartMaker(EvictingManager(absl::ZeroDuration()));
  Fill(8);
  EXPECT_EQ(AllocateNow(1, /*cache=*/false).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(asks_.empty());
  EXPECT_THAT(failures_, ::testing::ElementsAre(AllocationFailure::kPrivate));
}

// A flood of allocations into a full pool (a buggy or hostile worker) queues at most
// max_waiting; the rest are refused at once, so the queue and its wait stay bounded.
TEST_F(RoomMakerTest, TheWaitingQueueIsBounded) {
  StartMaker(
      [](const v1::MakeRoomRequest&, absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
        v1::MakeRoomResponse resp;
        resp.set_evicted_pages(1);
        return resp;  // nothing is ever freed: the one served waits out its deadline
      },
      /*wait_ms=*/10'000, /*max_waiting=*/2);
  Fill(8);
  std::atomic<int> refused{0}, unavailable{0};
  auto count = [&](absl::StatusOr<RoomMaker::Allocation> r) {
    if (absl::IsResourceExhausted(r.status())) ++refused;
    if (absl::IsUnavailable(r.status())) ++unavailable;
  };
  maker_->Allocate({.count = 1, .owner_epoch = epoch_->current(), .ns = ns_}, count);
  absl::SleepFor(absl::Milliseconds(100));  // being served
  for (int i = 0; i < 10; ++i) {
    maker_->Allocate({.count = 1, .owner_epoch = epoch_->current(), .ns = ns_}, count);
  }
  EXPECT_EQ(refused.load(), 8);  // 2 queued behind the one served
  maker_->Stop();
  EXPECT_EQ(unavailable.load(), 3);
}

TEST_F(RoomMakerTest, StopFailsWaitingAllocations) {
  absl::Notification release;
  StartMaker([&](const v1::MakeRoomRequest&, absl::Time) -> absl::StatusOr<v1::MakeRoomResponse> {
    v1::MakeRoomResponse resp;
    resp.set_evicted_pages(1);
    return resp;  // nothing is ever freed: the allocations wait
  });
  Fill(8);
  std::atomic<int> unavailable{0};
  for (int i = 0; i < 3; ++i) {
    maker_->Allocate({.count = 1, .owner_epoch = epoch_->current(), .ns = ns_},
                     [&](absl::StatusOr<RoomMaker::Allocation> r) {
                       if (absl::IsUnavailable(r.status())) ++unavailable;
                     });
  }
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  maker_->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));  // does not wait out the deadline
  EXPECT_EQ(unavailable.load(), 3);
}

}  // namespace
}  // namespace kvcm
