// kvcmctl's commands about agents and their pools: reserve and unreserve headroom in a pool
// (CacheManager), an agent's own counters (BlockAgent.Stats) and where an agent serves its
// blocks (AgentControl.LookupAgent).
#include "client/kvcmctl_agent.h"

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cli_inputs.h"
#include "client/kvcmctl_print.h"
#include "client/tls_hint.h"
#include "common/credentials.h"
#include "common/enum_names.h"
#include "common/grpc_status.h"
#include "grpcpp/client_context.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.pb.h"

namespace kvcm::cli {
namespace {

// --agent and --tier: the pool a command is about.
void DefinePool(FlagSet& f) {
  f.AddString("agent", "", "agent id of the pool (required)");
  f.AddString("tier", "gpu", "tier of the pool: gpu|host|disk");
}

absl::StatusOr<PoolRef> PoolFrom(const FlagSet& f) {
  if (f.GetString("agent").empty()) {
    return absl::InvalidArgumentError("--agent is required");
  }
  absl::StatusOr<Tier> tier = ParseTier(f.GetString("tier"), "--tier");
  if (!tier.ok()) return tier.status();
  return PoolRef{f.GetString("agent"), *tier};
}

// --bytes, required and > 0.
absl::StatusOr<uint64_t> BytesFrom(const FlagSet& f) {
  if (!f.IsSet("bytes") || f.GetUint("bytes") == 0) {
    return absl::InvalidArgumentError("--bytes is required and must be > 0");
  }
  return f.GetUint("bytes");
}

// A context for one call to an agent or AgentControl, under the global deadline.
void SetDeadline(const Invocation& in, grpc::ClientContext& context) {
  context.set_deadline(absl::ToChronoTime(
      absl::Now() + absl::Milliseconds(in.client->options().default_deadline_ms)));
}

absl::Status FromCall(const Invocation& in, const grpc::Status& status, absl::string_view server) {
  return WithTlsMismatchHint(FromGrpcStatus(status), in.client->options().insecure, server);
}

}  // namespace

// --- reserve / unreserve ------------------------------------------------------------------

// --tenant: whose headroom.
void DefineReservationTenant(FlagSet& f) {
  f.AddString("tenant", "",
              "whose headroom: empty is your token's tenant, or the operators' for an admin; "
              "an admin may name any tenant");
}

void DefineReserve(FlagSet& f) {
  DefinePool(f);
  f.AddUint("bytes", 0, "bytes of headroom to take (required, > 0)");
  DefineReservationTenant(f);
}

int RunReserve(const Invocation& in) {
  absl::StatusOr<PoolRef> pool = PoolFrom(in.flags);
  if (!pool.ok()) return in.Usage(pool.status().message());
  absl::StatusOr<uint64_t> bytes = BytesFrom(in.flags);
  if (!bytes.ok()) return in.Usage(bytes.status().message());
  v1::ReserveResponse reply;
  absl::StatusOr<uint64_t> evicted = in.client->Reserve(
      *pool, *bytes, ReserveParams{.tenant = in.flags.GetString("tenant")}, in.Call(reply));
  if (!evicted.ok()) return in.Failed(evicted.status());
  if (in.json) return PrintJson(reply);
  absl::PrintF("reserved %d bytes in %s\n", *bytes, pool->ToString());
  absl::PrintF("evicted_bytes: %d\n", *evicted);
  return kExitOk;
}

void DefineUnreserve(FlagSet& f) {
  DefinePool(f);
  f.AddUint("bytes", 0, "bytes of headroom to give back (required, > 0)");
  DefineReservationTenant(f);
}

int RunUnreserve(const Invocation& in) {
  absl::StatusOr<PoolRef> pool = PoolFrom(in.flags);
  if (!pool.ok()) return in.Usage(pool.status().message());
  absl::StatusOr<uint64_t> bytes = BytesFrom(in.flags);
  if (!bytes.ok()) return in.Usage(bytes.status().message());
  v1::UnreserveResponse reply;
  if (absl::Status s = in.client->Unreserve(
          *pool, *bytes, ReserveParams{.tenant = in.flags.GetString("tenant")}, in.Call(reply));
      !s.ok()) {
    return in.Failed(s);
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("unreserved %d bytes in %s\n", *bytes, pool->ToString());
  return kExitOk;
}

// --- agent-stats --------------------------------------------------------------------------

void DefineAgentStats(FlagSet& f) {
  f.AddString("agent_address", "",
              "host:port where the agent serves BlockAgent (its --listen_address)");
  f.AddString("agent_id", "",
              "or: the agent's id; its BlockAgent address comes from the manager's stats");
}

int RunAgentStats(const Invocation& in) {
  const bool by_address = in.flags.IsSet("agent_address");
  const bool by_id = in.flags.IsSet("agent_id");
  if (by_address == by_id) {
    return in.Usage("give one of --agent_address and --agent_id");
  }
  std::string address = in.flags.GetString("agent_address");
  if (by_address) {
    if (absl::Status s = CheckHostPort("agent_address", address, "the agent", kDefaultAgentPort);
        !s.ok()) {
      return in.Usage(s.message());
    }
  } else {
    absl::StatusOr<ManagerStats> stats = in.client->Stats();
    if (!stats.ok()) return in.Failed(stats.status());
    const std::string& id = in.flags.GetString("agent_id");
    for (const ManagerStats::Agent& a : stats->agents) {
      if (a.agent_id == id) address = a.block_agent_address;
    }
    if (address.empty()) {
      return in.Failed(absl::NotFoundError(
          absl::StrCat("agent ", id, " is not registered or serves no BlockAgent (see stats)")));
    }
  }
  auto stub = v1::BlockAgent::NewStub(in.client->channels().Open(address));
  grpc::ClientContext context;
  SetDeadline(in, context);
  v1::BlockAgentStatsResponse reply;
  if (grpc::Status s = stub->Stats(&context, v1::BlockAgentStatsRequest(), &reply); !s.ok()) {
    return in.Failed(FromCall(in, s, "the agent"));
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("agent_id: %s\n", reply.agent_id());
  absl::PrintF("address: %s\n", address);
  absl::PrintF("epoch: %d\n", reply.epoch());
  absl::PrintF("backend: %s\n", reply.backend());
  absl::PrintF("registered: %s\n", reply.registered() ? "true" : "false");
  absl::PrintF("bytes_per_block: %d\n", reply.geometry().bytes_per_block());
  absl::PrintF("num_blocks: %d\n", reply.geometry().num_blocks());
  absl::PrintF("free_blocks: %d\n", reply.free_blocks());
  absl::PrintF("capacity_bytes: %d (%s)\n", reply.capacity_bytes(),
               HumanBytes(reply.capacity_bytes()));
  absl::PrintF("used_bytes: %d (%s)\n", reply.used_bytes(), HumanBytes(reply.used_bytes()));
  if (reply.has_host_pool()) {
    absl::PrintF("host_pool: num_blocks=%d used_bytes=%d free_blocks=%d\n",
                 reply.host_pool().num_blocks(), reply.host_pool().used_bytes(),
                 reply.host_pool().free_blocks());
  }
  return kExitOk;
}

// --- lookup-agent -------------------------------------------------------------------------

void DefineLookupAgent(FlagSet& f) {
  f.AddString("agent_id", "", "agent to look up (required)");
  f.AddString("as_agent", "",
              "the calling agent's id, which an agent token must name; default: --agent_id");
}

int RunLookupAgent(const Invocation& in) {
  const std::string& id = in.flags.GetString("agent_id");
  if (id.empty()) return in.Usage("--agent_id is required");
  const std::string& as = in.flags.IsSet("as_agent") ? in.flags.GetString("as_agent") : id;
  auto stub = v1::AgentControl::NewStub(in.client->channels().Open(in.client->options().address));
  v1::LookupAgentRequest request;
  request.set_agent_id(as);
  request.set_peer_agent_id(id);
  grpc::ClientContext context;
  SetDeadline(in, context);
  v1::LookupAgentResponse reply;
  if (grpc::Status s = stub->LookupAgent(&context, request, &reply); !s.ok()) {
    return in.Failed(FromCall(in, s, "the manager"));
  }
  if (in.json) return PrintJson(reply);
  absl::PrintF("agent_id: %s\n", id);
  absl::PrintF("data_address: %s\n", reply.data_address());
  absl::PrintF("transport: %s\n", reply.transport());
  return kExitOk;
}

}  // namespace kvcm::cli
