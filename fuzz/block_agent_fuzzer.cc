// BlockAgent request handling on the agent, through BlockAgentService's own handler bodies
// (block_agent_service.h: AllocateRequestOf, FreeBlocksAs, RunAttentionAs, FetchAs, StatsOf;
// block_stream_reactors.h: WriteBlocksStage for WriteBlocks message sequences of header, data
// chunks and half-close, ReadBlocksStage for ReadBlocks), so authorization, generations and the
// ledger run as the service runs them. Each call is made by one of three callers chosen per
// call (the open dev-mode caller, a worker of tenant acme and a worker of the AgentWorld's
// tenant). Fetch runs the real Fetcher up to the pull (a transport that checks the pull it is
// given and refuses it). Against an AgentWorld; records as in fuzz_input.h.
//
// Beyond the sanitizers, every call is checked against the pools' state before it: a call
// naming a block of a generation that ended, or a worker's call naming a block that is not
// its tenant's, must be refused, and a refused call (Fetch: one refused so) must change
// nothing (no generation, namespace, commit or byte); ReadBlocks, RunAttention and Stats
// never change anything. Generation 1 in a request names the block's live allocation, so that
// inputs reach a worker's own blocks too.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fuzz/agent_world.h"
#include "fuzz/calls.h"
#include "fuzz/fuzz_input.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "gpu/agent/server/block_stream_reactors.h"
#include "gpu/agent/server/fetcher.h"

namespace kvcm::fuzz {
namespace {

using namespace block_agent_calls;  // NOLINT: the harness's calls

// Checks what the Fetcher asks of a transport, then refuses the pull as an unreachable
// peer would.
class RefusingTransport final : public Transport {
 public:
  std::string address() const override { return "127.0.0.1:1"; }
  void Pull(PullSpec spec, PullDone done) override {
    const size_t n = spec.peer_blocks.size();
    Require(n > 0 && spec.pages.size() == n && spec.dst_blocks.size() == n && spec.dst != nullptr,
            "Fetch: one page and one destination block per peer block");
    done(absl::UnavailableError("peer unreachable"));
  }
};

std::shared_ptr<const Principal> Worker(std::string name, std::string tenant) {
  auto p = std::make_shared<Principal>();
  p->name = std::move(name);
  p->roles = static_cast<uint8_t>(Role::kWorker);
  p->tenant = std::move(tenant);
  return p;
}

bool IsWorkerOnly(const Principal& p) { return !p.Has(Role::kAgent) && !p.Has(Role::kAdmin); }

// What a call may change in a pool.
struct PoolState {
  std::vector<uint64_t> generations;                   // per block; 0 while free
  std::vector<std::optional<NamespaceId>> namespaces;  // per block; none: free or private
  struct Committed {
    BlockId block;
    uint64_t owner_epoch;
    PageHash page;
    NamespaceId ns;
    friend bool operator==(const Committed&, const Committed&) = default;
  };
  std::vector<Committed> committed;
  uint64_t free_blocks = 0;
  std::vector<std::byte> bytes;

  friend bool operator==(const PoolState&, const PoolState&) = default;
};

PoolState StateOf(const BlockPool& pool) {
  PoolState s;
  std::vector<BlockId> ids(pool.Stats().num_blocks);
  std::iota(ids.begin(), ids.end(), BlockId{0});
  Require(pool.CheckNamespaces(
                  ids,
                  [&](BlockId, const NamespaceId* ns) {
                    s.namespaces.push_back(ns != nullptr ? std::optional(*ns) : std::nullopt);
                    return absl::OkStatus();
                  },
                  {}, &s.generations)
              .ok(),
          "pool state");
  for (const CommittedBlock& c : pool.Inventory()) {
    s.committed.push_back({c.block, c.owner_epoch, c.page, *c.ns});
  }
  s.free_blocks = pool.Stats().free_blocks;
  s.bytes.resize(pool.backend().arena_bytes());
  Require(pool.backend().CopyOut(0, s.bytes).ok(), "pool bytes");
  return s;
}

// Whether `caller` naming `ids` of a pool in state `s`, with `generations` (parallel, or
// empty), must be refused: a generation that is not the block's (0 names none), or, for a
// worker, a block that is not allocated to a namespace of its tenant. Ids past the pool are
// left to the pool.
bool MustRefuse(const Principal& caller, const PoolState& s, std::span<const BlockId> ids,
                std::span<const uint64_t> generations) {
  const bool with_generations = !generations.empty() && generations.size() == ids.size();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= s.generations.size()) continue;
    if (with_generations && generations[i] != 0 && generations[i] != s.generations[ids[i]]) {
      return true;
    }
    const std::optional<NamespaceId>& ns = s.namespaces[ids[i]];
    if (IsWorkerOnly(caller) && (!ns.has_value() || ns->tenant != caller.tenant)) {
      return true;
    }
  }
  return false;
}

// Generation 1 in a request stands for the block's generation in `s` (no allocation has
// generation 1: they start at the clock), so that inputs can name live allocations, which
// workers must, as well as stale ones.
void NameLiveGenerations(const PoolState& s, const google::protobuf::RepeatedField<BlockId>& ids,
                         google::protobuf::RepeatedField<uint64_t>* generations) {
  for (int i = 0; i < generations->size() && i < ids.size(); ++i) {
    if (generations->Get(i) == 1 && ids.Get(i) < s.generations.size() &&
        s.generations[ids.Get(i)] != 0) {
      generations->Set(i, s.generations[ids.Get(i)]);
    }
  }
}

template <typename Ids, typename Gens>
bool MustRefuse(const Principal& caller, const PoolState& s, const Ids& ids, const Gens& gens) {
  return MustRefuse(caller, s, std::span<const BlockId>(ids.data(), ids.size()),
                    std::span<const uint64_t>(gens.data(), gens.size()));
}

struct Session {
  AgentWorld world;
  // The caller of a call: callers[body size % 3].
  const std::shared_ptr<const Principal> callers[3] = {OpenPrincipal(), Worker("acme-a", "acme"),
                                                       Worker("world-a", AgentNamespace().tenant)};
  AgentMetrics metrics{world.options.agent_id, world.pools, &world.epoch};
  RefusingTransport transport;
  Fetcher fetcher{world.options.agent_id, world.options.tier, world.pools, &world.epoch, &transport,
                  // Every source is known, at the refusing transport's address.
                  [](const std::string&, PeerAddressDone done) { done("127.0.0.1:1"); },
                  /*manager=*/nullptr, &metrics};
  // The open WriteBlocks call, and whether it took its header.
  std::optional<WriteBlocksStage> write;
  bool write_has_header = false;

  const std::shared_ptr<const Principal>& Caller(std::string_view body) const {
    return callers[body.size() % 3];
  }
  BlockPool* PoolOf(v1::Tier tier) const {
    return PoolOfTier(world.pools, world.options.tier, tier);
  }

  // The call's answer; sets *must_refuse when the state before it says it must be refused.
  absl::Status Handle(Call call, std::string_view body, const PoolState& main_before,
                      bool* must_refuse) {
    const Principal& caller = *Caller(body);
    switch (call) {
      case kAllocate: {
        v1::AllocateBlocksRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        absl::StatusOr<RoomMaker::Request> request = AllocateRequestOf(caller, req);
        if (!request.ok()) return request.status();
        return RoomMaker::AllocateNow(*world.pools.main, *request).status();
      }
      case kFree: {
        v1::FreeBlocksRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        NameLiveGenerations(main_before, req.block_ids(), req.mutable_block_generations());
        *must_refuse = MustRefuse(caller, main_before, req.block_ids(), req.block_generations());
        return FreeBlocksAs(caller, *world.pools.main, req);
      }
      case kWriteMessage: {
        v1::WriteBlocksRequest msg;
        if (!Parse(body, &msg)) return absl::InvalidArgumentError("unparsable");
        if (!write.has_value()) write.emplace(&world.options, world.pools.main, Caller(body));
        if (!write_has_header && msg.has_header()) {
          NameLiveGenerations(main_before, msg.header().block_ids(),
                              msg.mutable_header()->mutable_block_generations());
          *must_refuse = MustRefuse(caller, main_before, msg.header().block_ids(),
                                    msg.header().block_generations());
        }
        absl::Status s = write->Take(msg);
        if (s.ok()) {
          write_has_header = true;
        } else {
          write.reset();  // a refused message ends the call
          write_has_header = false;
        }
        return s;
      }
      case kWriteClose: {
        if (!write.has_value()) write.emplace(&world.options, world.pools.main, Caller(body));
        v1::WriteBlocksResponse resp;
        absl::Status s = write->Apply(&resp);
        write.reset();
        write_has_header = false;
        return s;
      }
      case kReadBlocks: {
        v1::ReadBlocksRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        const BlockPool* pool = PoolOf(req.tier());
        if (pool != nullptr) {
          const PoolState before = pool == world.pools.main ? main_before : StateOf(*pool);
          NameLiveGenerations(before, req.block_ids(), req.mutable_block_generations());
          *must_refuse = MustRefuse(caller, before, req.block_ids(), req.block_generations());
        }
        absl::StatusOr<ReadBlocksStage> read =
            ReadBlocksStage::Open(&world.options, pool, caller, req);
        if (!read.ok()) return read.status();
        std::string chunk;
        while (!read->done()) {
          if (absl::Status s = read->Next(chunk); !s.ok()) return s;
        }
        return absl::OkStatus();
      }
      case kRunAttention: {
        v1::RunAttentionRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        for (v1::BlockList& row : *req.mutable_block_table()) {
          NameLiveGenerations(main_before, row.block_ids(), row.mutable_block_generations());
          *must_refuse = *must_refuse ||
                         MustRefuse(caller, main_before, row.block_ids(), row.block_generations());
        }
        v1::RunAttentionResponse resp;
        return RunAttentionAs(caller, *world.pools.main, req, &resp);
      }
      case kFetch: {
        v1::FetchRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        BlockPool* pool = PoolOf(req.tier());
        // Agents and admins name local blocks unchecked (AuthorizeFetch): the manager's
        // Insert vouches for them.
        if (pool != nullptr) {
          const PoolState before = pool == world.pools.main ? main_before : StateOf(*pool);
          NameLiveGenerations(before, req.local_block_ids(), req.mutable_local_block_generations());
          *must_refuse = IsWorkerOnly(caller) && (req.namespace_().tenant() != caller.tenant ||
                                                  MustRefuse(caller, before, req.local_block_ids(),
                                                             req.local_block_generations()));
        }
        v1::FetchResponse resp;
        absl::Status answer = absl::UnknownError("no answer");
        FetchAs(caller, pool, &fetcher, req, &resp, [&](const absl::Status& s) { answer = s; });
        Require(!answer.ok() && answer.message() != "no answer", "Fetch answers, refused");
        return answer;
      }
      case kStats: {
        v1::BlockAgentStatsResponse resp;
        StatsOf(world.options, world.pools, world.epoch, &resp);
        return absl::OkStatus();
      }
      case kNumCalls:
        break;
    }
    return absl::OkStatus();
  }

  absl::Status Run(Call call, std::string_view body) {
    const PoolState main_before = StateOf(*world.pools.main);
    const PoolState host_before = StateOf(*world.pools.host);
    bool must_refuse = false;
    const absl::Status s = Handle(call, body, main_before, &must_refuse);
    if (must_refuse) {
      Require(!s.ok(), "a stale generation or another tenant's block is refused");
    }
    const bool changes_nothing = call == kReadBlocks || call == kRunAttention || call == kStats ||
                                 (!s.ok() && (call != kFetch || must_refuse));
    if (changes_nothing) {
      Require(
          StateOf(*world.pools.main) == main_before && StateOf(*world.pools.host) == host_before,
          "a refused call, or one that only reads, changes nothing");
    }
    return s;
  }
};

}  // namespace
}  // namespace kvcm::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::fuzz;
  Session session;
  Records records(data, size);
  uint8_t tag;
  std::string_view body;
  while (records.Next(&tag, &body)) {
    const Call call = static_cast<Call>(tag % kNumCalls);
    Report(call, session.Run(call, body));
  }
  return 0;
}
