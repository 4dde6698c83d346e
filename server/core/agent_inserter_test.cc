#include "server/core/agent_inserter.h"

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using StreamId = AgentCommandBook::StreamId;

constexpr uint32_t kPage = 4;  // tokens per page
constexpr uint64_t kEpoch = 7;
constexpr uint64_t kBlocks = 16;

// Runs `f` on a thread of its own and says whether it returned within `timeout`. A call that
// does not (blocked on a lock another thread holds) is left running: the test has failed.
bool ReturnsWithin(std::function<void()> f, absl::Duration timeout = absl::Seconds(10)) {
  auto returned = std::make_shared<absl::Notification>();
  std::thread([f = std::move(f), returned] {
    f();
    returned->Notify();
  }).detach();
  return returned->WaitForNotificationWithTimeout(timeout);
}

class NullStream : public CommandStream {
 public:
  void Wake() override {}
  void End(const absl::Status&) override {}
};

// The inserter between a real CacheIndex, AgentRegistry and AgentCommandBook; the test plays
// the agent by taking commands from the book and acking them.
class AgentInserterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(
        CacheIndexOptions{.hash_secret = HashKey{3, 4}, .clock = &clock_});
    ASSERT_TRUE(index_->RegisterModel(ns_, spec_).ok());
    ASSERT_TRUE(index_->SetPoolCapacity(gpu_, kBlocks * spec_.BytesPerPage()).ok());
    AgentRegistration r{.agent_id = "gpu-0",
                        .tier = Tier::kGpu,
                        .epoch = kEpoch,
                        .capacity_bytes = kBlocks * spec_.BytesPerPage(),
                        .bytes_per_block = spec_.BytesPerPage(),
                        .num_blocks = kBlocks};
    ASSERT_TRUE(agents_.Register(r).ok());
    book_.OnRegistered("gpu-0", kEpoch);
    absl::StatusOr<StreamId> id = book_.Attach("gpu-0", kEpoch, std::make_shared<NullStream>());
    ASSERT_TRUE(id.ok());
    stream_ = *id;
    inserter_ = std::make_unique<AgentInserter>(index_.get(), &book_, &agents_);
  }
  void TearDown() override {
    book_.Detach(stream_);
    book_.Close();
  }

  std::vector<PageHash> Prompt(std::vector<int32_t> page_ids) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns_, tokens);
  }

  // Starts an insert; its answer lands in *out.
  void Start(std::vector<int32_t> page_ids, std::vector<BlockId> blocks,
             std::optional<absl::StatusOr<InsertResult>>* out, uint64_t agent_epoch = 0,
             PoolKey pool = {"gpu-0", Tier::kGpu}) {
    inserter_->Insert(InsertCommand{.ns = ns_,
                                    .pages = Prompt(page_ids),
                                    .pool = pool,
                                    .block_ids = std::move(blocks),
                                    .agent_epoch = agent_epoch},
                      [out](absl::StatusOr<InsertResult> r) { *out = std::move(r); });
  }

  // The next command for the agent, which must be of type T.
  template <typename T>
  std::pair<uint64_t, T> Next() {
    std::optional<AgentCommand> c = book_.TakeNext(stream_);
    if (!c.has_value() || !std::holds_alternative<T>(c->body)) {
      ADD_FAILURE() << "not the command expected next";
      return {0, T{}};
    }
    return {c->sequence, std::get<T>(c->body)};
  }
  void Ack(uint64_t sequence, absl::Status status = absl::OkStatus(),
           std::vector<BlockId> blocks = {}) {
    ASSERT_TRUE(book_
                    .OnAck(stream_, AgentCommandAck{.sequence = sequence,
                                                    .status = std::move(status),
                                                    .block_ids = std::move(blocks)})
                    .ok());
  }

  // Block ids of the GPU replica of the leading pages of `page_ids` the index holds.
  std::vector<BlockId> Indexed(std::vector<int32_t> page_ids) {
    absl::StatusOr<MatchResult> m = index_->Match(ns_, Prompt(page_ids), {.probe = true});
    std::vector<BlockId> out;
    if (!m.ok()) return out;
    for (const MatchedSegment& s : m->segments) {
      for (const MatchedReplica& r : m->Replicas(s)) {
        if (*r.pool != gpu_) continue;
        const std::span<const BlockId> ids = m->BlockIds(s, r);
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    return out;
  }

  FakeClock clock_;
  const NamespaceId ns_{"acme", "tiny"};
  const ModelSpec spec_{.attention = AttentionKind::kMla,
                        .num_layers = 2,
                        .num_heads = 4,
                        .kv_lora_rank = 16,
                        .rope_dim = 8,
                        .dtype = KvDtype::kBf16,
                        .page_size_tokens = kPage};
  const PoolKey gpu_{"gpu-0", Tier::kGpu};
  std::unique_ptr<CacheIndex> index_;
  AgentRegistry agents_{&clock_, absl::Seconds(10)};
  AgentCommandBook book_;
  std::unique_ptr<AgentInserter> inserter_;
  StreamId stream_ = 0;
};

TEST_F(AgentInserterTest, IndexesThePagesOnlyAfterTheAgentCommitsThem) {
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1, 2}, {3, 5}, &out, kEpoch);
  EXPECT_FALSE(out.has_value());
  EXPECT_TRUE(Indexed({1, 2}).empty());
  auto [seq, commit] = Next<CommitBlocksCommand>();
  EXPECT_EQ(commit.ns, ns_);
  EXPECT_EQ(commit.spec, spec_);
  EXPECT_THAT(commit.block_ids, ElementsAre(3, 5));
  EXPECT_EQ(commit.pages, Prompt({1, 2}));
  EXPECT_EQ(commit.first_parent, PageHash{});

  Ack(seq, absl::OkStatus(), {3, 5});
  ASSERT_TRUE(out.has_value());
  ASSERT_TRUE(out->ok()) << out->status();
  EXPECT_EQ((*out)->new_pages, 2u);
  EXPECT_THAT(Indexed({1, 2}), ElementsAre(3, 5));
  EXPECT_EQ(book_.unacked_commands("gpu-0"), 0u);  // no release needed
}

TEST_F(AgentInserterTest, RefusesWhatTheManagerCanCheckWithoutAskingTheAgent) {
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1, 2}, {3, kBlocks}, &out);
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out->status().message(), HasSubstr("block_ids[1] = 16 is past pool"));

  out.reset();
  Start({1, 2}, {3, 4}, &out, kEpoch - 1);
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(out->status().message(), HasSubstr("agent_epoch 6"));

  // A namespace whose pages are not the pool's block size (a Llama page in an MLA pool).
  const NamespaceId llama{"other", "llama"};
  ModelSpec big = spec_;
  big.attention = AttentionKind::kMha;
  big.num_kv_heads = 4;
  big.head_dim = 64;
  ASSERT_TRUE(index_->RegisterModel(llama, big).ok());
  out.reset();
  inserter_->Insert(
      InsertCommand{
          .ns = llama, .pages = std::vector<PageHash>{{1, 2}}, .pool = gpu_, .block_ids = {0}},
      [&out](absl::StatusOr<InsertResult> r) { out = std::move(r); });
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out->status().message(), HasSubstr("namespace other/llama has pages of"));

  EXPECT_EQ(book_.unacked_commands("gpu-0"), 0u);  // the agent was never asked
  EXPECT_EQ(index_->Stats().counters.inserted_pages, 0u);
}

TEST_F(AgentInserterTest, TheAgentsRefusalIsTheAnswerAndNothingIsIndexed) {
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1, 2}, {3, 5}, &out);
  auto [seq, commit] = Next<CommitBlocksCommand>();
  Ack(seq, absl::FailedPreconditionError("block_ids[1]: block 5 is allocated to namespace x/y"));
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(out->status().message(), HasSubstr("block_ids[1]"));
  EXPECT_TRUE(Indexed({1, 2}).empty());
  EXPECT_EQ(book_.unacked_commands("gpu-0"), 0u);
}

TEST_F(AgentInserterTest, DuplicatesGoBackToTheirAllocatorBeforeTheAnswer) {
  std::optional<absl::StatusOr<InsertResult>> first, second;
  Start({1, 2}, {0, 1}, &first);
  auto [s1, c1] = Next<CommitBlocksCommand>();
  Ack(s1, absl::OkStatus(), {0, 1});
  ASSERT_TRUE(first.has_value() && first->ok());

  // Another worker stored the same prompt, plus one page, in blocks 2, 3, 4.
  Start({1, 2, 3}, {2, 3, 4}, &second);
  auto [s2, c2] = Next<CommitBlocksCommand>();
  Ack(s2, absl::OkStatus(), {2, 3, 4});
  EXPECT_FALSE(second.has_value());  // waits for the release
  auto [s3, release] = Next<ReleaseBlocksCommand>();
  EXPECT_THAT(release.block_ids, ElementsAre(2, 3));
  EXPECT_FALSE(second.has_value());
  Ack(s3);
  ASSERT_TRUE(second.has_value());
  ASSERT_TRUE(second->ok()) << second->status();
  EXPECT_EQ((*second)->already_present_pages, 2u);
  EXPECT_THAT((*second)->existing_block_ids, ElementsAre(0, 1));
  EXPECT_THAT(Indexed({1, 2, 3}), ElementsAre(0, 1, 4));
}

TEST_F(AgentInserterTest, ABlockCommittedEarlierCannotAddAPageThePoolLost) {
  // The agent answers that it had committed block 9 to this page before (not newly): the
  // pool evicted the page and the block's FreeBlocks is on its way.
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1}, {9}, &out);
  auto [seq, commit] = Next<CommitBlocksCommand>();
  Ack(seq, absl::OkStatus(), {});
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(out->status().message(), HasSubstr("block_ids[0]: block 9"));
  EXPECT_TRUE(Indexed({1}).empty());
  EXPECT_EQ(book_.unacked_commands("gpu-0"), 0u);  // nothing of ours to release
}

TEST_F(AgentInserterTest, AnEpochThatEndsBeforeTheAckIndexesNothing) {
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1}, {2}, &out);
  book_.OnRegistered("gpu-0", kEpoch + 1);
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(Indexed({1}).empty());
}

TEST_F(AgentInserterTest, APoolDroppedWhileTheAgentCommittedIsNotFilledAndTheBlocksAreReleased) {
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1}, {2}, &out);
  auto [seq, commit] = Next<CommitBlocksCommand>();
  ASSERT_TRUE(index_->DropPool(gpu_).ok());
  Ack(seq, absl::OkStatus(), {2});
  auto [rs, release] = Next<ReleaseBlocksCommand>();
  EXPECT_THAT(release.block_ids, ElementsAre(2));
  EXPECT_FALSE(out.has_value());
  Ack(rs);
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(Indexed({1}).empty());
}

TEST_F(AgentInserterTest, WhenTheIndexRefusesEveryNewlyCommittedBlockIsReleased) {
  // Fill the pool with pinned pages so the insert cannot make room.
  std::optional<absl::StatusOr<InsertResult>> out;
  std::vector<int32_t> fill;
  std::vector<BlockId> blocks;
  for (BlockId b = 0; b < kBlocks; ++b) {
    fill.push_back(100 + static_cast<int32_t>(b));
    blocks.push_back(b);
  }
  Start(fill, blocks, &out);
  auto [s1, c1] = Next<CommitBlocksCommand>();
  Ack(s1, absl::OkStatus(), blocks);
  ASSERT_TRUE(out.has_value() && out->ok());
  ASSERT_TRUE(index_->Match(ns_, Prompt(fill), {.pin = true}).ok());

  out.reset();
  Start({1}, {0}, &out);  // block 0 is committed: the agent would refuse; say it did not
  auto [s2, c2] = Next<CommitBlocksCommand>();
  Ack(s2, absl::OkStatus(), {0});
  auto [s3, release] = Next<ReleaseBlocksCommand>();
  EXPECT_THAT(release.block_ids, ElementsAre(0));
  Ack(s3);
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->status().code(), absl::StatusCode::kResourceExhausted);
}

// No lock of the index is held while an insert waits for its agent (no lock across a network
// wait): with the commit sent and not acknowledged, other threads insert into another pool,
// take and drop a pin (the index's writer lock) and read; and the completion, which runs on
// the thread that delivers the ack, holds none either, so what it calls may use the index.
TEST_F(AgentInserterTest, NoIndexLockIsHeldWhileTheAgentCommits) {
  std::optional<absl::StatusOr<InsertResult>> pinnable;
  Start({7}, {1}, &pinnable);
  auto [s0, c0] = Next<CommitBlocksCommand>();
  Ack(s0, absl::OkStatus(), {1});
  ASSERT_TRUE(pinnable.has_value() && pinnable->ok());

  const PoolKey no_agent{"no-agent", Tier::kGpu};
  auto use_the_index = [&](int32_t page, BlockId block) {
    EXPECT_TRUE(index_->Insert(ns_, Prompt({page}), no_agent, std::vector<BlockId>{block}).ok());
    absl::StatusOr<MatchResult> m = index_->Match(ns_, Prompt({7}), {.pin = true});
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_NE(m->pin_id, 0u);
    EXPECT_TRUE(index_->Release(ns_, m->pin_id).ok());
    EXPECT_GE(index_->Stats().namespaces.size(), 1u);
  };
  std::optional<absl::StatusOr<InsertResult>> out;
  bool index_free_in_completion = false;
  inserter_->Insert(
      InsertCommand{.ns = ns_, .pages = Prompt({1, 2}), .pool = gpu_, .block_ids = {3, 5}},
      [&](absl::StatusOr<InsertResult> r) {
        index_free_in_completion = ReturnsWithin([&] { use_the_index(21, 43); });
        out = std::move(r);
      });
  auto [seq, commit] = Next<CommitBlocksCommand>();  // sent; the agent has not answered
  EXPECT_TRUE(ReturnsWithin([&] { use_the_index(20, 42); }));
  EXPECT_FALSE(out.has_value());

  Ack(seq, absl::OkStatus(), {3, 5});
  ASSERT_TRUE(out.has_value());
  ASSERT_TRUE(out->ok()) << out->status();
  EXPECT_TRUE(index_free_in_completion);
  EXPECT_THAT(Indexed({1, 2}), ElementsAre(3, 5));
}

TEST_F(AgentInserterTest, AnIndexOnlyPoolGoesStraightToTheIndex) {
  std::optional<absl::StatusOr<InsertResult>> out;
  Start({1}, {42}, &out, 0, PoolKey{"no-agent", Tier::kGpu});
  ASSERT_TRUE(out.has_value());
  ASSERT_TRUE(out->ok()) << out->status();
  EXPECT_EQ(book_.unacked_commands("gpu-0"), 0u);
}

}  // namespace
}  // namespace kvcm
