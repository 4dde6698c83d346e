#include "gpu/agent/control/room_maker.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/core_types.h"

namespace kvcm {

absl::string_view AllocationFailureName(AllocationFailure reason) {
  switch (reason) {
    case AllocationFailure::kPinned:
      return "pinned";
    case AllocationFailure::kQuota:
      return "quota";
    case AllocationFailure::kShare:
      return "share";
    case AllocationFailure::kManagerUnavailable:
      return "manager_unavailable";
    case AllocationFailure::kFreeTimeout:
      return "free_timeout";
    case AllocationFailure::kEpoch:
      return "epoch";
    case AllocationFailure::kPrivate:
      return "private";
    case AllocationFailure::kOther:
      return "other";
  }
  return "other";
}

RoomMaker::RoomMaker(BlockPool* pool, Tier tier, std::string agent_id, const AgentEpoch* epoch,
                     MakeRoomFn make_room, RoomMakerOptions options, RoomMakerObserver observer)
    : pool_(pool),
      tier_(tier),
      agent_id_(std::move(agent_id)),
      epoch_(epoch),
      make_room_(std::move(make_room)),
      options_(options),
      observer_(std::move(observer)) {}

RoomMaker::~RoomMaker() { Stop(); }

void RoomMaker::Start() {
  thread_ = std::thread([this] { Run(); });
}

void RoomMaker::Stop() {
  std::deque<Waiter> left;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    left.swap(queue_);
  }
  for (Waiter& w : left) {
    Fail(absl::UnavailableError("the agent is shutting down"), AllocationFailure::kOther, w.done);
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<RoomMaker::Allocation> RoomMaker::AllocateNow(BlockPool& pool,
                                                             const Request& request,
                                                             bool use_held) {
  Allocation out;
  absl::StatusOr<std::vector<BlockId>> ids =
      pool.Allocate(request.count, request.owner_epoch, request.ns ? &*request.ns : nullptr,
                    &out.generations, use_held, request.allocator);
  if (!ids.ok()) return ids.status();
  out.block_ids = *std::move(ids);
  return out;
}

void RoomMaker::Fail(const absl::Status& status, AllocationFailure reason, const Done& done) {
  if (observer_.on_failure) observer_.on_failure(reason);
  done(status);
}

void RoomMaker::Allocate(Request request, Done done) {
  absl::StatusOr<Allocation> now = AllocateNow(*pool_, request);
  if (now.ok() || !absl::IsResourceExhausted(now.status())) {
    done(std::move(now));
    return;
  }
  // Only blocks the cache will hold can take cached pages' place.
  if (!request.ns.has_value() || request.owner_epoch != epoch_->current()) {
    Fail(now.status(), AllocationFailure::kPrivate, done);
    return;
  }
  if (!make_room_ || request.count > pool_->geometry().num_blocks) {
    Fail(now.status(),
         make_room_ ? AllocationFailure::kOther : AllocationFailure::kManagerUnavailable, done);
    return;
  }
  bool stopping = false;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    if (!stopping && queue_.size() < options_.max_waiting) {
      queue_.push_back(Waiter{std::move(request), std::move(done)});
      return;
    }
  }
  Fail(stopping ? absl::UnavailableError("the agent is shutting down")
                : absl::ResourceExhaustedError(
                      absl::StrCat(now.status().message(), "; ", options_.max_waiting,
                                   " allocations are already waiting for room: try again later")),
       AllocationFailure::kOther, done);
}

void RoomMaker::Run() {
  while (true) {
    Waiter w;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      w = std::move(queue_.front());
      queue_.pop_front();
    }
    const absl::Time start = absl::Now();
    if (start >= w.request.deadline) {
      Fail(absl::DeadlineExceededError(absl::StrCat("the deadline passed while the allocation of ",
                                                    w.request.count, " blocks waited for room")),
           AllocationFailure::kOther, w.done);
      continue;
    }
    uint64_t evicted_pages = 0;
    AllocationFailure reason = AllocationFailure::kOther;
    absl::StatusOr<Allocation> served = Serve(w.request, &evicted_pages, &reason);
    if (!served.ok()) {
      Fail(served.status(), reason, w.done);
      continue;
    }
    if (observer_.on_room_made) observer_.on_room_made(absl::Now() - start, evicted_pages);
    w.done(std::move(served));
  }
}

bool RoomMaker::AwaitFree(uint32_t count, absl::Time deadline) {
  // In slices, so that Stop does not wait out a deadline.
  constexpr absl::Duration kSlice = absl::Milliseconds(50);
  while (!pool_->AwaitFree(count, std::min(deadline, absl::Now() + kSlice))) {
    if (absl::Now() >= deadline) return false;
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
  }
  return true;
}

absl::StatusOr<RoomMaker::Allocation> RoomMaker::Serve(const Request& request,
                                                       uint64_t* evicted_pages,
                                                       AllocationFailure* reason) {
  const absl::Time deadline =
      std::min(request.deadline, absl::Now() + absl::Milliseconds(options_.allocate_wait_ms));
  pool_->SetHeld(request.count);
  absl::Cleanup release_hold = [this] { pool_->SetHeld(0); };
  for (uint32_t round = 0; round < options_.max_rounds; ++round) {
    absl::StatusOr<Allocation> allocated = AllocateNow(*pool_, request, /*use_held=*/true);
    if (allocated.ok() || !absl::IsResourceExhausted(allocated.status())) return allocated;
    if (request.owner_epoch != epoch_->current()) {
      *reason = AllocationFailure::kEpoch;
      return absl::AbortedError(absl::StrCat("owner_epoch ", request.owner_epoch,
                                             " is no longer the agent's epoch ", epoch_->current(),
                                             "; allocate again"));
    }
    const BlockPoolStats stats = pool_->Stats();
    const uint32_t shortfall = request.count - static_cast<uint32_t>(stats.free_blocks);
    // Blocks allocated and not committed (stores in flight) are nobody's to evict.
    const std::string state = absl::StrCat(
        "asked for ", request.count, " blocks, ", stats.free_blocks, " of ", stats.num_blocks,
        " are free (", stats.num_blocks - stats.free_blocks - stats.committed_blocks,
        " allocated to stores not yet committed)");
    v1::MakeRoomRequest ask;
    ask.set_agent_id(agent_id_);
    ask.set_epoch(request.owner_epoch);
    ask.set_tier(TierToProto(tier_));
    ask.set_blocks(shortfall);
    ask.set_allocation_blocks(request.count);
    ask.mutable_namespace_()->set_tenant(request.ns->tenant);
    ask.mutable_namespace_()->set_model(request.ns->model);
    ask.set_tenant_allocated_blocks(
        pool_->AllocatedToTenant(request.owner_epoch, request.ns->tenant));
    absl::StatusOr<v1::MakeRoomResponse> room = make_room_(ask, deadline);
    if (!room.ok()) {
      const absl::Status& s = room.status();
      if (absl::IsResourceExhausted(s)) {
        *reason = absl::StrContains(s.message(), "tenant_max_bytes") ? AllocationFailure::kQuota
                  : absl::StrContains(s.message(), "default_tenant_pool_share_pct")
                      ? AllocationFailure::kShare
                      : AllocationFailure::kPinned;
        return absl::ResourceExhaustedError(
            absl::StrCat(state, "; the manager has nothing to evict: ", s.message()));
      }
      if (absl::IsAborted(s)) {
        *reason = AllocationFailure::kEpoch;
        return absl::AbortedError(
            absl::StrCat(state, "; the manager refused the agent's epoch: ", s.message()));
      }
      *reason = AllocationFailure::kManagerUnavailable;
      return absl::UnavailableError(
          absl::StrCat(state, "; the manager could not make room: ", s.ToString()));
    }
    *evicted_pages += room->evicted_pages();
    if (!AwaitFree(request.count, deadline)) {
      *reason = AllocationFailure::kFreeTimeout;
      return absl::UnavailableError(
          absl::StrCat(state, "; the manager evicted ", room->evicted_pages(),
                       " pages but their blocks were not freed by the deadline (are the manager's "
                       "commands reaching this agent?)"));
    }
  }
  *reason = AllocationFailure::kOther;
  return absl::ResourceExhaustedError(absl::StrCat("asked for ", request.count,
                                                   " blocks; still short after ",
                                                   options_.max_rounds, " rounds of eviction"));
}

}  // namespace kvcm
