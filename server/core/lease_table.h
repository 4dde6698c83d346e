// LeaseTable: live pins, their leases, and recently expired pin ids.
//
// A pin holds one radix node (and so its whole path from the root). Leases expire by the
// injected clock; CacheIndex drops expired pins through Expire(). Pin ids are 64 random bits
// from the kernel's CSPRNG (never 0, never a live or remembered id), so a client cannot
// guess another's pin.
//
// Not thread-safe: CacheIndex serialises access.
#ifndef KVCM_SERVER_CORE_LEASE_TABLE_H_
#define KVCM_SERVER_CORE_LEASE_TABLE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/secure_random.h"
#include "server/core/radix_tree.h"

namespace kvcm {

using PinId = uint64_t;

struct Lease {
  PinId id = 0;
  RadixNode* node = nullptr;  // deepest pinned node
  absl::Time expiry;
};

class LeaseTable {
 public:
  explicit LeaseTable(absl::Duration expired_memory) : expired_memory_(expired_memory) {}

  PinId Add(RadixNode* node, absl::Time expiry);

  // The live lease `id` of `tree`. NOT_FOUND when unknown or of another tree (namespace),
  // ABORTED when it expired recently.
  absl::StatusOr<Lease*> Find(PinId id, const RadixTree* tree);

  void SetExpiry(Lease* lease, absl::Time expiry);
  // Forgets a released lease. REQUIRES: `id` is live.
  void Erase(PinId id);

  // Removes every lease with expiry <= now, calling `on_expired` for each (in expiry
  // order), and remembers their ids as expired.
  void Expire(absl::Time now, const std::function<void(const Lease&)>& on_expired);

  // Forgets every lease of `tree`, calling `on_dropped` for each live one, and the expired
  // ids remembered for it: the tree is going away (CacheIndex::DeleteNamespace). Its pin ids
  // are then unknown (NOT_FOUND). Returns the live leases dropped.
  size_t ForgetTree(const RadixTree* tree, const std::function<void(const Lease&)>& on_dropped);

  size_t size() const { return leases_.size(); }
  // Calls fn(const Lease&) for every live lease, in no particular order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (const auto& [id, lease] : leases_) fn(lease);
  }

 private:
  // A fresh random id: not 0, not live, not remembered as expired.
  PinId NewId();

  const absl::Duration expired_memory_;
  SecureRandom random_;
  absl::flat_hash_map<PinId, Lease> leases_;
  absl::btree_set<std::pair<absl::Time, PinId>> by_expiry_;
  // Expired ids and the tree they belonged to, forgotten after expired_memory_.
  absl::flat_hash_map<PinId, const RadixTree*> expired_;
  std::deque<std::pair<absl::Time, PinId>> expired_order_;  // (forget at, id)
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_LEASE_TABLE_H_
