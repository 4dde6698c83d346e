#include "gpu/agent/transport/tcp/handshake_budget.h"

#include <algorithm>

namespace kvcm {

uint32_t HandshakeBudget::pending_from(uint32_t peer) const {
  auto it = per_peer_.find(peer);
  return it == per_peer_.end() ? 0 : it->second;
}

HandshakeBudget::Admission HandshakeBudget::Admit(int id, uint32_t peer, absl::Time deadline) {
  const uint32_t mine = pending_from(peer);
  if (mine >= max_per_peer_) return {.verdict = Verdict::kRefusedPerPeer};
  Admission out;
  if (entries_.size() >= max_total_) {
    uint32_t heaviest = 0;
    for (const auto& [address, count] : per_peer_) heaviest = std::max(heaviest, count);
    // Displacing one of an address holding mine + 1 would only swap who holds more.
    if (mine != 0 && mine + 1 >= heaviest) return {.verdict = Verdict::kRefusedFull};
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (per_peer_[it->second.peer] == heaviest &&
          (victim == entries_.end() || it->second.seq < victim->second.seq)) {
        victim = it;
      }
    }
    out.evicted = victim->first;
    Erase(victim);
  }
  entries_[id] = Entry{.peer = peer, .seq = next_seq_++, .deadline = deadline};
  ++per_peer_[peer];
  return out;
}

void HandshakeBudget::Erase(absl::flat_hash_map<int, Entry>::iterator it) {
  auto count = per_peer_.find(it->second.peer);
  if (--count->second == 0) per_peer_.erase(count);
  entries_.erase(it);
}

bool HandshakeBudget::Remove(int id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  Erase(it);
  return true;
}

std::vector<int> HandshakeBudget::TakeExpired(absl::Time now) {
  std::vector<int> out;
  for (const auto& [id, entry] : entries_) {
    if (entry.deadline <= now) out.push_back(id);
  }
  for (int id : out) Remove(id);
  return out;
}

}  // namespace kvcm
