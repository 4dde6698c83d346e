#include "server/core/lease_table.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace kvcm {

PinId LeaseTable::NewId() {
  while (true) {
    const PinId id = random_.Next64();
    if (id != 0 && !leases_.contains(id) && !expired_.contains(id)) return id;
  }
}

PinId LeaseTable::Add(RadixNode* node, absl::Time expiry) {
  const PinId id = NewId();
  leases_.emplace(id, Lease{id, node, expiry});
  by_expiry_.emplace(expiry, id);
  return id;
}

absl::StatusOr<Lease*> LeaseTable::Find(PinId id, const RadixTree* tree) {
  auto it = leases_.find(id);
  if (it != leases_.end() && it->second.node->tree == tree) return &it->second;
  auto dead = expired_.find(id);
  if (dead != expired_.end() && dead->second == tree) {
    return absl::AbortedError(absl::StrCat("pin_id ", id, ": lease expired"));
  }
  return absl::NotFoundError(absl::StrCat("pin_id ", id, " is not a live pin of this namespace"));
}

void LeaseTable::SetExpiry(Lease* lease, absl::Time expiry) {
  by_expiry_.erase({lease->expiry, lease->id});
  lease->expiry = expiry;
  by_expiry_.emplace(expiry, lease->id);
}

void LeaseTable::Erase(PinId id) {
  auto it = leases_.find(id);
  by_expiry_.erase({it->second.expiry, id});
  leases_.erase(it);
}

void LeaseTable::Expire(absl::Time now, const std::function<void(const Lease&)>& on_expired) {
  while (!expired_order_.empty() && expired_order_.front().first <= now) {
    expired_.erase(expired_order_.front().second);
    expired_order_.pop_front();
  }
  while (!by_expiry_.empty() && by_expiry_.begin()->first <= now) {
    PinId id = by_expiry_.begin()->second;
    by_expiry_.erase(by_expiry_.begin());
    auto it = leases_.find(id);
    Lease lease = it->second;
    leases_.erase(it);
    expired_.emplace(id, lease.node->tree);
    expired_order_.emplace_back(now + expired_memory_, id);
    on_expired(lease);
  }
}

size_t LeaseTable::ForgetTree(const RadixTree* tree,
                              const std::function<void(const Lease&)>& on_dropped) {
  std::vector<PinId> ids;
  for (const auto& [id, lease] : leases_) {
    if (lease.node->tree == tree) ids.push_back(id);
  }
  for (PinId id : ids) {
    auto it = leases_.find(id);
    const Lease lease = it->second;
    by_expiry_.erase({lease.expiry, id});
    leases_.erase(it);
    on_dropped(lease);
  }
  // expired_order_ keeps the ids; forgetting an id twice is harmless.
  absl::erase_if(expired_, [tree](const auto& entry) { return entry.second == tree; });
  return ids.size();
}

}  // namespace kvcm
