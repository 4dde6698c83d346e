#include "server/service/nccl_bootstrap_relay.h"

#include <atomic>
#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

class CountingStream final : public CommandStream {
 public:
  void Wake() override { ++wakes; }
  void End(const absl::Status& /*status*/) override { ++ends; }
  std::atomic<int> wakes{0};
  std::atomic<int> ends{0};
};

NcclLinkOffer Offer(uint64_t link_id) {
  return NcclLinkOffer{.from_agent_id = "gpu-0",
                       .link_id = link_id,
                       .unique_id = std::string(kNcclUniqueIdBytes, static_cast<char>(link_id))};
}

TEST(NcclBootstrapRelay, OffersReachTheOpenStreamInOrderAndWakeIt) {
  NcclBootstrapRelay relay;
  relay.OnRegistered("gpu-1", 7, "nccl");
  auto stream = std::make_shared<CountingStream>();
  const auto id = relay.Attach("gpu-1", 7, stream);
  ASSERT_TRUE(relay.Relay("gpu-1", 7, Offer(1)).ok());
  ASSERT_TRUE(relay.Relay("gpu-1", 7, Offer(2)).ok());
  EXPECT_EQ(stream->wakes, 2);
  EXPECT_EQ(relay.queued("gpu-1"), 2u);
  std::optional<NcclLinkOffer> first = relay.TakeNext(id);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->link_id, 1u);
  EXPECT_EQ(first->unique_id, std::string(kNcclUniqueIdBytes, '\1'));
  EXPECT_EQ(first->rank, 1);
  EXPECT_EQ(first->peer_rank, 0);
  EXPECT_EQ(first->nranks, 2);
  EXPECT_EQ(relay.TakeNext(id)->link_id, 2u);
  EXPECT_FALSE(relay.TakeNext(id).has_value());
}

TEST(NcclBootstrapRelay, RefusalsQueueNothing) {
  NcclBootstrapRelay relay(/*max_offers_per_agent=*/1);
  // Unknown, TCP-registered, or another epoch: FAILED_PRECONDITION.
  EXPECT_EQ(relay.Relay("gpu-1", 7, Offer(1)).code(), absl::StatusCode::kFailedPrecondition);
  relay.OnRegistered("gpu-1", 7, "tcp");
  auto stream = std::make_shared<CountingStream>();
  relay.Attach("gpu-1", 7, stream);
  EXPECT_EQ(relay.Relay("gpu-1", 7, Offer(1)).code(), absl::StatusCode::kFailedPrecondition);
  relay.OnRegistered("gpu-1", 7, "");
  EXPECT_EQ(relay.Relay("gpu-1", 7, Offer(1)).code(), absl::StatusCode::kFailedPrecondition);
  relay.OnRegistered("gpu-1", 7, "nccl");
  EXPECT_EQ(relay.Relay("gpu-1", 6, Offer(1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(relay.queued("gpu-1"), 0u);
  EXPECT_EQ(stream->wakes, 0);
  // Full: RESOURCE_EXHAUSTED, the first offer stays alone.
  ASSERT_TRUE(relay.Relay("gpu-1", 7, Offer(1)).ok());
  EXPECT_EQ(relay.Relay("gpu-1", 7, Offer(2)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(relay.queued("gpu-1"), 1u);
}

TEST(NcclBootstrapRelay, NoStreamIsUnavailableAndAnEndedStreamDropsItsOffers) {
  NcclBootstrapRelay relay;
  relay.OnRegistered("gpu-1", 7, "nccl");
  EXPECT_EQ(relay.Relay("gpu-1", 7, Offer(1)).code(), absl::StatusCode::kUnavailable);
  auto old_stream = std::make_shared<CountingStream>();
  const auto old_id = relay.Attach("gpu-1", 7, old_stream);
  ASSERT_TRUE(relay.Relay("gpu-1", 7, Offer(1)).ok());
  // A newer stream of the same epoch takes over the waiting offers; the old one gets none.
  auto stream = std::make_shared<CountingStream>();
  const auto id = relay.Attach("gpu-1", 7, stream);
  EXPECT_FALSE(relay.TakeNext(old_id).has_value());
  relay.Detach(old_id);  // late detach of the replaced stream: harmless
  EXPECT_EQ(relay.queued("gpu-1"), 1u);
  EXPECT_EQ(relay.TakeNext(id)->link_id, 1u);
  ASSERT_TRUE(relay.Relay("gpu-1", 7, Offer(2)).ok());
  relay.Detach(id);
  EXPECT_EQ(relay.queued("gpu-1"), 0u);
  EXPECT_EQ(relay.Relay("gpu-1", 7, Offer(3)).code(), absl::StatusCode::kUnavailable);
}

TEST(NcclBootstrapRelay, ANewEpochOrForgetDropsOffers) {
  NcclBootstrapRelay relay;
  relay.OnRegistered("gpu-1", 7, "nccl");
  relay.Attach("gpu-1", 7, std::make_shared<CountingStream>());
  ASSERT_TRUE(relay.Relay("gpu-1", 7, Offer(1)).ok());
  relay.OnRegistered("gpu-1", 8, "nccl");
  EXPECT_EQ(relay.queued("gpu-1"), 0u);
  // The open stream belongs to epoch 7: no offer for epoch 8 goes to it.
  EXPECT_EQ(relay.Relay("gpu-1", 8, Offer(2)).code(), absl::StatusCode::kUnavailable);
  const auto id = relay.Attach("gpu-1", 8, std::make_shared<CountingStream>());
  ASSERT_TRUE(relay.Relay("gpu-1", 8, Offer(3)).ok());
  relay.Forget("gpu-1");
  EXPECT_EQ(relay.queued("gpu-1"), 0u);
  EXPECT_FALSE(relay.TakeNext(id).has_value());
  EXPECT_FALSE(relay.IsNccl("gpu-1", 8));
}

}  // namespace
}  // namespace kvcm
