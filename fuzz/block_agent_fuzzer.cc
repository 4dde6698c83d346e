// BlockAgent request handling on the agent: Allocate and Free through BlockAgentService's own
// handler bodies (AllocateRequestOf, FreeBlocksAs: authorization, generations, the ledger), as
// one of three callers chosen per call (the open dev-mode caller, and two workers of tenant
// acme); RunAttention and Stats as the service's handler bodies do them, ReadBlocks through the
// checks and the chunk reads its reactor makes, WriteBlocks message sequences (header, data chunks,
// half-close) through the WriteBlocksStage its reactor uses, and Fetch through the real Fetcher up
// to the pull (a transport that checks the pull it is given and refuses it), against an AgentWorld.
// Records as in fuzz_input.h.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fuzz/agent_world.h"
#include "fuzz/calls.h"
#include "fuzz/fuzz_input.h"
#include "gpu/agent/control/agent_proto.h"
#include "gpu/agent/pool/pool_attention.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "gpu/agent/server/block_stream_reactors.h"
#include "gpu/agent/server/fetcher.h"
#include "proto/core_types.h"

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

std::shared_ptr<const Principal> Worker(std::string name) {
  auto p = std::make_shared<Principal>();
  p->name = std::move(name);
  p->roles = static_cast<uint8_t>(Role::kWorker);
  p->tenant = "acme";
  return p;
}

struct Session {
  AgentWorld world;
  // The caller of a call: callers[body size % 3].
  const std::shared_ptr<const Principal> callers[3] = {OpenPrincipal(), Worker("acme-a"),
                                                       Worker("acme-b")};
  AgentMetrics metrics{world.options.agent_id, world.pools, &world.epoch};
  RefusingTransport transport;
  Fetcher fetcher{world.options.agent_id, world.options.tier, world.pools, &world.epoch, &transport,
                  // Every source is known, at the refusing transport's address.
                  [](const std::string&, PeerAddressDone done) { done("127.0.0.1:1"); },
                  /*manager=*/nullptr, &metrics};
  std::optional<WriteBlocksStage> write;

  // BlockAgentService::ReadBlocks and ReadBlocksReactor: the pool, the checks, the chunks.
  absl::Status ReadBlocks(const v1::ReadBlocksRequest& req) {
    BlockPool* pool = nullptr;
    if (req.tier() == v1::TIER_UNSPECIFIED ||
        req.tier() == static_cast<v1::Tier>(world.options.tier)) {
      pool = world.pools.main;
    } else if (req.tier() == v1::TIER_HOST) {
      pool = world.pools.host;
    }
    if (absl::Status s = CheckReadBlocks(world.options, pool, req); !s.ok()) return s;
    const std::vector<BlockId> ids(req.block_ids().begin(), req.block_ids().end());
    const uint64_t total = ids.size() * pool->geometry().bytes_per_block();
    std::string chunk;
    for (uint64_t sent = 0; sent < total;) {
      chunk.resize(std::min<uint64_t>(world.options.read_chunk_bytes, total - sent));
      if (absl::Status s = ReadBlocksChunk(*pool, ids, {}, req.owner_epoch(), sent, chunk);
          !s.ok()) {
        return s;
      }
      sent += chunk.size();
    }
    return absl::OkStatus();
  }

  // BlockAgentService::RunAttention's body.
  absl::Status RunAttention(const v1::RunAttentionRequest& req) {
    PoolAttentionRequest in;
    in.block_table.reserve(req.block_table_size());
    for (const v1::BlockList& row : req.block_table()) {
      in.block_table.emplace_back(row.block_ids().begin(), row.block_ids().end());
    }
    in.seq_lens.assign(req.seq_lens().begin(), req.seq_lens().end());
    in.query_bf16 = std::as_bytes(std::span<const char>(req.query()));
    in.softmax_scale = req.softmax_scale();
    in.num_heads = req.num_heads();
    in.layer = req.layer();
    in.owner_epoch = req.owner_epoch();
    absl::StatusOr<PoolAttentionResult> out = RunMlaDecodeOnPool(*world.pools.main, in);
    if (!out.ok()) return out.status();
    v1::RunAttentionResponse resp;
    resp.set_output(out->output.data(), out->output.size() * sizeof(float));
    resp.mutable_lse()->Add(out->lse.begin(), out->lse.end());
    return absl::OkStatus();
  }

  const Principal& Caller(std::string_view body) const { return *callers[body.size() % 3]; }

  absl::Status Run(Call call, std::string_view body) {
    switch (call) {
      case kAllocate: {
        v1::AllocateBlocksRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        absl::StatusOr<RoomMaker::Request> request = AllocateRequestOf(Caller(body), req);
        if (!request.ok()) return request.status();
        return RoomMaker::AllocateNow(*world.pools.main, *request).status();
      }
      case kFree: {
        v1::FreeBlocksRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        return FreeBlocksAs(Caller(body), *world.pools.main, req);
      }
      case kWriteMessage: {
        v1::WriteBlocksRequest msg;
        if (!Parse(body, &msg)) return absl::InvalidArgumentError("unparsable");
        if (!write.has_value()) write.emplace(&world.options, world.pools.main);
        absl::Status s = write->Take(msg);
        if (!s.ok()) write.reset();  // a refused message ends the call
        return s;
      }
      case kWriteClose: {
        if (!write.has_value()) write.emplace(&world.options, world.pools.main);
        v1::WriteBlocksResponse resp;
        absl::Status s = write->Apply(&resp);
        write.reset();
        return s;
      }
      case kReadBlocks: {
        v1::ReadBlocksRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        return ReadBlocks(req);
      }
      case kRunAttention: {
        v1::RunAttentionRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        return RunAttention(req);
      }
      case kFetch: {
        v1::FetchRequest req;
        if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
        absl::Status answer = absl::UnknownError("no answer");
        fetcher.Fetch(req, [&](absl::StatusOr<FetchResult> r) { answer = r.status(); });
        Require(!answer.ok() && answer.message() != "no answer", "Fetch answers, refused");
        return answer;
      }
      case kStats: {
        v1::BlockAgentStatsResponse resp;
        const BlockPoolStats s = world.pools.main->Stats();
        PoolGeometryToProto(world.pools.main->geometry(), resp.mutable_geometry());
        resp.set_used_bytes(s.used_bytes);
        resp.set_free_blocks(s.free_blocks);
        return absl::OkStatus();
      }
      case kNumCalls:
        break;
    }
    return absl::OkStatus();
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
