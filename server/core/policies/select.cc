#include "server/core/policies/select.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/core/cache_index.h"
#include "server/core/policies/registry.h"

namespace kvcm {
namespace {

// Bits of each candidate's tag in the packed ghost tag.
constexpr int kTagBits = 8;

uint64_t RandomKey() {
  std::random_device device;
  return (uint64_t{device()} << 32 | device()) | 1;
}

// Finaliser of MurmurHash3: every bit of the result depends on every bit of `x`.
uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

EvictionPolicy::GhostHit Lane(const EvictionPolicy::GhostHit& ghost, size_t i) {
  EvictionPolicy::GhostHit own = ghost;
  own.tag = (ghost.tag >> (kTagBits * i)) & ((uint64_t{1} << kTagBits) - 1);
  return own;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SelectingPolicy>> SelectingPolicy::Create(
    const PolicyContext& context) {
  const SelectParams& p = context.select;
  if (p.shadow_pages < 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy \"select\": shadow_pages must be >= 64, not ", p.shadow_pages));
  }
  if (!(std::isfinite(p.margin_points) && p.margin_points >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy \"select\": margin_points must be finite and >= 0, not ", p.margin_points));
  }
  if (!(std::isfinite(p.window_capacities) && p.window_capacities > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy \"select\": window_capacities must be finite and > 0, not ", p.window_capacities));
  }
  if (!(std::isfinite(p.dwell_capacities) && p.dwell_capacities >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy \"select\": dwell_capacities must be finite and >= 0, not ", p.dwell_capacities));
  }
  std::vector<Candidate> candidates;
  for (const PolicyEntry& entry : PolicyTable()) {
    if (!entry.candidate) continue;
    absl::StatusOr<std::unique_ptr<EvictionPolicy>> live = entry.make(context);
    if (!live.ok()) return live.status();
    CacheIndexOptions shadow;
    shadow.policy = std::string(entry.name);
    shadow.reuse_credit = context.reuse_credit;
    shadow.adaptive = context.adaptive;
    shadow.density = context.density;
    shadow.conversation = context.conversation;
    shadow.regret_window = context.regret_window;
    shadow.clock = context.clock;
    // Pools come from PoolFor only; every tenant may use all of a miniature pool, as the
    // real pool's unpinned pages allow.
    shadow.default_pool_capacity_bytes = 0;
    shadow.default_tenant_pool_share_pct = 100;
    absl::StatusOr<std::unique_ptr<CacheIndex>> index = CacheIndex::Create(std::move(shadow));
    if (!index.ok()) return index.status();
    candidates.push_back({std::string(entry.name), *std::move(live), *std::move(index)});
  }
  if (candidates.empty() || candidates.size() > kMaxCandidates) {
    return absl::InternalError(absl::StrCat("policy \"select\": ", candidates.size(),
                                            " candidates in the policy table; 1 to ",
                                            kMaxCandidates, " are supported"));
  }
  auto initial = std::find_if(candidates.begin(), candidates.end(),
                              [&](const Candidate& c) { return c.name == p.initial; });
  if (initial == candidates.end()) {
    std::vector<std::string> names;
    for (const Candidate& c : candidates) names.push_back(c.name);
    return absl::InvalidArgumentError(
        absl::StrCat("policy \"select\": initial must be one of its candidates (",
                     absl::StrJoin(names, ", "), "), not \"", p.initial, "\""));
  }
  return std::unique_ptr<SelectingPolicy>(new SelectingPolicy(
      context, std::move(candidates), static_cast<size_t>(initial - candidates.begin())));
}

SelectingPolicy::SelectingPolicy(const PolicyContext& context, std::vector<Candidate> candidates,
                                 size_t initial)
    : params_(context.select),
      sample_key_(context.select.sample_key != 0 ? context.select.sample_key : RandomKey()),
      candidates_(std::move(candidates)),
      active_(initial),
      pending_(initial) {}

SelectingPolicy::~SelectingPolicy() = default;

void SelectingPolicy::TrackGroups() {
  for (Candidate& c : candidates_) c.live->TrackGroups();
}

void SelectingPolicy::Add(RadixNode* node, PoolId pool) {
  if (node->score_epoch != epoch_) {
    // Scored by an earlier choice, and a candidate of no pool since the move (the move
    // re-scored every candidate): its score is re-computed before it enters a set.
    node->priority = active().Score(*node);
    node->score_epoch = epoch_;
  }
  active().Add(node, pool);
}

void SelectingPolicy::Touch(RadixNode* node, uint64_t stamp, double now_s, Access access) {
  if (node->last_access == stamp) return;
  // The others learn from the access first, as Touch lets the chosen one (before the node's
  // recency changes).
  const size_t chosen = active_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (i != chosen) candidates_[i].live->OnTouch(*node, now_s, access);
  }
  active().Touch(node, stamp, now_s, access);
  node->score_epoch = epoch_;
}

uint64_t SelectingPolicy::OnGhostAdded(const RadixNode& node, double now_s) {
  uint64_t tag = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    const uint64_t own = candidates_[i].live->OnGhostAdded(node, now_s);
    tag |= (own & ((uint64_t{1} << kTagBits) - 1)) << (kTagBits * i);
  }
  return tag;
}

void SelectingPolicy::OnGhostHit(const RadixNode& leaf, const GhostHit& ghost, double now_s) {
  for (size_t i = 0; i < candidates_.size(); ++i) {
    candidates_[i].live->OnGhostHit(leaf, Lane(ghost, i), now_s);
  }
}

void SelectingPolicy::OnLeafAdded(RadixNode& leaf, const GhostHit* ghost, double now_s) {
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (ghost == nullptr) {
      candidates_[i].live->OnLeafAdded(leaf, nullptr, now_s);
    } else {
      const GhostHit own = Lane(*ghost, i);
      candidates_[i].live->OnLeafAdded(leaf, &own, now_s);
    }
  }
}

bool SelectingPolicy::Sampled(const PageHash& page, uint32_t shift) const {
  if (shift == 0) return true;
  return Mix(page.lo ^ Mix(page.hi ^ sample_key_)) >> (64 - shift) == 0;
}

SelectingPolicy::ShadowPool& SelectingPolicy::PoolFor(const PromptEvent& prompt) {
  const uint64_t capacity = prompt.pool_capacity_bytes;
  auto [it, added] = pools_.try_emplace(prompt.pool);
  ShadowPool& pool = it->second;
  if (!added && pool.capacity_bytes == capacity) return pool;

  const uint64_t pages = capacity / std::max<uint64_t>(prompt.bytes_per_page, 1);
  uint32_t shift = 0;
  while (shift < 63 && (pages >> shift) > params_.shadow_pages) ++shift;
  if (!added) {
    total_capacity_pages_ -= pool.capacity_pages;
    if (pool.shift != shift) {
      // Another sample: the miniature pools start again, empty.
      for (Candidate& c : candidates_) (void)c.shadow->DropPool(pool.key);
      added = true;
    }
  }
  if (added) {
    pool.key = PoolKey{absl::StrCat("shadow-", prompt.pool, "-", ++pool_generation_), Tier::kGpu};
  }
  pool.shift = shift;
  pool.capacity_bytes = capacity;
  pool.capacity_pages = pages;
  total_capacity_pages_ += pages;
  for (Candidate& c : candidates_) {
    (void)c.shadow->SetPoolCapacity(pool.key, capacity >> shift);
  }
  return pool;
}

void SelectingPolicy::OnPrompt(const PromptEvent& prompt) {
  absl::MutexLock lock(&mu_);
  ShadowPool& pool = PoolFor(prompt);
  if (namespaces_.insert(prompt.ns).second) {
    for (Candidate& c : candidates_) {
      (void)c.shadow->RegisterModel(prompt.ns, prompt.spec,
                                    CacheIndex::NamespaceSource::kInventory);
    }
  }
  thread_local std::vector<PageHash> sampled;
  sampled.clear();
  for (const PageHash& page : prompt.pages) {
    if (Sampled(page, pool.shift)) sampled.push_back(page);
  }
  if (sampled.empty()) return;
  const double weight = std::ldexp(1.0, static_cast<int>(pool.shift));

  if (!prompt.lookup) {
    sampled_store_pages_ += sampled.size();
    thread_local std::vector<BlockId> blocks;
    blocks.assign(sampled.size(), 0);
    // A store without a lookup first (a worker that names no agent in its Match) still
    // fills the miniature pool; after a lookup it finds its pages there and only touches them.
    for (Candidate& c : candidates_) {
      // RESOURCE_EXHAUSTED (a prompt larger than the miniature pool) stores nothing, as the
      // real pool would refuse a prompt larger than itself.
      (void)c.shadow->Insert(prompt.ns, sampled, pool.key, blocks);
    }
    return;
  }
  sampled_lookup_pages_ += sampled.size();
  const double pages = weight * sampled.size();
  const double decay =
      std::exp2(-pages / std::max(1.0, params_.window_capacities * total_capacity_pages_));
  lookups_ = lookups_ * decay + pages;
  MatchOptions match{.requester_agent_id = pool.key.agent_id};
  thread_local std::vector<BlockId> blocks;
  blocks.assign(sampled.size(), 0);
  for (Candidate& c : candidates_) {
    absl::StatusOr<MatchResult> hit = c.shadow->Match(prompt.ns, sampled, match);
    const double hits = hit.ok() ? weight * hit->local_pages : 0;
    c.hits = c.hits * decay + hits;
    // The request runs where it looked, and its prompt is cached there after: the miniature
    // pool stores it now, whether or not the real worker's Insert comes (a worker skips it
    // when the real pool holds the whole prompt, which says nothing of the miniature one).
    (void)c.shadow->Insert(prompt.ns, sampled, pool.key, blocks);
  }
  Decide(pages);
}

void SelectingPolicy::Decide(double pages) {
  since_move_ += pages;
  if (since_move_ < params_.dwell_capacities * total_capacity_pages_ || lookups_ <= 0) return;
  const size_t current = pending_.load(std::memory_order_relaxed);
  size_t best = current;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (candidates_[i].hits > candidates_[best].hits) best = i;
  }
  const double gain_points = 100 * (candidates_[best].hits - candidates_[current].hits) / lookups_;
  if (best == current || gain_points <= params_.margin_points) return;
  pending_.store(best, std::memory_order_relaxed);
  since_move_ = 0;
}

void SelectingPolicy::Settle() {
  const size_t next = pending_.load(std::memory_order_relaxed);
  if (next == active_.load(std::memory_order_relaxed)) return;
  // The new choice orders every candidate the old one held, by its own scores.
  std::vector<RadixNode*> nodes = active().TakeCandidates();
  active_.store(next, std::memory_order_relaxed);
  ++epoch_;
  for (RadixNode* node : nodes) Rescore(node);
  switches_.fetch_add(1, std::memory_order_relaxed);
}

void SelectingPolicy::OnPoolRetired(PoolId id) {
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) return;
  for (Candidate& c : candidates_) (void)c.shadow->DropPool(it->second.key);
  total_capacity_pages_ -= it->second.capacity_pages;
  pools_.erase(it);
}

std::optional<SelectionStats> SelectingPolicy::selection() const {
  SelectionStats out;
  out.active = candidates_[active_.load(std::memory_order_relaxed)].name;
  out.switches = switches_.load(std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  for (const Candidate& c : candidates_) {
    out.candidates.push_back({c.name, lookups_ > 0 ? c.hits / lookups_ : 0});
    for (const PoolStats& p : c.shadow->Stats().pools) out.shadow_pages += p.pages;
  }
  out.sampled_lookup_pages = sampled_lookup_pages_;
  out.sampled_store_pages = sampled_store_pages_;
  out.pools = static_cast<uint32_t>(pools_.size());
  uint32_t max_shift = 0;
  for (const auto& [id, pool] : pools_) max_shift = std::max(max_shift, pool.shift);
  out.min_sample_rate = pools_.empty() ? 0 : std::ldexp(1.0, -static_cast<int>(max_shift));
  return out;
}

}  // namespace kvcm
