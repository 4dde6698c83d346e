#include "server/core/command_outbox.h"

#include <optional>
#include <variant>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

FreeBlocksCommand Free(BlockId id) { return FreeBlocksCommand{.block_ids = {id}}; }

BlockId FirstBlock(const AgentCommand& c) {
  return std::get<FreeBlocksCommand>(c.body).block_ids.at(0);
}

// Sequences of the commands TakeNext gives until it has none.
std::vector<uint64_t> TakeAllSequences(CommandOutbox& outbox) {
  std::vector<uint64_t> out;
  while (std::optional<AgentCommand> c = outbox.TakeNext()) out.push_back(c->sequence);
  return out;
}

TEST(CommandOutboxTest, NumbersCommandsFromOneAndSendsThemInOrder) {
  CommandOutbox outbox(/*epoch=*/7, /*max_queued=*/10);
  EXPECT_EQ(outbox.epoch(), 7u);
  EXPECT_EQ(*outbox.Push(Free(10), nullptr), 1u);
  EXPECT_EQ(*outbox.Push(Free(11), nullptr), 2u);
  EXPECT_TRUE(outbox.has_unsent());
  std::optional<AgentCommand> first = outbox.TakeNext();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->sequence, 1u);
  EXPECT_EQ(FirstBlock(*first), 10u);
  EXPECT_EQ(first->acked_through, 0u);
  EXPECT_THAT(TakeAllSequences(outbox), ElementsAre(2));
  EXPECT_FALSE(outbox.has_unsent());
  EXPECT_EQ(outbox.unacked(), 2u);
}

TEST(CommandOutboxTest, RewindResendsFromTheFirstUnacked) {
  CommandOutbox outbox(1, 10);
  for (BlockId b : {1, 2, 3}) ASSERT_TRUE(outbox.Push(Free(b), nullptr).ok());
  EXPECT_THAT(TakeAllSequences(outbox), ElementsAre(1, 2, 3));
  ASSERT_TRUE(outbox.Ack(1).ok());
  outbox.Rewind();  // the stream broke: 2 and 3 go again, with what was acked since
  std::optional<AgentCommand> again = outbox.TakeNext();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->sequence, 2u);
  EXPECT_EQ(again->acked_through, 1u);
  EXPECT_THAT(TakeAllSequences(outbox), ElementsAre(3));
}

TEST(CommandOutboxTest, AnAckCompletesTheFirstUnackedOnceAndARepeatIsIgnored) {
  CommandOutbox outbox(1, 10);
  int runs = 0;
  ASSERT_TRUE(outbox.Push(Free(1), [&](const absl::StatusOr<AgentCommandAck>&) { ++runs; }).ok());
  ASSERT_TRUE(outbox.Push(Free(2), nullptr).ok());
  TakeAllSequences(outbox);

  absl::StatusOr<std::optional<CommandCompletion>> taken = outbox.Ack(1);
  ASSERT_TRUE(taken.ok());
  ASSERT_TRUE(taken->has_value());
  (**taken)(AgentCommandAck{.sequence = 1});
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(outbox.acked_through(), 1u);
  EXPECT_EQ(outbox.unacked(), 1u);

  taken = outbox.Ack(1);  // a repeat
  ASSERT_TRUE(taken.ok());
  EXPECT_FALSE(taken->has_value());
  EXPECT_EQ(outbox.unacked(), 1u);

  taken = outbox.Ack(2);  // a command queued without a completion
  ASSERT_TRUE(taken.ok());
  ASSERT_TRUE(taken->has_value());
  EXPECT_FALSE(**taken);
  EXPECT_EQ(outbox.acked_through(), 2u);
  EXPECT_EQ(outbox.unacked(), 0u);
}

TEST(CommandOutboxTest, AnAckOutOfOrderOrOfAnUnsentCommandIsRefused) {
  CommandOutbox outbox(1, 10);
  ASSERT_TRUE(outbox.Push(Free(1), nullptr).ok());
  ASSERT_TRUE(outbox.Push(Free(2), nullptr).ok());
  // Nothing sent yet: even the first sequence is not ackable.
  EXPECT_EQ(outbox.Ack(1).status().code(), absl::StatusCode::kInvalidArgument);
  TakeAllSequences(outbox);
  absl::StatusOr<std::optional<CommandCompletion>> skipped = outbox.Ack(2);
  EXPECT_EQ(skipped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(skipped.status().message(), HasSubstr("expected 1"));
  EXPECT_EQ(outbox.unacked(), 2u);  // nothing changed
  EXPECT_EQ(outbox.acked_through(), 0u);
  EXPECT_TRUE(outbox.Ack(1).ok());
}

TEST(CommandOutboxTest, PushBeyondTheBoundIsRefused) {
  CommandOutbox outbox(1, /*max_queued=*/2);
  ASSERT_TRUE(outbox.Push(Free(1), nullptr).ok());
  ASSERT_TRUE(outbox.Push(Free(2), nullptr).ok());
  bool ran = false;
  absl::StatusOr<uint64_t> refused =
      outbox.Push(Free(3), [&](const absl::StatusOr<AgentCommandAck>&) { ran = true; });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(ran);
  EXPECT_EQ(outbox.unacked(), 2u);
  // An ack makes room; the refused command used no sequence.
  TakeAllSequences(outbox);
  ASSERT_TRUE(outbox.Ack(1).ok());
  EXPECT_EQ(*outbox.Push(Free(3), nullptr), 3u);
}

TEST(CommandOutboxTest, TakeAllReturnsTheCompletionsInOrder) {
  CommandOutbox outbox(1, 10);
  std::vector<int> order;
  for (int i : {1, 2, 3}) {
    ASSERT_TRUE(
        outbox
            .Push(Free(i),
                  [&order, i](const absl::StatusOr<AgentCommandAck>&) { order.push_back(i); })
            .ok());
  }
  outbox.TakeNext();
  std::vector<CommandCompletion> done = outbox.TakeAll();
  ASSERT_EQ(done.size(), 3u);
  for (CommandCompletion& d : done) d(absl::AbortedError("epoch ended"));
  EXPECT_THAT(order, ElementsAre(1, 2, 3));
  EXPECT_EQ(outbox.unacked(), 0u);
  EXPECT_FALSE(outbox.TakeNext().has_value());
}

}  // namespace
}  // namespace kvcm
