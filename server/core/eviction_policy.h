// EvictionPolicy: orders the eviction candidates of each pool.
//
// A candidate is one replica (node, pool) that is an unpinned leaf of its pool: the node is
// unpinned and no child holds the pool. CacheIndex tells the policy when a replica becomes
// or stops being a candidate and when a node is accessed; the policy answers which
// candidate of a pool to evict next. Eviction frees whole nodes.
//
// Every policy here keeps one ordered set of candidates per pool, keyed by a score it
// stores in RadixNode::priority (lower goes first); policies differ only in the score.
// With TrackGroups it also keeps one set per group of trees (RadixTree::group(): CacheIndex
// gives a tenant's trees one group), so that eviction can be confined to a tenant.
//
// Not thread-safe: CacheIndex serialises access.
#ifndef KVCM_SERVER_CORE_EVICTION_POLICY_H_
#define KVCM_SERVER_CORE_EVICTION_POLICY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/types.h"
#include "server/core/radix_tree.h"

namespace kvcm {

// Tells the clairvoyant `opt` policy when a page will next be asked for. Only a simulator,
// which knows the whole trace, can implement it. Called under the index lock.
class NextUseOracle {
 public:
  virtual ~NextUseOracle() = default;
  // Logical time (for example the request index) of the first request after the one now
  // being served whose prompt includes `page`; UINT64_MAX when none does.
  virtual uint64_t NextUse(const PageHash& page) const = 0;
};

// Parameters of the "adaptive" policy. All are dimensionless: the credit is measured in
// units of the workload's own mean reuse interval, so nothing here is a time scale of one
// trace. The defaults are the point of kvcm-bench --crossval's grid chosen on its train
// part (docs/EVICTION.md, "Adaptive credit, cross-validated").
struct AdaptiveParams {
  // Credit of one reuse at start, in mean reuse intervals.
  double initial_credit = 0.0;
  // Bounds of the credit, in mean reuse intervals. REQUIRES: 0 <= min_credit <= max_credit.
  double min_credit = 0.0;
  double max_credit = 1.0;
  // How far one adaptation step moves the credit, in mean reuse intervals. REQUIRES: > 0.
  double step = 0.1;
};

// Parameters of the "density" policy: which statistics it keeps, not a scale of any
// workload. The defaults are the point of kvcm-bench --crossval's grid chosen on its train
// part (docs/EVICTION.md, "Hit density").
struct DensityParams {
  // Reuse classes with their own statistics, per tenant: 1 (age only), 2 (used once, more)
  // or 4 (used 1, 2, 3, 4+ times). REQUIRES: 1, 2 or 4.
  uint32_t reuse_classes = 1;
  // Whether least-recently-used is a second expert that decides evictions while its
  // victims come back less often than density's (see MakeHitDensityPolicy).
  bool lru_guard = true;
};

// Parameters of the "conversation" policy. Dimensionless: the shift is in units of the
// workload's own measured time between a turn and the next. The default is the point
// kvcm-bench --crossval chose on the bundled trace's first half (docs/EVICTION.md,
// "Conversation turns").
struct ConversationParams {
  // Seconds of recency one unit of log-odds of a continuation is worth, in units of the
  // typical (geometric mean) time to the next turn. 0 is least-recently-used. REQUIRES:
  // finite, >= 0.
  double shift = 2.0;
};

class Clock;

// Parameters of the "select" policy (server/core/policies/select.h). None is a scale of a
// workload: the window and the sample follow each pool's own capacity.
struct SelectParams {
  // Most pages one candidate's miniature cache of one pool may hold. Each pool's sample rate
  // is the largest power of two (at most 1) that keeps the pool's capacity, scaled by it,
  // within this. REQUIRES: >= 64.
  uint32_t shadow_pages = 4096;
  // Hysteresis, in points of page hit rate: the choice moves to another candidate only when
  // its miniature caches hit more than this above the current one's over the window.
  // REQUIRES: finite, >= 0.
  double margin_points = 1;
  // Half-life of the window, in the pools' capacities of pages looked up: the counts are
  // decayed so that what happened this many cache-fulls of lookups ago weighs half.
  // REQUIRES: finite, > 0.
  double window_capacities = 4;
  // Least lookups, in the pools' capacities of pages, between two moves (and before the
  // first): each move costs a transient in the real pools, so the choice does not chase
  // noise. REQUIRES: finite, >= 0.
  double dwell_capacities = 4;
  // The candidate it starts on. A move off a learning candidate is cheap (what it kept,
  // lru can use); a move onto one is not (it classes pages by what happened to them, so
  // what lru evicted costs it while those pages live). REQUIRES: a candidate's name.
  // The defaults are what kvcm-bench --crossval chose on its train part only: the margin
  // and window on the bundled trace's first half, the dwell and the starting candidate on
  // every train cell (docs/EVICTION.md, "Selection by miniature simulation").
  std::string initial = "conversation";
  // Key of the hash that picks the sampled pages; 0: a random one per process, so that no
  // client can aim pages at the sample. The simulator sets one, to be reproducible.
  uint64_t sample_key = 0;
};

// What a policy may know besides the tree. Pointers may be null; not owned.
struct PolicyContext {
  // Required by "opt".
  const NextUseOracle* next_use = nullptr;
  // "cost": the recency one reuse of a typical page is worth.
  absl::Duration reuse_credit = absl::Seconds(40);
  // "adaptive": its dimensionless parameters.
  AdaptiveParams adaptive;
  // "density": its parameters.
  DensityParams density;
  // "conversation": its parameters.
  ConversationParams conversation;
  // "select": its parameters, and what its miniature caches (CacheIndex instances) need of
  // the index they shadow: the clock and the regret window.
  SelectParams select;
  Clock* clock = nullptr;
  absl::Duration regret_window = absl::Minutes(5);
};

struct EvictionCandidate {
  RadixNode* node;
  PoolId pool;
};

// How a node was reached, for policies that count reuse.
enum class Access : uint8_t { kMatch, kInsert };

// A prompt the index served (EvictionPolicy::OnPrompt): a counting Match by the agent that
// owns GPU pool `pool` (lookup), or an Insert into `pool` (store).
struct PromptEvent {
  const NamespaceId& ns;
  const ModelSpec& spec;    // the namespace's
  uint64_t bytes_per_page;  // what the index charges for one of its pages
  PoolId pool;
  uint64_t pool_capacity_bytes;
  std::span<const PageHash> pages;
  bool lookup;
};

// What "select" knows of its choice (EvictionPolicy::selection, CacheIndex::Stats).
struct SelectionStats {
  struct Candidate {
    std::string name;
    // Page hit rate of its miniature caches over the window (decayed), 0..1: the token hit
    // rate where every namespace has the same page size.
    double hit_rate = 0;
  };
  std::string active;  // the candidate whose order the index evicts in
  std::vector<Candidate> candidates;
  uint64_t switches = 0;  // moves made (a chosen move counts once the index applies it)
  // Pages the prompts looked up and stored that fell in the sample, since the start.
  uint64_t sampled_lookup_pages = 0;
  uint64_t sampled_store_pages = 0;
  // Page-locations all miniature caches hold now, and the pools they shadow.
  uint64_t shadow_pages = 0;
  uint32_t pools = 0;
  // Smallest sample rate of a pool (1: every page), 0 before the first prompt.
  double min_sample_rate = 0;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  virtual absl::string_view name() const = 0;

  // Whether eviction may take just the tail pages of a victim node that it needs (exactly
  // the shortfall, in pages) instead of the whole node. The lru arms free whole nodes, as
  // SGLang's RadixCache does.
  virtual bool trims_nodes() const { return false; }

  // Whether a page evicted from a GPU pool first moves to its agent's HOST pool, when the
  // agent has one (CacheIndex::EvictLocked).
  virtual bool demotes_to_host() const { return false; }

  // The operations below keep the candidates in order. They are virtual so that "select"
  // can hand them to the candidate it has chosen (server/core/policies/select.h).

  // (node, pool) became a candidate / stopped being one.
  virtual void Add(RadixNode* node, PoolId pool) {
    SetOf(pool).insert(KeyOf(node));
    if (track_groups_) AddToGroup(node, pool);
  }
  virtual void Remove(RadixNode* node, PoolId pool) {
    SetOf(pool).erase(KeyOf(node));
    if (track_groups_) RemoveFromGroup(node, pool);
  }

  // Also orders the candidates of each group of trees, across their pools (GroupVictim).
  // REQUIRES: no candidate added yet.
  virtual void TrackGroups() { track_groups_ = true; }

  // `node` was on a matched or inserted path at logical time `stamp` (increasing), clock
  // time `now_s` (seconds). Updates its recency and hit count and re-scores it.
  virtual void Touch(RadixNode* node, uint64_t stamp, double now_s, Access access);

  // Whether the policy wants OnPrompt. OnPrompt runs without the index's lock, from several
  // threads at once, concurrently with the other calls: the policy guards what it changes
  // there itself and reads nothing of the tree.
  virtual bool observes_prompts() const { return false; }
  // A prompt the index served (see PromptEvent), reported once the index's lock is
  // released. For policies that simulate the workload ("select").
  virtual void OnPrompt(const PromptEvent& /*prompt*/) {}
  // Called with the index's lock held exclusively, at the start of every exclusive section:
  // a policy changes its order here ("select" moving to another candidate), never in
  // OnPrompt.
  virtual void Settle() {}
  // Pool `pool` was dropped (its agent's epoch ended): it gets no more prompts. Called with
  // the index's lock held exclusively.
  virtual void OnPoolRetired(PoolId /*pool*/) {}
  // What "select" knows of its choice; nullopt for every other policy. Thread-safe, and
  // called without the index's lock.
  virtual std::optional<SelectionStats> selection() const { return std::nullopt; }

 protected:
  // Called by Touch before it updates `node` (so node.last_access_s is the previous access).
  // For policies that learn.
  virtual void OnTouch(const RadixNode& /*node*/, double /*now_s*/, Access /*access*/) {}

 public:
  // `node` is leaving the index by eviction (its last replica goes) and is remembered for
  // the regret window (a ghost); its hits and last_access_s are still set. For policies
  // that learn; what it returns comes back as GhostHit::tag if the run is inserted again.
  // Policies other than "select" answer within 8 bits (select packs its candidates' tags).
  virtual uint64_t OnGhostAdded(const RadixNode& /*node*/, double /*now_s*/) { return 0; }

  // What the ghost history knew of a run that is inserted again.
  struct GhostHit {
    uint32_t hits;         // its uses when it was evicted
    double last_access_s;  // clock time of its last access before it went
    double evicted_s;      // clock time it was evicted
    uint32_t pages;        // its length then
    uint64_t tag;          // what OnGhostAdded returned for it
  };
  // A run evicted within the regret window is inserted again at clock time `now_s` as
  // `leaf` (a ghost hit). For policies that learn.
  virtual void OnGhostHit(const RadixNode& /*leaf*/, const GhostHit& /*ghost*/, double /*now_s*/) {}

  // Insert added `leaf` below `leaf->parent` at clock time `now_s`, after OnGhostHit when
  // the run came back from the ghost history (`ghost` is then what it knew, else null), and
  // before the path is touched. For policies that class nodes by how they were added.
  virtual void OnLeafAdded(RadixNode& /*leaf*/, const GhostHit* /*ghost*/, double /*now_s*/) {}

  // Re-scores `node` after something its score depends on changed (a split, a replica
  // added or dropped), keeping its candidates in order.
  virtual void Rescore(RadixNode* node);

  // The candidate of `pool` to evict next, or nullopt when there is none. The first in
  // score order unless a policy knows better.
  virtual std::optional<EvictionCandidate> Victim(PoolId pool) const;

  // The candidate of group `group`'s trees to evict next, in any pool (retired ones
  // included), in Priority order; nullopt when there is none. REQUIRES: TrackGroups().
  virtual std::optional<EvictionCandidate> GroupVictim(uint32_t group) const;

  // Rank of a candidate across pools (lower is evicted first); used when evicting from a
  // namespace rather than a pool.
  virtual double Priority(const RadixNode* node, PoolId /*pool*/) const { return node->priority; }

 protected:
  // "select" drives its candidates' learning hooks and moves their candidates.
  friend class SelectingPolicy;

  // Every candidate node, once each, and the policy left with none (its learnt state stays).
  std::vector<RadixNode*> TakeCandidates();

  // The node's sort key now. Called after last_access and hits are updated.
  virtual double Score(const RadixNode& node) const = 0;

  // Score, then recency (equal scores go least recently used first), then identity.
  using Key = std::tuple<double, uint64_t, RadixNode*>;
  // The candidates of `pool` in key order; null when it has none.
  const absl::btree_set<Key>* CandidatesOf(PoolId pool) const {
    return pool < by_pool_.size() && !by_pool_[pool].empty() ? &by_pool_[pool] : nullptr;
  }

 private:
  static Key KeyOf(RadixNode* node) { return {node->priority, node->last_access, node}; }
  absl::btree_set<Key>& SetOf(PoolId pool);
  // A candidate of a group: its pool key, then the pool.
  using GroupKey = std::tuple<double, uint64_t, RadixNode*, PoolId>;
  void AddToGroup(RadixNode* node, PoolId pool);
  void RemoveFromGroup(RadixNode* node, PoolId pool);
  // Takes `node`'s candidates out, runs `update` on its fields, re-scores, puts them back.
  template <typename Update>
  void Rekey(RadixNode* node, Update update);

  std::vector<absl::btree_set<Key>> by_pool_;  // indexed by PoolId
  bool track_groups_ = false;
  absl::flat_hash_map<uint32_t, absl::btree_set<GroupKey>> by_group_;  // no empty sets
};

// "lru": SGLang RadixCache's order. Every node on a matched or inserted path gets the same
// stamp; the least recently stamped candidate goes first.
std::unique_ptr<EvictionPolicy> MakeLruPolicy();

// "cost": keeps what saves the most prefill per byte. Each reuse of a node buys it extra
// time in the cache, in proportion to the prefill it saves per byte:
//   priority = last_access_s + reuse_credit * min(hits - 1, 10) * worth
//   worth    = recompute cost per byte, relative to a DeepSeek-V3 page
// Recency decays everything (a reuse is worth a fixed amount of time, so an old reuse
// counts for less than a fresh access once that time has passed); the cost per byte
// shrinks with the model's bytes per token (an MLA page saves ~71x more per byte than an
// MHA-shaped one). Replica-aware: a node that another pool also holds (another agent's GPU,
// or this agent's HOST pool) is evicted before every node that is the only copy, least
// recently used first among them, because dropping it loses a transfer, not a recompute.
// Replicas of a dropped pool count until SweepRetired removes them (it runs continuously
// in the manager).
// A run evicted and inserted again within the regret window keeps its hit count (see
// CacheIndex), so reuse that outlives a stay in the cache still counts. Eviction takes only
// the tail pages it needs from a victim node. docs/EVICTION.md has the measurements
// behind reuse_credit = 40 s.
std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(absl::Duration reuse_credit);

// "adaptive": the score of "cost" with a credit learnt online instead of a fixed one:
//   priority = last_access_s + credit * reuse_interval * min(hits - 1, 10) * worth
// reuse_interval is a running mean of the time between a leaf's access and its reuse (a
// match, or a ghost hit: a run evicted and asked for again within the regret window), so
// the credit is dimensionless. The credit is worth its space when a reused node that it
// keeps past the eviction age (how old unreused runs are when evicted) is hit more often
// than an unreused run, evicted to make that room, is asked for again. Both rates are
// counted online (decayed over about 1,024 events); after each event the credit moves one
// `step` towards the better of the two and stays in [min_credit, max_credit]. A node keeps
// the credit of its last touch (re-scoring every candidate on each change would cost
// O(n)). It learns from the ghost history, so it needs a regret window
// (CacheIndexOptions::regret_window > 0; without one the credit stays at initial_credit).
// Replica-aware, trims nodes and demotes to the HOST tier as "cost" does.
// Deterministic. docs/EVICTION.md ("Adaptive credit, cross-validated") has its evaluation.
class AdaptivePolicy final : public EvictionPolicy {
 public:
  explicit AdaptivePolicy(const AdaptiveParams& params);
  absl::string_view name() const override { return "adaptive"; }
  bool trims_nodes() const override { return true; }
  bool demotes_to_host() const override { return true; }
  uint64_t OnGhostAdded(const RadixNode& node, double now_s) override;
  void OnGhostHit(const RadixNode& leaf, const GhostHit& ghost, double now_s) override;

  // The credit now, in mean reuse intervals, and the mean reuse interval (seconds; 0
  // before the first reuse).
  double credit() const { return credit_; }
  double reuse_interval_s() const { return reuse_interval_s_; }

 protected:
  void OnTouch(const RadixNode& node, double now_s, Access access) override;
  double Score(const RadixNode& node) const override;

 private:
  // Adds one interval between an access and the reuse that followed to the running mean.
  void SampleReuse(double interval_s);
  // Moves the credit one step towards where the two rates below say it should be.
  void Adapt();

  const AdaptiveParams params_;
  double credit_;
  double reuse_interval_s_ = 0;  // running mean
  uint64_t samples_ = 0;
  double eviction_age_s_ = 0;  // of runs without reuse, running mean
  uint64_t age_samples_ = 0;
  // Decayed counts. A reused node older than the eviction age was either hit (the credit
  // kept it for that hit) or evicted unreused (the credit kept it in vain); a run used once
  // that was evicted was either asked for again within the regret window or not.
  double credit_kept_hit_ = 0, credit_kept_vain_ = 0;
  double once_evicted_ = 0, once_regretted_ = 0;
};

std::unique_ptr<AdaptivePolicy> MakeAdaptivePolicy(const AdaptiveParams& params);

// "density": evicts the candidate with the lowest hit density, learnt online: page hits
// expected per second of residence, times the recompute cost per byte of the model's KV
// (LHD, Beckmann et al., NSDI '18, with the worth of "cost"). Candidates are classed by
// tenant (tree group) and, with DensityParams::reuse_classes > 1, by how often they were
// used, and aged in power-of-two buckets from about a millisecond. For each (class, age)
// cell the policy counts, in pages, lives that ended in a reuse (a hit, or a ghost hit: a
// run evicted and asked for again within the regret window, counted at the age it would
// have been hit) or in an eviction without one, and ranks the cells by reuses to come over
// expected residence to come. It evicts from the lowest-ranked cell that holds a
// candidate, least recently used first within it. So it keeps what is about to be reused
// and drops what has outlived every reuse it has seen, in either order: a conversation
// whose next turn is due outranks one just served when turns come at a steady pace.
// With lru_guard, least-recently-used is a second expert: when the two would evict
// different candidates, the one whose victims came back less often (ghost hits per
// evicted page, decayed) decides, and the other keeps the rate it had when it last
// decided. Nothing in it is a time scale of a workload: ages are log-spaced and the counts
// decay per event. It needs a regret window to learn from evictions. Replica-aware, trims
// nodes and demotes to the HOST tier as "cost" does. Deterministic.
// docs/EVICTION.md ("Hit density") has its evaluation.
std::unique_ptr<EvictionPolicy> MakeHitDensityPolicy(const DensityParams& params);

// "conversation": keeps the contexts whose conversation is likeliest to come back. A prompt
// that extends a whole cached leaf (its match ended where a leaf ended) is the next turn of
// that leaf's conversation; the leaf it adds is one turn deeper. Each added leaf is classed
// by its turn depth (0-4+) and how many pages it added (power-of-two buckets), and the
// policy learns online, per class, how often a leaf is continued (a match that covers a
// whole leaf, or a ghost hit of an evicted one), and the typical time to that continuation
// (a geometric running mean). The score is recency shifted by the learnt log-odds:
//   priority = last_access_s + shift * typical_gap_s * logit(p_continued(class))
// so a class twice as likely to continue is kept about shift * typical_gap longer. Counts
// decay per event (about the last 2,048 leaves), so nothing is a time scale of one trace;
// before the first continuation every class is equal and the order is least-recently-used.
// A node keeps the score of its last touch. Replica-aware, trims nodes and demotes to the
// HOST tier as "cost" does. Deterministic. docs/EVICTION.md ("Conversation turns") has the
// analysis behind it and its evaluation.
std::unique_ptr<EvictionPolicy> MakeConversationPolicy(const ConversationParams& params);

// "opt": Belady's clairvoyant order for the simulator: the candidate whose first page is
// needed furthest in the future goes first. REQUIRES: oracle != nullptr.
std::unique_ptr<EvictionPolicy> MakeOptPolicy(const NextUseOracle* oracle);

// "lru-mha": LRU, for which CacheIndex charges MHA-shaped bytes (the byte-blind baseline).
std::unique_ptr<EvictionPolicy> MakeLruMhaPolicy();

// "opt-whether": knows whether a node will be used again but not when: least recently used
// first among those that will not, then among those that will. REQUIRES: oracle != nullptr.
std::unique_ptr<EvictionPolicy> MakeOptWhetherPolicy(const NextUseOracle* oracle);

// Policies by name: server/core/policies/registry.h.

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_EVICTION_POLICY_H_
