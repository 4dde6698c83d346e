#include "bench/replay/replayer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <queue>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "bench/replay/agent_backed_pool.h"
#include "bench/replay/next_use_oracle.h"
#include "bench/workload.h"
#include "server/core/clock.h"

namespace kvcm::bench {
namespace {

using SteadyClock = std::chrono::steady_clock;

const NamespaceId kNamespace{"bench", "replay"};

// Tenant t's namespace: kNamespace for 0 (single-tenant runs are unchanged), its own
// tenant otherwise.
NamespaceId TenantNamespace(uint32_t t) {
  return t == 0 ? kNamespace : NamespaceId{absl::StrCat("bench-", t), "replay"};
}
// Extra lease beyond a request's longest possible duration, so that its Release always
// comes first.
constexpr double kLeaseMarginMs = 1000;
// Longest lease the simulator's indexes allow; a request longer than a day of simulated
// time would let its lease lapse, which ReplayResult::lease_expiries shows.
constexpr absl::Duration kMaxLease = absl::Hours(24);

// An index-only pool's demotions, acknowledged at once: an agent answers a DemoteBlocks
// with the HOST blocks it copied into, and until then the pages are pending (never evicted
// by a later demotion, CacheIndex::EvictLocked). With no agent behind the pools, this
// listener gives every demoted page a block of its own right after the call that demoted
// it, as an agent that answers at once would.
class InstantDemotions {
 public:
  // Becomes `index`'s event listener; `index` must outlive this object.
  explicit InstantDemotions(CacheIndex* index) : index_(index) {
    index_->SetEventListener([this](const CacheEvent& e) {
      if (e.kind != CacheEvent::Kind::kStored || !e.demoted_from.has_value()) return;
      Demotion d{.ns = e.ns,
                 .pool = e.pool,
                 .path = e.prefix,
                 .first_page = static_cast<uint32_t>(e.prefix.size())};
      d.path.insert(d.path.end(), e.pages.begin(), e.pages.end());
      pending_.push_back(std::move(d));
    });
  }
  ~InstantDemotions() { index_->SetEventListener(nullptr); }
  InstantDemotions(const InstantDemotions&) = delete;
  InstantDemotions& operator=(const InstantDemotions&) = delete;

  // Assigns the demotions of the last call (outside the index's lock).
  absl::Status Settle() {
    std::vector<Demotion> pending;
    pending.swap(pending_);
    for (const Demotion& d : pending) {
      std::vector<BlockId> blocks(d.path.size() - d.first_page);
      for (BlockId& b : blocks) b = next_block_++ % kPendingBlock;
      absl::StatusOr<std::vector<BlockId>> unassigned =
          index_->AssignBlocks(d.ns, d.path, d.first_page, d.pool, blocks);
      if (!unassigned.ok()) return unassigned.status();
    }
    return absl::OkStatus();
  }

 private:
  struct Demotion {
    NamespaceId ns;
    PoolKey pool;
    std::vector<PageHash> path;
    uint32_t first_page = 0;
  };
  CacheIndex* const index_;
  std::vector<Demotion> pending_;
  uint64_t next_block_ = 0;
};

// A request still running: its pin is released at finish_ms.
struct Completion {
  double finish_ms;
  uint64_t seq;  // arrival order, to break ties deterministically
  uint32_t gpu;
  CacheIndex* index;
  uint32_t tenant;
  PinId pin;  // 0: nothing matched, nothing to release
  bool operator>(const Completion& o) const {
    return finish_ms != o.finish_ms ? finish_ms > o.finish_ms : seq > o.seq;
  }
};

// Whether the trace alone decides each request's GPU (not the replay's state).
bool RouteIsStatic(RoutePolicy route) {
  return route == RoutePolicy::kRoundRobin || route == RoutePolicy::kFirstPageHash;
}

class ReplayRun {
 public:
  ReplayRun(const Trace& trace, const ReplayOptions& options)
      : trace_(trace), options_(options), start_(clock_.Now()) {}

  absl::StatusOr<ReplayResult> Run() {
    if (absl::Status s = Setup(); !s.ok()) return s;
    const size_t n = trace_.requests.size();
    for (size_t i = 0; i < n; ++i) {
      if (absl::Status s = Serve(i); !s.ok()) return s;
      const uint32_t every = options_.agent_full_check_every;
      if (absl::Status s = CheckAgents(every > 0 && (i + 1) % every == 0); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("after request ", i, ": ", s.message()));
      }
      if (options_.after_request) options_.after_request(i, raw_indexes_);
      if (options_.progress && (i + 1) % 256 == 0) options_.progress(i + 1, n);
    }
    if (absl::Status s = CompleteUntil(std::numeric_limits<double>::infinity()); !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckAgents(/*full=*/true); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("after the last request: ", s.message()));
    }
    if (options_.progress) options_.progress(n, n);
    for (CacheIndex* index : raw_indexes_) {
      const IndexStats stats = index->Stats();
      const IndexCounters& c = stats.counters;
      for (const PoolStats& p : stats.pools) result_.index_pages += p.pages;
      if (stats.selection.has_value()) {
        result_.select_switches += stats.selection->switches;
        result_.select_shadow_pages += stats.selection->shadow_pages;
        absl::StrAppend(&result_.select_choice, result_.select_choice.empty() ? "" : "+",
                        stats.selection->active);
      }
      result_.inserted_page_locations += c.inserted_pages;
      result_.evicted_pages += c.evicted_pages;
      result_.eviction_regret_pages += c.eviction_regret_pages;
      result_.lease_expiries += c.lease_expiries;
      result_.allocation_evicted_pages += c.allocation_evicted_pages;
      result_.allocation_room_refusals += c.allocation_room_refusals;
    }
    for (const std::unique_ptr<AgentBackedPools>& agents : agents_) {
      const AgentPathCounters& c = agents->counters();
      result_.short_allocations += c.short_allocations;
      result_.agent_demotions += c.demotions;
      result_.agent_failed_demotions += c.failed_demotions;
      result_.agent_checks += c.checks;
      result_.agent_full_checks += c.full_checks;
    }
    result_.page_ops += result_.evicted_pages;
    if (n > 0) result_.simulated_seconds = (last_finish_ms_ - trace_.requests[0].arrival_ms) / 1e3;
    return result_;
  }

 private:
  absl::Status Setup() {
    const uint32_t gpus = options_.gpus;
    result_.page_size_tokens = options_.spec.page_size_tokens;
    result_.bytes_per_page = options_.spec.BytesPerPage();
    result_.distinct_pages = trace_.DistinctPages();
    specs_.push_back(options_.spec);
    for (const ModelSpec& extra : options_.extra_specs) specs_.push_back(extra);
    for (const TraceRequest& r : trace_.requests) {
      if (r.tenant >= specs_.size()) {
        return absl::InvalidArgumentError(absl::StrCat("trace ", trace_.name, " names tenant ",
                                                       r.tenant, " but only ", specs_.size(),
                                                       " model specs are given"));
      }
    }
    double total = options_.capacity_fraction * static_cast<double>(result_.distinct_pages) *
                   static_cast<double>(result_.bytes_per_page);
    if (specs_.size() > 1) {
      // Each distinct page at its own model's bytes.
      std::vector<absl::flat_hash_set<PageHash>> distinct(specs_.size());
      for (const TraceRequest& r : trace_.requests) {
        distinct[r.tenant].insert(r.pages.begin(), r.pages.end());
      }
      double bytes = 0;
      for (size_t t = 0; t < specs_.size(); ++t) {
        bytes +=
            static_cast<double>(distinct[t].size()) * static_cast<double>(specs_[t].BytesPerPage());
      }
      total = options_.capacity_fraction * bytes;
    }
    result_.capacity_bytes_per_gpu = static_cast<uint64_t>(total / gpus);
    for (uint32_t g = 0; g < gpus; ++g) {
      pools_.push_back(PoolKey{absl::StrCat("gpu-", g), Tier::kGpu});
      candidates_.push_back(
          RouteCandidate{.agent_id = pools_.back().agent_id, .link_gbps = options_.link_gbps});
    }
    for (const ModelSpec& spec : specs_) {
      costs_.push_back(RouteCost{.bytes_per_page = spec.BytesPerPage(),
                                 .page_size_tokens = spec.page_size_tokens,
                                 .prefill_tokens_per_s = options_.prefill_tokens_per_s});
    }

    // Oracles for "opt": one per GPU when each GPU has its own index and the trace alone
    // decides which requests it serves; otherwise one over the whole trace.
    const bool local = options_.mode == ClusterMode::kLocal;
    const size_t num_indexes = local ? gpus : 1;
    if (options_.policy == "opt" || options_.policy == "opt-whether") {
      std::vector<uint32_t> routes;
      if (local && RouteIsStatic(options_.route)) {
        routes.reserve(trace_.requests.size());
        for (size_t i = 0; i < trace_.requests.size(); ++i) {
          routes.push_back(Rank(i, trace_.requests[i], MatchResult{}).front().candidate);
        }
        for (uint32_t g = 0; g < gpus; ++g) {
          oracles_.push_back(std::make_unique<TraceNextUseOracle>(trace_, routes, g));
        }
      } else {
        oracles_.push_back(std::make_unique<TraceNextUseOracle>(trace_));
      }
    }

    for (size_t k = 0; k < num_indexes; ++k) {
      CacheIndexOptions o;
      o.policy = options_.policy;
      if (!oracles_.empty()) o.next_use = oracles_[std::min(k, oracles_.size() - 1)].get();
      o.default_pool_capacity_bytes = 0;  // only the pools registered below exist
      o.default_lease_ttl = absl::Seconds(30);
      o.max_lease_ttl = kMaxLease;
      o.regret_window = options_.regret_window;
      o.reuse_credit = options_.reuse_credit;
      o.adaptive = options_.adaptive;
      o.density = options_.density;
      o.conversation = options_.conversation;
      o.select = options_.select;
      o.clock = &clock_;
      // The replays measure eviction with tenants that trust each other: no default share
      // (docs/SECURITY.md), so the published numbers stay comparable.
      o.default_tenant_pool_share_pct = 100;
      absl::StatusOr<std::unique_ptr<CacheIndex>> index = CacheIndex::Create(std::move(o));
      if (!index.ok()) return index.status();
      for (uint32_t t = 0; t < specs_.size(); ++t) {
        absl::StatusOr<RegisterModelResult> reg =
            (*index)->RegisterModel(TenantNamespace(t), specs_[t]);
        if (!reg.ok()) return reg.status();
      }
      std::unique_ptr<AgentBackedPools> agents;
      if (options_.backing == PoolBacking::kAgent) {
        agents = std::make_unique<AgentBackedPools>(index->get());
      } else if (options_.host_capacity_fraction > 0) {
        demotions_.push_back(std::make_unique<InstantDemotions>(index->get()));
      }
      // An agent's pool of `bytes` has bytes / page bytes blocks, as many pages as the
      // index lets it hold.
      const auto add_pool = [&](const PoolKey& pool, uint64_t bytes) -> absl::Status {
        if (absl::Status s = (*index)->SetPoolCapacity(pool, bytes); !s.ok()) return s;
        if (agents == nullptr) return absl::OkStatus();
        return agents->AddPool(pool, static_cast<uint32_t>(bytes / result_.bytes_per_page));
      };
      for (uint32_t g = 0; g < gpus; ++g) {
        if (local && g != k) continue;
        if (absl::Status s = add_pool(pools_[g], result_.capacity_bytes_per_gpu); !s.ok()) {
          return s;
        }
        if (options_.host_capacity_fraction > 0) {
          const double host = options_.host_capacity_fraction / options_.capacity_fraction *
                              static_cast<double>(result_.capacity_bytes_per_gpu);
          const PoolKey host_pool{pools_[g].agent_id, Tier::kHost};
          if (absl::Status s = add_pool(host_pool, static_cast<uint64_t>(host)); !s.ok()) {
            return s;
          }
        }
      }
      if (agents != nullptr) agents_.push_back(std::move(agents));
      raw_indexes_.push_back(index->get());
      indexes_.push_back(std::move(*index));
    }
    in_flight_.assign(gpus, 0);
    prefill_busy_until_ms_.assign(gpus, 0);
    return absl::OkStatus();
  }

  // The agent ledgers against the indexes (PoolBacking::kAgent; nothing otherwise).
  absl::Status CheckAgents(bool full) {
    for (const std::unique_ptr<AgentBackedPools>& agents : agents_) {
      if (absl::Status s = agents->Check(full); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Moves the FakeClock to simulated time `ms` (never backwards).
  void SetTime(double ms) {
    const absl::Duration d = (start_ + absl::Milliseconds(ms)) - clock_.Now();
    if (d > absl::ZeroDuration()) clock_.Advance(d);
  }

  template <typename Fn>
  auto Timed(Fn fn) {
    const SteadyClock::time_point t0 = SteadyClock::now();
    auto r = fn();
    result_.core_seconds += std::chrono::duration<double>(SteadyClock::now() - t0).count();
    return r;
  }

  // Releases the pins of every request that finished at or before `ms`, in time order.
  absl::Status CompleteUntil(double ms) {
    while (!running_.empty() && running_.top().finish_ms <= ms) {
      const Completion c = running_.top();
      running_.pop();
      SetTime(c.finish_ms);
      last_finish_ms_ = std::max(last_finish_ms_, c.finish_ms);
      --in_flight_[c.gpu];
      if (c.pin == 0) continue;
      absl::Status s = Timed([&] { return c.index->Release(TenantNamespace(c.tenant), c.pin); });
      // ABORTED: the lease lapsed first (the index counts it in lease_expiries).
      if (!s.ok() && !absl::IsAborted(s)) return s;
    }
    return absl::OkStatus();
  }

  // The GPUs for request i, best first. `match` is a probe of the global index (only
  // prefill-saved reads it).
  std::vector<RouteEstimate> Rank(size_t i, const TraceRequest& r, const MatchResult& match) {
    for (uint32_t g = 0; g < options_.gpus; ++g) {
      candidates_[g].load = in_flight_.empty() ? 0 : in_flight_[g];
      // Prefill still ahead of GPU g if it ran its requests' prefills one after another.
      const double backlog_ms = prefill_busy_until_ms_.empty()
                                    ? 0
                                    : std::max(0.0, prefill_busy_until_ms_[g] - r.arrival_ms);
      candidates_[g].queued_prefill_tokens =
          static_cast<uint64_t>(backlog_ms * options_.prefill_tokens_per_s / 1e3);
    }
    return RankAgents(options_.route, match, candidates_, costs_[r.tenant], i,
                      r.pages.empty() ? nullptr : &r.pages[0]);
  }

  absl::StatusOr<uint32_t> PickGpu(size_t i, const TraceRequest& r) {
    const NamespaceId ns = TenantNamespace(r.tenant);
    MatchResult probe;
    if (options_.route == RoutePolicy::kPrefillSaved && !r.pages.empty()) {
      absl::StatusOr<MatchResult> m =
          Timed([&] { return indexes_[0]->Match(ns, r.pages, {.probe = true}); });
      if (!m.ok()) return m.status();
      probe = *std::move(m);
      result_.page_ops += r.pages.size();  // looked up by Route's probe
    }
    return static_cast<uint32_t>(Rank(i, r, probe).front().candidate);
  }

  // Step 2: the prompt's pages into GPU `gpu`'s pool, after `match`.
  absl::Status Store(uint32_t gpu, const NamespaceId& ns, std::span<const PageHash> pages,
                     const MatchResult& match) {
    if (options_.backing == PoolBacking::kAgent) {
      AgentBackedPools& agents = *agents_[agents_.size() == 1 ? 0 : gpu];
      absl::StatusOr<bool> stored =
          Timed([&] { return agents.Store(ns, pages, pools_[gpu], match); });
      if (!stored.ok()) return stored.status();
      if (!*stored) ++result_.failed_inserts;
      return absl::OkStatus();
    }
    CacheIndex* index = indexes_.size() == 1 ? indexes_[0].get() : indexes_[gpu].get();
    std::span<const BlockId> blocks = blocks_.Next(gpu, static_cast<uint32_t>(pages.size()));
    absl::StatusOr<InsertResult> ins =
        Timed([&] { return index->Insert(ns, pages, pools_[gpu], blocks); });
    for (const std::unique_ptr<InstantDemotions>& d : demotions_) {
      if (absl::Status s = d->Settle(); !s.ok()) return s;
    }
    if (absl::IsResourceExhausted(ins.status())) {
      ++result_.failed_inserts;
    } else if (!ins.ok()) {
      return ins.status();
    }
    return absl::OkStatus();
  }

  absl::Status Serve(size_t i) {
    const TraceRequest& r = trace_.requests[i];
    if (absl::Status s = CompleteUntil(r.arrival_ms); !s.ok()) return s;
    SetTime(r.arrival_ms);
    for (auto& oracle : oracles_) oracle->set_cursor(i);

    absl::StatusOr<uint32_t> picked = PickGpu(i, r);
    if (!picked.ok()) return picked.status();
    const uint32_t gpu = *picked;
    CacheIndex* index = indexes_.size() == 1 ? indexes_[0].get() : indexes_[gpu].get();
    const NamespaceId ns = TenantNamespace(r.tenant);
    const double page_tokens = options_.spec.page_size_tokens;
    const double prefill_ms_per_token = 1e3 / options_.prefill_tokens_per_s;
    const double decode_ms = r.output_tokens * options_.decode_ms_per_token;
    uint64_t hit = 0;
    double transfer_ms = 0;
    PinId pin = 0;
    if (!r.pages.empty()) {
      // The longest the request can run: a transfer is only chosen when it is faster than
      // the prefill it replaces, so prefilling everything bounds it.
      const double worst_ms = r.prompt_tokens * prefill_ms_per_token + decode_ms + kLeaseMarginMs;
      const MatchOptions match_options{
          .requester_agent_id = pools_[gpu].agent_id,
          .pin = true,
          .lease_ttl = std::min(absl::Milliseconds(worst_ms), kMaxLease)};
      absl::StatusOr<MatchResult> m =
          Timed([&] { return index->Match(ns, r.pages, match_options); });
      if (!m.ok()) return m.status();
      pin = m->pin_id;
      // What the manager's Route would tell the worker about this GPU.
      const RouteEstimate e = EstimateFor(*m, gpu, candidates_[gpu], costs_[r.tenant]);
      hit = e.cached_pages + e.fetch_pages;
      result_.transferred_pages += e.fetch_pages;
      result_.recomputed_remote_pages += m->matched_pages - e.cached_pages - e.fetch_pages;
      transfer_ms = e.transfer_ms;
      if (absl::Status s = Store(gpu, ns, r.pages, *m); !s.ok()) return s;
      result_.page_ops += 2 * r.pages.size();  // looked up by Match + passed to Insert
    }
    ++result_.requests;
    result_.prompt_pages += r.pages.size();
    result_.hit_pages += hit;
    if (hit > 0) ++result_.requests_with_hit;
    if (options_.record_request_hits) {
      result_.request_hit_pages.push_back(static_cast<uint32_t>(hit));
    }

    // Tokens to prefill: all but the hit pages (a block kept by PartialBlock::kKeepAsBlock
    // can make hit pages cover more than the prompt, hence the clamp).
    const double prefill_tokens =
        std::max(0.0, static_cast<double>(r.prompt_tokens) - hit * page_tokens);
    const double finish_ms =
        r.arrival_ms + prefill_tokens * prefill_ms_per_token + transfer_ms + decode_ms;
    running_.push(Completion{finish_ms, i, gpu, index, r.tenant, pin});
    prefill_busy_until_ms_[gpu] = std::max(prefill_busy_until_ms_[gpu], r.arrival_ms) +
                                  prefill_tokens * prefill_ms_per_token + transfer_ms;
    ++in_flight_[gpu];
    last_finish_ms_ = std::max(last_finish_ms_, finish_ms);
    return absl::OkStatus();
  }

  const Trace& trace_;
  const ReplayOptions& options_;
  FakeClock clock_;
  const absl::Time start_;
  std::vector<std::unique_ptr<TraceNextUseOracle>> oracles_;
  std::vector<std::unique_ptr<CacheIndex>> indexes_;
  std::vector<CacheIndex*> raw_indexes_;
  // PoolBacking::kAgent: one per index, in the same order; declared after indexes_ so that
  // they stop listening before their index goes.
  std::vector<std::unique_ptr<AgentBackedPools>> agents_;
  // Index-only pools with a HOST tier: their demotions, acknowledged at once.
  std::vector<std::unique_ptr<InstantDemotions>> demotions_;
  std::vector<PoolKey> pools_;
  std::vector<RouteCandidate> candidates_;  // one per GPU, as pools_
  std::vector<ModelSpec> specs_;            // by tenant: options_.spec, then extra_specs
  std::vector<RouteCost> costs_;            // by tenant
  std::vector<uint32_t> in_flight_;         // running requests per GPU
  // Per GPU: when its prefill backlog would end were prefills run one at a time (the
  // router's queued_prefill_tokens; the replay itself does not queue requests).
  std::vector<double> prefill_busy_until_ms_;
  std::priority_queue<Completion, std::vector<Completion>, std::greater<Completion>> running_;
  BlockAllocator blocks_;
  ReplayResult result_;
  double last_finish_ms_ = 0;
};

}  // namespace

absl::string_view ClusterModeName(ClusterMode mode) {
  return mode == ClusterMode::kGlobal ? "global" : "local";
}

absl::StatusOr<ClusterMode> ParseClusterMode(absl::string_view name) {
  if (name == "global") return ClusterMode::kGlobal;
  if (name == "local") return ClusterMode::kLocal;
  return absl::InvalidArgumentError(
      absl::StrCat("cluster mode \"", name, "\" is unknown; known: global, local"));
}

absl::string_view PoolBackingName(PoolBacking backing) {
  return backing == PoolBacking::kIndexOnly ? "index" : "agent";
}

absl::StatusOr<PoolBacking> ParsePoolBacking(absl::string_view name) {
  if (name == "index") return PoolBacking::kIndexOnly;
  if (name == "agent") return PoolBacking::kAgent;
  return absl::InvalidArgumentError(
      absl::StrCat("pool backing \"", name, "\" is unknown; known: index, agent"));
}

absl::Status ReplayOptions::Validate() const {
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  const auto positive = [](double v) { return std::isfinite(v) && v > 0; };
  if (!positive(capacity_fraction)) {
    return absl::InvalidArgumentError("capacity_fraction must be a positive number");
  }
  if (gpus < 1) return absl::InvalidArgumentError("gpus must be at least 1");
  if (!std::isfinite(host_capacity_fraction) || host_capacity_fraction < 0) {
    return absl::InvalidArgumentError("host_capacity_fraction must not be negative");
  }
  if (!positive(prefill_tokens_per_s)) {
    return absl::InvalidArgumentError("prefill_tokens_per_s must be positive");
  }
  if (!std::isfinite(decode_ms_per_token) || decode_ms_per_token < 0) {
    return absl::InvalidArgumentError("decode_ms_per_token must not be negative");
  }
  if (!positive(link_gbps)) return absl::InvalidArgumentError("link_gbps must be positive");
  if (backing == PoolBacking::kAgent) {
    for (const ModelSpec& extra : extra_specs) {
      if (extra.BytesPerPage() != spec.BytesPerPage()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "backing agent: an extra spec has pages of ", extra.BytesPerPage(), " bytes, not ",
            spec.BytesPerPage(), ": an agent pool's blocks have one size"));
      }
    }
  }
  if (route == RoutePolicy::kPrefillSaved && mode == ClusterMode::kLocal && gpus > 1) {
    return absl::InvalidArgumentError(
        "route prefill-saved needs the global index (mode global): in local mode no GPU "
        "sees what the others hold");
  }
  return absl::OkStatus();
}

absl::StatusOr<ReplayResult> Replay(const Trace& trace, const ReplayOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  for (const ModelSpec& extra : options.extra_specs) {
    if (absl::Status s = extra.Validate(); !s.ok()) return s;
    if (extra.page_size_tokens != trace.page_size_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace ", trace.name, " has ", trace.page_size_tokens,
                       "-token pages but an extra spec has ", extra.page_size_tokens));
    }
  }
  if (trace.page_size_tokens != options.spec.page_size_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("trace ", trace.name, " has ", trace.page_size_tokens,
                     "-token pages but spec.page_size_tokens is ", options.spec.page_size_tokens));
  }
  if (trace.requests.size() >= std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError("a trace holds at most 2^32 - 2 requests");
  }
  return ReplayRun(trace, options).Run();
}

}  // namespace kvcm::bench
