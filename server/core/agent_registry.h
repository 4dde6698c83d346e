// AgentRegistry: the agents the manager knows, their epochs and their liveness.
//
// An agent registers with an epoch (its incarnation) and then heartbeats. A registration
// with a lower epoch than the known one is stale (ABORTED); a higher one replaces the old
// incarnation. An agent whose last Register/Heartbeat is older than the heartbeat timeout
// is reported gone; liveness is computed from the clock when asked, so no timer is needed.
// A gone agent that heartbeats again in the same epoch is alive again, until TakeGone hands
// it to the caller (who drops its pools from the index): from then on its heartbeats answer
// NOT_FOUND, and it registers again (with the same epoch, if it kept its blocks: it then
// reports its inventory, as it does to a restarted manager).
//
// A dropped agent is remembered for `gone_memory` (so that Stats, the metrics and the
// KvcmAgentGone alert show it), then forgotten (TakeForgotten): a rollout that replaces
// every agent pod leaves no record behind for ever. An agent that stops on purpose says so
// (Forget, from its last heartbeat) and is forgotten at once.
//
// An epoch is the agent's start time in microseconds since the Unix epoch
// (gpu/agent/pool/agent_state.h), so one more than `max_epoch_ahead` ahead of the clock is
// refused (OUT_OF_RANGE): no caller, a bug or an impostor, can register an epoch that the
// real agent's restarts do not pass once that much time has gone by. The bound needs no
// history, so a restarted manager applies it just the same.
//
// Thread-safe: every method locks mu_.
#ifndef KVCM_SERVER_CORE_AGENT_REGISTRY_H_
#define KVCM_SERVER_CORE_AGENT_REGISTRY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/types.h"
#include "server/core/clock.h"

namespace kvcm {

// What an agent says about itself when it registers.
struct AgentRegistration {
  std::string agent_id;
  std::string device;  // "cuda:0", "host"
  Tier tier = Tier::kGpu;
  uint64_t epoch = 0;  // >= 1
  uint64_t capacity_bytes = 0;
  // Capacity of the agent's HOST pool (the demotion target); 0 when it has none.
  uint64_t host_capacity_bytes = 0;
  std::string block_agent_address;
  std::string data_address;  // where peers pull its blocks; may be empty
  std::string transport;     // how it pulls: "tcp", "nccl"; empty when it has no data port
  // Geometry of the pools: bytes of one block, and blocks in the main and HOST pools (0:
  // no HOST pool).
  uint64_t bytes_per_block = 0;
  uint64_t num_blocks = 0;
  uint64_t host_num_blocks = 0;
};

// One pool of a registered agent, as Insert needs it.
struct AgentPool {
  uint64_t epoch = 0;
  uint64_t bytes_per_block = 0;
  uint64_t num_blocks = 0;
};

// What Register changed.
struct RegisterOutcome {
  // A new incarnation (first registration, or a larger epoch): whatever the index holds for
  // this agent's pools belongs to a process that is gone.
  bool new_epoch = false;
};

// What a heartbeat reports.
struct AgentUsage {
  uint64_t used_bytes = 0;   // of the main pool, held by allocated blocks
  uint64_t free_blocks = 0;  // of the main pool
  double pull_gbps = 0;      // measured on the agent's recent pulls; 0: none yet
};

// One agent as reported by Snapshot().
struct AgentInfo {
  AgentRegistration registration;
  bool alive = false;
  absl::Duration last_heartbeat_age;
  AgentUsage usage;         // from the last heartbeat
  uint64_t heartbeats = 0;  // received in this epoch
};

// Totals for metrics.
struct AgentCounts {
  uint64_t alive = 0;
  uint64_t gone = 0;
  uint64_t heartbeats_total = 0;  // every accepted heartbeat since start, all agents
};

class AgentRegistry {
 public:
  // How far ahead of the clock an epoch may be unless the caller says otherwise.
  static constexpr absl::Duration kDefaultMaxEpochAhead = absl::Minutes(5);
  // How long a dropped agent is remembered unless the caller says otherwise.
  static constexpr absl::Duration kDefaultGoneMemory = absl::Hours(1);

  // `clock` (wall time: epochs are compared with it) is not owned and must outlive the
  // registry. REQUIRES: heartbeat_timeout > 0, max_epoch_ahead >= 0, gone_memory >= 0.
  AgentRegistry(const Clock* clock, absl::Duration heartbeat_timeout,
                absl::Duration max_epoch_ahead = kDefaultMaxEpochAhead,
                absl::Duration gone_memory = kDefaultGoneMemory);
  AgentRegistry(const AgentRegistry&) = delete;
  AgentRegistry& operator=(const AgentRegistry&) = delete;

  // What Register(reg) would answer, changing nothing: lets a caller check before changing
  // other state.
  absl::StatusOr<RegisterOutcome> CheckRegister(const AgentRegistration& reg) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK when `epoch` is the live registered epoch of `agent_id`; otherwise what Heartbeat
  // would answer. Changes nothing.
  absl::Status CheckLive(absl::string_view agent_id, uint64_t epoch) const ABSL_LOCKS_EXCLUDED(mu_);

  // Records (or refreshes) `reg` and counts as a heartbeat of zero usage when the epoch is
  // new to the registry: a first registration, a larger epoch, or the same epoch after
  // TakeGone dropped it (the index holds nothing of the agent then). ABORTED (nothing
  // changed) when a higher epoch is registered; OUT_OF_RANGE naming `epoch` (nothing
  // changed) when reg.epoch is more than max_epoch_ahead past the clock. REQUIRES:
  // reg.epoch >= 1 and a valid agent id (the service validates).
  absl::StatusOr<RegisterOutcome> Register(const AgentRegistration& reg) ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND for an unknown agent or one TakeGone dropped; ABORTED when `epoch` is not the
  // registered epoch.
  absl::Status Heartbeat(absl::string_view agent_id, uint64_t epoch, const AgentUsage& usage)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The pool `pool` of a registered agent (its main tier, or kHost when it has a host
  // pool) in its current epoch, whether or not it is alive; nullopt when no agent (or an
  // agent TakeGone dropped) has that pool.
  std::optional<AgentPool> FindPool(const PoolKey& pool) const ABSL_LOCKS_EXCLUDED(mu_);

  // The agents gone as of now and not taken before, in agent_id order; each is marked
  // dropped (see the class comment). The caller forgets their pools.
  std::vector<AgentRegistration> TakeGone() ABSL_LOCKS_EXCLUDED(mu_);

  // The agents dropped more than gone_memory ago, in agent_id order, now forgotten: they
  // leave Snapshot and Counts, and their heartbeats answer NOT_FOUND. The caller forgets
  // their pools for good.
  std::vector<AgentRegistration> TakeForgotten() ABSL_LOCKS_EXCLUDED(mu_);

  // Agent `agent_id` stops on purpose: forgotten at once, as TakeForgotten would, and its
  // registration returned (the caller forgets its pools). NOT_FOUND for an unknown agent;
  // ABORTED (nothing changed) when `epoch` is not the registered one.
  absl::StatusOr<AgentRegistration> Forget(absl::string_view agent_id, uint64_t epoch)
      ABSL_LOCKS_EXCLUDED(mu_);

  // An operator forgets `agent_id` now (CacheManager.ForgetAgent), as TakeForgotten would
  // once it had been gone for gone_memory; returns it as it was. NOT_FOUND for an unknown
  // agent; FAILED_PRECONDITION (nothing changed) for a live one unless `force`. The caller
  // forgets its pools.
  absl::StatusOr<AgentInfo> ForgetNow(absl::string_view agent_id, bool force)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Every agent, in agent_id order, with liveness as of now.
  std::vector<AgentInfo> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  AgentCounts Counts() const ABSL_LOCKS_EXCLUDED(mu_);

  absl::Duration heartbeat_timeout() const { return heartbeat_timeout_; }

  // Held by whoever changes an agent's life beyond this registry (Register with its pool
  // changes, the end of an incarnation: a leave, gone, forgotten) across the registry call
  // and the index's changes, so that a new incarnation's Register never interleaves with
  // the end of the previous one (which would drop the new incarnation's pools). Rare calls:
  // one mutex for every agent. Taken before mu_ and the index's lock, never inside them.
  absl::Mutex& lifecycle_mu() const ABSL_LOCK_RETURNED(lifecycle_mu_) { return lifecycle_mu_; }

 private:
  struct Entry {
    AgentRegistration registration;
    absl::Time last_seen;
    AgentUsage usage;
    uint64_t heartbeats = 0;
    bool dropped = false;   // by TakeGone; only a larger epoch revives it
    absl::Time dropped_at;  // when TakeGone dropped it
  };

  // `e`: the agent's entry, null when unknown; `now`: the clock's time.
  absl::StatusOr<RegisterOutcome> CheckRegisterLocked(const AgentRegistration& reg, const Entry* e,
                                                      absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckLiveLocked(absl::string_view agent_id, uint64_t epoch) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool Alive(const Entry& e, absl::Time now) const {
    return !e.dropped && now - e.last_seen <= heartbeat_timeout_;
  }
  AgentInfo InfoOf(const Entry& e, absl::Time now) const {
    return AgentInfo{.registration = e.registration,
                     .alive = Alive(e, now),
                     .last_heartbeat_age = now - e.last_seen,
                     .usage = e.usage,
                     .heartbeats = e.heartbeats};
  }

  const Clock* const clock_;
  const absl::Duration heartbeat_timeout_;
  const absl::Duration max_epoch_ahead_;
  const absl::Duration gone_memory_;
  mutable absl::Mutex lifecycle_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  absl::btree_map<std::string, Entry> agents_ ABSL_GUARDED_BY(mu_);
  uint64_t heartbeats_total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_AGENT_REGISTRY_H_
