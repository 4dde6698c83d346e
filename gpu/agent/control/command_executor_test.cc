#include "gpu/agent/control/command_executor.h"

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/core_types.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Optional;

constexpr uint64_t kEpoch = 7;
const NamespaceId kNs{"acme", "small-gqa"};
const NamespaceId kOtherNs{"acme", "other"};

constexpr int kOk = 0;
constexpr int Code(absl::StatusCode code) { return static_cast<int>(code); }

std::vector<std::byte> Pattern(size_t n, int seed) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  return b;
}

// Page i of the test prompt.
PageHash Page(uint64_t i) { return PageHash{.lo = 1000 + i, .hi = 2000 + i}; }

v1::AgentCommand Free(uint64_t sequence, v1::Tier tier, std::vector<BlockId> ids) {
  v1::AgentCommand c;
  c.set_sequence(sequence);
  c.mutable_free()->set_tier(tier);
  c.mutable_free()->mutable_block_ids()->Add(ids.begin(), ids.end());
  return c;
}

v1::AgentCommand Release(uint64_t sequence, v1::Tier tier, std::vector<BlockId> ids) {
  v1::AgentCommand c;
  c.set_sequence(sequence);
  c.mutable_release()->set_tier(tier);
  c.mutable_release()->mutable_block_ids()->Add(ids.begin(), ids.end());
  return c;
}

v1::AgentCommand Demote(uint64_t sequence, std::vector<BlockId> ids) {
  v1::AgentCommand c;
  c.set_sequence(sequence);
  c.mutable_demote()->mutable_source_block_ids()->Add(ids.begin(), ids.end());
  return c;
}

// Commits ids[i] to page first_page + i of kNs (SmallGqa) in the GPU pool; page first_page's
// parent is page first_page - 1, none for page 0.
v1::AgentCommand Commit(uint64_t sequence, std::vector<BlockId> ids, uint64_t first_page = 0) {
  v1::AgentCommand c;
  c.set_sequence(sequence);
  v1::CommitBlocks* commit = c.mutable_commit();
  commit->set_tier(v1::TIER_GPU);
  NamespaceToProto(kNs, commit->mutable_namespace_());
  ModelSpecToProto(SmallGqa(), commit->mutable_spec());
  commit->mutable_block_ids()->Add(ids.begin(), ids.end());
  std::vector<PageHash> pages;
  for (size_t i = 0; i < ids.size(); ++i) pages.push_back(Page(first_page + i));
  commit->set_page_hashes(EncodePageHashes(pages));
  if (first_page > 0) {
    const PageHash parent = Page(first_page - 1);
    commit->set_first_parent_hash(EncodePageHashes({&parent, 1}));
  }
  return c;
}

std::vector<BlockId> AckIds(const v1::AgentCommandAck& ack) {
  return std::vector<BlockId>(ack.block_ids().begin(), ack.block_ids().end());
}

class CommandExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executor_.Reset(kEpoch);
    ids_ = *gpu_->Allocate(3, kEpoch, &kNs);
    bpb_ = gpu_->geometry().bytes_per_block();
    for (size_t i = 0; i < ids_.size(); ++i) {
      ASSERT_TRUE(gpu_->WriteBlocks({&ids_[i], 1}, kEpoch, Pattern(bpb_, i)).ok());
    }
  }

  std::unique_ptr<BlockPool> gpu_ = MakeHostPool(SmallGqa(), 4);
  std::unique_ptr<BlockPool> host_ = MakeHostPool(SmallGqa(), 2);
  NamespaceSpecs specs_;
  CommandExecutor executor_{gpu_.get(), Tier::kGpu, host_.get(), &specs_};
  std::vector<BlockId> ids_;
  uint64_t bpb_ = 0;
};

TEST_F(CommandExecutorTest, CommitReturnsTheNewlyCommittedBlocksAndChainsTheParents) {
  v1::AgentCommandAck ack = executor_.Execute(Commit(1, {ids_[1], ids_[2]}, /*first_page=*/5));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_THAT(AckIds(ack), ElementsAre(ids_[1], ids_[2]));
  const std::vector<CommittedBlock> inventory = gpu_->Inventory();
  ASSERT_EQ(inventory.size(), 2u);
  for (const CommittedBlock& b : inventory) {
    ASSERT_NE(b.ns, nullptr);
    EXPECT_EQ(*b.ns, kNs);
    const uint64_t page = b.block == ids_[1] ? 5 : 6;
    EXPECT_EQ(b.page, Page(page)) << b.block;
    EXPECT_EQ(b.parent, Page(page - 1)) << b.block;
  }
  // Page 0 of a prompt has no parent.
  ack = executor_.Execute(Commit(2, {ids_[0]}));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(gpu_->Inventory()[0].parent, PageHash{});
}

TEST_F(CommandExecutorTest, ARepeatedCommitOfTheSamePagesCommitsNothingNew) {
  ASSERT_EQ(executor_.Execute(Commit(1, {ids_[0], ids_[1]})).code(), kOk);
  v1::AgentCommandAck ack = executor_.Execute(Commit(2, {ids_[0], ids_[1]}));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_THAT(AckIds(ack), IsEmpty());
  // A longer prompt over the same first pages: only its new block is reported.
  ack = executor_.Execute(Commit(3, {ids_[0], ids_[1], ids_[2]}));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_THAT(AckIds(ack), ElementsAre(ids_[2]));
  EXPECT_EQ(gpu_->Stats().committed_blocks, 3u);
}

TEST_F(CommandExecutorTest, ARefusedCommitNamesTheBlockAndChangesNothing) {
  const BlockId other_ns = (*gpu_->Allocate(1, kEpoch, &kOtherNs))[0];
  ASSERT_TRUE(gpu_->Free(std::vector<BlockId>{ids_[2]}, kEpoch).ok());  // now free
  struct Case {
    const char* name;
    std::vector<BlockId> ids;
    absl::StatusCode code;
    const char* message;
  };
  const Case cases[] = {
      {"another namespace",
       {ids_[0], other_ns},
       absl::StatusCode::kFailedPrecondition,
       "block_ids[1]: block "},
      {"not allocated",
       {ids_[0], ids_[1], ids_[2]},
       absl::StatusCode::kFailedPrecondition,
       "block_ids[2]: block "},
      {"listed twice",
       {ids_[0], ids_[1], ids_[0]},
       absl::StatusCode::kInvalidArgument,
       "block_ids[2] lists block"},
      {"past the pool",
       {ids_[0], 99},
       absl::StatusCode::kInvalidArgument,
       "block_ids[1]: block 99"},
  };
  uint64_t sequence = 0;
  for (const Case& c : cases) {
    const v1::AgentCommandAck ack = executor_.Execute(Commit(++sequence, c.ids));
    EXPECT_EQ(ack.code(), Code(c.code)) << c.name << ": " << ack.message();
    EXPECT_THAT(ack.message(), HasSubstr(c.message)) << c.name;
    EXPECT_THAT(AckIds(ack), IsEmpty()) << c.name;
    EXPECT_EQ(gpu_->Stats().committed_blocks, 0u) << c.name;
  }
  // Every block is as it was: the first two still commit, the worker still frees the rest.
  ASSERT_EQ(executor_.Execute(Commit(++sequence, {ids_[0], ids_[1]})).code(), kOk);
  EXPECT_TRUE(gpu_->Free(std::vector<BlockId>{other_ns}, kEpoch).ok());
}

TEST_F(CommandExecutorTest, AMalformedCommitNamesTheField) {
  struct Case {
    const char* name;
    void (*mutate)(v1::CommitBlocks*);
    const char* message;
  };
  const Case cases[] = {
      {"short page_hashes", [](v1::CommitBlocks* c) { c->mutable_page_hashes()->resize(31); },
       "commit.page_hashes is 31 bytes"},
      {"long page_hashes", [](v1::CommitBlocks* c) { c->mutable_page_hashes()->append(16, 'x'); },
       "commit.page_hashes is 48 bytes"},
      {"bad first parent", [](v1::CommitBlocks* c) { c->set_first_parent_hash("12345678"); },
       "commit.first_parent_hash must be 0 or 16 bytes, got 8"},
      {"no spec", [](v1::CommitBlocks* c) { c->clear_spec(); }, "commit.spec is required"},
      {"bad spec", [](v1::CommitBlocks* c) { c->mutable_spec()->set_num_layers(0); },
       "commit.spec.num_layers"},
      {"spec of another page size",
       [](v1::CommitBlocks* c) { c->mutable_spec()->set_page_size_tokens(8); },
       "commit.spec has pages of"},
      {"no namespace", [](v1::CommitBlocks* c) { c->clear_namespace_(); },
       "commit.namespace is required"},
      {"bad tenant", [](v1::CommitBlocks* c) { c->mutable_namespace_()->set_tenant("a b"); },
       "commit.namespace.tenant"},
      {"bad model", [](v1::CommitBlocks* c) { c->mutable_namespace_()->set_model(""); },
       "commit.namespace.model"},
      {"not a pool", [](v1::CommitBlocks* c) { c->set_tier(v1::TIER_DISK); }, "commit.tier"},
  };
  uint64_t sequence = 0;
  for (const Case& c : cases) {
    v1::AgentCommand command = Commit(++sequence, {ids_[0], ids_[1]});
    c.mutate(command.mutable_commit());
    const v1::AgentCommandAck ack = executor_.Execute(command);
    EXPECT_EQ(ack.code(), Code(absl::StatusCode::kInvalidArgument)) << c.name;
    EXPECT_THAT(ack.message(), HasSubstr(c.message)) << c.name;
  }
  EXPECT_EQ(gpu_->Stats().committed_blocks, 0u);
  EXPECT_FALSE(specs_.Get(kNs).has_value());
}

TEST_F(CommandExecutorTest, CommitRecordsTheNamespacesSpec) {
  EXPECT_FALSE(specs_.Get(kNs).has_value());
  ASSERT_EQ(executor_.Execute(Commit(1, {ids_[0]})).code(), kOk);
  EXPECT_THAT(specs_.Get(kNs), Optional(SmallGqa()));
  EXPECT_EQ(specs_.Snapshot().size(), 1u);
}

TEST_F(CommandExecutorTest, ReleasedBlocksGoBackToTheirAllocator) {
  ASSERT_EQ(executor_.Execute(Commit(1, {ids_[0], ids_[1]})).code(), kOk);
  // Committed: the worker can no longer free them.
  EXPECT_EQ(gpu_->Free(std::vector<BlockId>{ids_[0]}, kEpoch).code(),
            absl::StatusCode::kFailedPrecondition);
  v1::AgentCommandAck ack = executor_.Execute(Release(2, v1::TIER_GPU, {ids_[0], ids_[2]}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ack.message(), HasSubstr("release.block_ids"));
  EXPECT_EQ(gpu_->Stats().committed_blocks, 2u);
  ack = executor_.Execute(Release(3, v1::TIER_GPU, {ids_[0], ids_[1]}));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(gpu_->Stats().committed_blocks, 0u);
  EXPECT_TRUE(gpu_->Free(std::vector<BlockId>{ids_[0], ids_[1]}, kEpoch).ok());
  ack = executor_.Execute(Release(4, v1::TIER_DISK, {ids_[2]}));
  EXPECT_THAT(ack.message(), HasSubstr("release.tier"));
}

TEST_F(CommandExecutorTest, FreeBlocksFreesCommittedBlocksOnly) {
  ASSERT_EQ(executor_.Execute(Commit(1, {ids_[0], ids_[1]})).code(), kOk);
  // ids_[2] is allocated, not committed: it belongs to its worker.
  v1::AgentCommandAck ack = executor_.Execute(Free(2, v1::TIER_GPU, {ids_[0], ids_[2]}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ack.message(), HasSubstr("free.block_ids"));
  EXPECT_EQ(gpu_->Stats().free_blocks, 1u);
  ack = executor_.Execute(Free(3, v1::TIER_GPU, {ids_[0], ids_[1]}));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
  EXPECT_EQ(gpu_->Stats().committed_blocks, 0u);
}

TEST_F(CommandExecutorTest, DemoteCopiesIntoNewHostBlocks) {
  ASSERT_EQ(executor_.Execute(Commit(1, ids_)).code(), kOk);
  v1::AgentCommandAck ack = executor_.Execute(Demote(2, {ids_[2], ids_[0]}));
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(ack.sequence(), 2u);
  ASSERT_EQ(ack.block_ids_size(), 2);
  EXPECT_EQ(host_->Stats().free_blocks, 0u);
  EXPECT_EQ(gpu_->Stats().free_blocks, 1u);  // the sources stay until a FreeBlocks
  std::vector<std::byte> got(bpb_);
  ASSERT_TRUE(host_->ReadBlock(ack.block_ids(0), kEpoch, 0, got).ok());
  EXPECT_EQ(got, Pattern(bpb_, 2));
  ASSERT_TRUE(host_->ReadBlock(ack.block_ids(1), kEpoch, 0, got).ok());
  EXPECT_EQ(got, Pattern(bpb_, 0));
  // The copies hold their sources' pages, so the manager frees them as it frees any.
  const std::vector<CommittedBlock> copies = host_->Inventory();
  ASSERT_EQ(copies.size(), 2u);
  for (const CommittedBlock& b : copies) {
    EXPECT_EQ(b.page, Page(b.block == ack.block_ids(0) ? 2 : 0)) << b.block;
  }
  EXPECT_EQ(executor_.Execute(Free(3, v1::TIER_HOST, AckIds(ack))).code(), kOk);
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
}

TEST_F(CommandExecutorTest, DemoteIsAllOrNothing) {
  // Three sources, two free host blocks.
  v1::AgentCommandAck ack = executor_.Execute(Demote(1, ids_));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kResourceExhausted)) << ack.message();
  EXPECT_EQ(ack.block_ids_size(), 0);
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
  // A source block the epoch does not own.
  const BlockId foreign = (*gpu_->Allocate(1, kEpoch + 1))[0];
  ack = executor_.Execute(Demote(2, {ids_[0], foreign}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kFailedPrecondition)) << ack.message();
  EXPECT_THAT(ack.message(), HasSubstr("demote.source_block_ids"));
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
}

TEST_F(CommandExecutorTest, FreeNamesTheMainOrTheHostPool) {
  ASSERT_EQ(executor_.Execute(Commit(1, ids_)).code(), kOk);
  v1::AgentCommandAck demoted = executor_.Execute(Demote(2, {ids_[0]}));
  ASSERT_EQ(demoted.code(), kOk);
  v1::AgentCommandAck ack = executor_.Execute(Free(3, v1::TIER_GPU, {ids_[0], ids_[1]}));
  EXPECT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
  ack = executor_.Execute(Free(4, v1::TIER_HOST, {demoted.block_ids(0)}));
  EXPECT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
  ack = executor_.Execute(Free(5, v1::TIER_DISK, {0}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ack.message(), HasSubstr("free.tier"));
  // Not a tier at all (257 would wrap to TIER_GPU in a one-byte Tier).
  ack = executor_.Execute(Free(6, static_cast<v1::Tier>(257), {ids_[2]}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
  // A block of another owner (a worker's private block) is refused and stays allocated.
  const BlockId foreign = (*gpu_->Allocate(1, kEpoch + 1))[0];
  ack = executor_.Execute(Free(7, v1::TIER_GPU, {foreign}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(gpu_->CheckOwned({&foreign, 1}, kEpoch + 1, "ids").ok());
}

TEST_F(CommandExecutorTest, ARepeatedSequenceGetsItsFirstAckAndDoesNotRunAgain) {
  ASSERT_EQ(executor_.Execute(Commit(1, ids_)).code(), kOk);
  v1::AgentCommandAck first = executor_.Execute(Demote(2, {ids_[0]}));
  ASSERT_EQ(first.code(), kOk);
  v1::AgentCommandAck freed = executor_.Execute(Free(3, v1::TIER_GPU, {ids_[0]}));
  ASSERT_EQ(freed.code(), kOk);

  // The stream broke before the acks arrived: the manager resends them.
  v1::AgentCommandAck again = executor_.Execute(Commit(1, ids_));
  EXPECT_THAT(AckIds(again), ElementsAreArray(ids_));  // the first ack, not a re-run's
  again = executor_.Execute(Demote(2, {ids_[0]}));
  EXPECT_EQ(again.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(host_->Stats().free_blocks, 1u);  // copied once
  again = executor_.Execute(Free(3, v1::TIER_GPU, {ids_[0]}));
  EXPECT_EQ(again.code(), kOk);  // not a double free
  EXPECT_EQ(gpu_->Stats().free_blocks, 2u);

  // Once the manager confirms them, their acks are forgotten.
  v1::AgentCommand next = Free(4, v1::TIER_GPU, {ids_[1]});
  next.set_acked_through(3);
  ASSERT_EQ(executor_.Execute(next).code(), kOk);
  again = executor_.Execute(Demote(2, {ids_[0]}));
  EXPECT_EQ(again.code(), Code(absl::StatusCode::kAborted));
  EXPECT_EQ(host_->Stats().free_blocks, 1u);
}

TEST_F(CommandExecutorTest, ANewManagerIncarnationNumbersFromOneAgain) {
  constexpr uint64_t kFirst = 0x1111, kSecond = 0x2222;
  v1::AgentCommand commit = Commit(1, {ids_[0], ids_[1]});
  commit.set_manager_incarnation(kFirst);
  ASSERT_EQ(executor_.Execute(commit).code(), kOk);
  v1::AgentCommand free = Free(2, v1::TIER_GPU, {ids_[0]});
  free.set_manager_incarnation(kFirst);
  ASSERT_EQ(executor_.Execute(free).code(), kOk);
  ASSERT_EQ(gpu_->Stats().free_blocks, 2u);

  // The manager restarted: its sequence 1 is a new command, run in the same epoch.
  v1::AgentCommand restarted = Free(1, v1::TIER_GPU, {ids_[1]});
  restarted.set_manager_incarnation(kSecond);
  v1::AgentCommandAck ack = executor_.Execute(restarted);
  ASSERT_EQ(ack.code(), kOk) << ack.message();
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
  EXPECT_EQ(executor_.epoch(), kEpoch);
  // Repeats within the new incarnation are still answered from memory.
  EXPECT_EQ(executor_.Execute(restarted).SerializeAsString(), ack.SerializeAsString());
  // A command without an incarnation (0) does not count as a new manager.
  v1::AgentCommand unnamed = Free(1, v1::TIER_GPU, {ids_[1]});
  EXPECT_EQ(executor_.Execute(unnamed).SerializeAsString(), ack.SerializeAsString());
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
}

TEST_F(CommandExecutorTest, ResetStartsANewEpoch) {
  ASSERT_EQ(executor_.Execute(Commit(1, ids_)).code(), kOk);
  executor_.Reset(kEpoch + 1);
  EXPECT_EQ(executor_.epoch(), kEpoch + 1);
  // Sequence 1 of the new epoch is a new command; blocks of the old epoch are not its own.
  v1::AgentCommandAck ack = executor_.Execute(Free(1, v1::TIER_GPU, {ids_[1]}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(gpu_->FreeAllOwnedBy(kEpoch), 3u);
  EXPECT_EQ(gpu_->Stats().free_blocks, 4u);
}

TEST(CommandExecutorNoHostTest, DemoteWithoutAHostPoolIsRefused) {
  std::unique_ptr<BlockPool> gpu = MakeHostPool(SmallGqa(), 2);
  CommandExecutor executor(gpu.get(), Tier::kGpu, nullptr);
  executor.Reset(kEpoch);
  const BlockId id = (*gpu->Allocate(1, kEpoch))[0];
  v1::AgentCommandAck ack = executor.Execute(Demote(1, {id}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ack.message(), HasSubstr("no host pool"));
  ack = executor.Execute(Free(2, v1::TIER_HOST, {id}));
  EXPECT_EQ(ack.code(), Code(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvcm
