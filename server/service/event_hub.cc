#include "server/service/event_hub.h"

#include <algorithm>
#include <utility>

#include "server/service/proto_convert.h"

namespace kvcm {

EventSubscription::Next EventSubscription::Pop() {
  absl::MutexLock lock(&mu_);
  if (!queue_.empty()) {
    Queued front = std::move(queue_.front());
    queue_.pop_front();
    auto numbered = std::make_shared<v1::CacheEvent>(*front.event);
    numbered->set_sequence(front.sequence);
    return Next{State::kEvent, std::move(numbered)};
  }
  if (overflowed_) return {State::kOverflowed, nullptr};
  if (closed_) return {State::kClosed, nullptr};
  armed_ = true;
  return {State::kEmpty, nullptr};
}

size_t EventSubscription::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

EventHub::EventHub(size_t max_queue)
    : max_queue_(std::max<size_t>(max_queue, 1)), delivery_([this] { DeliveryLoop(); }) {}

EventHub::~EventHub() { Stop(); }

void EventHub::Publish(const CacheEvent& event) {
  absl::MutexLock lock(&mu_);
  ++sequence_;
  // Encoded once, on first use, and shared by every subscriber's queue; each numbers it.
  std::shared_ptr<const v1::CacheEvent> encoded;
  for (const std::shared_ptr<EventSubscription>& sub : subs_) {
    if (!sub->filter_.Matches(event.ns)) continue;
    if (encoded == nullptr) {
      auto proto = std::make_shared<v1::CacheEvent>();
      CacheEventToProto(event, /*sequence=*/0, proto.get());
      encoded = std::move(proto);
    }
    bool wake = false;
    {
      absl::MutexLock sub_lock(&sub->mu_);
      if (sub->overflowed_ || sub->closed_) continue;
      if (sub->queue_.size() >= max_queue_) {
        sub->overflowed_ = true;
        sub->queue_.clear();
        ++overflows_;
      } else {
        sub->queue_.push_back(EventSubscription::Queued{encoded, ++sub->sequence_});
      }
      wake = std::exchange(sub->armed_, false);
    }
    if (wake) Wake(sub);
  }
}

std::shared_ptr<EventSubscription> EventHub::Subscribe(EventFilter filter,
                                                       std::weak_ptr<EventSink> sink) {
  std::shared_ptr<EventSubscription> sub(new EventSubscription(std::move(filter), std::move(sink)));
  absl::MutexLock lock(&mu_);
  absl::MutexLock sub_lock(&sub->mu_);
  sub->armed_ = true;
  if (closed_) {
    sub->closed_ = true;
  } else {
    subs_.push_back(sub);
  }
  return sub;
}

void EventHub::Unsubscribe(const EventSubscription* sub) {
  absl::MutexLock lock(&mu_);
  auto it =
      std::find_if(subs_.begin(), subs_.end(),
                   [sub](const std::shared_ptr<EventSubscription>& s) { return s.get() == sub; });
  if (it != subs_.end()) subs_.erase(it);
}

void EventHub::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (const std::shared_ptr<EventSubscription>& sub : subs_) {
    bool wake = false;
    {
      absl::MutexLock sub_lock(&sub->mu_);
      sub->closed_ = true;
      wake = std::exchange(sub->armed_, false);
    }
    if (wake) Wake(sub);
  }
}

void EventHub::Stop() {
  std::call_once(stop_once_, [this] {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    delivery_.join();
  });
}

size_t EventHub::subscribers() const {
  absl::MutexLock lock(&mu_);
  return subs_.size();
}

uint64_t EventHub::published() const {
  absl::MutexLock lock(&mu_);
  return sequence_;
}

uint64_t EventHub::overflows() const {
  absl::MutexLock lock(&mu_);
  return overflows_;
}

void EventHub::Wake(std::shared_ptr<EventSubscription> sub) { to_wake_.push_back(std::move(sub)); }

void EventHub::DeliveryLoop() {
  for (;;) {
    std::vector<std::shared_ptr<EventSubscription>> batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &EventHub::HasWork));
      batch.swap(to_wake_);
      if (batch.empty() && stopping_) return;
    }
    // Outside every hub lock: the sink starts a gRPC write or finishes its stream.
    for (const std::shared_ptr<EventSubscription>& sub : batch) {
      if (std::shared_ptr<EventSink> sink = sub->sink_.lock()) sink->OnEventsReady();
    }
  }
}

}  // namespace kvcm
