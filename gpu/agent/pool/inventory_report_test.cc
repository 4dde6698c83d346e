#include "gpu/agent/pool/inventory_report.h"

#include <memory>
#include <vector>

#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gpu/agent/control/agent_proto.h"
#include "gtest/gtest.h"
#include "proto/core_types.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr uint64_t kEpoch = 9;
const NamespaceId kA{"acme", "a"};
const NamespaceId kB{"acme", "b"};

PageHash Page(uint64_t i) { return PageHash{.lo = 500 + i, .hi = 900 + i}; }
PageHash ParentOf(uint64_t i) { return i == 0 ? PageHash{} : Page(i - 1); }

// Allocates `n` blocks of `ns` in `pool` and commits them to pages first..first+n-1.
std::vector<BlockId> CommitChain(BlockPool& pool, const NamespaceId& ns, uint64_t first,
                                 uint32_t n) {
  std::vector<BlockId> ids = *pool.Allocate(n, kEpoch, &ns);
  std::vector<CommitEntry> entries;
  for (uint32_t i = 0; i < n; ++i)
    entries.push_back({ids[i], Page(first + i), ParentOf(first + i)});
  EXPECT_TRUE(pool.Commit(ns, kEpoch, entries, "block_ids").ok());
  return ids;
}

std::vector<BlockId> Ids(const v1::InventoryChunk& c) {
  return std::vector<BlockId>(c.block_ids().begin(), c.block_ids().end());
}

class InventoryReportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    specs_.Set(kA, SmallGqa());
    specs_.Set(kB, SmallGqa());
  }
  std::unique_ptr<BlockPool> gpu_ = MakeHostPool(SmallGqa(), 8);
  std::unique_ptr<BlockPool> host_ = MakeHostPool(SmallGqa(), 4);
  NamespaceSpecs specs_;
};

TEST_F(InventoryReportTest, NothingCommittedIsNoChunk) {
  (void)gpu_->Allocate(2, kEpoch, &kA);  // allocated, not committed
  InventoryReport report("agent-1", kEpoch, *gpu_, Tier::kGpu, host_.get(), specs_);
  EXPECT_EQ(report.chunks(), 0u);
  EXPECT_EQ(report.blocks(), 0u);
}

TEST_F(InventoryReportTest, ChunksArePerPoolAndNamespaceAndBounded) {
  const std::vector<BlockId> a = CommitChain(*gpu_, kA, 0, 3);
  const std::vector<BlockId> b = CommitChain(*gpu_, kB, 0, 1);
  const std::vector<BlockId> host_a = CommitChain(*host_, kA, 7, 1);
  InventoryReport report("agent-1", kEpoch, *gpu_, Tier::kGpu, host_.get(), specs_,
                         /*max_blocks_per_chunk=*/2);
  EXPECT_EQ(report.blocks(), 5u);
  EXPECT_EQ(report.skipped_blocks(), 0u);
  ASSERT_EQ(report.chunks(), 4u);

  struct Want {
    v1::Tier tier;
    NamespaceId ns;
    std::vector<BlockId> ids;
    std::vector<uint64_t> pages;
  };
  const Want want[] = {{v1::TIER_GPU, kA, {a[0], a[1]}, {0, 1}},
                       {v1::TIER_GPU, kA, {a[2]}, {2}},
                       {v1::TIER_GPU, kB, {b[0]}, {0}},
                       {v1::TIER_HOST, kA, {host_a[0]}, {7}}};
  for (size_t i = 0; i < report.chunks(); ++i) {
    const v1::InventoryChunk c = report.Chunk(i);
    EXPECT_EQ(c.agent_id(), "agent-1");
    EXPECT_EQ(c.epoch(), kEpoch);
    EXPECT_EQ(c.tier(), want[i].tier) << i;
    EXPECT_EQ(c.namespace_().tenant(), want[i].ns.tenant) << i;
    EXPECT_EQ(c.namespace_().model(), want[i].ns.model) << i;
    absl::StatusOr<ModelSpec> got_spec = ModelSpecFromProto(&c.spec(), "spec");
    ASSERT_TRUE(got_spec.ok()) << got_spec.status();
    EXPECT_EQ(*got_spec, SmallGqa());
    EXPECT_THAT(Ids(c), ElementsAreArray(want[i].ids)) << i;
    std::vector<PageHash> pages, parents;
    for (uint64_t p : want[i].pages) {
      pages.push_back(Page(p));
      parents.push_back(ParentOf(p));
    }
    EXPECT_EQ(c.page_hashes(), EncodePageHashes(pages)) << i;
    EXPECT_EQ(c.parent_hashes(), EncodePageHashes(parents)) << i;
  }
}

// Retention: each block's commit time and the namespace's own max page age travel with the
// inventory, so a restarted manager keeps the pages' ages and the namespace's limit.
TEST_F(InventoryReportTest, ChunksCarryCommitTimesAndTheNamespaceMaxPageAge) {
  specs_.Set(kA, SmallGqa(), /*max_page_age_s=*/600);
  std::vector<BlockId> ids = *gpu_->Allocate(2, kEpoch, &kA);
  ASSERT_TRUE(gpu_->Commit(kA, kEpoch, std::vector<CommitEntry>{{ids[0], Page(0), ParentOf(0)}},
                           "block_ids", 1'000)
                  .ok());
  ASSERT_TRUE(gpu_->Commit(kA, kEpoch, std::vector<CommitEntry>{{ids[1], Page(1), ParentOf(1)}},
                           "block_ids", 2'000)
                  .ok());
  CommitChain(*gpu_, kB, 0, 1);  // no time given: 0, "not recorded"
  InventoryReport report("agent-1", kEpoch, *gpu_, Tier::kGpu, nullptr, specs_);
  ASSERT_EQ(report.chunks(), 2u);
  const v1::InventoryChunk a = report.Chunk(0);
  EXPECT_EQ(a.namespace_().model(), "a");
  EXPECT_THAT(a.committed_unix_ms(), ElementsAre(1'000, 2'000));
  EXPECT_EQ(a.max_page_age_s(), 600u);
  const v1::InventoryChunk b = report.Chunk(1);
  EXPECT_THAT(b.committed_unix_ms(), ElementsAre(0));
  EXPECT_EQ(b.max_page_age_s(), 0u);
  EXPECT_EQ(specs_.MaxPageAgeS(kB), 0u);
}

TEST_F(InventoryReportTest, ItIsASnapshot) {
  CommitChain(*gpu_, kA, 0, 1);
  InventoryReport report("agent-1", kEpoch, *gpu_, Tier::kGpu, nullptr, specs_);
  CommitChain(*gpu_, kA, 1, 1);
  ASSERT_EQ(report.chunks(), 1u);
  EXPECT_EQ(report.Chunk(0).block_ids_size(), 1);
}

TEST_F(InventoryReportTest, BlocksOfANamespaceWithoutASpecAreLeftOut) {
  const NamespaceId unknown{"acme", "unknown"};
  CommitChain(*gpu_, unknown, 0, 2);
  CommitChain(*gpu_, kA, 0, 1);
  InventoryReport report("agent-1", kEpoch, *gpu_, Tier::kGpu, nullptr, specs_);
  EXPECT_EQ(report.blocks(), 1u);
  EXPECT_EQ(report.skipped_blocks(), 2u);
  EXPECT_THAT(report.skipped_namespaces(), ElementsAre(unknown));
  ASSERT_EQ(report.chunks(), 1u);
  EXPECT_EQ(report.Chunk(0).namespace_().model(), "a");
}

TEST(InventoryReportLargeTest, AFullChunkHolds16384Blocks) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), kMaxInventoryChunkBlocks + 1);
  NamespaceSpecs specs;
  specs.Set(kA, SmallGqa());
  CommitChain(*pool, kA, 0, kMaxInventoryChunkBlocks + 1);
  InventoryReport report("agent-1", kEpoch, *pool, Tier::kGpu, nullptr, specs);
  ASSERT_EQ(report.chunks(), 2u);
  const v1::InventoryChunk first = report.Chunk(0);
  EXPECT_EQ(first.block_ids_size(), static_cast<int>(kMaxInventoryChunkBlocks));
  EXPECT_EQ(first.page_hashes().size(), 16u * kMaxInventoryChunkBlocks);
  EXPECT_EQ(first.parent_hashes().size(), 16u * kMaxInventoryChunkBlocks);
  EXPECT_EQ(report.Chunk(1).block_ids_size(), 1);
}

TEST_F(InventoryReportTest, FreeInventoryRefusalsFreesWhatItCanInTheNamedPool) {
  const std::vector<BlockId> a = CommitChain(*gpu_, kA, 0, 3);
  const std::vector<BlockId> host_a = CommitChain(*host_, kA, 0, 1);
  const BlockId allocated = (*gpu_->Allocate(1, kEpoch, &kA))[0];  // not committed
  v1::InventoryReply reply;
  v1::PoolBlocks* gpu = reply.add_to_free();
  gpu->set_tier(v1::TIER_GPU);
  gpu->add_block_ids(a[1]);
  gpu->add_block_ids(allocated);
  gpu->add_block_ids(a[2]);
  v1::PoolBlocks* host = reply.add_to_free();
  host->set_tier(v1::TIER_HOST);
  host->add_block_ids(host_a[0]);
  v1::PoolBlocks* disk = reply.add_to_free();
  disk->set_tier(v1::TIER_DISK);
  disk->add_block_ids(0);

  const InventoryFreeResult r =
      FreeInventoryRefusals(reply, kEpoch, *gpu_, Tier::kGpu, host_.get());
  EXPECT_EQ(r.freed_blocks, 3u);
  EXPECT_EQ(r.refused_blocks, 2u);
  EXPECT_THAT(std::string(r.first_error.message()), HasSubstr("to_free.block_ids"));
  EXPECT_EQ(gpu_->Stats().committed_blocks, 1u);  // a[0]
  EXPECT_EQ(host_->Stats().committed_blocks, 0u);
  EXPECT_EQ(host_->Stats().free_blocks, 4u);
  EXPECT_TRUE(gpu_->CheckOwned({&allocated, 1}, kEpoch, "ids").ok());  // untouched
}

}  // namespace
}  // namespace kvcm
