// EventHub: fans the CacheIndex's events out to WatchEvents subscribers.
//
// Publish runs inside the CacheIndex's event listener, i.e. under the index lock, so it
// only numbers the event, encodes it once and appends a shared pointer to each matching
// subscriber's bounded queue; it never blocks on a subscriber and never calls into gRPC.
// A subscriber that was idle is woken by the hub's delivery thread, outside every lock.
// A subscriber whose queue is full is marked overflowed (its queue dropped) and its stream
// is ended with RESOURCE_EXHAUSTED; it should resubscribe.
//
// Thread-safe: every method may be called concurrently.
#ifndef KVCM_SERVER_SERVICE_EVENT_HUB_H_
#define KVCM_SERVER_SERVICE_EVENT_HUB_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/token_table.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "server/core/cache_index.h"

namespace kvcm {

// Receives "events are pending" wake-ups for one subscription. Implemented by the
// WatchEvents reactor; called on the hub's delivery thread with no hub lock held.
class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual void OnEventsReady() = 0;
};

class EventHub;

// Which events a subscription gets.
struct EventFilter {
  // Only this namespace's; every namespace when unset.
  std::optional<NamespaceId> ns;
  // Only namespaces of tenants this caller may probe (Principal::MayProbe); every tenant when
  // null (an admin, or the open dev-mode caller).
  std::shared_ptr<const Principal> reader;

  bool Matches(const NamespaceId& id) const {
    if (ns.has_value() && !(*ns == id)) return false;
    return reader == nullptr || reader->MayProbe(id.tenant);
  }
};

// One subscriber's queue. Created by EventHub::Subscribe; thread-safe.
class EventSubscription {
 public:
  enum class State { kEvent, kEmpty, kOverflowed, kClosed };
  struct Next {
    State state;
    std::shared_ptr<const v1::CacheEvent> event;  // set when state == kEvent
  };

  // Pops the oldest queued event, numbered in this subscription's own sequence (1, 2, ...
  // with no gaps, whatever other subscribers see). kOverflowed once the queue overflowed (queued
  // events are dropped), kClosed once the hub closed and the queue is drained. On kEmpty the
  // subscription is armed: the sink's OnEventsReady is called when something arrives.
  Next Pop() ABSL_LOCKS_EXCLUDED(mu_);

  // Events queued now.
  size_t queued() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class EventHub;
  EventSubscription(EventFilter filter, std::weak_ptr<EventSink> sink)
      : filter_(std::move(filter)), sink_(std::move(sink)) {}

  const EventFilter filter_;
  const std::weak_ptr<EventSink> sink_;

  // An event as encoded once for every subscriber (sequence unset), and its number here.
  struct Queued {
    std::shared_ptr<const v1::CacheEvent> event;
    uint64_t sequence = 0;
  };

  mutable absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  // Events queued so far: the last sequence handed out.
  uint64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  bool overflowed_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // The subscriber found the queue empty and waits for OnEventsReady.
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
};

class EventHub {
 public:
  // `max_queue`: events one subscriber may have queued before it overflows. >= 1.
  explicit EventHub(size_t max_queue);
  // Stops the delivery thread (see Stop).
  ~EventHub();
  EventHub(const EventHub&) = delete;
  EventHub& operator=(const EventHub&) = delete;

  // Queues `event` for every matching subscriber, each of which numbers it in its own
  // sequence (previous + 1, from 1): no subscriber sees a gap where events it may not see
  // were, so none learns other tenants' event volume. Quick and non-blocking: safe under
  // the index lock.
  void Publish(const CacheEvent& event) ABSL_LOCKS_EXCLUDED(mu_);

  // A new subscription to the events `filter` matches. It starts armed; `sink` is woken on
  // the delivery thread while it is alive. After Close the subscription is already closed.
  std::shared_ptr<EventSubscription> Subscribe(EventFilter filter, std::weak_ptr<EventSink> sink)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stops queueing for `sub`. Idempotent.
  void Unsubscribe(const EventSubscription* sub) ABSL_LOCKS_EXCLUDED(mu_);

  // Closes every subscription (each stream ends once its queue is drained) and refuses new
  // ones. The delivery thread keeps running so that the subscribers get woken.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);
  // Delivers pending wake-ups and joins the delivery thread. Idempotent; after it, sinks
  // are no longer woken.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  size_t subscribers() const ABSL_LOCKS_EXCLUDED(mu_);
  // Events published so far, manager-wide (for the operator's metrics only).
  uint64_t published() const ABSL_LOCKS_EXCLUDED(mu_);
  // Subscriptions ended because their queue overflowed.
  uint64_t overflows() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void DeliveryLoop() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !to_wake_.empty() || stopping_; }
  // Queues a wake-up of `sub` for the delivery thread.
  void Wake(std::shared_ptr<EventSubscription> sub) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_queue_;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<EventSubscription>> subs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<EventSubscription>> to_wake_ ABSL_GUARDED_BY(mu_);
  uint64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t overflows_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::once_flag stop_once_;
  std::thread delivery_;  // started in the constructor, joined by Stop
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_EVENT_HUB_H_
