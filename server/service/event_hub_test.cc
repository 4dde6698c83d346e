#include "server/service/event_hub.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

// Counts wake-ups; lets a test wait for the next one.
class CountingSink final : public EventSink {
 public:
  void OnEventsReady() override {
    absl::MutexLock lock(&mu_);
    ++wakes_;
  }
  // Waits up to 5 s for at least `n` wake-ups.
  bool WaitForWakes(int n) {
    absl::MutexLock lock(&mu_);
    auto done = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wakes_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(5));
  }
  int wakes() {
    absl::MutexLock lock(&mu_);
    return wakes_;
  }

 private:
  absl::Mutex mu_;
  int wakes_ ABSL_GUARDED_BY(mu_) = 0;
};

CacheEvent Stored(const NamespaceId& ns, uint64_t page) {
  return CacheEvent{
      CacheEvent::Kind::kStored, ns, PoolKey{"gpu-0", Tier::kGpu}, {PageHash{page, ~page}}};
}

const NamespaceId kA{"tenant-a", "m"};
const NamespaceId kB{"tenant-b", "m"};

TEST(EventHubTest, SequencesArePerSubscriptionAndStartAtOne) {
  EventHub hub(16);
  hub.Publish(Stored(kA, 1));  // no subscriber yet: counted, not queued
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> sub = hub.Subscribe({}, sink);
  hub.Publish(Stored(kB, 2));
  hub.Publish(Stored(kA, 3));
  EXPECT_EQ(hub.published(), 3u);

  EventSubscription::Next first = sub->Pop();
  ASSERT_EQ(first.state, EventSubscription::State::kEvent);
  EXPECT_EQ(first.event->sequence(), 1u);
  EXPECT_EQ(first.event->namespace_().tenant(), "tenant-b");
  EXPECT_EQ(first.event->kind(), v1::CacheEvent::KIND_STORED);
  EventSubscription::Next second = sub->Pop();
  ASSERT_EQ(second.state, EventSubscription::State::kEvent);
  EXPECT_EQ(second.event->sequence(), 2u);
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kEmpty);
}

// A tenant's subscriber numbers only the events it sees: however many events another
// tenant causes between two of its own, its sequence has no gap to count them by.
TEST(EventHubTest, ATenantsSequenceHasNoGapsForOtherTenantsEvents) {
  EventHub hub(64);
  auto sink = std::make_shared<CountingSink>();
  auto reader = [](std::string tenant) {
    return std::make_shared<const Principal>(
        Principal{.name = tenant, .roles = static_cast<uint8_t>(Role::kWorker), .tenant = tenant});
  };
  std::shared_ptr<EventSubscription> a = hub.Subscribe({.reader = reader("tenant-a")}, sink);
  std::shared_ptr<EventSubscription> b = hub.Subscribe({.reader = reader("tenant-b")}, sink);
  std::shared_ptr<EventSubscription> all = hub.Subscribe({}, sink);  // an admin
  hub.Publish(Stored(kA, 1));
  for (int i = 0; i < 7; ++i) hub.Publish(Stored(kB, 10 + i));
  hub.Publish(Stored(kA, 2));
  for (uint64_t want : {1u, 2u}) {
    EventSubscription::Next next = a->Pop();
    ASSERT_EQ(next.state, EventSubscription::State::kEvent);
    EXPECT_EQ(next.event->namespace_().tenant(), "tenant-a");
    EXPECT_EQ(next.event->sequence(), want) << "no gap for tenant-b's 7 events";
  }
  EXPECT_EQ(a->Pop().state, EventSubscription::State::kEmpty);
  for (uint64_t want = 1; want <= 7; ++want) {
    EventSubscription::Next next = b->Pop();
    ASSERT_EQ(next.state, EventSubscription::State::kEvent);
    EXPECT_EQ(next.event->sequence(), want);
  }
  EXPECT_EQ(b->Pop().state, EventSubscription::State::kEmpty);
  for (uint64_t want = 1; want <= 9; ++want) {
    EventSubscription::Next next = all->Pop();
    ASSERT_EQ(next.state, EventSubscription::State::kEvent);
    EXPECT_EQ(next.event->sequence(), want);
  }
}

TEST(EventHubTest, NamespaceFilter) {
  EventHub hub(16);
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> only_a = hub.Subscribe({.ns = kA}, sink);
  hub.Publish(Stored(kB, 1));
  hub.Publish(Stored(kA, 2));
  EventSubscription::Next next = only_a->Pop();
  ASSERT_EQ(next.state, EventSubscription::State::kEvent);
  EXPECT_EQ(next.event->namespace_().tenant(), "tenant-a");
  EXPECT_EQ(next.event->sequence(), 1u);  // the filtered-out event took no number
  EXPECT_EQ(only_a->Pop().state, EventSubscription::State::kEmpty);
}

TEST(EventHubTest, ArmedSubscriptionIsWokenOncePerArming) {
  EventHub hub(16);
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> sub = hub.Subscribe({}, sink);
  hub.Publish(Stored(kA, 1));  // starts armed: wakes
  ASSERT_TRUE(sink->WaitForWakes(1));
  hub.Publish(Stored(kA, 2));  // not re-armed yet: no second wake
  EXPECT_EQ(sub->queued(), 2u);
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kEvent);
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kEvent);
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kEmpty);  // re-arms
  hub.Publish(Stored(kA, 3));
  ASSERT_TRUE(sink->WaitForWakes(2));
  hub.Stop();
  EXPECT_EQ(sink->wakes(), 2);
}

TEST(EventHubTest, OverflowDropsTheQueueAndEndsTheSubscription) {
  EventHub hub(2);
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> sub = hub.Subscribe({}, sink);
  for (uint64_t i = 0; i < 3; ++i) hub.Publish(Stored(kA, i));
  EXPECT_EQ(hub.overflows(), 1u);
  EXPECT_EQ(sub->queued(), 0u);
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kOverflowed);
  hub.Publish(Stored(kA, 9));
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kOverflowed);
  EXPECT_EQ(hub.overflows(), 1u);
}

TEST(EventHubTest, CloseDrainsThenCloses) {
  EventHub hub(8);
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> sub = hub.Subscribe({}, sink);
  hub.Publish(Stored(kA, 1));
  hub.Close();
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kEvent);
  EXPECT_EQ(sub->Pop().state, EventSubscription::State::kClosed);
  std::shared_ptr<EventSubscription> late = hub.Subscribe({}, sink);
  EXPECT_EQ(late->Pop().state, EventSubscription::State::kClosed);
  EXPECT_EQ(hub.subscribers(), 1u);  // `late` was never added
}

TEST(EventHubTest, UnsubscribeStopsQueueing) {
  EventHub hub(8);
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> sub = hub.Subscribe({}, sink);
  EXPECT_EQ(hub.subscribers(), 1u);
  hub.Unsubscribe(sub.get());
  hub.Unsubscribe(sub.get());  // idempotent
  EXPECT_EQ(hub.subscribers(), 0u);
  hub.Publish(Stored(kA, 1));
  EXPECT_EQ(sub->queued(), 0u);
}

TEST(EventHubTest, DeadSinkIsNotWoken) {
  EventHub hub(8);
  auto sink = std::make_shared<CountingSink>();
  std::shared_ptr<EventSubscription> sub = hub.Subscribe({}, sink);
  std::weak_ptr<CountingSink> weak = sink;
  sink.reset();  // the stream ended without unsubscribing
  hub.Publish(Stored(kA, 1));
  hub.Stop();  // delivers the wake-up to nobody, without crashing
  EXPECT_TRUE(weak.expired());
  EXPECT_EQ(sub->queued(), 1u);
}

}  // namespace
}  // namespace kvcm
