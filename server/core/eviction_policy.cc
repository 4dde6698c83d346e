#include "server/core/eviction_policy.h"

#include <algorithm>

namespace kvcm {

void EvictionPolicy::Touch(RadixNode* node, uint64_t stamp, double now_s, Access access) {
  if (node->last_access == stamp) return;
  OnTouch(*node, now_s, access);
  Rekey(node, [&] {
    node->last_access = stamp;
    node->last_access_s = now_s;
    if (access == Access::kMatch || node->hits == 0) ++node->hits;
  });
}

void EvictionPolicy::Rescore(RadixNode* node) {
  Rekey(node, [] {});
}

template <typename Update>
void EvictionPolicy::Rekey(RadixNode* node, Update update) {
  // Candidates are found by their key, so they leave the sets before it changes.
  for (const Replica& r : node->replicas) {
    if (r.evictable) Remove(node, r.pool);
  }
  update();
  node->priority = Score(*node);
  for (const Replica& r : node->replicas) {
    if (r.evictable) Add(node, r.pool);
  }
}

std::optional<EvictionCandidate> EvictionPolicy::Victim(PoolId pool) const {
  if (pool >= by_pool_.size() || by_pool_[pool].empty()) return std::nullopt;
  return EvictionCandidate{std::get<2>(*by_pool_[pool].begin()), pool};
}

std::optional<EvictionCandidate> EvictionPolicy::GroupVictim(uint32_t group) const {
  auto it = by_group_.find(group);
  if (it == by_group_.end()) return std::nullopt;
  const GroupKey& first = *it->second.begin();
  return EvictionCandidate{std::get<2>(first), std::get<3>(first)};
}

void EvictionPolicy::AddToGroup(RadixNode* node, PoolId pool) {
  by_group_[node->tree->group()].insert({node->priority, node->last_access, node, pool});
}

void EvictionPolicy::RemoveFromGroup(RadixNode* node, PoolId pool) {
  auto it = by_group_.find(node->tree->group());
  if (it == by_group_.end()) return;
  it->second.erase({node->priority, node->last_access, node, pool});
  if (it->second.empty()) by_group_.erase(it);
}

std::vector<RadixNode*> EvictionPolicy::TakeCandidates() {
  std::vector<RadixNode*> nodes;
  for (absl::btree_set<Key>& set : by_pool_) {
    for (const Key& key : set) nodes.push_back(std::get<2>(key));
    set.clear();
  }
  by_group_.clear();
  // A node that is a candidate of several pools is listed once.
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  return nodes;
}

absl::btree_set<EvictionPolicy::Key>& EvictionPolicy::SetOf(PoolId pool) {
  if (pool >= by_pool_.size()) by_pool_.resize(pool + 1);
  return by_pool_[pool];
}

}  // namespace kvcm
