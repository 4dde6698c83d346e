#include "gpu/agent/command_executor.h"

#include <cstddef>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/agent/agent_test_util.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kEpoch = 7;

std::vector<std::byte> Pattern(size_t n, int seed) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  return b;
}

v1::AgentCommand Free(uint64_t sequence, v1::Tier tier, std::vector<BlockId> ids) {
  v1::AgentCommand c;
  c.set_sequence(sequence);
  c.mutable_free()->set_tier(tier);
  c.mutable_free()->mutable_block_ids()->Add(ids.begin(), ids.end());
  return c;
}

v1::AgentCommand Demote(uint64_t sequence, std::vector<BlockId> ids) {
  v1::AgentCommand c;
  c.set_sequence(sequence);
  c.mutable_demote()->mutable_source_block_ids()->Add(ids.begin(), ids.end());
  return c;
}

class CommandExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    executor_.Reset(kEpoch);
    ids_ = *gpu_->Allocate(3, kEpoch);
    bpb_ = gpu_->geometry().bytes_per_block();
    for (size_t i = 0; i < ids_.size(); ++i) {
      ASSERT_TRUE(gpu_->WriteBlocks({&ids_[i], 1}, kEpoch, Pattern(bpb_, i)).ok());
    }
  }

  std::unique_ptr<BlockPool> gpu_ = MakeHostPool(SmallGqa(), 4);
  std::unique_ptr<BlockPool> host_ = MakeHostPool(SmallGqa(), 2);
  CommandExecutor executor_{gpu_.get(), Tier::kGpu, host_.get()};
  std::vector<BlockId> ids_;
  uint64_t bpb_ = 0;
};

TEST_F(CommandExecutorTest, DemoteCopiesIntoNewHostBlocks) {
  v1::AgentCommandAck ack = executor_.Execute(Demote(1, {ids_[2], ids_[0]}));
  ASSERT_EQ(ack.code(), 0) << ack.message();
  EXPECT_EQ(ack.sequence(), 1u);
  ASSERT_EQ(ack.block_ids_size(), 2);
  EXPECT_EQ(host_->Stats().free_blocks, 0u);
  EXPECT_EQ(gpu_->Stats().free_blocks, 1u);  // the sources stay until a FreeBlocks
  std::vector<std::byte> got(bpb_);
  ASSERT_TRUE(host_->ReadBlock(ack.block_ids(0), kEpoch, 0, got).ok());
  EXPECT_EQ(got, Pattern(bpb_, 2));
  ASSERT_TRUE(host_->ReadBlock(ack.block_ids(1), kEpoch, 0, got).ok());
  EXPECT_EQ(got, Pattern(bpb_, 0));
}

TEST_F(CommandExecutorTest, DemoteIsAllOrNothing) {
  // Three sources, two free host blocks.
  v1::AgentCommandAck ack = executor_.Execute(Demote(1, ids_));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << ack.message();
  EXPECT_EQ(ack.block_ids_size(), 0);
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
  // A source block the epoch does not own.
  const BlockId foreign = (*gpu_->Allocate(1, kEpoch + 1))[0];
  ack = executor_.Execute(Demote(2, {ids_[0], foreign}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << ack.message();
  EXPECT_THAT(ack.message(), HasSubstr("demote.source_block_ids"));
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
}

TEST_F(CommandExecutorTest, FreeNamesTheMainOrTheHostPool) {
  v1::AgentCommandAck demoted = executor_.Execute(Demote(1, {ids_[0]}));
  ASSERT_EQ(demoted.code(), 0);
  v1::AgentCommandAck ack = executor_.Execute(Free(2, v1::TIER_GPU, {ids_[0], ids_[1]}));
  EXPECT_EQ(ack.code(), 0) << ack.message();
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
  ack = executor_.Execute(Free(3, v1::TIER_HOST, {demoted.block_ids(0)}));
  EXPECT_EQ(ack.code(), 0) << ack.message();
  EXPECT_EQ(host_->Stats().free_blocks, 2u);
  ack = executor_.Execute(Free(4, v1::TIER_DISK, {0}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ack.message(), HasSubstr("free.tier"));
  // Not a tier at all (257 would wrap to TIER_GPU in a one-byte Tier).
  ack = executor_.Execute(Free(5, static_cast<v1::Tier>(257), {ids_[2]}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(gpu_->Stats().free_blocks, 3u);
  // A block of another owner (a worker's private block) is refused and stays allocated.
  const BlockId foreign = (*gpu_->Allocate(1, kEpoch + 1))[0];
  ack = executor_.Execute(Free(6, v1::TIER_GPU, {foreign}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_TRUE(gpu_->CheckOwned({&foreign, 1}, kEpoch + 1, "ids").ok());
}

TEST_F(CommandExecutorTest, ARepeatedSequenceGetsItsFirstAckAndDoesNotRunAgain) {
  v1::AgentCommandAck first = executor_.Execute(Demote(1, {ids_[0]}));
  ASSERT_EQ(first.code(), 0);
  v1::AgentCommandAck freed = executor_.Execute(Free(2, v1::TIER_GPU, {ids_[0]}));
  ASSERT_EQ(freed.code(), 0);

  // The stream broke before the acks arrived: the manager resends both.
  v1::AgentCommandAck again = executor_.Execute(Demote(1, {ids_[0]}));
  EXPECT_EQ(again.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(host_->Stats().free_blocks, 1u);  // copied once
  again = executor_.Execute(Free(2, v1::TIER_GPU, {ids_[0]}));
  EXPECT_EQ(again.code(), 0);  // not a double free
  EXPECT_EQ(gpu_->Stats().free_blocks, 2u);

  // Once the manager confirms them, their acks are forgotten.
  v1::AgentCommand next = Free(3, v1::TIER_GPU, {ids_[1]});
  next.set_acked_through(2);
  ASSERT_EQ(executor_.Execute(next).code(), 0);
  again = executor_.Execute(Demote(1, {ids_[0]}));
  EXPECT_EQ(again.code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ(host_->Stats().free_blocks, 1u);
}

TEST_F(CommandExecutorTest, ResetStartsANewEpoch) {
  ASSERT_EQ(executor_.Execute(Free(1, v1::TIER_GPU, {ids_[0]})).code(), 0);
  executor_.Reset(kEpoch + 1);
  EXPECT_EQ(executor_.epoch(), kEpoch + 1);
  // Sequence 1 of the new epoch is a new command; blocks of the old epoch are not its own.
  v1::AgentCommandAck ack = executor_.Execute(Free(1, v1::TIER_GPU, {ids_[1]}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ(gpu_->FreeAllOwnedBy(kEpoch), 2u);
  EXPECT_EQ(gpu_->Stats().free_blocks, 4u);
}

TEST(CommandExecutorNoHostTest, DemoteWithoutAHostPoolIsRefused) {
  std::unique_ptr<BlockPool> gpu = MakeHostPool(SmallGqa(), 2);
  CommandExecutor executor(gpu.get(), Tier::kGpu, nullptr);
  executor.Reset(kEpoch);
  const BlockId id = (*gpu->Allocate(1, kEpoch))[0];
  v1::AgentCommandAck ack = executor.Execute(Demote(1, {id}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ack.message(), HasSubstr("no host pool"));
  ack = executor.Execute(Free(2, v1::TIER_HOST, {id}));
  EXPECT_EQ(ack.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvcm
