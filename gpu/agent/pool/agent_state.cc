#include "gpu/agent/pool/agent_state.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace kvcm {
namespace {

uint64_t NowMicros() { return static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())); }

}  // namespace

uint64_t FreeBlocksOfEpoch(const AgentPools& pools, uint64_t epoch) {
  uint64_t freed = pools.main->FreeAllOwnedBy(epoch);
  if (pools.host != nullptr) freed += pools.host->FreeAllOwnedBy(epoch);
  return freed;
}

AgentEpoch::AgentEpoch() : epoch_(NowMicros()) {}

uint64_t AgentEpoch::Advance() {
  const uint64_t next = std::max(current() + 1, NowMicros());
  epoch_.store(next, std::memory_order_release);
  return next;
}

}  // namespace kvcm
