// AgentEpoch and AgentPools: the state the agent's components (BlockAgentService, ControlLoop,
// CommandLoop, AgentMetrics) share, owned by Agent and handed to each by pointer.
//
// Epochs: the agent starts with a fresh epoch (microseconds since the Unix epoch, so a
// restarted agent always registers a larger one). Blocks the manager indexes belong to that
// epoch (workers allocate them with it). A manager that forgot the agent (restarted) gets the
// same epoch again with the inventory of its blocks; only when the manager refuses the epoch
// (ABORTED) does the ControlLoop free the epoch's blocks and move to a larger one.
//
// Thread-safe: AgentEpoch is atomics; AgentPools is a pair of pointers to thread-safe pools.
#ifndef KVCM_GPU_AGENT_POOL_AGENT_STATE_H_
#define KVCM_GPU_AGENT_POOL_AGENT_STATE_H_

#include <atomic>
#include <cstdint>

#include "gpu/agent/pool/block_pool.h"

namespace kvcm {

// The agent's pools; not owned.
struct AgentPools {
  // The pool the agent registers; never null.
  BlockPool* main = nullptr;
  // The host-DRAM pool the manager demotes into; null when host_capacity_bytes is 0.
  BlockPool* host = nullptr;

  // The pool a message names by `tier`: `main` for the tier it is registered as
  // (`main_tier`), `host` for Tier::kHost; null for any other tier or a missing host pool.
  BlockPool* ForTier(Tier main_tier, Tier tier) const {
    if (tier == main_tier) return main;
    return tier == Tier::kHost ? host : nullptr;
  }
  // The same for a tier as it came on the wire (a v1::Tier value, which may be any int):
  // null unless it is one of the Tier values, so that no value wraps into one.
  BlockPool* ForWireTier(Tier main_tier, int wire_tier) const {
    if (wire_tier < static_cast<int>(Tier::kGpu) || wire_tier > static_cast<int>(Tier::kDisk)) {
      return nullptr;
    }
    return ForTier(main_tier, static_cast<Tier>(wire_tier));
  }
};

// Frees every block allocated to `epoch` in both pools; returns how many.
uint64_t FreeBlocksOfEpoch(const AgentPools& pools, uint64_t epoch);

// The current epoch and whether the manager accepted it.
class AgentEpoch {
 public:
  // Starts at the current time in microseconds since the Unix epoch, not registered.
  AgentEpoch();
  AgentEpoch(const AgentEpoch&) = delete;
  AgentEpoch& operator=(const AgentEpoch&) = delete;

  uint64_t current() const { return epoch_.load(std::memory_order_acquire); }
  // Moves to max(current + 1, now in microseconds) and returns it. Only the ControlLoop
  // calls it.
  uint64_t Advance();

  // Whether the last Register or Heartbeat succeeded.
  bool registered() const { return registered_.load(std::memory_order_acquire); }
  void set_registered(bool registered) { registered_.store(registered, std::memory_order_release); }

 private:
  std::atomic<uint64_t> epoch_;
  std::atomic<bool> registered_{false};
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_AGENT_STATE_H_
