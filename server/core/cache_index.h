// CacheIndex: the manager's global prefix index. One radix tree of page hashes per
// namespace, each page carrying the pools (agent, tier) that hold it; the lease table of
// pins; per-pool byte budgets; and the eviction policy that keeps pools within capacity.
//
// Thread-safe: every public method may be called concurrently. One reader/writer mutex
// guards the index: matches that do not pin (probes, Route's lookups, counting matches),
// Stats and the other readers share it. A counting match records its recency update in a
// small buffer that the next exclusive section (a pin, an insert, any other writer) applies
// first, in order, so the eviction order is the one the match would have made itself
// (docs/PERFORMANCE.md, "Readers beside inserts").
#ifndef KVCM_SERVER_CORE_CACHE_INDEX_H_
#define KVCM_SERVER_CORE_CACHE_INDEX_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/byte_budget.h"
#include "server/core/cache_index_types.h"
#include "server/core/clock.h"
#include "server/core/eviction_history.h"
#include "server/core/eviction_policy.h"
#include "server/core/lease_table.h"
#include "server/core/radix_tree.h"
#include "server/core/recency_buffer.h"
#include "server/core/tenant_ledger.h"

namespace kvcm {

// Longest max page age a namespace or the manager may set (10 years): anything longer is
// a mistake (a value in ms given as seconds), not a retention policy.
inline constexpr uint32_t kMaxPageAgeS = 10 * 365 * 86'400;

struct CacheIndexOptions {
  // Secret every namespace's hash key is derived from. Keep it stable across restarts, or
  // clients' cached hash keys go stale (they get FAILED_PRECONDITION and re-register).
  HashKey hash_secret;
  // Eviction policy by name: a row of server/core/policies/registry.cc.
  std::string policy = "lru";
  // Next-use oracle for "opt" (simulator only). Not owned.
  const NextUseOracle* next_use = nullptr;
  // "cost": how much recency one reuse of a page is worth (see MakeCostAwarePolicy).
  absl::Duration reuse_credit = absl::Seconds(40);
  // "adaptive": its dimensionless parameters (see AdaptiveParams).
  AdaptiveParams adaptive;
  // "density": its parameters (see DensityParams).
  DensityParams density;
  // "conversation": its parameters (see ConversationParams).
  ConversationParams conversation;
  // "select": its parameters (see SelectParams).
  SelectParams select;
  // Capacity given to a pool the first time an Insert names it. 0 refuses unknown pools
  // (NOT_FOUND) so that only RegisterPool creates them.
  uint64_t default_pool_capacity_bytes = 64ULL << 30;
  // Lease of a pin when the caller asks for none.
  absl::Duration default_lease_ttl = absl::Seconds(30);
  // Longest lease a caller may ask for.
  absl::Duration max_lease_ttl = absl::Minutes(10);
  // How long an expired pin id is remembered, so that Release answers ABORTED (expired)
  // rather than NOT_FOUND.
  absl::Duration expired_pin_memory = absl::Minutes(10);
  // An eviction counts as regretted when its page is requested again within this window.
  absl::Duration regret_window = absl::Minutes(5);
  // Most namespaces, in all and per tenant, that RegisterModel creates (RESOURCE_EXHAUSTED
  // beyond). Namespaces rebuilt from agents' inventories are not refused: what agents hold
  // is the truth. >= 1.
  uint32_t max_namespaces = 4'096;
  uint32_t max_namespaces_per_tenant = 64;
  // Most live pins of one tenant's namespaces: a Match(pin) beyond is RESOURCE_EXHAUSTED,
  // with nothing matched or pinned, so no tenant can pin a pool full. >= 1.
  uint32_t max_pins_per_tenant = 65'536;
  // Tenant quotas (docs/EVICTION.md), 0: unlimited. tenant_max_bytes: the bytes one tenant
  // may hold, its page-locations in live pools (each replica, pages x bytes_per_page) plus
  // what it reserved; an Insert or Reserve beyond first evicts the tenant's own unpinned
  // pages (never another tenant's), and is RESOURCE_EXHAUSTED, nothing changed, when that
  // cannot make room. tenant_max_pinned_bytes: the bytes of its page-locations that its pins
  // may hold (each replica counts, a page under several pins once); a Match(pin) beyond is
  // RESOURCE_EXHAUSTED with nothing matched or pinned. At most tenant_max_bytes when both
  // are set.
  uint64_t tenant_max_bytes = 0;
  uint64_t tenant_max_pinned_bytes = 0;
  // Fair by default (docs/SECURITY.md, "Limits"): while neither tenant quota above is set,
  // in a pool where another tenant holds pages or a reservation, the bytes one tenant (other
  // than the operators' "") reserves there plus the bytes of its pages there that its pins
  // hold may reach this percent of the pool's capacity; a Reserve or a Match(pin) beyond is
  // RESOURCE_EXHAUSTED naming default_tenant_pool_share_pct, nothing changed. A pool one
  // tenant has to itself is not limited, and unpinned pages never are: any tenant's Insert
  // or Reserve can evict them. 1..100; 100 turns the share off.
  uint32_t default_tenant_pool_share_pct = 50;
  // Page-locations (pages x tiers) in one engine's pools, and in the engine pools of one
  // tenant's namespaces (StoreEnginePages): a store beyond is RESOURCE_EXHAUSTED naming
  // the option, nothing changed. >= 1.
  uint64_t max_engine_pages_per_engine = 1ULL << 20;
  uint64_t max_engine_pages_per_tenant = 4ULL << 20;
  // Retention (docs/EVICTION.md): how long a page-location may stay indexed after it was
  // committed, for every namespace; a namespace's own limit (RegisterModel) may only be
  // shorter. 0: no limit. At most kMaxPageAgeS seconds.
  absl::Duration default_max_page_age = absl::ZeroDuration();
  // Time source; RealClock::Get() when null. Not owned.
  Clock* clock = nullptr;

  // What the policy is made over (next_use and each policy's parameters above).
  PolicyContext policy_context() const;
  absl::Status Validate() const;
};

// What happened to the index, for WatchEvents subscribers.
struct CacheEvent {
  enum class Kind : uint8_t { kStored = 1, kRemoved = 2, kCleared = 3 };
  // Why pages were removed (kRemoved only; kNone for the other kinds and for a demotion
  // the agent could not carry out).
  enum class Reason : uint8_t { kNone = 0, kEvicted = 1, kExpired = 2 };
  Kind kind;
  NamespaceId ns;
  PoolKey pool;
  // kCleared: empty (every page of `pool` in `ns` left at once).
  std::vector<PageHash> pages;
  // kRemoved: the evicted replica's block ids, one per page of `pages` (kPendingBlock for a
  // HOST block the agent has not reported yet). Empty for the other kinds.
  std::vector<BlockId> block_ids;
  // kStored by a demotion into a HOST pool (its blocks are kPendingBlock until AssignBlocks):
  // the GPU pool the pages are copied from, its block id of each page of `pages`, and the
  // pages of the path above `pages` (prefix + pages is a prompt's leading pages, which is
  // what AssignBlocks takes). Empty for every other event.
  std::optional<PoolKey> demoted_from;
  std::vector<BlockId> source_block_ids;
  std::vector<PageHash> prefix;
  Reason reason = Reason::kNone;
};

// Called with events in order, under the index's lock: must be quick and must not call back
// into the CacheIndex.
using CacheEventListener = std::function<void(const CacheEvent&)>;

class CacheIndex {
 public:
  // REQUIRES: options.Validate().ok() (use Create to get an error instead).
  explicit CacheIndex(CacheIndexOptions options);
  ~CacheIndex();
  CacheIndex(const CacheIndex&) = delete;
  CacheIndex& operator=(const CacheIndex&) = delete;

  static absl::StatusOr<std::unique_ptr<CacheIndex>> Create(CacheIndexOptions options);

  // Replaces the event listener (null to stop). Safe to call at any time.
  void SetEventListener(CacheEventListener listener) ABSL_LOCKS_EXCLUDED(mu_);

  // The tenants the deployment knows (the tokens file's, as the service reloads it). With
  // two or more, default_tenant_pool_share_pct limits every tenant in every pool from its
  // first byte; with fewer (no tokens file, or one tenant) only once another tenant uses
  // the pool. Safe to call at any time.
  void SetConfiguredTenants(size_t count) ABSL_LOCKS_EXCLUDED(mu_);

  // Who asks for a namespace: a client (within max_namespaces and max_namespaces_per_tenant),
  // the rebuild from agents' inventories (never refused for a count), or a reader that may
  // only confirm an existing namespace and learn its key (a router: NOT_FOUND when absent,
  // and its max_page_age changes nothing).
  enum class NamespaceSource : uint8_t { kClient, kInventory, kReader };

  // Creates namespace `ns` or confirms it. FAILED_PRECONDITION, nothing changed, when it
  // exists with a spec that is not CompatibleWith `spec` (a kv_layout conflict names both
  // layouts); INVALID_ARGUMENT for a bad spec or name; RESOURCE_EXHAUSTED naming the limit
  // when a client's new namespace would pass max_namespaces or max_namespaces_per_tenant.
  // A namespace stored without a kv_layout takes `spec`'s (unless `source` is kReader); the
  // result's spec is the stored one, layout included, whatever `spec` stated.
  //
  // `max_page_age` is the namespace's retention limit (0: the manager's default; the
  // shorter of the two is in force). It only ever tightens: confirming a namespace with a
  // shorter non-zero limit lowers it (pages already older leave at the next SweepExpired),
  // a longer one or 0 leaves it as it is (the result says what is in force).
  // INVALID_ARGUMENT "max_page_age_s", nothing changed, when it is negative or longer than
  // kMaxPageAgeS.
  absl::StatusOr<RegisterModelResult> RegisterModel(
      const NamespaceId& ns, const ModelSpec& spec,
      NamespaceSource source = NamespaceSource::kClient,
      absl::Duration max_page_age = absl::ZeroDuration()) ABSL_LOCKS_EXCLUDED(mu_);

  // The namespace's spec and hash key; NOT_FOUND when unregistered.
  absl::StatusOr<RegisterModelResult> GetNamespace(const NamespaceId& ns) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Chained page hashes of `tokens` in namespace `ns` (trailing partial page ignored).
  absl::StatusOr<std::vector<PageHash>> HashTokens(const NamespaceId& ns,
                                                   std::span<const int32_t> tokens) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Creates pool `pool` with `capacity_bytes`, or changes its capacity. Lowering capacity
  // below used bytes evicts the difference; RESOURCE_EXHAUSTED (and no change) when pins
  // prevent that.
  absl::Status SetPoolCapacity(const PoolKey& pool, uint64_t capacity_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Whether `pool` exists (SetPoolCapacity or an Insert created it).
  bool HasPool(const PoolKey& pool) const ABSL_LOCKS_EXCLUDED(mu_);
  // An id of the pool's current incarnation: DropPool starts a new one. NOT_FOUND for an
  // unknown pool.
  absl::StatusOr<uint64_t> PoolGeneration(const PoolKey& pool) const ABSL_LOCKS_EXCLUDED(mu_);

  // Longest prefix of `pages` cached anywhere. NOT_FOUND for an unknown namespace.
  // Without pin it shares the index's lock with other readers: a counting match's recency
  // update (and the split of a partly matched last node) is applied by the next exclusive
  // call, before that call changes anything, so Stats' radix_nodes may lag until then.
  // With pin, RESOURCE_EXHAUSTED (nothing matched, pinned or counted) naming
  // max_pins_per_tenant, tenant_max_pinned_bytes or default_tenant_pool_share_pct when the
  // pin would pass one.
  // Never returns a page-location past its namespace's max page age: the match ends before
  // the first radix node that still holds one (even when another pool holds the same pages
  // younger), because a new pin there would keep the old copy; SweepExpired removes it.
  absl::StatusOr<MatchResult> Match(const NamespaceId& ns, std::span<const PageHash> pages,
                                    const MatchOptions& options) ABSL_LOCKS_EXCLUDED(mu_);

  // Records that `pool` holds pages [0, pages.size()) of a prompt in blocks `block_ids`.
  // Evicts exactly the shortfall from `pool` when the new pages do not fit, and then, when
  // they would take ns's tenant past tenant_max_bytes, that tenant's own pages (any pool,
  // policy order, never demoted); when either cannot make room, RESOURCE_EXHAUSTED (naming
  // tenant_max_bytes for the quota) and nothing changes.
  // REQUIRES: block_ids.size() == pages.size() (INVALID_ARGUMENT otherwise).
  absl::StatusOr<InsertResult> Insert(const NamespaceId& ns, std::span<const PageHash> pages,
                                      const PoolKey& pool, std::span<const BlockId> block_ids,
                                      const InsertOptions& options = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // Headroom for `tenant`'s admitted work: makes `bytes` of `pool` free, evicting exactly
  // the shortfall (whole nodes), and holds them reserved for the tenant until it Unreserves
  // them or an Insert with use_reservation into one of its namespaces takes them. The bytes
  // count against tenant_max_bytes: beyond it the tenant's own pages are evicted first, as
  // for Insert. Tenant "": an operator's reservation, no quota (and no Insert takes it).
  // RESOURCE_EXHAUSTED (nothing changed) when pins leave too little evictable in the pool
  // or of the tenant's pages (naming tenant_max_bytes), or when the tenant's reservation and
  // pins would pass its default share of the pool (naming default_tenant_pool_share_pct);
  // NOT_FOUND for an unknown pool.
  // Returns the bytes evicted.
  absl::StatusOr<uint64_t> Reserve(const PoolKey& pool, uint64_t bytes, const std::string& tenant)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Room for an agent's allocation that its free blocks cannot serve (BlockAgent.Allocate;
  // AgentControl.MakeRoom): evicts `shortfall_bytes` (whole nodes) from agent pool `pool` in
  // policy order, with an Insert's guarantees (pinned pages and reservations stay, GPU
  // victims are demoted to the agent's HOST pool when the policy demotes), and, when the
  // allocation's `allocation_bytes` would take ns's tenant past tenant_max_bytes, that
  // tenant's own pages too (MakeRoom). The victims' blocks reach the agent as FreeBlocks
  // commands (kRemoved events). The tenant's stores in flight in the pool
  // (`in_flight_bytes`, allocated and not committed, as the agent counts them) plus this
  // allocation are a claim like a reservation: past its default_tenant_pool_share_pct of a
  // pool other tenants use, RESOURCE_EXHAUSTED naming the option. RESOURCE_EXHAUSTED,
  // nothing changed, too when pins or reservations leave less than the shortfall evictable
  // (the message says which) or the tenant's quota cannot make room; NOT_FOUND for an
  // unknown pool or namespace; FAILED_PRECONDITION for an engine's pool; INVALID_ARGUMENT
  // for shortfall_bytes 0.
  absl::StatusOr<EvictResult> EvictForAllocation(const PoolKey& pool, const NamespaceId& ns,
                                                 uint64_t shortfall_bytes,
                                                 uint64_t allocation_bytes,
                                                 uint64_t in_flight_bytes = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Returns headroom `tenant` no longer needs. OUT_OF_RANGE, nothing changed, beyond what
  // that tenant holds reserved in `pool`.
  absl::Status Unreserve(const PoolKey& pool, uint64_t bytes, const std::string& tenant)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Drops pin `pin_id` of namespace `ns`. NOT_FOUND for an unknown pin (or one of another
  // namespace), ABORTED for one whose lease expired.
  absl::Status Release(const NamespaceId& ns, PinId pin_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Extends a live pin's lease to now + ttl (0: default). Same errors as Release, and
  // ABORTED for a pin some of whose pages no live pool holds any more (their agent's pools
  // were dropped): the pin protects nothing, the caller should release it and match again.
  // ABORTED too for a pin on pages of which some copy is past its max page age: a pin may
  // keep expired pages only until its lease ends.
  absl::StatusOr<absl::Time> RenewLease(const NamespaceId& ns, PinId pin_id, absl::Duration ttl)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Evicts at least `bytes` of unpinned pages from one pool / one namespace, by policy.
  // All or nothing: OUT_OF_RANGE when the target holds fewer bytes, RESOURCE_EXHAUSTED when
  // fewer are unpinned; neither changes anything.
  absl::StatusOr<EvictResult> EvictFromPool(const PoolKey& pool, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<EvictResult> EvictFromNamespace(const NamespaceId& ns, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Fills in the HOST blocks of a demotion (see CacheEvent::demoted_from): `pages` are a
  // prompt's leading pages, and block_ids[i] is the block now holding page first_page + i
  // in `pool`. A page gets its block only while that pool still holds it with
  // kPendingBlock; the ids of the other pages (evicted meanwhile, or already filled) are
  // returned, in order, for the caller to free. INVALID_ARGUMENT when block_ids does not
  // cover pages[first_page..] exactly or names kPendingBlock; NOT_FOUND for an unknown
  // namespace or pool.
  absl::StatusOr<std::vector<BlockId>> AssignBlocks(const NamespaceId& ns,
                                                    std::span<const PageHash> pages,
                                                    uint32_t first_page, const PoolKey& pool,
                                                    std::span<const BlockId> block_ids)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Undoes a demotion the agent could not carry out: removes the replicas in `pool` of
  // pages[first_page..] whose blocks are all still kPendingBlock, deepest first, while they
  // are unpinned leaves of the pool (pages a later demotion put below them, or a pin, keep
  // them pending until the pool's policy evicts them). kRemoved events carry no block to
  // free. Returns the pages removed. Errors as AssignBlocks.
  absl::StatusOr<uint64_t> AbandonPending(const NamespaceId& ns, std::span<const PageHash> pages,
                                          uint32_t first_page, const PoolKey& pool)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets every page `pool` holds, pinned or not, without evicting (no kRemoved events,
  // nothing to free: the blocks are gone with the agent's old incarnation), in O(1): the
  // pool's replicas are retired at once (Match and eviction no longer see them) and the
  // pool starts empty under a fresh id with the same capacity and reservations. The
  // retired replicas leave the tree through SweepRetired (an empty pool gets a fresh id
  // too, so PoolGeneration changes); pins keep working (a pin on pages
  // only the dropped pool held just holds nothing). One kCleared event per namespace.
  // With `forget`, the pool has no fresh incarnation: it leaves Stats (and the metrics),
  // every tenant's reservation in it is released, and only a later SetPoolCapacity or
  // Insert makes it anew (its agent left for good). NOT_FOUND for an unknown pool.
  absl::StatusOr<DropPoolResult> DropPool(const PoolKey& pool, bool forget = false)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes namespace `ns` with everything it holds: its live pins are dropped (their ids
  // become unknown), every page-location leaves with a kRemoved event (so its agent frees
  // the block, as after an eviction), and the namespace stops counting against
  // max_namespaces. Not counted as eviction. NOT_FOUND for an unknown namespace.
  absl::StatusOr<DeleteNamespaceResult> DeleteNamespace(const NamespaceId& ns)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Engine pools (cache_index_engine.cc): the prefix cache of an inference engine that keeps
  // its own KV, mirrored from its events (PublishEngineEvents). The engine is their truth:
  // the manager never evicts, expires or reserves them, Insert never writes them, they hold
  // no blocks (kNoBlock) and count against no byte quota, only against the engine page caps. An
  // engine's changes apply even to pinned pages: a pin cannot keep KV the engine dropped (Match
  // stops before pages no pool holds any more, and RenewLease of such a pin is ABORTED).
  //
  // Records that engine pool `pool` holds every page of the chain `pages` (from a prompt's
  // first page), creating the pool on first use. Returns the page-locations added.
  // FAILED_PRECONDITION naming the pool when it is an agent's or an index-only pool;
  // NOT_FOUND for an unknown namespace; INVALID_ARGUMENT for no pages; RESOURCE_EXHAUSTED
  // naming max_engine_pages_per_engine / max_engine_pages_per_tenant when the new
  // page-locations would take the engine (all its tiers) or ns's tenant past it.
  absl::StatusOr<uint64_t> StoreEnginePages(const NamespaceId& ns, std::span<const PageHash> pages,
                                            const PoolKey& pool) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes from `pool` the chain's last page and every page under it; nothing when the pool
  // does not hold that page. Returns the page-locations removed. Errors as StoreEnginePages.
  absl::StatusOr<uint64_t> RemoveEnginePages(const NamespaceId& ns, std::span<const PageHash> pages,
                                             const PoolKey& pool) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every page of `ns` in `pool` (0 for a pool never used). Errors as
  // StoreEnginePages, except that no pages is what it takes.
  absl::StatusOr<uint64_t> ClearEnginePool(const NamespaceId& ns, const PoolKey& pool)
      ABSL_LOCKS_EXCLUDED(mu_);
  // OK when `pool` is an engine's or unknown; FAILED_PRECONDITION as StoreEnginePages
  // otherwise.
  absl::Status CheckEnginePool(const PoolKey& pool) const ABSL_LOCKS_EXCLUDED(mu_);
  // Page-locations `pool` holds (0 for an unknown pool).
  uint64_t PoolPages(const PoolKey& pool) const ABSL_LOCKS_EXCLUDED(mu_);

  // Removes up to `max_replicas` retired replicas (unpinned ones, leaves first) from the
  // tree, freeing nodes nothing else holds. The manager runs it in small steps on a timer,
  // so the index lock is never held for long.
  SweepResult SweepRetired(size_t max_replicas) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes page-locations past their namespace's max page age (age = time since commit),
  // oldest first, with kRemoved events (reason kExpired) so that their blocks are freed,
  // as evictions do. A page-location's descendants in the same pool leave with it (a pool
  // holds whole prefixes). Pinned ones stay until their pins are released or lapse. Does
  // at most `max_steps` replicas' work (removed, or looked at and left) per call, so the
  // index lock is never held for long; one pass over every namespace with a limit may take
  // several calls (`more`). The manager runs it from its lease sweep. REQUIRES:
  // max_steps >= 1.
  ExpirySweepResult SweepExpired(size_t max_steps) ABSL_LOCKS_EXCLUDED(mu_);

  // The index's clock (CacheIndexOptions::clock).
  absl::Time Now() const { return clock_->Now(); }

  // Releases every pin whose lease ended at or before now. Also done lazily by every
  // mutating call; the service runs it on a timer so idle managers expire pins too.
  void ExpireLeases() ABSL_LOCKS_EXCLUDED(mu_);

  IndexStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // Recomputes every tenant's usage from the trees, the pools and the leases and compares
  // it with the counters kept as the index changes; INTERNAL naming the first difference.
  // O(index): for tests.
  absl::Status CheckTenantAccounting() const ABSL_LOCKS_EXCLUDED(mu_);

  const CacheIndexOptions& options() const { return options_; }

  // Internal record of one namespace; defined in cache_index_internal.h.
  struct Namespace;

 private:
  // mu_ held exclusively, the accesses readers recorded applied first (ApplyAccessesLocked);
  // every exclusive section takes it. Defined in cache_index_internal.h.
  class WriterLock;

  // Applies the accesses in recency_, in the order recorded, each as the match that recorded
  // it would have: lease expiry and the regret window's pruning at its time, the
  // split of a partly matched last node, the policy's Touch of the path with its stamp.
  // Nothing else changes the tree between recording and applying, so every node named is
  // still there.
  void ApplyAccessesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes mu_ exclusively to apply the pending accesses.
  void FlushAccesses() ABSL_LOCKS_EXCLUDED(mu_);
  // Reports a prompt to a policy that observes them once the lock is released.
  class PromptObserver;
  absl::StatusOr<Namespace*> FindNamespace(const NamespaceId& ns) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // NOT_FOUND for a pool no Insert or SetPoolCapacity created.
  absl::StatusOr<PoolId> FindPool(const PoolKey& pool) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<absl::Duration> LeaseTtl(absl::Duration requested) const;
  void ExpireLeasesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the pin `lease` (released, expired or its namespace deleted): unpins its path and
  // counts it off its tenant. lease.node may be gone when it returns.
  void EndPin(const Lease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Tenant quotas (cache_index_quota.cc; the counts and checks are ledger_'s).
  // Evicts at least `bytes` of `tenant`'s unpinned pages in live pools, in the policy's
  // cross-pool order, without demoting them; retired replicas met on the way are swept.
  // REQUIRES: the tenant's evictable bytes >= `bytes`.
  EvictResult EvictTenantLocked(Tenant& tenant, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What an Insert or Reserve is about to add to a tenant: a demotion during its eviction
  // must leave room for it (DemoteToHost).
  struct Incoming {
    const Tenant* tenant;  // null: none
    uint64_t bytes;
  };
  // Makes room for `adding` bytes of `tenant` in pool `pool` (nullopt: a pool the caller
  // creates) that needs `pool_shortfall` evicted: checks that both the pool and the tenant
  // can make room, then evicts from the pool and from the tenant. RESOURCE_EXHAUSTED,
  // nothing changed, when one cannot; `what` and `pool_key` name the call in the message.
  absl::StatusOr<uint64_t> MakeRoom(Tenant& tenant, uint64_t adding, std::optional<PoolId> pool,
                                    const PoolKey& pool_key, uint64_t pool_shortfall,
                                    absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Keeps (node, replica) registered with the policy exactly when it is an unpinned leaf of
  // its pool.
  void RefreshCandidate(RadixNode* node, Replica& replica) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RadixTree::Split, keeping the policy's order.
  RadixNode* SplitNode(RadixNode* node, uint32_t k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds / drops one pin on `node` and every ancestor, keeping pinned bytes in step.
  void PinPath(RadixNode* node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinPath(RadixNode* node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives `node` a replica in `pool`, committed at `committed_ms` (Unix ms).
  // REQUIRES: the parent (unless root) holds `pool`.
  void AddReplica(RadixNode* node, PoolId pool, std::span<const BlockId> block_ids,
                  int64_t committed_ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts the candidate (node, pool); removes the node when no replica is left.
  // Returns the bytes freed.
  uint64_t EvictReplica(RadixNode* node, PoolId pool, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What evicting, sweeping and engines' removals share: drops the replica (node, pool) from
  // the policy, the budget and the parent's child_refs; removes the node when no replica is
  // left (after `on_last`, called with the node before it goes). Returns the replica's block
  // ids. REQUIRES: the replica is an eviction candidate (an unpinned leaf of its pool), or
  // is in an engine's pool and no descendant holds that pool: an engine removes pinned pages
  // too, and a pinned node it empties stays, holding nothing, until its last pin ends
  // (UnpinPath).
  std::vector<BlockId> RemoveReplica(RadixNode* node, PoolId pool,
                                     absl::FunctionRef<void(RadixNode*)> on_last)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Engine pools (cache_index_engine.cc). The pool's id, created as an engine pool when new
  // and `create`; FAILED_PRECONDITION when `pool` is not an engine's, NOT_FOUND when
  // unknown and not `create`.
  absl::StatusOr<PoolId> EnginePool(const PoolKey& pool, bool create)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION naming `what` when `pool` is an engine's.
  absl::Status NotEnginePool(PoolId pool, const PoolKey& key, absl::string_view what) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Page-locations in engine `engine_id`'s live pools, all tiers.
  uint64_t EnginePagesLocked(const std::string& engine_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Removes the replicas in engine pool `pool` of `top` and of every descendant, leaves
  // first; returns the page-locations removed. `on_node` sees each node's pages first.
  uint64_t RemoveEngineSubtree(RadixNode* top, PoolId pool,
                               absl::FunctionRef<void(const RadixNode&)> on_node)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `node` has a replica in a pool that is not retired.
  bool HasLiveReplica(const RadixNode* node) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Retention (cache_index_expiry.cc). The limit in force for a namespace registered with
  // `registered` (0: the default); InfiniteDuration when none.
  absl::Duration MaxPageAgeFor(absl::Duration registered) const;
  // Sets ns's registered limit and the one in force, filling its retention queue when it
  // gets a limit.
  void SetMaxPageAge(Namespace& ns, absl::Duration registered) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `node` holds a replica, in a pool that is not retired, committed at or before
  // `cutoff_ms`.
  bool HoldsExpired(const RadixNode* node, int64_t cutoff_ms) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Keeps ns's retention queue in step with (node, replica) entering or leaving the tree.
  void TrackExpiry(RadixNode* node, const Replica& replica) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UntrackExpiry(RadixNode* node, const Replica& replica) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One namespace's part of SweepExpired; false when `steps` reached `max_steps` first.
  bool SweepNamespace(Namespace& ns, absl::Time now, size_t max_steps, size_t& steps,
                      ExpirySweepResult& result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `top`'s replica in `pool` and every descendant's, leaves first, as expired;
  // false, with the rest left for the next call, when `steps` reaches `max_steps`.
  // REQUIRES: top unpinned (so is every descendant).
  bool ExpireSubtree(RadixNode* top, PoolId pool, size_t max_steps, size_t& steps,
                     ExpirySweepResult& result) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives `node` (a victim in GPU pool `gpu`) a replica in the same agent's HOST pool, with
  // whatever of its prefix the HOST pool lacks (pools stay prefix-closed), evicting from
  // the HOST pool to make room. False, changing nothing, when there is no HOST pool or it
  // cannot make room. New host blocks are kPendingBlock until the agent reports them.
  // False too when the copies would take the node's tenant past tenant_max_bytes (leaving
  // room for `incoming`).
  bool DemoteToHost(RadixNode* node, PoolId gpu, const Incoming& incoming)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts at least `bytes` from `pool` in policy order.
  // REQUIRES: budget_.evictable(pool) >= bytes.
  // With `skip_pending`, replicas whose blocks are still kPendingBlock (a demotion the agent
  // has not acknowledged) are passed over, so it may evict less: a demotion that evicted a
  // page an earlier, unacknowledged demotion put in the HOST pool would find the agent's
  // HOST pool short (the block that page is about to get is freed only after the earlier
  // ack), fail, and leave pending pages indexed with no block.
  EvictResult EvictLocked(PoolId pool, uint64_t bytes,
                          const Incoming& incoming = Incoming{nullptr, 0},
                          bool skip_pending = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts the pages of a match's miss that were evicted within the regret window: the run
  // that starts at the first missed page, if one was evicted, capped by the pages asked.
  // Marks the run counted under regret_mu_, so matches sharing mu_ count it once.
  void CountRegret(std::span<const PageHash> missed, absl::Time now) ABSL_SHARED_LOCKS_REQUIRED(mu_)
      ABSL_LOCKS_EXCLUDED(regret_mu_);
  // Forgets the evicted runs that left the regret window by `now`.
  void ForgetOldEvictions(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Emit(CacheEvent::Kind kind, const Namespace& ns, PoolId pool,
            std::span<const PageHash> pages, std::vector<BlockId> block_ids = {},
            CacheEvent::Reason reason = CacheEvent::Reason::kNone)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CacheIndexOptions options_;
  Clock* const clock_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<NamespaceId, std::unique_ptr<Namespace>> namespaces_ ABSL_GUARDED_BY(mu_);
  ByteBudget budget_ ABSL_GUARDED_BY(mu_);
  // Tenants with a namespace or a reservation: their counts, usage and reservations.
  TenantLedger ledger_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<EvictionPolicy> policy_ ABSL_GUARDED_BY(mu_);
  LeaseTable leases_ ABSL_GUARDED_BY(mu_);
  IndexCounters counters_ ABSL_GUARDED_BY(mu_);
  // The counters non-pinning matches add to while they share mu_ (the rest of counters_
  // changes only under it exclusively).
  struct MatchCounters {
    std::atomic<uint64_t> match_requests{0};
    std::atomic<uint64_t> requested_pages{0};
    std::atomic<uint64_t> matched_pages{0};
    std::atomic<uint64_t> requested_tokens{0};
    std::atomic<uint64_t> matched_tokens{0};
    std::atomic<uint64_t> eviction_regret_pages{0};
  };
  MatchCounters match_counters_;
  // The access stamps of matched and inserted paths, and the recency updates of matches
  // that share mu_ (recorded under it, applied by the next exclusive section).
  RecencyBuffer recency_;
  // Taken after mu_ (shared) by matches that count regret; never the other way round.
  absl::Mutex regret_mu_ ABSL_ACQUIRED_AFTER(mu_);
  // Runs of pages removed within regret_window: eviction regret, and re-inserted runs'
  // earlier hit counts.
  EvictionHistory history_ ABSL_GUARDED_BY(mu_);
  CacheEventListener listener_ ABSL_GUARDED_BY(mu_);
  // Retired pools (DropPool) with replicas left in the tree, oldest first.
  std::deque<PoolId> sweeping_ ABSL_GUARDED_BY(mu_);
  // Namespaces with a retention limit (they keep a retention queue), and the one SweepExpired
  // goes on with.
  std::vector<Namespace*> expiring_ ABSL_GUARDED_BY(mu_);
  size_t expiry_next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_CACHE_INDEX_H_
