#include "server/service/agent_control_service.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/transports.h"
#include "proto/core_types.h"
#include "server/service/cache_manager_service.h"
#include "server/service/command_stream.h"
#include "server/service/inventory_stream.h"
#include "server/service/proto_convert.h"

namespace kvcm {
namespace {

constexpr size_t kMaxDeviceBytes = 128;
constexpr size_t kMaxAddressBytes = 256;
// A BlockId is 32 bits and kPendingBlock is reserved.
constexpr uint64_t kMaxBlocks = std::numeric_limits<BlockId>::max() - 1;

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  return b != 0 && a > std::numeric_limits<uint64_t>::max() / b
             ? std::numeric_limits<uint64_t>::max()
             : a * b;
}

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

}  // namespace

absl::StatusOr<RegisterAgentCall> RegisterAgentFromProto(const v1::RegisterAgentRequest& req) {
  RegisterAgentCall call;
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.agent_id(), "agent_id"));
  if (req.device().size() > kMaxDeviceBytes) {
    return Invalid("device", absl::StrCat("must be at most ", kMaxDeviceBytes, " bytes"));
  }
  if (req.block_agent_address().size() > kMaxAddressBytes) {
    return Invalid("block_agent_address",
                   absl::StrCat("must be at most ", kMaxAddressBytes, " bytes"));
  }
  if (req.data_address().size() > kMaxAddressBytes) {
    return Invalid("data_address", absl::StrCat("must be at most ", kMaxAddressBytes, " bytes"));
  }
  if (!req.transport().empty()) KVCM_RETURN_IF_ERROR(LookupTransport(req.transport()).status());
  if (!req.transport().empty() && req.data_address().empty()) {
    return Invalid("transport", "needs a data_address to pull from");
  }
  switch (req.tier()) {
    case v1::TIER_GPU:
    case v1::TIER_HOST:
    case v1::TIER_DISK:
      break;
    default:
      return Invalid("tier", absl::StrCat("must be TIER_GPU, TIER_HOST or TIER_DISK, got ",
                                          static_cast<int>(req.tier())));
  }
  if (!req.has_geometry()) return Invalid("geometry", "is required");
  const v1::PoolGeometry& g = req.geometry();
  absl::StatusOr<ModelSpec> spec = ModelSpecFromProto(g.has_spec() ? &g.spec() : nullptr);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.", spec.status().message()));
  }
  call.spec = *spec;
  const uint64_t bytes_per_block = call.spec.BytesPerPage();
  if (g.bytes_per_block() != bytes_per_block) {
    return Invalid("geometry.bytes_per_block",
                   absl::StrCat("must be the spec's bytes per page, ", bytes_per_block, ", got ",
                                g.bytes_per_block()));
  }
  if (g.num_blocks() < 1 || g.num_blocks() > kMaxBlocks) {
    return Invalid("geometry.num_blocks",
                   absl::StrCat("must be in [1, ", kMaxBlocks, "], got ", g.num_blocks()));
  }
  const uint64_t pool_bytes = g.num_blocks() * bytes_per_block;
  if (pool_bytes / bytes_per_block != g.num_blocks()) {
    return Invalid("geometry.num_blocks", "times bytes_per_block overflows 64 bits");
  }
  if (req.capacity_bytes() < 1 || req.capacity_bytes() > pool_bytes) {
    return Invalid("capacity_bytes", absl::StrCat("must be in [1, num_blocks x bytes_per_block = ",
                                                  pool_bytes, "], got ", req.capacity_bytes()));
  }
  if (req.epoch() < 1) return Invalid("epoch", "must be >= 1");
  if (req.has_host_pool()) {
    const v1::HostPool& h = req.host_pool();
    if (req.tier() != v1::TIER_GPU) {
      return Invalid("host_pool", "is only for an agent whose tier is TIER_GPU");
    }
    if (h.num_blocks() < 1 || h.num_blocks() > kMaxBlocks) {
      return Invalid("host_pool.num_blocks",
                     absl::StrCat("must be in [1, ", kMaxBlocks, "], got ", h.num_blocks()));
    }
    const uint64_t host_bytes = h.num_blocks() * bytes_per_block;
    if (host_bytes / bytes_per_block != h.num_blocks()) {
      return Invalid("host_pool.num_blocks", "times bytes_per_block overflows 64 bits");
    }
    if (h.capacity_bytes() < 1 || h.capacity_bytes() > host_bytes) {
      return Invalid("host_pool.capacity_bytes",
                     absl::StrCat("must be in [1, num_blocks x bytes_per_block = ", host_bytes,
                                  "], got ", h.capacity_bytes()));
    }
    call.registration.host_capacity_bytes = h.capacity_bytes();
    call.registration.host_num_blocks = h.num_blocks();
  }
  AgentRegistration& r = call.registration;
  r.agent_id = req.agent_id();
  r.device = req.device();
  r.tier = TierFromProto(req.tier());
  r.epoch = req.epoch();
  r.capacity_bytes = req.capacity_bytes();
  r.block_agent_address = req.block_agent_address();
  r.data_address = req.data_address();
  r.transport = req.transport().empty() && !r.data_address.empty() ? std::string(kDefaultTransport)
                                                                   : req.transport();
  r.bytes_per_block = bytes_per_block;
  r.num_blocks = g.num_blocks();
  return call;
}

absl::Status ValidateHeartbeat(const v1::HeartbeatRequest& req) {
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.agent_id(), "agent_id"));
  if (req.epoch() < 1) return Invalid("epoch", "must be >= 1");
  // Beyond any link there is (1 Pbit/s): a sender's mistake, not a measurement.
  constexpr double kMaxPullGbps = 1e6;
  if (!std::isfinite(req.pull_gbps()) || req.pull_gbps() < 0 || req.pull_gbps() > kMaxPullGbps) {
    return Invalid("pull_gbps",
                   absl::StrCat("must be in [0, ", kMaxPullGbps, "], got ", req.pull_gbps()));
  }
  return absl::OkStatus();
}

absl::StatusOr<NcclLinkOffer> NcclLinkOfferFromProto(const v1::NcclBootstrapRequest& req) {
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.agent_id(), "agent_id"));
  if (req.epoch() < 1) return Invalid("epoch", "must be >= 1");
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.peer_agent_id(), "peer_agent_id"));
  if (req.peer_agent_id() == req.agent_id()) {
    return Invalid("peer_agent_id", "must not be the calling agent");
  }
  if (req.link_id() == 0) return Invalid("link_id", "must be non-zero");
  if (req.unique_id().size() != kNcclUniqueIdBytes) {
    return Invalid("unique_id",
                   absl::StrCat("must be exactly ", kNcclUniqueIdBytes,
                                " bytes (an ncclUniqueId), got ", req.unique_id().size()));
  }
  return NcclLinkOffer{.from_agent_id = req.agent_id(),
                       .link_id = req.link_id(),
                       .unique_id = req.unique_id(),
                       .rank = 1,
                       .peer_rank = 0,
                       .nranks = 2};
}

uint64_t DropAgentPools(CacheIndex& index, const AgentRegistration& r, bool forget) {
  uint64_t pages = 0;
  for (const PoolKey& p : {PoolKey{r.agent_id, r.tier}, PoolKey{r.agent_id, Tier::kHost}}) {
    if (absl::StatusOr<DropPoolResult> dropped = index.DropPool(p, forget); dropped.ok()) {
      pages += dropped->dropped_pages;
    }
  }
  return pages;
}

uint64_t EndAgent(CacheIndex& index, AgentCommandBook& commands, NcclBootstrapRelay& nccl_relay,
                  const AgentRegistration& r, bool forget) {
  commands.Forget(r.agent_id);
  nccl_relay.Forget(r.agent_id);
  return DropAgentPools(index, r, forget);
}

absl::StatusOr<ForgottenAgent> ForgetAgentNow(CacheIndex& index, AgentRegistry& agents,
                                              AgentCommandBook& commands,
                                              NcclBootstrapRelay& nccl_relay,
                                              absl::string_view agent_id, bool force) {
  absl::MutexLock lifecycle(&agents.lifecycle_mu());
  KVCM_ASSIGN_OR_RETURN(AgentInfo agent, agents.ForgetNow(agent_id, force));
  const uint64_t pages = EndAgent(index, commands, nccl_relay, agent.registration, /*forget=*/true);
  return ForgottenAgent{.agent = std::move(agent), .dropped_pages = pages};
}

absl::Status LookupAgentNow(const AgentRegistry& agents, const v1::LookupAgentRequest& req,
                            v1::LookupAgentResponse* resp) {
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.agent_id(), "agent_id"));
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.peer_agent_id(), "peer_agent_id"));
  for (const AgentInfo& a : agents.Snapshot()) {
    if (a.registration.agent_id != req.peer_agent_id()) continue;
    if (!a.alive || a.registration.data_address.empty()) break;
    resp->set_data_address(a.registration.data_address);
    resp->set_transport(a.registration.transport);
    return absl::OkStatus();
  }
  // One answer for unknown, gone and port-less agents: the caller learns no more.
  return absl::NotFoundError(absl::StrCat("peer_agent_id \"", req.peer_agent_id(),
                                          "\" is not a live agent with a data port"));
}

absl::Status MakeRoomNow(CacheIndex& index, const AgentRegistry& agents,
                         const v1::MakeRoomRequest& req, v1::MakeRoomResponse* resp) {
  KVCM_RETURN_IF_ERROR(ValidateAgentId(req.agent_id(), "agent_id"));
  if (req.epoch() == 0) return Invalid("epoch", "must be >= 1");
  if (req.blocks() == 0) return Invalid("blocks", "must be >= 1");
  if (req.allocation_blocks() < req.blocks()) {
    return Invalid("allocation_blocks", absl::StrCat("must be >= blocks (", req.blocks(), "), got ",
                                                     req.allocation_blocks()));
  }
  KVCM_ASSIGN_OR_RETURN(
      NamespaceId ns,
      NamespaceFromProto(req.has_namespace_() ? &req.namespace_() : nullptr, "namespace"));
  if (req.tier() != v1::TIER_GPU && req.tier() != v1::TIER_HOST && req.tier() != v1::TIER_DISK) {
    return Invalid("tier", "must be the agent's pool tier (TIER_GPU, TIER_HOST or TIER_DISK)");
  }
  KVCM_RETURN_IF_ERROR(agents.CheckLive(req.agent_id(), req.epoch()));
  const PoolKey pool{.agent_id = req.agent_id(), .tier = TierFromProto(req.tier())};
  std::optional<AgentPool> agent_pool = agents.FindPool(pool);
  if (!agent_pool.has_value()) {
    return absl::NotFoundError(absl::StrCat(
        "tier: agent ", req.agent_id(), " registered no pool of tier ", v1::Tier_Name(req.tier())));
  }
  const uint64_t block_bytes = agent_pool->bytes_per_block;
  KVCM_ASSIGN_OR_RETURN(
      EvictResult evicted,
      index.EvictForAllocation(pool, ns, uint64_t{req.blocks()} * block_bytes,
                               uint64_t{req.allocation_blocks()} * block_bytes,
                               SaturatingMul(req.tenant_allocated_blocks(), block_bytes)));
  resp->set_evicted_pages(evicted.evicted_pages);
  resp->set_evicted_bytes(evicted.evicted_bytes);
  resp->set_demoted_pages(evicted.demoted_pages);
  return absl::OkStatus();
}

void AgentsToProto(std::span<const AgentInfo> agents, v1::StatsResponse* out) {
  for (const AgentInfo& a : agents) {
    v1::AgentStats* s = out->add_agents();
    s->set_agent_id(a.registration.agent_id);
    s->set_device(a.registration.device);
    s->set_epoch(a.registration.epoch);
    s->set_alive(a.alive);
    s->set_last_heartbeat_age_ms(static_cast<uint64_t>(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(a.last_heartbeat_age))));
    s->set_tier(TierToProto(a.registration.tier));
    s->set_used_bytes(a.usage.used_bytes);
    s->set_free_blocks(a.usage.free_blocks);
    s->set_heartbeats(a.heartbeats);
    s->set_block_agent_address(a.registration.block_agent_address);
    s->set_data_address(a.registration.data_address);
    s->set_transport(a.registration.transport);
    s->set_pull_gbps(a.usage.pull_gbps);
  }
}

AgentControlService::AgentControlService(CacheIndex* index, AgentRegistry* agents,
                                         ServiceMetrics* metrics, AgentCommandBook* commands,
                                         NcclBootstrapRelay* nccl_relay,
                                         uint64_t manager_incarnation,
                                         const Authenticator* authenticator)
    : index_(index),
      agents_(agents),
      rpc_(metrics),
      commands_(commands),
      nccl_relay_(nccl_relay),
      manager_incarnation_(manager_incarnation),
      access_(authenticator) {}

grpc::ServerUnaryReactor* AgentControlService::Register(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterAgentRequest* req,
                                                        v1::RegisterAgentResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kRegisterAgent, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(RegisterAgentCall call, RegisterAgentFromProto(*req));
    const AgentRegistration& r = call.registration;
    absl::MutexLock lifecycle(&agents_->lifecycle_mu());
    // A stale agent must not resize the pool of its successor.
    KVCM_ASSIGN_OR_RETURN(RegisterOutcome check, agents_->CheckRegister(r));
    const PoolKey pool{r.agent_id, r.tier};
    const PoolKey host{r.agent_id, Tier::kHost};
    if (check.new_epoch) {
      // A new incarnation holds nothing: forget what the index and the command queue kept
      // for the old one (its blocks died with it).
      commands_->OnRegistered(r.agent_id, r.epoch);
      if (const uint64_t pages = DropAgentPools(*index_, r); pages > 0) {
        LogInfo(absl::StrCat("agent ", r.agent_id, " epoch ", r.epoch, ": dropped the ", pages,
                             " pages its previous epoch held"));
      }
    }
    KVCM_RETURN_IF_ERROR(index_->SetPoolCapacity(pool, r.capacity_bytes));
    if (r.host_capacity_bytes > 0) {
      KVCM_RETURN_IF_ERROR(index_->SetPoolCapacity(host, r.host_capacity_bytes));
    }
    KVCM_RETURN_IF_ERROR(agents_->Register(r).status());
    nccl_relay_->OnRegistered(r.agent_id, r.epoch, req->transport());
    resp->set_heartbeat_timeout_ms(
        static_cast<uint32_t>(absl::ToInt64Milliseconds(agents_->heartbeat_timeout())));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AgentControlService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                         const v1::HeartbeatRequest* req,
                                                         v1::HeartbeatResponse* /*resp*/) {
  return rpc_.Unary(ctx, Rpc::kHeartbeat, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_RETURN_IF_ERROR(ValidateHeartbeat(*req));
    if (req->leaving()) {
      absl::MutexLock lifecycle(&agents_->lifecycle_mu());
      KVCM_ASSIGN_OR_RETURN(AgentRegistration r, agents_->Forget(req->agent_id(), req->epoch()));
      const uint64_t pages = EndAgent(*index_, *commands_, *nccl_relay_, r, /*forget=*/true);
      LogInfo(absl::StrCat("agent ", r.agent_id, " epoch ", r.epoch, " left: forgot it and its ",
                           pages, " pages"));
      return absl::OkStatus();
    }
    return agents_->Heartbeat(req->agent_id(), req->epoch(),
                              {.used_bytes = req->used_bytes(),
                               .free_blocks = req->free_blocks(),
                               .pull_gbps = req->pull_gbps()});
  });
}

grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* AgentControlService::Commands(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<std::shared_ptr<const Principal>> caller = access_.Authenticate(*ctx);
  if (stream_slots_ != nullptr) caller = stream_slots_->Hold(std::move(caller), "Commands");
  return OpenCommandStream(commands_, agents_, nccl_relay_, manager_incarnation_,
                           std::move(caller));
}

grpc::ServerReadReactor<v1::InventoryChunk>* AgentControlService::ReportInventory(
    grpc::CallbackServerContext* ctx, v1::InventoryReply* reply) {
  absl::StatusOr<std::shared_ptr<const Principal>> caller = access_.Authenticate(*ctx);
  if (stream_slots_ != nullptr) {
    caller = stream_slots_->Hold(std::move(caller), "ReportInventory");
  }
  return OpenInventoryStream(index_, agents_, &rpc_, std::move(caller), reply);
}

grpc::ServerUnaryReactor* AgentControlService::NcclBootstrap(grpc::CallbackServerContext* ctx,
                                                             const v1::NcclBootstrapRequest* req,
                                                             v1::NcclBootstrapResponse* /*resp*/) {
  return rpc_.Unary(ctx, Rpc::kNcclBootstrap, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    KVCM_ASSIGN_OR_RETURN(NcclLinkOffer offer, NcclLinkOfferFromProto(*req));
    if (absl::Status s = agents_->CheckLive(req->agent_id(), req->epoch()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("agent_id: ", s.message()));
    }
    // Both agents' liveness and epochs, as of now.
    const AgentInfo* caller = nullptr;
    const AgentInfo* peer = nullptr;
    const std::vector<AgentInfo> all = agents_->Snapshot();
    for (const AgentInfo& a : all) {
      if (a.registration.agent_id == req->agent_id()) caller = &a;
      if (a.registration.agent_id == req->peer_agent_id()) peer = &a;
    }
    if (caller == nullptr || !caller->alive) {
      return absl::FailedPreconditionError(
          absl::StrCat("agent_id ", req->agent_id(), " is not alive (heartbeat first)"));
    }
    if (!nccl_relay_->IsNccl(req->agent_id(), req->epoch())) {
      return absl::FailedPreconditionError(
          absl::StrCat("agent_id ", req->agent_id(), " did not register transport \"nccl\""));
    }
    if (peer == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("peer_agent_id ", req->peer_agent_id(), " is not registered"));
    }
    if (!peer->alive) {
      return absl::FailedPreconditionError(
          absl::StrCat("peer_agent_id ", req->peer_agent_id(), " is not alive"));
    }
    return nccl_relay_->Relay(req->peer_agent_id(), peer->registration.epoch, std::move(offer));
  });
}

grpc::ServerUnaryReactor* AgentControlService::LookupAgent(grpc::CallbackServerContext* ctx,
                                                           const v1::LookupAgentRequest* req,
                                                           v1::LookupAgentResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kLookupAgent, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    return LookupAgentNow(*agents_, *req, resp);
  });
}

grpc::ServerUnaryReactor* AgentControlService::MakeRoom(grpc::CallbackServerContext* ctx,
                                                        const v1::MakeRoomRequest* req,
                                                        v1::MakeRoomResponse* resp) {
  return rpc_.Unary(ctx, Rpc::kMakeRoom, [&]() -> absl::Status {
    KVCM_RETURN_IF_ERROR(access_.Check(*ctx, *req).status());
    return MakeRoomNow(*index_, *agents_, *req, resp);
  });
}

}  // namespace kvcm
