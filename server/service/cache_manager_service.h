// CacheManagerService: the kvcm.v1.CacheManager gRPC service over a CacheIndex.
//
// Every unary handler is one call of RpcRunner::Unary (common/rpc_runner.h), which times the body,
// converts its status, records the RPC metrics and logs failures. Each body first checks
// the caller (AccessControl::Check, access_control.h), then validates and converts with
// proto_convert.h before touching the index, so a rejected request changes nothing. WatchEvents
// streams EventHub subscriptions.
//
// Thread-safe: gRPC calls the handlers concurrently; all shared state is in the
// (thread-safe) CacheIndex, EventHub and ServiceMetrics.
#ifndef KVCM_SERVER_SERVICE_CACHE_MANAGER_SERVICE_H_
#define KVCM_SERVER_SERVICE_CACHE_MANAGER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "common/log.h"
#include "common/rpc_runner.h"
#include "common/stream_slots.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/core/agent_command_book.h"
#include "server/core/agent_inserter.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/service/access_control.h"
#include "server/service/event_hub.h"
#include "server/service/metrics.h"
#include "server/service/nccl_bootstrap_relay.h"
#include "server/service/proto_convert.h"
#include "server/service/route_handler.h"

namespace kvcm {

class CacheManagerService final : public v1::CacheManager::CallbackService {
 public:
  // None of the pointers is owned; all must outlive the service. Inserts go through
  // `inserter` (into agents' pools, through their ledgers); engines' events through
  // `engines`; Stats lists `agents` and `engines`, Route chooses among them; ForgetAgent
  // ends an agent in `agents`, `commands` and `nccl_relay`; every call's caller is checked
  // against `authenticator`.
  CacheManagerService(CacheIndex* index, EventHub* hub, ServiceMetrics* metrics,
                      RequestLimits limits, AgentRegistry* agents, AgentInserter* inserter,
                      EngineSessions* engines, AgentCommandBook* commands,
                      NcclBootstrapRelay* nccl_relay, const Authenticator* authenticator,
                      RouteDefaults route_defaults = {});

  grpc::ServerUnaryReactor* RegisterModel(grpc::CallbackServerContext* ctx,
                                          const v1::RegisterModelRequest* req,
                                          v1::RegisterModelResponse* resp) override;
  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* ctx, const v1::MatchRequest* req,
                                  v1::MatchResponse* resp) override;
  grpc::ServerUnaryReactor* Insert(grpc::CallbackServerContext* ctx, const v1::InsertRequest* req,
                                   v1::InsertResponse* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* req,
                                    v1::ReleaseResponse* resp) override;
  grpc::ServerUnaryReactor* RenewLease(grpc::CallbackServerContext* ctx,
                                       const v1::RenewLeaseRequest* req,
                                       v1::RenewLeaseResponse* resp) override;
  grpc::ServerUnaryReactor* Route(grpc::CallbackServerContext* ctx, const v1::RouteRequest* req,
                                  v1::RouteResponse* resp) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* ctx, const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) override;
  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* ctx, const v1::ReserveRequest* req,
                                    v1::ReserveResponse* resp) override;
  grpc::ServerUnaryReactor* Unreserve(grpc::CallbackServerContext* ctx,
                                      const v1::ReserveRequest* req,
                                      v1::UnreserveResponse* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteNamespace(grpc::CallbackServerContext* ctx,
                                            const v1::DeleteNamespaceRequest* req,
                                            v1::DeleteNamespaceResponse* resp) override;
  grpc::ServerUnaryReactor* ForgetAgent(grpc::CallbackServerContext* ctx,
                                        const v1::ForgetAgentRequest* req,
                                        v1::ForgetAgentResponse* resp) override;
  grpc::ServerUnaryReactor* PublishEngineEvents(grpc::CallbackServerContext* ctx,
                                                const v1::PublishEngineEventsRequest* req,
                                                v1::PublishEngineEventsResponse* resp) override;
  grpc::ServerWriteReactor<v1::CacheEvent>* WatchEvents(grpc::CallbackServerContext* ctx,
                                                        const v1::WatchEventsRequest* req) override;

  // Each WatchEvents stream holds one of `slots` for its life (null: no cap). Call before
  // the server starts.
  void SetStreamSlots(std::shared_ptr<StreamSlots> slots) { stream_slots_ = std::move(slots); }

 private:
  class WatchEventsReactor;

  CacheIndex* const index_;
  EventHub* const hub_;
  RpcRunner<Rpc> rpc_;
  const RequestLimits limits_;
  AgentRegistry* const agents_;
  AgentInserter* const inserter_;
  EngineSessions* const engines_;
  AgentCommandBook* const commands_;
  NcclBootstrapRelay* const nccl_relay_;
  const AccessControl access_;
  RouteHandler route_;
  std::shared_ptr<StreamSlots> stream_slots_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_CACHE_MANAGER_SERVICE_H_
