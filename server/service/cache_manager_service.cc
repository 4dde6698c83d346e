#include "server/service/cache_manager_service.h"

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/service/agent_control_service.h"

namespace kvcm {

// The server side of one WatchEvents stream: writes the subscription's events one at a
// time and finishes when the subscriber overflows (RESOURCE_EXHAUSTED), the hub closes
// (UNAVAILABLE) or the client goes away (CANCELLED).
//
// Thread-safe: gRPC reactions and the hub's delivery thread (OnEventsReady) race; every
// decision is taken under mu_, and StartWrite/Finish are called with no lock held. The
// reactor owns itself through self_ from Start until OnDone; the delivery thread holds a
// shared_ptr while it wakes the reactor, so a wake-up never touches a deleted reactor.
class CacheManagerService::WatchEventsReactor final
    : public grpc::ServerWriteReactor<v1::CacheEvent>,
      public EventSink,
      public std::enable_shared_from_this<WatchEventsReactor> {
 public:
  // Starts a stream of `filter`'s events, or one that finishes at once with the filter's
  // error.
  // `slot` (a StreamSlots hold, or null) is kept until the stream is done.
  static WatchEventsReactor* Start(CacheManagerService* service, absl::StatusOr<EventFilter> filter,
                                   std::shared_ptr<const Principal> slot) {
    std::shared_ptr<WatchEventsReactor> reactor(new WatchEventsReactor(service));
    reactor->self_ = reactor;
    reactor->slot_ = std::move(slot);
    if (!filter.ok()) {
      {
        absl::MutexLock lock(&reactor->mu_);
        reactor->finished_ = true;
      }
      reactor->FinishStream(filter.status());
      return reactor.get();
    }
    std::shared_ptr<EventSubscription> sub =
        service->hub_->Subscribe(*std::move(filter), std::weak_ptr<EventSink>(reactor));
    {
      absl::MutexLock lock(&reactor->mu_);
      reactor->sub_ = std::move(sub);
    }
    // Headers go out now, so a client can tell (WaitForInitialMetadata) that it is
    // subscribed before it triggers events.
    reactor->StartSendInitialMetadata();
    reactor->Pump();
    return reactor.get();
  }

  void OnEventsReady() override { Pump(); }

  void OnWriteDone(bool ok) override {
    std::shared_ptr<WatchEventsReactor> keep = shared_from_this();
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      in_flight_.reset();
      if (!ok) cancelled_ = true;
    }
    Pump();
  }

  void OnCancel() override {
    std::shared_ptr<WatchEventsReactor> keep = shared_from_this();
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    Pump();
  }

  void OnDone() override {
    std::shared_ptr<WatchEventsReactor> self;
    std::shared_ptr<EventSubscription> sub;
    {
      absl::MutexLock lock(&mu_);
      self = std::move(self_);
      sub = std::move(sub_);
    }
    if (sub != nullptr) service_->hub_->Unsubscribe(sub.get());
    slot_.reset();  // the stream is over: its slot is free now, not when the last ref goes
    // `self` may hold the last reference: the reactor is destroyed when it goes out of scope.
  }

 private:
  explicit WatchEventsReactor(CacheManagerService* service) : service_(service) {}

  // Starts the next write or finishes the stream, whichever is due; nothing when a write
  // is in flight or the queue is empty (the subscription is then armed).
  void Pump() ABSL_LOCKS_EXCLUDED(mu_) {
    const v1::CacheEvent* to_write = nullptr;
    absl::Status finish_with;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_ || sub_ == nullptr) return;
      if (cancelled_) {
        finish_with = absl::CancelledError("WatchEvents stream cancelled by the client");
      } else {
        EventSubscription::Next next = sub_->Pop();
        switch (next.state) {
          case EventSubscription::State::kEvent:
            in_flight_ = std::move(next.event);
            writing_ = true;
            to_write = in_flight_.get();
            break;
          case EventSubscription::State::kEmpty:
            return;
          case EventSubscription::State::kOverflowed:
            finish_with = absl::ResourceExhaustedError(
                "WatchEvents subscriber fell more than max_event_queue events behind; events "
                "were dropped, resubscribe");
            break;
          case EventSubscription::State::kClosed:
            finish_with = absl::UnavailableError("kvcm-manager is shutting down");
            break;
        }
      }
      if (to_write == nullptr) finished_ = true;
    }
    if (to_write != nullptr) {
      // in_flight_ stays untouched until OnWriteDone.
      StartWrite(to_write);
      return;
    }
    FinishStream(finish_with);
  }

  // Records, logs and finishes. May run OnDone inline: touches nothing afterwards.
  void FinishStream(const absl::Status& status) {
    Finish(service_->rpc_.StreamEnd(Rpc::kWatchEvents, status));
  }

  CacheManagerService* const service_;
  std::shared_ptr<const Principal> slot_;  // set in Start, reset in OnDone
  absl::Mutex mu_;
  std::shared_ptr<WatchEventsReactor> self_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<EventSubscription> sub_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const v1::CacheEvent> in_flight_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

CacheManagerService::CacheManagerService(CacheIndex* index, EventHub* hub, ServiceMetrics* metrics,
                                         RequestLimits limits, AgentRegistry* agents,
                                         AgentInserter* inserter, EngineSessions* engines,
                                         AgentCommandBook* commands, NcclBootstrapRelay* nccl_relay,
                                         const Authenticator* authenticator,
                                         RouteDefaults route_defaults)
    : index_(index),
      hub_(hub),
      rpc_(metrics),
      limits_(limits),
      agents_(agents),
      inserter_(inserter),
      engines_(engines),
      commands_(commands),
      nccl_relay_(nccl_relay),
      access_(authenticator),
      route_(index, agents, engines, limits, route_defaults) {}

grpc::ServerUnaryReactor* CacheManagerService::RegisterModel(grpc::CallbackServerContext* ctx,
                                                             const v1::RegisterModelRequest* req,
                                                             v1::RegisterModelResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kRegisterModel, [&]() -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller, access_.Check(*ctx, *req));
    KVCM_ASSIGN_OR_RETURN(RegisterModelCall call, RegisterModelFromProto(*req));
    KVCM_ASSIGN_OR_RETURN(
        RegisterModelResult result,
        index_->RegisterModel(call.ns, call.spec, RegisterModelSource(*caller, req->namespace_()),
                              call.max_page_age));
    RegisterModelResultToProto(result, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Match(grpc::CallbackServerContext* ctx,
                                                     const v1::MatchRequest* req,
                                                     v1::MatchResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kMatch, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(MatchCall call, MatchFromProto(*index_, *req, limits_));
    KVCM_ASSIGN_OR_RETURN(MatchResult result,
                          index_->Match(call.ns, call.prompt.pages, call.options));
    MatchResultToProto(result, call.prompt.page_size_tokens, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Insert(grpc::CallbackServerContext* ctx,
                                                      const v1::InsertRequest* req,
                                                      v1::InsertResponse* resp) {
  return rpc_.UnaryAsync(ctx, Rpc::kInsert, [&](std::function<void(const absl::Status&)> finish) {
    absl::StatusOr<std::shared_ptr<const Principal>> caller = access_.Check(*ctx, *req);
    if (!caller.ok()) {
      finish(caller.status());
      return;
    }
    absl::StatusOr<InsertCall> call = InsertFromProto(*index_, *req, limits_);
    if (!call.ok()) {
      finish(call.status());
      return;
    }
    InsertCommand command = ToInsertCommand(*std::move(call));
    command.create_pool = (*caller)->Has(Role::kAdmin);
    command.committer = AllocatorName(**caller);
    // Into an agent's pool the answer comes once the agent has committed the blocks.
    inserter_->Insert(std::move(command), [resp, finish](absl::StatusOr<InsertResult> result) {
      if (result.ok()) InsertResultToProto(*result, resp);
      finish(result.status());
    });
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Release(grpc::CallbackServerContext* ctx,
                                                       const v1::ReleaseRequest* req,
                                                       v1::ReleaseResponse* /*resp*/) {
  return rpc_.Unary(ctx, Rpc::kRelease, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(PinCall call, ReleaseFromProto(*req));
    return index_->Release(call.ns, call.pin_id);
  });
}

grpc::ServerUnaryReactor* CacheManagerService::RenewLease(grpc::CallbackServerContext* ctx,
                                                          const v1::RenewLeaseRequest* req,
                                                          v1::RenewLeaseResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kRenewLease, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(PinCall call, RenewLeaseFromProto(*req, limits_));
    KVCM_ASSIGN_OR_RETURN(absl::Time expiry,
                          index_->RenewLease(call.ns, call.pin_id, call.lease_ttl));
    resp->set_lease_expiry_unix_ms(absl::ToUnixMillis(expiry));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Evict(grpc::CallbackServerContext* ctx,
                                                     const v1::EvictRequest* req,
                                                     v1::EvictResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kEvict, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(EvictCall call, EvictFromProto(*req));
    absl::StatusOr<EvictResult> result =
        std::holds_alternative<PoolKey>(call.target)
            ? index_->EvictFromPool(std::get<PoolKey>(call.target), call.bytes)
            : index_->EvictFromNamespace(std::get<NamespaceId>(call.target), call.bytes);
    if (!result.ok()) return result.status();
    EvictResultToProto(*result, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Reserve(grpc::CallbackServerContext* ctx,
                                                       const v1::ReserveRequest* req,
                                                       v1::ReserveResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kReserve, [&]() -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller, access_.Check(*ctx, *req));
    KVCM_ASSIGN_OR_RETURN(ReserveCall call, ReserveFromProto(*req));
    KVCM_ASSIGN_OR_RETURN(uint64_t evicted,
                          index_->Reserve(call.pool, call.bytes, ReservationTenant(*caller, *req)));
    resp->set_evicted_bytes(evicted);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Unreserve(grpc::CallbackServerContext* ctx,
                                                         const v1::ReserveRequest* req,
                                                         v1::UnreserveResponse* /*resp*/) {
  return rpc_.Unary(ctx, Rpc::kUnreserve, [&]() -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller, access_.Check(*ctx, *req));
    KVCM_ASSIGN_OR_RETURN(ReserveCall call, ReserveFromProto(*req));
    return index_->Unreserve(call.pool, call.bytes, ReservationTenant(*caller, *req));
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Route(grpc::CallbackServerContext* ctx,
                                                     const v1::RouteRequest* req,
                                                     v1::RouteResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kRoute, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    return route_.Route(*req, resp);
  });
}

grpc::ServerUnaryReactor* CacheManagerService::Stats(grpc::CallbackServerContext* ctx,
                                                     const v1::StatsRequest* req,
                                                     v1::StatsResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kStats, [&]() -> absl::Status {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller, access_.Check(*ctx, *req));
    IndexStats stats = index_->Stats();
    if (!caller->Has(Role::kAdmin)) {
      // Other tenants' namespaces, and the manager-wide counters that sum over them, are
      // an admin's to read.
      std::erase_if(stats.namespaces,
                    [&](const NamespaceStats& n) { return !caller->MayProbe(n.ns.tenant); });
      std::erase_if(stats.tenants,
                    [&](const TenantStats& t) { return !caller->MayProbe(t.tenant); });
      stats.counters = IndexCounters{};
      if (stats.selection.has_value()) {
        // The choice is the manager's; the hit rates and samples it was made from are not.
        SelectionStats visible{.active = stats.selection->active};
        for (const SelectionStats::Candidate& c : stats.selection->candidates) {
          visible.candidates.push_back({.name = c.name});
        }
        stats.selection = std::move(visible);
      }
    }
    StatsToProto(stats, limits_, resp);
    if (agents_ != nullptr) AgentsToProto(agents_->Snapshot(), resp);
    if (engines_ != nullptr) {
      std::vector<EngineSessionInfo> engines = engines_->Snapshot();
      if (!caller->Has(Role::kAdmin)) {
        std::erase_if(engines,
                      [&](const EngineSessionInfo& e) { return !caller->MayProbe(e.ns.tenant); });
      }
      EngineSessionsToProto(engines, absl::Now(), resp);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::DeleteNamespace(
    grpc::CallbackServerContext* ctx, const v1::DeleteNamespaceRequest* req,
    v1::DeleteNamespaceResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kDeleteNamespace, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(
        NamespaceId ns,
        NamespaceFromProto(req->has_namespace_() ? &req->namespace_() : nullptr, "namespace"));
    KVCM_ASSIGN_OR_RETURN(DeleteNamespaceResult result, index_->DeleteNamespace(ns));
    resp->set_removed_pages(result.removed_pages);
    resp->set_dropped_pins(result.dropped_pins);
    LogInfo(absl::StrCat("namespace ", ns.ToString(), " deleted: ", result.removed_pages,
                         " page-locations removed, ", result.dropped_pins, " pins dropped"));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::ForgetAgent(grpc::CallbackServerContext* ctx,
                                                           const v1::ForgetAgentRequest* req,
                                                           v1::ForgetAgentResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kForgetAgent, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_RETURN_IF_ERROR(ValidateAgentId(req->agent_id(), "agent_id"));
    KVCM_ASSIGN_OR_RETURN(
        ForgottenAgent f,
        ForgetAgentNow(*index_, *agents_, *commands_, *nccl_relay_, req->agent_id(), req->force()));
    resp->set_epoch(f.agent.registration.epoch);
    resp->set_was_alive(f.agent.alive);
    resp->set_dropped_pages(f.dropped_pages);
    LogInfo(absl::StrCat("agent ", req->agent_id(), " epoch ", f.agent.registration.epoch,
                         f.agent.alive ? " (alive, forced)" : "", " forgotten by an operator: its ",
                         f.dropped_pages, " pages left the index"));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* CacheManagerService::PublishEngineEvents(
    grpc::CallbackServerContext* ctx, const v1::PublishEngineEventsRequest* req,
    v1::PublishEngineEventsResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kPublishEngineEvents, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    if (engines_ == nullptr) return absl::UnimplementedError("this manager takes no engine events");
    KVCM_ASSIGN_OR_RETURN(EnginePublish call, EnginePublishFromProto(*index_, *req, limits_));
    KVCM_ASSIGN_OR_RETURN(EnginePublishResult result, engines_->Publish(call));
    if (result.new_session) {
      LogInfo(absl::StrCat("engine ", call.engine_id, " session ", call.session, " began in ",
                           call.ns.ToString()));
    }
    resp->set_stored_pages(result.stored_pages);
    resp->set_removed_pages(result.removed_pages);
    resp->set_pages(result.pages);
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::CacheEvent>* CacheManagerService::WatchEvents(
    grpc::CallbackServerContext* ctx, const v1::WatchEventsRequest* req) {
  std::shared_ptr<const Principal> slot;  // held by the reactor for the stream's life
  absl::StatusOr<EventFilter> filter = [&]() -> absl::StatusOr<EventFilter> {
    KVCM_ASSIGN_OR_RETURN(std::shared_ptr<const Principal> caller, access_.Check(*ctx, *req));
    KVCM_ASSIGN_OR_RETURN(std::optional<NamespaceId> ns, WatchFilterFromProto(*req));
    if (stream_slots_ != nullptr) {
      KVCM_ASSIGN_OR_RETURN(caller, stream_slots_->Hold(std::move(caller), "WatchEvents"));
    }
    slot = caller;
    EventFilter f{.ns = std::move(ns)};
    if (!caller->Has(Role::kAdmin)) f.reader = std::move(caller);
    return f;
  }();
  return WatchEventsReactor::Start(this, std::move(filter), std::move(slot));
}

}  // namespace kvcm
