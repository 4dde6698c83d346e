// Block generations (block_ledger.h): every call that names a block with the generation
// Allocate gave it acts only while the block is still in that allocation, checked in the
// critical section of the work itself; a stale generation changes nothing and touches no
// byte of the block's next allocation.
#include <cstddef>
#include <cstring>
#include <vector>

#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gpu/agent/pool/block_ledger.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/pool_attention.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kEpoch = 7;
const NamespaceId kAcme{"acme", "dsv3"};

std::vector<std::byte> Fill(size_t n, uint8_t value) {
  return std::vector<std::byte>(n, static_cast<std::byte>(value));
}

TEST(BlockGenerationTest, EveryAllocationGetsAFreshGenerationAndFreedBlocksAreReusedFifo) {
  BlockLedger l(4, /*first_generation=*/100);
  std::vector<uint64_t> g1;
  ASSERT_THAT(*l.Allocate(2, kEpoch, &kAcme, &g1), ElementsAre(0, 1));
  EXPECT_THAT(g1, ElementsAre(100, 101));
  EXPECT_EQ(l.generation(0), 100u);
  EXPECT_EQ(l.generation(2), 0u) << "a free block has no generation";
  ASSERT_TRUE(l.Free(std::vector<BlockId>{0}, kEpoch, g1).code() ==
              absl::StatusCode::kInvalidArgument)
      << "one generation per id";
  ASSERT_TRUE(l.Free(std::vector<BlockId>{0}, kEpoch, std::vector<uint64_t>{100}).ok());
  EXPECT_EQ(l.generation(0), 0u) << "Free ends the generation";
  // FIFO: blocks 2 and 3 (never used) come before block 0 (freed last).
  std::vector<uint64_t> g2;
  EXPECT_THAT(*l.Allocate(3, kEpoch, &kAcme, &g2), ElementsAre(2, 3, 0));
  EXPECT_THAT(g2, ElementsAre(102, 103, 104)) << "block 0 comes back in a new generation";
  // The default first generation is the wall clock: a later ledger (a restarted agent)
  // never hands out a generation an earlier one gave.
  BlockLedger before(1), after(1);
  std::vector<uint64_t> a, b;
  ASSERT_TRUE(before.Allocate(1, kEpoch, nullptr, &a).ok());
  ASSERT_TRUE(after.Allocate(1, kEpoch, nullptr, &b).ok());
  EXPECT_GT(b[0], a[0]);
}

TEST(BlockGenerationTest, StaleGenerationsAreRefusedByEveryLedgerCallAndChangeNothing) {
  BlockLedger l(2, 1);
  std::vector<uint64_t> old;
  ASSERT_TRUE(l.Allocate(2, kEpoch, &kAcme, &old).ok());
  const std::vector<BlockId> one = {1};
  ASSERT_TRUE(l.Free(one, kEpoch, std::vector<uint64_t>{old[1]}).ok());
  std::vector<uint64_t> fresh;
  ASSERT_THAT(*l.Allocate(1, kEpoch, &kAcme, &fresh), ElementsAre(1));

  const std::vector<BlockId> both = {0, 1};
  absl::Status s = l.Free(both, kEpoch, old);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(s.message(), HasSubstr("block_ids[1]: block 1 was freed and reallocated since "
                                     "generation 2"));
  EXPECT_THAT(s.message(), Not(HasSubstr("acme")));
  EXPECT_EQ(l.state(0), BlockLedger::State::kAllocated) << "all or nothing";
  EXPECT_EQ(l.generation(1), fresh[0]);
  EXPECT_EQ(l.Check(both, kEpoch, true, "block_ids", old).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(
      l.Check(both, kEpoch, true, "block_ids", std::vector<uint64_t>{old[0], fresh[0]}).ok());
  // 0 is "any" (the agent binds generations for callers who send none); a generation no
  // allocation had yet is a malformed request, not a stale one.
  EXPECT_TRUE(l.Check(one, kEpoch, false, "block_ids", std::vector<uint64_t>{0}).ok());
  absl::Status future = l.Check(one, kEpoch, false, "block_ids", std::vector<uint64_t>{999});
  EXPECT_EQ(future.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(future.message(), HasSubstr("block_generations[0]"));
  // Freed and not reallocated: still ABORTED, "was freed".
  ASSERT_TRUE(l.Free(one, kEpoch, fresh).ok());
  absl::Status gone = l.Check(one, kEpoch, false, "block_ids", fresh);
  EXPECT_EQ(gone.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(gone.message(), HasSubstr("was freed since generation"));
}

// A pool whose block 0 went from allocation `old` (writer B) to allocation `now` (A, who
// wrote 0xAA into it).
struct Reused {
  std::unique_ptr<BlockPool> pool;
  uint64_t bpb = 0;
  std::vector<BlockId> ids;   // {0, 1}: block 0 reused, block 1 still B's
  std::vector<uint64_t> old;  // B's generations of ids
  uint64_t now = 0;           // A's generation of block 0
};

Reused MakeReused() {
  Reused r;
  r.pool = MakeHostPool(SmallGqa(), 2);
  r.bpb = r.pool->geometry().bytes_per_block();
  r.ids = *r.pool->Allocate(2, kEpoch, &kAcme, &r.old);
  EXPECT_TRUE(r.pool->WriteBlocks(r.ids, kEpoch, Fill(2 * r.bpb, 0x11), r.old).ok());
  EXPECT_TRUE(r.pool->Free({&r.ids[0], 1}, kEpoch, {&r.old[0], 1}).ok());
  std::vector<uint64_t> now;
  EXPECT_THAT(*r.pool->Allocate(1, kEpoch, &kAcme, &now), ElementsAre(0));
  r.now = now[0];
  EXPECT_TRUE(r.pool->WriteBlocks({&r.ids[0], 1}, kEpoch, Fill(r.bpb, 0xAA), now).ok());
  return r;
}

// Block 0 still holds A's bytes, read in A's generation.
void ExpectAsBytes(const Reused& r) {
  std::vector<std::byte> got(r.bpb);
  ASSERT_TRUE(r.pool->ReadRange({&r.ids[0], 1}, {&r.now, 1}, kEpoch, 0, got, "block_ids").ok());
  EXPECT_EQ(got, Fill(r.bpb, 0xAA));
}

TEST(BlockGenerationTest, StaleWritesAndFreesTouchNothingOfTheNextAllocation) {
  Reused r = MakeReused();
  // A WriteBlocks stream's chunk, wholly in block 0 or straddling both blocks.
  absl::Status chunk =
      r.pool->WriteRange(r.ids, r.old, kEpoch, 8, Fill(16, 0xBB), "header.block_ids");
  EXPECT_EQ(chunk.code(), absl::StatusCode::kAborted) << chunk;
  EXPECT_THAT(chunk.message(), HasSubstr("block 0 was freed and reallocated"));
  EXPECT_EQ(
      r.pool->WriteRange(r.ids, r.old, kEpoch, r.bpb - 4, Fill(8, 0xBB), "header.block_ids").code(),
      absl::StatusCode::kAborted);
  // A chunk only in block 1 (still B's) is fine.
  EXPECT_TRUE(r.pool->WriteRange(r.ids, r.old, kEpoch, r.bpb, Fill(8, 0xBB), "h").ok());
  EXPECT_EQ(r.pool->WriteRange(r.ids, r.old, kEpoch, 2 * r.bpb - 4, Fill(8, 0xBB), "h").code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.pool->WriteBlocks(r.ids, kEpoch, Fill(2 * r.bpb, 0xBB), r.old).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(r.pool->Free(r.ids, kEpoch, r.old).code(), absl::StatusCode::kAborted);
  bool ran = false;
  EXPECT_EQ(r.pool
                ->WithWritableBlock(
                    0, kEpoch, "dst_blocks[0]",
                    [&](std::byte*) -> absl::StatusOr<uint64_t> {
                      ran = true;
                      return 0;
                    },
                    r.old[0])
                .code(),
            absl::StatusCode::kAborted)
      << "a pull into a destination block freed mid-pull (Fetch's target)";
  EXPECT_FALSE(ran);
  EXPECT_EQ(r.pool
                ->CheckNamespaces(
                    r.ids,
                    [&](BlockId, const NamespaceId*) {
                      ran = true;
                      return absl::OkStatus();
                    },
                    r.old)
                .code(),
            absl::StatusCode::kAborted)
      << "authorization checks the generation first";
  EXPECT_FALSE(ran);
  EXPECT_EQ(r.pool->Stats().free_blocks, 0u) << "nothing freed";
  ExpectAsBytes(r);
}

TEST(BlockGenerationTest, StaleReadsSendNoByteOfTheNextAllocation) {
  Reused r = MakeReused();
  std::vector<std::byte> got = Fill(2 * r.bpb, 0x00);
  absl::Status s = r.pool->ReadRange(r.ids, r.old, kEpoch, 0, got, "block_ids");
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(got, Fill(2 * r.bpb, 0x00)) << "nothing copied, not even block 1's bytes";
  // Block 1 alone, still B's: B's bytes.
  ASSERT_TRUE(
      r.pool->ReadRange(r.ids, r.old, kEpoch, r.bpb, std::span(got).first(r.bpb), "b").ok());
  EXPECT_EQ(std::vector<std::byte>(got.begin(), got.begin() + r.bpb), Fill(r.bpb, 0x11));
  EXPECT_EQ(r.pool->CheckOwned(r.ids, kEpoch, "block_ids", r.old).code(),
            absl::StatusCode::kAborted);
  ExpectAsBytes(r);
}

TEST(BlockGenerationTest, RunAttentionChecksGenerationsUnderTheKernelsLock) {
  constexpr uint32_t kLayer = 1;
  absl::StatusOr<ModelSpec> spec = FindModel("deepseek-v3", KvDtype::kBf16);
  ASSERT_TRUE(spec.ok());
  const PoolGeometry g{*spec, kMlaTestPoolBlocks};
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(g.pool_bytes());
  ASSERT_TRUE(host.ok());
  absl::StatusOr<std::unique_ptr<BlockPool>> made = BlockPool::Create(g, *std::move(host));
  ASSERT_TRUE(made.ok());
  BlockPool& pool = **made;
  std::vector<uint64_t> gen;  // by block id: a fresh pool allocates 0, 1, 2, ...
  const std::vector<BlockId> all = *pool.Allocate(kMlaTestPoolBlocks, kEpoch, nullptr, &gen);
  ASSERT_TRUE(pool.WriteBlocks(all, kEpoch, MakeMlaPoolBytes(g, kLayer, 3), gen).ok());
  const std::vector<uint16_t> query =
      RandomBf16(kScatteredBatch * kScatteredHeads * gpu::kMlaHeadDim, 4);
  PoolAttentionRequest req = ScatteredMlaRequest(kLayer, kEpoch, query);
  for (const std::vector<BlockId>& row : req.block_table) {
    std::vector<uint64_t>& out = req.block_generations.emplace_back();
    for (BlockId id : row) out.push_back(gen[id]);
  }
  ASSERT_TRUE(RunMlaDecodeOnPool(pool, req).ok());

  PoolAttentionRequest ragged = req;
  ragged.block_generations[1].pop_back();
  EXPECT_EQ(RunMlaDecodeOnPool(pool, ragged).status().code(), absl::StatusCode::kInvalidArgument);
  PoolAttentionRequest twice = req;
  twice.block_generations[2][0] += 1;  // block 2 also in row 0 with its true generation
  absl::StatusOr<PoolAttentionResult> two = RunMlaDecodeOnPool(pool, twice);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(two.status().message(), HasSubstr("block_generations"));

  // Block 2 freed and reallocated: the old table no longer runs.
  const BlockId two_id = 2;
  ASSERT_TRUE(pool.Free({&two_id, 1}, kEpoch, {&gen[2], 1}).ok());
  ASSERT_THAT(*pool.Allocate(1, kEpoch), ElementsAre(2));
  absl::StatusOr<PoolAttentionResult> stale = RunMlaDecodeOnPool(pool, req);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted) << stale.status();
  EXPECT_THAT(stale.status().message(), HasSubstr("block 2 was freed and reallocated"));
}

}  // namespace
}  // namespace kvcm
