// Replays a request trace through the real kvcm::CacheIndex on simulated time.
//
// Per request, at its arrival time:
//   1. Route, with the core's router (server/core/router.h), the manager's Route RPC uses:
//      the policy picks a GPU (prefill-saved first probes the index, changing nothing).
//      Match(pin = true) on that GPU. In global mode a prefix held only by other GPUs is
//      either transferred (it then counts as a hit) or recomputed, whichever the router's
//      cost model says is faster: bytes / link bandwidth vs tokens / prefill rate.
//   2. Insert the prompt's whole pages into that GPU's pool (block ids from a per-pool
//      counter). Pages already there are kept; pages held elsewhere become replicas here.
//      RESOURCE_EXHAUSTED (the pool is too small or all pinned) counts as a failed insert.
//      With PoolBacking::kAgent, the worker's Allocate -> write -> Insert on agent ledgers
//      instead (ReplayOptions::backing).
//   3. Hold the pin for the request's duration: prefill of the tokens not hit at
//      prefill_tokens_per_s, plus any transfer, plus output_tokens * decode_ms_per_token.
//   4. Release the pin when the request finishes. Completions are processed in time order
//      (a priority queue) before each later arrival; the FakeClock the index reads follows
//      the simulated time, so leases and the eviction-regret window run on it. Nothing
//      sleeps.
// GPUs are not modelled as queues: every request starts at its arrival, however many run.
//
// The insert happens in the same instant as the match, so requests are cached in arrival
// order; with unbounded capacity the replay's hits are exactly the trace's repeated pages
// that lie on a repeated prefix (all of them, for chained traces).
//
// Cluster modes, with the same per-GPU capacity (total / gpus) in both:
//   global  one CacheIndex over gpus pools "gpu-0".."gpu-N-1"; a match sees every GPU.
//   local   gpus independent CacheIndex instances of one pool each; a GPU sees only itself.
//
// Not thread-safe; one replay runs on the calling thread.
#ifndef KVCM_BENCH_REPLAY_REPLAYER_H_
#define KVCM_BENCH_REPLAY_REPLAYER_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "bench/replay/trace.h"
#include "common/model_spec.h"
#include "server/core/cache_index.h"
#include "server/core/router.h"

namespace kvcm::bench {

enum class ClusterMode : uint8_t { kGlobal, kLocal };

absl::string_view ClusterModeName(ClusterMode mode);
absl::StatusOr<ClusterMode> ParseClusterMode(absl::string_view name);  // "global", "local"

// What holds each agent pool's pages (ReplayOptions::backing).
enum class PoolBacking : uint8_t { kIndexOnly, kAgent };

absl::string_view PoolBackingName(PoolBacking backing);
absl::StatusOr<PoolBacking> ParsePoolBacking(absl::string_view name);  // "index", "agent"

struct ReplayOptions {
  // Eviction policy of every CacheIndex (CacheIndexOptions::policy). "opt" gets a next-use
  // oracle built from the trace: the next request anywhere in the trace (global mode, or
  // local mode with least-loaded routing, which depends on the replay), or the next request
  // routed to the same GPU (local mode with a routing that the trace alone decides).
  std::string policy = "lru";
  // KV geometry. REQUIRES: spec.page_size_tokens == the trace's page size.
  ModelSpec spec;
  // Models of tenants 1.. of a multi-tenant trace (TraceRequest::tenant), each in its own
  // namespace of its own tenant, sharing the pools. REQUIRES: the trace's page size, and
  // one entry per tenant above 0 the trace names. Capacity fractions then count each
  // distinct page at its own model's bytes.
  std::vector<ModelSpec> extra_specs;
  // Total capacity as a fraction of the trace's distinct pages x spec.BytesPerPage() (the
  // real bytes, whatever the policy charges), split evenly over the GPUs.
  double capacity_fraction = 1.0;
  uint32_t gpus = 1;
  ClusterMode mode = ClusterMode::kGlobal;
  // The core's RankAgents over the GPUs, with the request index as the round-robin step
  // and the GPU's running requests as its load. prefill-saved needs the global index.
  RoutePolicy route = RoutePolicy::kRoundRobin;
  // Prefill throughput of one GPU, tokens/s: what recomputing an uncached token costs.
  double prefill_tokens_per_s = 10'000;
  // Decode time per output token, ms.
  double decode_ms_per_token = 20;
  // GPU-to-GPU link bandwidth for transfers in global mode, Gbit/s.
  double link_gbps = 400;
  // CacheIndexOptions::regret_window, on simulated time.
  absl::Duration regret_window = absl::Minutes(5);
  // HOST-tier pool of each GPU's agent, as a fraction like capacity_fraction (0: none).
  // Only policies that demote (all but lru, lru-mha and opt) put pages there; a page found in the
  // requester's own HOST pool counts as a local hit (the host-to-GPU copy is not timed).
  double host_capacity_fraction = 0;
  // CacheIndexOptions::reuse_credit, for the "cost" policy.
  absl::Duration reuse_credit = absl::Seconds(40);
  // CacheIndexOptions::adaptive, for the "adaptive" policy.
  AdaptiveParams adaptive;
  // CacheIndexOptions::density, for the "density" policy.
  DensityParams density;
  // CacheIndexOptions::conversation, for the "conversation" policy.
  ConversationParams conversation;
  // CacheIndexOptions::select, for the "select" policy; a fixed sample key, so that a
  // replay is reproducible.
  SelectParams select{.sample_key = 0x6b76636d};

  // kIndexOnly: the index alone; step 2 above (Insert with counter block ids) evicts the
  // shortfall. kAgent: every GPU and HOST pool is backed by a real BlockLedger of
  // capacity / bytes per page blocks, in process (bench/replay/agent_backed_pool.h), and
  // step 2 is the worker's path (issue 33): Allocate blocks for the pages the pool lacks;
  // when the agent is short, EvictForAllocation of the shortfall, whose evictions free the
  // victims' blocks, then Allocate again; Commit on the ledger; Insert with newly_committed;
  // free what the index did not keep. A refused EvictForAllocation or Insert is a failed
  // insert. After every request, ledgers and index are checked against each other (an
  // INTERNAL error ends the replay). REQUIRES for kAgent: every tenant's model has the same
  // bytes per page (an agent pool's blocks have one size).
  PoolBacking backing = PoolBacking::kIndexOnly;
  // kAgent: every this many requests, and after the last, the check is a full one (every
  // committed block is the index's block of its page: O(pages held), a probe Match per chain);
  // the other requests check counts and their own blocks only. 0: after the last only.
  uint32_t agent_full_check_every = 1;

  // Whether to fill ReplayResult::request_hit_pages (kvcm-bench --explain).
  bool record_request_hits = false;
  // Called after each request's Insert with the request index and every index of the
  // cluster (tests check budgets there). Optional.
  std::function<void(size_t request, std::span<CacheIndex* const> indexes)> after_request;
  // Called every few hundred requests and at the end. Optional.
  std::function<void(size_t done, size_t total)> progress;

  absl::Status Validate() const;
};

struct ReplayResult {
  uint32_t page_size_tokens = 0;
  uint64_t bytes_per_page = 0;          // real (spec) bytes of one page
  uint64_t distinct_pages = 0;          // of the trace
  uint64_t capacity_bytes_per_gpu = 0;  // what each pool was given

  uint64_t requests = 0;
  uint64_t requests_with_hit = 0;        // at least one page hit (local or transferred)
  uint64_t prompt_pages = 0;             // whole pages of all prompts
  uint64_t hit_pages = 0;                // pages not prefilled: local hits + transferred
  uint64_t transferred_pages = 0;        // hits fetched from another GPU (global mode)
  uint64_t recomputed_remote_pages = 0;  // cached on another GPU but cheaper to recompute
  uint64_t failed_inserts = 0;           // Insert answered RESOURCE_EXHAUSTED
  // Per request, in trace order, its hit pages; only with record_request_hits.
  std::vector<uint32_t> request_hit_pages;

  // Summed over the cluster's indexes (IndexCounters).
  uint64_t inserted_page_locations = 0;
  uint64_t evicted_pages = 0;
  uint64_t eviction_regret_pages = 0;
  uint64_t lease_expiries = 0;  // 0 unless a request outlived its lease (a replay bug)

  // PoolBacking::kAgent only (0 otherwise). Stores that found the agent short (the first
  // Allocate failed), the page-locations EvictForAllocation evicted for them (also in
  // evicted_pages) and its refusals (also in failed_inserts); HOST copies the agent made and
  // those it could not (the index abandoned them); ledger checks, full ones included.
  uint64_t short_allocations = 0;
  uint64_t allocation_evicted_pages = 0;
  uint64_t allocation_room_refusals = 0;
  uint64_t agent_demotions = 0;
  uint64_t agent_failed_demotions = 0;
  uint64_t agent_checks = 0;
  uint64_t agent_full_checks = 0;

  // "select" only: its moves, summed over the cluster's indexes, and the choice of each at
  // the end ("+"-joined); shadow page-locations at the end against the index's own.
  uint64_t select_switches = 0;
  std::string select_choice;
  uint64_t select_shadow_pages = 0;
  uint64_t index_pages = 0;

  // Core work, as kvcm_core_bench counts it: per request the prompt's pages looked up by
  // Match + the pages passed to Insert, plus every page evicted. core_seconds is the wall
  // time spent inside CacheIndex calls (Match, Insert, Release).
  uint64_t page_ops = 0;
  double core_seconds = 0;
  double simulated_seconds = 0;  // arrival of the first request to the last completion

  uint64_t prompt_tokens() const { return prompt_pages * page_size_tokens; }
  // = prefill tokens saved.
  uint64_t hit_tokens() const { return hit_pages * page_size_tokens; }
  double TokenHitRate() const {
    return prompt_pages == 0 ? 0 : static_cast<double>(hit_pages) / prompt_pages;
  }
  double RequestHitRate() const {
    return requests == 0 ? 0 : static_cast<double>(requests_with_hit) / requests;
  }
  double PageOpsPerSecond() const { return core_seconds > 0 ? page_ops / core_seconds : 0; }
};

absl::StatusOr<ReplayResult> Replay(const Trace& trace, const ReplayOptions& options);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_REPLAYER_H_
