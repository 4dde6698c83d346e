#include "server/core/byte_budget.h"

namespace kvcm {

PoolId ByteBudget::Intern(const PoolKey& pool, uint64_t capacity_bytes, bool engine) {
  auto [it, inserted] = ids_.try_emplace(pool, static_cast<PoolId>(pools_.size()));
  if (inserted) {
    pools_.push_back(PoolStats{.pool = pool, .capacity_bytes = capacity_bytes, .engine = engine});
    retired_.push_back(0);
  }
  return it->second;
}

PoolId ByteBudget::Replace(PoolId id) {
  const PoolId fresh = static_cast<PoolId>(pools_.size());
  const PoolStats& old = pools_[id];
  pools_.push_back(PoolStats{.pool = old.pool,
                             .capacity_bytes = old.capacity_bytes,
                             .reserved_bytes = old.reserved_bytes,
                             .engine = old.engine});
  retired_.push_back(0);
  retired_[id] = 1;
  pools_[id].reserved_bytes = 0;
  ids_[old.pool] = fresh;
  return fresh;
}

void ByteBudget::Retire(PoolId id) {
  retired_[id] = 1;
  pools_[id].reserved_bytes = 0;
  ids_.erase(pools_[id].pool);
}

std::optional<PoolId> ByteBudget::Find(const PoolKey& pool) const {
  auto it = ids_.find(pool);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

}  // namespace kvcm
