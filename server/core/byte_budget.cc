#include "server/core/byte_budget.h"

namespace kvcm {

PoolId ByteBudget::Intern(const PoolKey& pool, uint64_t capacity_bytes) {
  auto [it, inserted] = ids_.try_emplace(pool, static_cast<PoolId>(pools_.size()));
  if (inserted) pools_.push_back(PoolStats{.pool = pool, .capacity_bytes = capacity_bytes});
  return it->second;
}

std::optional<PoolId> ByteBudget::Find(const PoolKey& pool) const {
  auto it = ids_.find(pool);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

}  // namespace kvcm
