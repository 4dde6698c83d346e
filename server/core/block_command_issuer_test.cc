#include "server/core/block_command_issuer.h"

#include <memory>
#include <optional>
#include <span>
#include <variant>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using StreamId = AgentCommandBook::StreamId;

constexpr uint32_t kPage = 4;  // tokens per page

class NullStream : public CommandStream {
 public:
  void Wake() override {}
  void End(const absl::Status&) override {}
};

// The issuer between a real CacheIndex (cost policy, so evicted GPU pages are demoted into
// the HOST pool) and a book whose one stream the test drives.
class BlockCommandIssuerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(
        CacheIndexOptions{.hash_secret = HashKey{11, 22}, .policy = "cost", .clock = &clock_});
    issuer_ = std::make_unique<BlockCommandIssuer>(index_.get(), &book_);
    ASSERT_TRUE(index_->RegisterModel(ns_, spec_).ok());
    ASSERT_TRUE(index_->SetPoolCapacity(gpu_, 2 * spec_.BytesPerPage()).ok());
    ASSERT_TRUE(index_->SetPoolCapacity(host_, 10 * spec_.BytesPerPage()).ok());
    book_.OnRegistered("gpu-0", 1);
    index_->SetEventListener([this](const CacheEvent& e) { issuer_->OnEvent(e); });
    absl::StatusOr<StreamId> id = book_.Attach("gpu-0", 1, std::make_shared<NullStream>());
    ASSERT_TRUE(id.ok());
    stream_ = *id;
  }
  void TearDown() override {
    index_->SetEventListener(nullptr);
    book_.Detach(stream_);
    book_.Close();  // runs the issuer's last completions while it lives
  }

  std::vector<PageHash> Prompt(std::vector<int32_t> page_ids) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns_, tokens);
  }

  // Fills the GPU pool with [1, 2] in blocks 0, 1, then inserts [5]: [2] leaves the GPU
  // pool (block 1) and [1, 2] are demoted into the HOST pool. Returns the DemoteBlocks
  // command (the FreeBlocks of GPU block 1 follows it).
  AgentCommand Demote() {
    EXPECT_TRUE(index_->Insert(ns_, Prompt({1, 2}), gpu_, std::vector<BlockId>{0, 1}).ok());
    EXPECT_TRUE(index_->Insert(ns_, Prompt({5}), gpu_, std::vector<BlockId>{10}).ok());
    std::optional<AgentCommand> c = book_.TakeNext(stream_);
    EXPECT_TRUE(c.has_value() && std::holds_alternative<DemoteBlocksCommand>(c->body));
    return c.value_or(AgentCommand{});
  }

  // The next command, which must be a FreeBlocks; acked.
  FreeBlocksCommand NextFree() {
    std::optional<AgentCommand> c = book_.TakeNext(stream_);
    if (!c.has_value() || !std::holds_alternative<FreeBlocksCommand>(c->body)) {
      ADD_FAILURE() << "no FreeBlocks next";
      return {};
    }
    EXPECT_TRUE(book_.OnAck(stream_, AgentCommandAck{.sequence = c->sequence}).ok());
    return std::get<FreeBlocksCommand>(c->body);
  }

  // Block ids of the HOST replicas of the leading pages of `pages` that the index has.
  std::vector<BlockId> HostBlocks(const std::vector<PageHash>& pages) {
    absl::StatusOr<MatchResult> m = index_->Match(ns_, pages, {.probe = true});
    std::vector<BlockId> out;
    if (!m.ok()) return out;
    for (const MatchedSegment& seg : m->segments) {
      for (const MatchedReplica& r : m->Replicas(seg)) {
        if (*r.pool != host_) continue;
        const std::span<const BlockId> ids = m->BlockIds(seg, r);
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    return out;
  }

  FakeClock clock_;
  const NamespaceId ns_{"tenant", "model"};
  const ModelSpec spec_{.attention = AttentionKind::kMla,
                        .num_layers = 61,
                        .num_heads = 128,
                        .kv_lora_rank = 512,
                        .rope_dim = 64,
                        .page_size_tokens = kPage};
  const PoolKey gpu_{"gpu-0", Tier::kGpu};
  const PoolKey host_{"gpu-0", Tier::kHost};
  std::unique_ptr<CacheIndex> index_;
  AgentCommandBook book_;
  std::unique_ptr<BlockCommandIssuer> issuer_;
  StreamId stream_ = 0;
};

TEST_F(BlockCommandIssuerTest, EvictedBlocksAreFreed) {
  ASSERT_TRUE(index_->Insert(ns_, Prompt({1}), host_, std::vector<BlockId>{40}).ok());
  ASSERT_TRUE(index_->EvictFromPool(host_, spec_.BytesPerPage()).ok());
  const FreeBlocksCommand free = NextFree();
  EXPECT_EQ(free.tier, Tier::kHost);
  EXPECT_THAT(free.block_ids, ElementsAre(40));
  EXPECT_FALSE(book_.TakeNext(stream_).has_value());
}

TEST_F(BlockCommandIssuerTest, ADemoteAckAssignsTheHostBlocks) {
  const AgentCommand demote = Demote();
  EXPECT_THAT(std::get<DemoteBlocksCommand>(demote.body).source_block_ids, ElementsAre(0, 1));
  EXPECT_THAT(HostBlocks(Prompt({1, 2})), ElementsAre(kPendingBlock, kPendingBlock));
  ASSERT_TRUE(
      book_.OnAck(stream_, AgentCommandAck{.sequence = demote.sequence, .block_ids = {30, 31}})
          .ok());
  EXPECT_THAT(HostBlocks(Prompt({1, 2})), ElementsAre(30, 31));
  const FreeBlocksCommand gpu_free = NextFree();  // the GPU copies, from the eviction
  EXPECT_EQ(gpu_free.tier, Tier::kGpu);
  EXPECT_THAT(gpu_free.block_ids, ElementsAre(1));
  EXPECT_FALSE(book_.TakeNext(stream_).has_value());  // nothing left over to free
}

TEST_F(BlockCommandIssuerTest, HostBlocksTheIndexNoLongerWantsAreFreed) {
  const AgentCommand demote = Demote();
  // The pending pages leave the HOST pool before the agent answers.
  ASSERT_TRUE(index_->EvictFromPool(host_, 2 * spec_.BytesPerPage()).ok());
  ASSERT_TRUE(
      book_.OnAck(stream_, AgentCommandAck{.sequence = demote.sequence, .block_ids = {30, 31}})
          .ok());
  EXPECT_TRUE(HostBlocks(Prompt({1, 2})).empty());
  EXPECT_EQ(NextFree().tier, Tier::kGpu);
  const FreeBlocksCommand follow_up = NextFree();
  EXPECT_EQ(follow_up.tier, Tier::kHost);
  EXPECT_THAT(follow_up.block_ids, ElementsAre(30, 31));
}

TEST_F(BlockCommandIssuerTest, AFailedDemoteAbandonsThePendingPages) {
  const AgentCommand demote = Demote();
  ASSERT_TRUE(book_
                  .OnAck(stream_, AgentCommandAck{.sequence = demote.sequence,
                                                  .status = absl::ResourceExhaustedError("full")})
                  .ok());
  EXPECT_TRUE(HostBlocks(Prompt({1, 2})).empty());
  EXPECT_EQ(NextFree().tier, Tier::kGpu);
  EXPECT_FALSE(book_.TakeNext(stream_).has_value());
}

TEST_F(BlockCommandIssuerTest, AMalformedDemoteAckIsUndoneAndItsBlocksFreed) {
  const AgentCommand demote = Demote();
  ASSERT_TRUE(
      book_.OnAck(stream_, AgentCommandAck{.sequence = demote.sequence, .block_ids = {30}}).ok());
  EXPECT_TRUE(HostBlocks(Prompt({1, 2})).empty());
  EXPECT_EQ(NextFree().tier, Tier::kGpu);
  const FreeBlocksCommand follow_up = NextFree();
  EXPECT_EQ(follow_up.tier, Tier::kHost);
  EXPECT_THAT(follow_up.block_ids, ElementsAre(30));
}

TEST_F(BlockCommandIssuerTest, ADemoteThatDiesWithItsEpochChangesNothing) {
  Demote();
  book_.OnRegistered("gpu-0", 2);  // the agent restarted; the manager drops its pools itself
  EXPECT_EQ(book_.unacked_commands("gpu-0"), 0u);
  EXPECT_THAT(HostBlocks(Prompt({1, 2})), ElementsAre(kPendingBlock, kPendingBlock));
}

}  // namespace
}  // namespace kvcm
