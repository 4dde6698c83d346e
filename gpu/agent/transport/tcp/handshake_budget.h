// HandshakeBudget: the data port's accepted connections whose handshake has not completed
// (TLS: the handshake; plaintext: the request frame), kept apart from the served ones so
// that a flood of connections that never handshake cannot take the slots of peers that do.
//
// At most `max_total` are pending, at most `max_per_peer` from one IP address. When the
// budget is full, a connection from an address that holds none, or holds at least two fewer
// than the address holding the most, takes the place of that heaviest address's oldest
// pending connection (which the caller then closes); any other is refused. So a peer's
// first handshake always gets in, and it is itself displaced only when every pending
// address holds one (an attacker with at least `max_total` addresses) and it is the
// oldest of them. docs/SECURITY.md "Data port" has the reasoning and the measured flood.
//
// Not thread-safe: the transport calls it under its own lock.
#ifndef KVCM_GPU_AGENT_TRANSPORT_TCP_HANDSHAKE_BUDGET_H_
#define KVCM_GPU_AGENT_TRANSPORT_TCP_HANDSHAKE_BUDGET_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"

namespace kvcm {

class HandshakeBudget {
 public:
  // REQUIRES: both >= 1.
  HandshakeBudget(uint32_t max_total, uint32_t max_per_peer)
      : max_total_(max_total), max_per_peer_(max_per_peer) {}

  enum class Verdict {
    kAdmitted,
    kRefusedPerPeer,  // its address holds max_per_peer pending already
    kRefusedFull,     // the budget is full and its address is not lighter than the heaviest
  };
  struct Admission {
    Verdict verdict = Verdict::kAdmitted;
    int evicted = -1;  // the pending connection it displaced, to be closed; -1: none
  };

  // Connection `id` (its fd) from IPv4 address `peer`, which must finish by `deadline`.
  // REQUIRES: `id` is not pending.
  Admission Admit(int id, uint32_t peer, absl::Time deadline);

  // Removes `id`: true when it was pending (not displaced, expired or removed before).
  bool Remove(int id);

  // Removes and returns the connections whose deadline is at or before `now`.
  std::vector<int> TakeExpired(absl::Time now);

  size_t pending() const { return entries_.size(); }
  uint32_t pending_from(uint32_t peer) const;

 private:
  struct Entry {
    uint32_t peer;
    uint64_t seq;  // admission order: lower is older
    absl::Time deadline;
  };
  void Erase(absl::flat_hash_map<int, Entry>::iterator it);

  const uint32_t max_total_;
  const uint32_t max_per_peer_;
  uint64_t next_seq_ = 0;
  absl::flat_hash_map<int, Entry> entries_;
  absl::flat_hash_map<uint32_t, uint32_t> per_peer_;  // only addresses holding some
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_TCP_HANDSHAKE_BUDGET_H_
