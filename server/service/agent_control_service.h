// AgentControlService: the kvcm.v1.AgentControl gRPC service (agents -> manager).
//
// Register validates the request, checks the epoch against the AgentRegistry, sizes the
// agent's pool in the CacheIndex (SetPoolCapacity) and records the agent; Heartbeat
// refreshes the agent's liveness and usage; Commands streams move commands and acks in and out of
// the AgentCommandBook (command_stream.h); NcclBootstrap checks both agents of an NCCL link
// and hands the offer to the NcclBootstrapRelay, which the peer's Commands stream writes;
// LookupAgent tells an agent where a live peer serves its blocks (its Fetch source); MakeRoom
// evicts for an allocation the agent's free blocks cannot serve (CacheIndex::EvictForAllocation).
// Handlers are thin: each is one call of RpcRunner::Unary (common/rpc_runner.h), which times the
// body, records the RPC metrics, logs failures at a bounded rate and finishes with the body's
// status (same code and message), like CacheManagerService.
//
// Thread-safe: gRPC calls the handlers concurrently; all shared state is in the
// (thread-safe) CacheIndex, AgentRegistry and ServiceMetrics.
#ifndef KVCM_SERVER_SERVICE_AGENT_CONTROL_SERVICE_H_
#define KVCM_SERVER_SERVICE_AGENT_CONTROL_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <span>

#include "absl/status/statusor.h"
#include "common/log.h"
#include "common/rpc_runner.h"
#include "common/stream_slots.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "server/core/agent_command_book.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/service/access_control.h"
#include "server/service/metrics.h"
#include "server/service/nccl_bootstrap_relay.h"

namespace kvcm {

// A validated RegisterAgentRequest.
struct RegisterAgentCall {
  AgentRegistration registration;
  ModelSpec spec;
};

// Field names as in agent.proto. INVALID_ARGUMENT naming the field for: a bad agent_id,
// device or block_agent_address longer than allowed, tier not GPU/HOST/DISK, missing or
// impossible geometry.spec ("geometry.spec.<field>"), geometry.bytes_per_block not the
// spec's bytes per page, geometry.num_blocks outside 1..2^32-2, capacity_bytes outside
// 1..num_blocks x bytes_per_block, epoch 0, a host_pool on an agent whose tier is not
// TIER_GPU or with num_blocks / capacity_bytes out of range ("host_pool.<field>").
absl::StatusOr<RegisterAgentCall> RegisterAgentFromProto(const v1::RegisterAgentRequest& req);

// INVALID_ARGUMENT naming the field for a bad agent_id, epoch 0, or pull_gbps negative,
// non-finite or above 1e6.
absl::Status ValidateHeartbeat(const v1::HeartbeatRequest& req);

// The offer a valid NcclBootstrapRequest makes. INVALID_ARGUMENT naming the field for a bad
// agent_id, epoch 0, a bad peer_agent_id or the caller's own, link_id 0, or a unique_id that
// is not exactly kNcclUniqueIdBytes.
absl::StatusOr<NcclLinkOffer> NcclLinkOfferFromProto(const v1::NcclBootstrapRequest& req);

// Forgets the pages the index holds in the pools of agent `r` (its main pool and its HOST
// pool): its process restarted or is gone, and its blocks with it. With `forget`, the pools
// leave the index for good (CacheIndex::DropPool with forget). Returns the pages.
uint64_t DropAgentPools(CacheIndex& index, const AgentRegistration& r, bool forget = false);

// Agent `r`'s process is gone, declared gone or it left: its queued commands and NCCL offers
// end and its pools' pages are dropped (for good with `forget`). Returns the pages.
uint64_t EndAgent(CacheIndex& index, AgentCommandBook& commands, NcclBootstrapRelay& nccl_relay,
                  const AgentRegistration& r, bool forget);

// What CacheManager.ForgetAgent did: the agent as it was, and the pages its pools held.
struct ForgottenAgent {
  AgentInfo agent;
  uint64_t dropped_pages = 0;
};

// An operator forgets agent `agent_id` now (CacheManager.ForgetAgent), as DropGoneAgents
// forgets one gone for gone_agent_memory_s: AgentRegistry::ForgetNow, then EndAgent with
// forget, under the registry's lifecycle_mu. NOT_FOUND for an unknown agent,
// FAILED_PRECONDITION for a live one unless `force`; each with nothing changed.
absl::StatusOr<ForgottenAgent> ForgetAgentNow(CacheIndex& index, AgentRegistry& agents,
                                              AgentCommandBook& commands,
                                              NcclBootstrapRelay& nccl_relay,
                                              absl::string_view agent_id, bool force);

// The bodies of LookupAgent and MakeRoom after access control: validation, then the
// registry's or the index's answer, exactly as the handlers run them (and the fuzzer).
absl::Status LookupAgentNow(const AgentRegistry& agents, const v1::LookupAgentRequest& req,
                            v1::LookupAgentResponse* resp);
absl::Status MakeRoomNow(CacheIndex& index, const AgentRegistry& agents,
                         const v1::MakeRoomRequest& req, v1::MakeRoomResponse* resp);

// Appends one v1::AgentStats per agent to `out->agents`.
void AgentsToProto(std::span<const AgentInfo> agents, v1::StatsResponse* out);

class AgentControlService final : public v1::AgentControl::CallbackService {
 public:
  // None of the pointers is owned; all must outlive the service. Commands streams attach
  // to `commands`.
  // `manager_incarnation` tags every command this process sends (non-zero, random).
  // `nccl_relay` holds the link offers of NcclBootstrap for the peers' streams. Every call,
  // the streams included, must come from an agent principal of `authenticator` acting as
  // the agent id it names.
  AgentControlService(CacheIndex* index, AgentRegistry* agents, ServiceMetrics* metrics,
                      AgentCommandBook* commands, NcclBootstrapRelay* nccl_relay,
                      uint64_t manager_incarnation, const Authenticator* authenticator);

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterAgentRequest* req,
                                     v1::RegisterAgentResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* Commands(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerReadReactor<v1::InventoryChunk>* ReportInventory(grpc::CallbackServerContext* ctx,
                                                               v1::InventoryReply* reply) override;
  grpc::ServerUnaryReactor* NcclBootstrap(grpc::CallbackServerContext* ctx,
                                          const v1::NcclBootstrapRequest* req,
                                          v1::NcclBootstrapResponse* resp) override;
  grpc::ServerUnaryReactor* LookupAgent(grpc::CallbackServerContext* ctx,
                                        const v1::LookupAgentRequest* req,
                                        v1::LookupAgentResponse* resp) override;
  grpc::ServerUnaryReactor* MakeRoom(grpc::CallbackServerContext* ctx,
                                     const v1::MakeRoomRequest* req,
                                     v1::MakeRoomResponse* resp) override;

  // Each Commands and ReportInventory stream holds one of `slots` for its life (null: no
  // cap). Call before the server starts.
  void SetStreamSlots(std::shared_ptr<StreamSlots> slots) { stream_slots_ = std::move(slots); }

 private:
  CacheIndex* const index_;
  AgentRegistry* const agents_;
  RpcRunner<Rpc> rpc_;
  AgentCommandBook* const commands_;
  NcclBootstrapRelay* const nccl_relay_;
  const uint64_t manager_incarnation_;
  const AccessControl access_;
  std::shared_ptr<StreamSlots> stream_slots_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_AGENT_CONTROL_SERVICE_H_
