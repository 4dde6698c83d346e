// RoomMaker: a store into a full pool evicts instead of failing (ARCHITECTURE §2 step 3).
//
// A cache allocation (blocks for a namespace, owned by the agent's epoch: what a worker
// allocates before it writes and inserts) that the main pool's free blocks cannot serve
// waits here, first come first served, while the manager evicts exactly the shortfall by
// its policy (AgentControl.MakeRoom: pins, reservations, quotas and HOST demotion as for an
// Insert). The victims' blocks come back through the manager's FreeBlocks / DemoteBlocks
// commands on the Commands stream, the only path that frees a committed block; the waiter
// allocates once enough blocks are free. While one waits, the pool holds its blocks
// (BlockPool::SetHeld), so an allocation that came later cannot take what evictions freed
// for it. The common case, room available, never gets here: it allocates in the caller's
// thread with no round trip.
//
// Errors, each with the pool's free blocks in the message: RESOURCE_EXHAUSTED with the
// manager's reason when nothing evictable is left (pins, reservations, the tenant's quota);
// UNAVAILABLE when the manager cannot be asked, or its frees do not arrive by the
// deadline; ABORTED when the agent's epoch changed; DEADLINE_EXCEEDED when the caller's
// deadline passes while it waits its turn. An allocation the manager cannot make room for
// (no namespace, or another owner: private blocks) is RESOURCE_EXHAUSTED at once.
//
// Thread-safe: Allocate may be called from any thread; waiting allocations are served by
// one thread of its own (Start/Stop), which calls `done`.
#ifndef KVCM_GPU_AGENT_CONTROL_ROOM_MAKER_H_
#define KVCM_GPU_AGENT_CONTROL_ROOM_MAKER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/types.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/block_pool.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

// Why an allocation failed, as the `reason` label of kvcm_agent_allocation_failures_total.
enum class AllocationFailure : int {
  kPinned,              // the manager found too little evictable: pins or reservations
  kQuota,               // the tenant's tenant_max_bytes leaves no room
  kShare,               // the tenant's stores in flight would pass its default pool share
  kManagerUnavailable,  // the manager could not be asked (or answered UNAVAILABLE)
  kFreeTimeout,         // the manager evicted, but the frees did not arrive in time
  kEpoch,               // the agent's epoch changed (ABORTED)
  kPrivate,             // short pool, and the blocks are not for the cache: no eviction
  kOther,               // deadline, shutdown, or another error
};
inline constexpr int kNumAllocationFailures = 8;
absl::string_view AllocationFailureName(AllocationFailure reason);

// What RoomMaker reports, for metrics. Called on the thread that ends the allocation.
struct RoomMakerObserver {
  // An allocation that waited for room was served: its wait, and the pages the manager
  // evicted for it.
  std::function<void(absl::Duration waited, uint64_t evicted_pages)> on_room_made;
  std::function<void(AllocationFailure reason)> on_failure;
};

struct RoomMakerOptions {
  // Longest an allocation waits for room (its call's own deadline may be shorter), ms.
  uint32_t allocate_wait_ms = 5000;
  // Rounds of MakeRoom one allocation may take (evictions it waited for, then found the
  // blocks gone to another pool user: only private allocations and demotions can).
  uint32_t max_rounds = 3;
  // Most allocations waiting at once; one more is RESOURCE_EXHAUSTED at once, so callers
  // flooding a full pool with allocations cannot grow the queue (or the wait) without bound.
  uint32_t max_waiting = 256;
};

class RoomMaker {
 public:
  // Asks the manager to make room (AgentControl.MakeRoom), giving up at `deadline`.
  using MakeRoomFn = std::function<absl::StatusOr<v1::MakeRoomResponse>(
      const v1::MakeRoomRequest& request, absl::Time deadline)>;

  struct Request {
    uint32_t count = 0;
    uint64_t owner_epoch = 0;
    std::optional<NamespaceId> ns;
    // The principal that alone may commit the blocks (BlockLedger); empty: none named.
    std::string allocator;
    // The caller's deadline (InfiniteFuture: none); capped by allocate_wait_ms.
    absl::Time deadline = absl::InfiniteFuture();
  };
  struct Allocation {
    std::vector<BlockId> block_ids;
    std::vector<uint64_t> generations;  // parallel to block_ids
  };
  using Done = std::function<void(absl::StatusOr<Allocation> result)>;

  // `pool` is the agent's main pool, registered as `tier`; `epoch` the agent's. Not owned;
  // they must outlive this. `make_room` null: no manager, a short pool fails as before.
  RoomMaker(BlockPool* pool, Tier tier, std::string agent_id, const AgentEpoch* epoch,
            MakeRoomFn make_room, RoomMakerOptions options, RoomMakerObserver observer = {});
  ~RoomMaker();
  RoomMaker(const RoomMaker&) = delete;
  RoomMaker& operator=(const RoomMaker&) = delete;

  void Start();
  // Fails every waiting allocation (UNAVAILABLE) and joins the thread. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Allocates `request` (BlockPool::Allocate's errors for a bad one). `done` runs exactly
  // once: inline when the pool has room or the request cannot wait, else on RoomMaker's
  // thread.
  void Allocate(Request request, Done done) ABSL_LOCKS_EXCLUDED(mu_);

  // BlockPool::Allocate of `request` now, nothing waited for: what Allocate does first, and
  // all an agent without a RoomMaker does.
  static absl::StatusOr<Allocation> AllocateNow(BlockPool& pool, const Request& request,
                                                bool use_held = false);

 private:
  struct Waiter {
    Request request;
    Done done;
  };

  void Run();
  // Serves one waiter: rounds of MakeRoom and waits until its blocks are free.
  // `evicted_pages` adds the pages the manager evicted for it; `reason` is set on failure.
  absl::StatusOr<Allocation> Serve(const Request& request, uint64_t* evicted_pages,
                                   AllocationFailure* reason);
  // Waits until `count` blocks are free; false at `deadline` or when stopping.
  bool AwaitFree(uint32_t count, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  void Fail(const absl::Status& status, AllocationFailure reason, const Done& done);

  BlockPool* const pool_;
  const Tier tier_;
  const std::string agent_id_;
  const AgentEpoch* const epoch_;
  const MakeRoomFn make_room_;
  const RoomMakerOptions options_;
  const RoomMakerObserver observer_;

  mutable absl::Mutex mu_;
  std::deque<Waiter> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_CONTROL_ROOM_MAKER_H_
