#include "server/core/agent_command_book.h"

#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using StreamId = AgentCommandBook::StreamId;

// Records what the book asks of it.
class FakeStream : public CommandStream {
 public:
  void Wake() override { ++wakes; }
  void End(const absl::Status& status) override { ends.push_back(status); }

  int wakes = 0;
  std::vector<absl::Status> ends;
};

FreeBlocksCommand Free(BlockId id) { return FreeBlocksCommand{.block_ids = {id}}; }

// A completion that appends what it is given to `*results`.
CommandCompletion Record(std::vector<absl::StatusOr<AgentCommandAck>>* results) {
  return [results](const absl::StatusOr<AgentCommandAck>& r) { results->push_back(r); };
}

class AgentCommandBookTest : public ::testing::Test {
 protected:
  explicit AgentCommandBookTest(size_t max_queued = 4096)
      : book_(AgentCommandBookOptions{
            .max_queued_commands = max_queued,
            .on_command_end = [this](CommandEnd end) { ends_.push_back(end); }}) {}

  StreamId MustAttach(const std::string& agent, uint64_t epoch,
                      const std::shared_ptr<FakeStream>& stream) {
    absl::StatusOr<StreamId> id = book_.Attach(agent, epoch, stream);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.value_or(0);
  }

  std::vector<uint64_t> Drain(StreamId stream) {
    std::vector<uint64_t> sequences;
    while (std::optional<AgentCommand> c = book_.TakeNext(stream)) {
      sequences.push_back(c->sequence);
    }
    return sequences;
  }

  // Declared before book_: the book completes what is left when it is destroyed.
  std::vector<CommandEnd> ends_;
  std::vector<absl::StatusOr<AgentCommandAck>> results_;
  AgentCommandBook book_;
};

TEST_F(AgentCommandBookTest, EnqueueNeedsAnAgentInTheRightEpoch) {
  EXPECT_EQ(book_.Enqueue("a", AgentCommandBook::kCurrentEpoch, Free(1), nullptr).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(book_.epoch("a"), 0u);
  book_.OnRegistered("a", 3);
  EXPECT_EQ(book_.epoch("a"), 3u);
  EXPECT_EQ(*book_.Enqueue("a", AgentCommandBook::kCurrentEpoch, Free(1), nullptr), 1u);
  EXPECT_EQ(*book_.Enqueue("a", 3, Free(2), nullptr), 2u);
  EXPECT_EQ(book_.Enqueue("a", 2, Free(3), nullptr).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(book_.unacked_commands("a"), 2u);
  EXPECT_TRUE(ends_.empty());
}

TEST_F(AgentCommandBookTest, CommandsWaitForAStreamAndAreResentOnReattach) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), nullptr).ok());
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(2), nullptr).ok());

  auto first = std::make_shared<FakeStream>();
  const StreamId s1 = MustAttach("a", 1, first);
  EXPECT_EQ(book_.open_streams(), 1u);
  EXPECT_THAT(Drain(s1), ElementsAre(1, 2));
  ASSERT_TRUE(book_.OnAck(s1, AgentCommandAck{.sequence = 1}).ok());
  book_.Detach(s1);  // broke before the second ack
  EXPECT_TRUE(first->ends.empty());
  EXPECT_EQ(book_.open_streams(), 0u);
  EXPECT_FALSE(book_.TakeNext(s1).has_value());

  const StreamId s2 = MustAttach("a", 1, std::make_shared<FakeStream>());
  std::optional<AgentCommand> resent = book_.TakeNext(s2);
  ASSERT_TRUE(resent.has_value());
  EXPECT_EQ(resent->sequence, 2u);
  EXPECT_EQ(resent->acked_through, 1u);
  ASSERT_TRUE(book_.OnAck(s2, AgentCommandAck{.sequence = 2}).ok());
  EXPECT_EQ(book_.unacked_commands("a"), 0u);
  EXPECT_THAT(ends_, ElementsAre(CommandEnd::kAcked, CommandEnd::kAcked));
}

TEST_F(AgentCommandBookTest, EnqueueWakesTheAttachedStream) {
  book_.OnRegistered("a", 1);
  auto stream = std::make_shared<FakeStream>();
  const StreamId id = MustAttach("a", 1, stream);
  EXPECT_EQ(stream->wakes, 0);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), nullptr).ok());
  EXPECT_EQ(stream->wakes, 1);
  EXPECT_THAT(Drain(id), ElementsAre(1));
}

TEST_F(AgentCommandBookTest, AcksCompleteCommandsAndCountTheirStatus) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), Record(&results_)).ok());
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(2), Record(&results_)).ok());
  const StreamId id = MustAttach("a", 1, std::make_shared<FakeStream>());
  Drain(id);
  ASSERT_TRUE(book_.OnAck(id, AgentCommandAck{.sequence = 1, .block_ids = {7}}).ok());
  ASSERT_TRUE(book_.OnAck(id, AgentCommandAck{.sequence = 1}).ok());  // a repeat: ignored
  ASSERT_TRUE(
      book_.OnAck(id, AgentCommandAck{.sequence = 2, .status = absl::InternalError("x")}).ok());
  ASSERT_EQ(results_.size(), 2u);
  ASSERT_TRUE(results_[0].ok());
  EXPECT_EQ(results_[0]->sequence, 1u);
  EXPECT_THAT(results_[0]->block_ids, ElementsAre(7));
  ASSERT_TRUE(results_[1].ok());
  EXPECT_EQ(results_[1]->status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(ends_, ElementsAre(CommandEnd::kAcked, CommandEnd::kFailed));
}

TEST_F(AgentCommandBookTest, AnAckOutOfOrderEndsTheStreamAndKeepsTheCommand) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), Record(&results_)).ok());
  auto stream = std::make_shared<FakeStream>();
  const StreamId id = MustAttach("a", 1, stream);
  Drain(id);
  absl::Status s = book_.OnAck(id, AgentCommandAck{.sequence = 5});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expected 1"));
  ASSERT_EQ(stream->ends.size(), 1u);
  EXPECT_EQ(stream->ends[0], s);
  EXPECT_EQ(book_.open_streams(), 0u);
  EXPECT_EQ(book_.unacked_commands("a"), 1u);  // still owed to the next stream
  EXPECT_TRUE(results_.empty());
  EXPECT_TRUE(book_.OnAck(id, AgentCommandAck{.sequence = 1}).ok());  // detached: ignored
  EXPECT_EQ(book_.unacked_commands("a"), 1u);
}

class BoundedBookTest : public AgentCommandBookTest {
 protected:
  BoundedBookTest() : AgentCommandBookTest(/*max_queued=*/2) {}
};

TEST_F(BoundedBookTest, AFullQueueRefusesTheCommandAndCountsItDropped) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), nullptr).ok());
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(2), nullptr).ok());
  bool ran = false;
  absl::StatusOr<uint64_t> refused =
      book_.Enqueue("a", 1, Free(3), [&](const absl::StatusOr<AgentCommandAck>&) { ran = true; });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(ran);  // the caller learnt it from Enqueue
  EXPECT_THAT(ends_, ElementsAre(CommandEnd::kDropped));
  EXPECT_EQ(book_.unacked_commands("a"), 2u);
}

TEST_F(AgentCommandBookTest, ANewEpochDropsTheOldOutbox) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), Record(&results_)).ok());
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(2), Record(&results_)).ok());
  auto stream = std::make_shared<FakeStream>();
  MustAttach("a", 1, stream);

  book_.OnRegistered("a", 1);  // the same epoch again changes nothing
  EXPECT_EQ(book_.unacked_commands("a"), 2u);
  EXPECT_TRUE(stream->ends.empty());

  book_.OnRegistered("a", 2);
  ASSERT_EQ(results_.size(), 2u);
  for (const auto& r : results_) EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(ends_, ElementsAre(CommandEnd::kDropped, CommandEnd::kDropped));
  ASSERT_EQ(stream->ends.size(), 1u);
  EXPECT_EQ(stream->ends[0].code(), absl::StatusCode::kAborted);
  EXPECT_EQ(book_.unacked_commands("a"), 0u);
  EXPECT_EQ(book_.open_streams(), 0u);

  // The old epoch is stale; the new one numbers from 1.
  EXPECT_EQ(book_.Attach("a", 1, std::make_shared<FakeStream>()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(book_.Enqueue("a", 1, Free(3), nullptr).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(*book_.Enqueue("a", 2, Free(3), nullptr), 1u);
}

TEST_F(AgentCommandBookTest, AStreamOfANewerEpochStartsIt) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), Record(&results_)).ok());
  const StreamId id = MustAttach("a", 2, std::make_shared<FakeStream>());  // raced ahead
  EXPECT_EQ(book_.epoch("a"), 2u);
  ASSERT_EQ(results_.size(), 1u);
  EXPECT_EQ(results_[0].status().code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(book_.Enqueue("a", 2, Free(2), nullptr).ok());
  EXPECT_THAT(Drain(id), ElementsAre(1));
}

TEST_F(AgentCommandBookTest, ANewerStreamReplacesTheOlder) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), nullptr).ok());
  auto old_stream = std::make_shared<FakeStream>();
  const StreamId old_id = MustAttach("a", 1, old_stream);
  Drain(old_id);
  const StreamId new_id = MustAttach("a", 1, std::make_shared<FakeStream>());
  ASSERT_EQ(old_stream->ends.size(), 1u);
  EXPECT_EQ(old_stream->ends[0].code(), absl::StatusCode::kAborted);
  EXPECT_EQ(book_.open_streams(), 1u);
  EXPECT_TRUE(book_.OnAck(old_id, AgentCommandAck{.sequence = 1}).ok());  // ignored
  EXPECT_EQ(book_.unacked_commands("a"), 1u);
  EXPECT_THAT(Drain(new_id), ElementsAre(1));
}

TEST_F(AgentCommandBookTest, ForgetDropsTheAgent) {
  book_.OnRegistered("a", 4);
  ASSERT_TRUE(book_.Enqueue("a", 4, Free(1), Record(&results_)).ok());
  auto stream = std::make_shared<FakeStream>();
  MustAttach("a", 4, stream);
  book_.Forget("a");
  ASSERT_EQ(results_.size(), 1u);
  EXPECT_EQ(results_[0].status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(ends_, ElementsAre(CommandEnd::kDropped));
  ASSERT_EQ(stream->ends.size(), 1u);
  EXPECT_EQ(stream->ends[0].code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(book_.epoch("a"), 0u);
  EXPECT_EQ(book_.open_streams(), 0u);
  EXPECT_EQ(book_.Enqueue("a", 4, Free(2), nullptr).status().code(), absl::StatusCode::kNotFound);
  book_.Forget("a");  // unknown: nothing
}

TEST_F(AgentCommandBookTest, CloseEndsEverythingWithUnavailable) {
  book_.OnRegistered("a", 1);
  ASSERT_TRUE(book_.Enqueue("a", 1, Free(1), Record(&results_)).ok());
  auto stream = std::make_shared<FakeStream>();
  MustAttach("a", 1, stream);
  book_.Close();
  book_.Close();
  ASSERT_EQ(results_.size(), 1u);
  EXPECT_EQ(results_[0].status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(ends_.empty());  // not counted as dropped
  ASSERT_EQ(stream->ends.size(), 1u);
  EXPECT_EQ(stream->ends[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(book_.Enqueue("a", 1, Free(2), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(book_.Attach("a", 1, stream).status().code(), absl::StatusCode::kUnavailable);
}

// Completions and stream callbacks run outside the book's lock: they may call the book.
TEST_F(AgentCommandBookTest, CompletionsMayCallTheBook) {
  book_.OnRegistered("a", 1);
  const StreamId id = MustAttach("a", 1, std::make_shared<FakeStream>());
  absl::StatusOr<uint64_t> follow_up;
  ASSERT_TRUE(book_
                  .Enqueue("a", 1, Free(1),
                           [&](const absl::StatusOr<AgentCommandAck>&) {
                             follow_up = book_.Enqueue("a", 1, Free(2), nullptr);
                           })
                  .ok());
  Drain(id);
  ASSERT_TRUE(book_.OnAck(id, AgentCommandAck{.sequence = 1}).ok());
  ASSERT_TRUE(follow_up.ok()) << follow_up.status();
  EXPECT_EQ(*follow_up, 2u);
  EXPECT_THAT(Drain(id), ElementsAre(2));
}

}  // namespace
}  // namespace kvcm
