// CacheManager request handling: every RPC's request through proto_convert's *FromProto,
// the core call and the *ToProto conversion, exactly as CacheManagerService's handler
// bodies do minus gRPC, against a ManagerWorld. An input is a sequence of calls (records:
// the tag picks the RPC, the body is its serialized request), so pins taken by one Match
// can be released, renewed or expired by the next calls. Every call must end in a Status.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <variant>

#include "fuzz/calls.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/manager_world.h"
#include "server/core/router.h"
#include "server/service/cache_manager_service.h"

namespace kvcm::fuzz {
namespace {

using namespace cache_manager_calls;  // NOLINT: the harness's calls

absl::Status Run(ManagerWorld& w, Call call, std::string_view body, RouteHandler& route,
                 std::optional<std::optional<NamespaceId>>& watch) {
  switch (call) {
    case kRegisterModel: {
      v1::RegisterModelRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<RegisterModelCall> c = RegisterModelFromProto(req);
      if (!c.ok()) return c.status();
      absl::StatusOr<RegisterModelResult> r = w.index->RegisterModel(c->ns, c->spec);
      if (!r.ok()) return r.status();
      v1::RegisterModelResponse resp;
      RegisterModelResultToProto(*r, &resp);
      return absl::OkStatus();
    }
    case kMatch: {
      v1::MatchRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<MatchCall> c = MatchFromProto(*w.index, req, w.limits);
      if (!c.ok()) return c.status();
      absl::StatusOr<MatchResult> r = w.index->Match(c->ns, c->prompt.pages, c->options);
      if (!r.ok()) return r.status();
      Require(r->matched_pages <= c->prompt.pages.size(), "Match: matched <= prompt pages");
      v1::MatchResponse resp;
      MatchResultToProto(*r, c->prompt.page_size_tokens, &resp);
      return absl::OkStatus();
    }
    case kInsert: {
      v1::InsertRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<InsertCall> c = InsertFromProto(*w.index, req, w.limits);
      if (!c.ok()) return c.status();
      // Into an agent's pool the answer waits for the agent's ack (the book fails it when
      // the world closes); into an index-only pool it comes inline.
      w.inserter.Insert(ToInsertCommand(*std::move(c)), [](absl::StatusOr<InsertResult> result) {
        v1::InsertResponse resp;
        if (result.ok()) InsertResultToProto(*result, &resp);
      });
      return absl::OkStatus();  // the callback has the answer
    }
    case kRelease: {
      v1::ReleaseRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<PinCall> c = ReleaseFromProto(req);
      if (!c.ok()) return c.status();
      return w.index->Release(c->ns, c->pin_id);
    }
    case kRenewLease: {
      v1::RenewLeaseRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<PinCall> c = RenewLeaseFromProto(req, w.limits);
      if (!c.ok()) return c.status();
      return w.index->RenewLease(c->ns, c->pin_id, c->lease_ttl).status();
    }
    case kEvict: {
      v1::EvictRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<EvictCall> c = EvictFromProto(req);
      if (!c.ok()) return c.status();
      absl::StatusOr<EvictResult> r =
          std::holds_alternative<PoolKey>(c->target)
              ? w.index->EvictFromPool(std::get<PoolKey>(c->target), c->bytes)
              : w.index->EvictFromNamespace(std::get<NamespaceId>(c->target), c->bytes);
      if (!r.ok()) return r.status();
      v1::EvictResponse resp;
      EvictResultToProto(*r, &resp);
      return absl::OkStatus();
    }
    case kReserve:
    case kUnreserve: {
      v1::ReserveRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<ReserveCall> c = ReserveFromProto(req);
      if (!c.ok()) return c.status();
      if (call == kUnreserve) return w.index->Unreserve(c->pool, c->bytes, c->tenant);
      return w.index->Reserve(c->pool, c->bytes, c->tenant).status();
    }
    case kRoute: {
      v1::RouteRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      v1::RouteResponse resp;
      return route.Route(req, &resp);
    }
    case kStats: {
      v1::StatsResponse resp;
      StatsToProto(w.index->Stats(), w.limits, &resp);
      AgentsToProto(w.agents.Snapshot(), &resp);
      EngineSessionsToProto(w.engines->Snapshot(), w.clock.Now(), &resp);
      return absl::OkStatus();
    }
    case kPublishEngineEvents: {
      v1::PublishEngineEventsRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<EnginePublish> c = EnginePublishFromProto(*w.index, req, w.limits);
      if (!c.ok()) return c.status();
      absl::StatusOr<EnginePublishResult> r = w.engines->Publish(*c);
      if (!r.ok()) return r.status();
      Require(r->pages == 0 || w.engines->IsLive(c->engine_id) || c->close,
              "PublishEngineEvents: pages only in a live session");
      return absl::OkStatus();
    }
    case kWatchEvents: {
      v1::WatchEventsRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<std::optional<NamespaceId>> filter = WatchFilterFromProto(req);
      if (!filter.ok()) return filter.status();
      watch = *filter;
      return absl::OkStatus();
    }
    case kDeleteNamespace: {
      v1::DeleteNamespaceRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      absl::StatusOr<NamespaceId> ns =
          NamespaceFromProto(req.has_namespace_() ? &req.namespace_() : nullptr, "namespace");
      if (!ns.ok()) return ns.status();
      return w.index->DeleteNamespace(*ns).status();
    }
    case kForgetAgent: {
      v1::ForgetAgentRequest req;
      if (!Parse(body, &req)) return absl::InvalidArgumentError("unparsable");
      if (absl::Status s = ValidateAgentId(req.agent_id(), "agent_id"); !s.ok()) return s;
      absl::StatusOr<ForgottenAgent> f =
          ForgetAgentNow(*w.index, w.agents, w.commands, w.relay, req.agent_id(), req.force());
      if (!f.ok()) return f.status();
      Require(!w.agents.FindPool(PoolKey{req.agent_id(), Tier::kGpu}).has_value(),
              "ForgetAgent: the agent's pool outlived it");
      return absl::OkStatus();
    }
    case kAdvanceClock:
      w.clock.Advance(absl::Seconds(body.empty() ? 1 : static_cast<uint8_t>(body[0])));
      w.index->ExpireLeases();
      (void)w.engines->ExpireIdle();
      return absl::OkStatus();
    case kNumCalls:
      break;
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvcm::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::fuzz;
  ManagerWorld world;
  // WatchEvents: once a call subscribed, every later event of its namespace (or all) is
  // converted as the hub's subscriber stream would write it.
  std::optional<std::optional<kvcm::NamespaceId>> watch;
  uint64_t event_sequence = 0;
  world.index->SetEventListener([&](const kvcm::CacheEvent& event) {
    if (!watch.has_value() || (watch->has_value() && **watch != event.ns)) return;
    kvcm::v1::CacheEvent out;
    kvcm::CacheEventToProto(event, ++event_sequence, &out);
  });
  kvcm::RouteHandler route(world.index.get(), &world.agents, world.engines.get(), world.limits, {});
  Records records(data, size);
  uint8_t tag;
  std::string_view body;
  while (records.Next(&tag, &body)) {
    const Call call = static_cast<Call>(tag % kNumCalls);
    Report(call, Run(world, call, body, route, watch));
  }
  world.index->SetEventListener(nullptr);
  return 0;
}
