#include "gpu/agent/pool/block_ledger.h"

#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using State = BlockLedger::State;

constexpr uint64_t kEpoch = 7;
const NamespaceId kAcme{"acme", "dsv3"};
const NamespaceId kOther{"globex", "dsv3"};

PageHash Page(uint64_t n) { return PageHash{.lo = n, .hi = n * 31}; }

std::vector<CommitEntry> Chain(std::span<const BlockId> blocks, uint64_t first_page = 1) {
  std::vector<CommitEntry> out;
  PageHash parent;
  for (size_t i = 0; i < blocks.size(); ++i) {
    out.push_back({.block = blocks[i], .page = Page(first_page + i), .parent = parent});
    parent = Page(first_page + i);
  }
  return out;
}

// Everything observable about the ledger, to check that a refused call changed nothing.
struct Snapshot {
  std::vector<State> states;
  uint32_t free = 0;
  uint32_t committed = 0;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};
Snapshot Snap(const BlockLedger& l) {
  Snapshot s{.free = l.free_blocks(), .committed = l.committed_blocks()};
  for (BlockId id = 0; id < l.num_blocks(); ++id) s.states.push_back(l.state(id));
  return s;
}

TEST(BlockLedgerTest, CommitRecordsPageAndParentForTheInventory) {
  BlockLedger l(8);
  std::vector<BlockId> ids = *l.Allocate(3, kEpoch, &kAcme);
  EXPECT_THAT(ids, ElementsAre(0, 1, 2));
  absl::StatusOr<std::vector<BlockId>> fresh = l.Commit(kAcme, kEpoch, Chain(ids), "pages");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_THAT(*fresh, ElementsAre(0, 1, 2));
  EXPECT_EQ(l.committed_blocks(), 3u);
  std::vector<CommittedBlock> inventory;
  l.ForEachCommitted([&](const CommittedBlock& b) { inventory.push_back(b); });
  ASSERT_EQ(inventory.size(), 3u);
  EXPECT_EQ(*inventory[0].ns, kAcme);
  EXPECT_EQ(inventory[0].parent, PageHash{});
  EXPECT_EQ(inventory[2].page, Page(3));
  EXPECT_EQ(inventory[2].parent, Page(2));
  EXPECT_EQ(inventory[2].owner_epoch, kEpoch);
}

TEST(BlockLedgerTest, RepeatedCommitOfTheSamePagesIsAcceptedAndReportsNothingNew) {
  BlockLedger l(4);
  std::vector<BlockId> ids = *l.Allocate(2, kEpoch, &kAcme);
  ASSERT_TRUE(l.Commit(kAcme, kEpoch, Chain(ids), "pages").ok());
  absl::StatusOr<std::vector<BlockId>> again = l.Commit(kAcme, kEpoch, Chain(ids), "pages");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->empty());
  EXPECT_EQ(l.committed_blocks(), 2u);
}

// Every way to name a block that must not back this page is refused, names the field and
// the entry, and changes nothing.
TEST(BlockLedgerTest, CommitRefusesEveryBlockItMustNotTakeAndChangesNothing) {
  BlockLedger l(8);
  std::vector<BlockId> mine = *l.Allocate(2, kEpoch, &kAcme);           // 0, 1
  std::vector<BlockId> theirs = *l.Allocate(2, kEpoch, &kOther);        // 2, 3
  std::vector<BlockId> old_epoch = *l.Allocate(1, kEpoch - 1, &kAcme);  // 4
  std::vector<BlockId> no_ns = *l.Allocate(1, kEpoch, nullptr);         // 5
  ASSERT_TRUE(l.Commit(kOther, kEpoch, Chain(theirs, 100), "pages").ok());
  const Snapshot before = Snap(l);

  struct Case {
    const char* name;
    std::vector<CommitEntry> entries;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"empty", {}, absl::StatusCode::kInvalidArgument, "must not be empty"},
      {"twice in one call", Chain(std::vector<BlockId>{0, 0}), absl::StatusCode::kInvalidArgument,
       "pages[1] lists block 0 twice (first at [0])"},
      {"past the pool", Chain(std::vector<BlockId>{0, 999}), absl::StatusCode::kInvalidArgument,
       "pages[1]: block 999 is past the pool of 8"},
      {"pending value", Chain(std::vector<BlockId>{0, kPendingBlock}),
       absl::StatusCode::kInvalidArgument, "pages[1]: block 4294967295 is reserved"},
      {"free block", Chain(std::vector<BlockId>{0, 7}), absl::StatusCode::kFailedPrecondition,
       "pages[1]: block 7 is not allocated"},
      {"another tenant's committed block", Chain(std::vector<BlockId>{0, 2}),
       absl::StatusCode::kFailedPrecondition,
       "pages[1]: block 2 is not allocated to namespace acme/dsv3"},
      {"another owner epoch", Chain(std::vector<BlockId>{0, 4}),
       absl::StatusCode::kFailedPrecondition, "belongs to owner epoch 6"},
      {"allocated without namespace", Chain(std::vector<BlockId>{5}),
       absl::StatusCode::kFailedPrecondition, "allocated without a namespace"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<BlockId>> r = l.Commit(kAcme, kEpoch, c.entries, "pages");
    EXPECT_EQ(r.status().code(), c.code) << c.name << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.name;
    EXPECT_EQ(Snap(l), before) << c.name;
  }
  // A block of mine committed to one page cannot be committed to another.
  ASSERT_TRUE(l.Commit(kAcme, kEpoch, Chain(mine), "pages").ok());
  const Snapshot committed = Snap(l);
  absl::StatusOr<std::vector<BlockId>> moved = l.Commit(kAcme, kEpoch, Chain(mine, 50), "pages");
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(moved.status().message(), HasSubstr("pages[0]: block 0 already holds page"));
  EXPECT_EQ(Snap(l), committed);
  (void)old_epoch;
  (void)no_ns;
}

TEST(BlockLedgerTest, OnlyTheAllocatorCommitsAndOnlyABlockWrittenWhole) {
  constexpr uint64_t kBlockBytes = 100;
  BlockLedger l(8);
  const std::vector<BlockId> alice = *l.Allocate(2, kEpoch, &kAcme, nullptr, nullptr, 0, "alice");
  const std::vector<BlockId> unnamed = *l.Allocate(1, kEpoch, &kAcme);
  for (BlockId id : alice) l.AddWritten(id, kBlockBytes);
  l.AddWritten(unnamed[0], kBlockBytes);
  const Snapshot before = Snap(l);

  // Another principal of the same tenant names alice's blocks: refused, nothing committed.
  absl::StatusOr<std::vector<BlockId>> bob =
      l.Commit(kAcme, kEpoch, Chain(alice), "block_ids", 0,
               {.committer = "bob", .block_bytes = kBlockBytes});
  EXPECT_EQ(bob.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(bob.status().message(), HasSubstr("block_ids[0]: block 0 was allocated by "
                                                "principal \"alice\", not by \"bob\""));
  EXPECT_EQ(Snap(l), before);

  // A block written short (or not at all) is not committed, by its allocator either.
  const std::vector<BlockId> half = *l.Allocate(1, kEpoch, &kAcme, nullptr, nullptr, 0, "alice");
  l.AddWritten(half[0], kBlockBytes / 2);
  const Snapshot with_half = Snap(l);
  absl::StatusOr<std::vector<BlockId>> short_write =
      l.Commit(kAcme, kEpoch, Chain(half, 10), "block_ids", 0,
               {.committer = "alice", .block_bytes = kBlockBytes});
  EXPECT_EQ(short_write.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(short_write.status().message(), HasSubstr("block 3 has 50 of its 100 bytes written"));
  EXPECT_EQ(Snap(l), with_half);
  l.AddWritten(half[0], kBlockBytes / 2);
  EXPECT_TRUE(l.Commit(kAcme, kEpoch, Chain(half, 10), "block_ids", 0,
                       {.committer = "alice", .block_bytes = kBlockBytes})
                  .ok());

  // The allocator commits its own; an unnamed allocation (the open caller, or the agent's
  // own for a Fetch) and an unnamed committer check no principal.
  EXPECT_TRUE(l.Commit(kAcme, kEpoch, Chain(alice), "block_ids", 0,
                       {.committer = "alice", .block_bytes = kBlockBytes})
                  .ok());
  EXPECT_TRUE(l.Commit(kAcme, kEpoch, Chain(unnamed, 20), "block_ids", 0,
                       {.committer = "bob", .block_bytes = kBlockBytes})
                  .ok());

  // A freed block forgets its allocator and its bytes: the next allocation starts at 0.
  ASSERT_TRUE(l.FreeCommitted(half, kEpoch, "b").ok());
  const std::vector<BlockId> again = *l.Allocate(5, kEpoch, &kAcme, nullptr, nullptr, 0, "bob");
  for (BlockId id : again) EXPECT_EQ(l.written(id), 0u) << id;
}

TEST(BlockLedgerTest, CommittedBlocksBelongToTheCache) {
  BlockLedger l(4);
  std::vector<BlockId> ids = *l.Allocate(2, kEpoch, &kAcme);
  ASSERT_TRUE(l.Commit(kAcme, kEpoch, Chain(ids), "pages").ok());
  const Snapshot before = Snap(l);
  // Its allocator can neither free nor write it.
  absl::Status freed = l.Free(ids, kEpoch);
  EXPECT_EQ(freed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(freed.message(), HasSubstr("committed to the cache"));
  absl::Status write = l.Check(ids, kEpoch, /*writable=*/true, "block_ids");
  EXPECT_EQ(write.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(write.message(), HasSubstr("cannot change"));
  EXPECT_EQ(Snap(l), before);
  // It can still be read.
  EXPECT_TRUE(l.Check(ids, kEpoch, /*writable=*/false, "block_ids").ok());
  // The manager frees it.
  ASSERT_TRUE(l.FreeCommitted(ids, kEpoch, "block_ids").ok());
  EXPECT_EQ(l.free_blocks(), 4u);
  EXPECT_EQ(l.committed_blocks(), 0u);
}

TEST(BlockLedgerTest, ReleaseReturnsCommittedBlocksToTheirAllocator) {
  BlockLedger l(4);
  std::vector<BlockId> ids = *l.Allocate(2, kEpoch, &kAcme);
  ASSERT_TRUE(l.Commit(kAcme, kEpoch, Chain(ids), "pages").ok());
  ASSERT_TRUE(l.Release({&ids[1], 1}, kEpoch, "block_ids").ok());
  EXPECT_EQ(l.state(ids[1]), State::kAllocated);
  EXPECT_EQ(l.committed_blocks(), 1u);
  // Writable and freeable by its owner again; releasing it twice is refused.
  EXPECT_TRUE(l.Check({&ids[1], 1}, kEpoch, /*writable=*/true, "block_ids").ok());
  EXPECT_EQ(l.Release({&ids[1], 1}, kEpoch, "block_ids").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(l.Free({&ids[1], 1}, kEpoch).ok());
  // FreeCommitted refuses a merely allocated block.
  std::vector<BlockId> more = *l.Allocate(1, kEpoch, &kAcme);
  EXPECT_EQ(l.FreeCommitted(more, kEpoch, "block_ids").code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(BlockLedgerTest, CommitCopyGivesADemotedCopyTheSourcePage) {
  BlockLedger gpu(2), host(2);
  std::vector<BlockId> src = *gpu.Allocate(1, kEpoch, &kAcme);
  ASSERT_TRUE(gpu.Commit(kAcme, kEpoch, Chain(src), "pages").ok());
  std::vector<BlockId> dst = *host.Allocate(1, kEpoch, nullptr);
  ASSERT_TRUE(host.CommitCopy(dst[0], gpu.Committed(src[0])).ok());
  const CommittedBlock copy = host.Committed(dst[0]);
  ASSERT_NE(copy.ns, nullptr);
  EXPECT_EQ(*copy.ns, kAcme);
  EXPECT_EQ(copy.page, Page(1));
  // A target of another owner is refused.
  std::vector<BlockId> foreign = *host.Allocate(1, kEpoch + 1, nullptr);
  EXPECT_EQ(host.CommitCopy(foreign[0], gpu.Committed(src[0])).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(host.state(foreign[0]), State::kAllocated);
}

// Retention: every committed block knows when it was committed, so that a rebuilt index
// keeps the pages' ages.
TEST(BlockLedgerTest, CommitTimesAreRecordedKeptByRepeatsAndCopiedByDemotion) {
  BlockLedger gpu(4), host(2);
  std::vector<BlockId> ids = *gpu.Allocate(2, kEpoch, &kAcme);
  ASSERT_TRUE(gpu.Commit(kAcme, kEpoch, Chain(ids), "pages", 1'000).ok());
  EXPECT_EQ(gpu.Committed(ids[0]).committed_unix_ms, 1'000);
  // A repeated commit commits nothing new and keeps the first time.
  ASSERT_TRUE(gpu.Commit(kAcme, kEpoch, Chain(ids), "pages", 5'000).ok());
  EXPECT_EQ(gpu.Committed(ids[1]).committed_unix_ms, 1'000);
  // A demoted copy is as old as its source.
  std::vector<BlockId> dst = *host.Allocate(1, kEpoch, nullptr);
  ASSERT_TRUE(host.CommitCopy(dst[0], gpu.Committed(ids[1])).ok());
  EXPECT_EQ(host.Committed(dst[0]).committed_unix_ms, 1'000);
  // Released, the block is no longer committed; committed again, it gets the new time.
  ASSERT_TRUE(gpu.Release({&ids[1], 1}, kEpoch, "block_ids").ok());
  ASSERT_TRUE(
      gpu.Commit(kAcme, kEpoch, std::vector<CommitEntry>{Chain(ids)[1]}, "pages", 7'000).ok());
  EXPECT_EQ(gpu.Committed(ids[1]).committed_unix_ms, 7'000);
}

TEST(BlockLedgerTest, FreeAllOwnedByFreesCommittedAndAllocatedBlocksOfThatEpochOnly) {
  BlockLedger l(6);
  std::vector<BlockId> cache = *l.Allocate(2, kEpoch, &kAcme);
  ASSERT_TRUE(l.Commit(kAcme, kEpoch, Chain(cache), "pages").ok());
  (void)*l.Allocate(1, kEpoch, &kAcme);
  (void)*l.Allocate(2, kEpoch + 1, nullptr);
  EXPECT_EQ(l.FreeAllOwnedBy(kEpoch), 3u);
  EXPECT_EQ(l.committed_blocks(), 0u);
  EXPECT_EQ(l.free_blocks(), 4u);
  EXPECT_EQ(l.FreeAllOwnedBy(0), 0u);
}

// Random operations against a model: no block is ever handed out while allocated or
// committed, committed blocks keep their page, and the counts agree.
TEST(BlockLedgerTest, RandomOperationsNeverShareABlock) {
  std::mt19937_64 rng(20261124);
  constexpr uint32_t kBlocks = 64;
  BlockLedger l(kBlocks);
  absl::flat_hash_map<BlockId, State> model;
  uint64_t next_page = 1;
  for (int step = 0; step < 20'000; ++step) {
    const int op = static_cast<int>(rng() % 5);
    std::vector<BlockId> pick;
    for (auto& [id, st] : model) {
      if (rng() % 4 == 0) pick.push_back(id);
    }
    if (op == 0) {
      absl::StatusOr<std::vector<BlockId>> got =
          l.Allocate(1 + static_cast<uint32_t>(rng() % 4), kEpoch, &kAcme);
      if (!got.ok()) continue;
      for (BlockId id : *got) {
        ASSERT_FALSE(model.contains(id)) << "block " << id << " handed out twice";
        model[id] = State::kAllocated;
      }
    } else if (op == 1 && !pick.empty()) {
      std::vector<CommitEntry> entries;
      for (BlockId id : pick) entries.push_back({.block = id, .page = Page(next_page++)});
      const bool all_allocated = std::all_of(
          pick.begin(), pick.end(), [&](BlockId id) { return model[id] == State::kAllocated; });
      absl::StatusOr<std::vector<BlockId>> r = l.Commit(kAcme, kEpoch, entries, "pages");
      ASSERT_EQ(r.ok(), all_allocated) << r.status();
      if (r.ok()) {
        for (BlockId id : pick) model[id] = State::kCommitted;
      }
    } else if (op == 2 && !pick.empty()) {
      const bool all_allocated = std::all_of(
          pick.begin(), pick.end(), [&](BlockId id) { return model[id] == State::kAllocated; });
      ASSERT_EQ(l.Free(pick, kEpoch).ok(), all_allocated);
      if (all_allocated) {
        for (BlockId id : pick) model.erase(id);
      }
    } else if (op == 3 && !pick.empty()) {
      const bool all_committed = std::all_of(
          pick.begin(), pick.end(), [&](BlockId id) { return model[id] == State::kCommitted; });
      ASSERT_EQ(l.FreeCommitted(pick, kEpoch, "block_ids").ok(), all_committed);
      if (all_committed) {
        for (BlockId id : pick) model.erase(id);
      }
    } else if (op == 4 && !pick.empty()) {
      const bool all_committed = std::all_of(
          pick.begin(), pick.end(), [&](BlockId id) { return model[id] == State::kCommitted; });
      ASSERT_EQ(l.Release(pick, kEpoch, "block_ids").ok(), all_committed);
      if (all_committed) {
        for (BlockId id : pick) model[id] = State::kAllocated;
      }
    }
    uint32_t committed = 0;
    for (auto& [id, st] : model) {
      ASSERT_EQ(l.state(id), st) << "block " << id << " at step " << step;
      committed += st == State::kCommitted;
    }
    ASSERT_EQ(l.free_blocks(), kBlocks - model.size());
    ASSERT_EQ(l.committed_blocks(), committed);
  }
}

}  // namespace
}  // namespace kvcm
