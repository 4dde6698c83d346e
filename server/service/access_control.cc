#include "server/service/access_control.h"

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

absl::Status Denied(const Principal& p, absl::string_view what) {
  return absl::PermissionDeniedError(
      absl::StrCat("principal ", p.name, " (roles ", RoleNames(p.roles), ") may not ", what));
}

// A worker of the namespace's tenant. An absent namespace is the empty tenant, which no
// principal but the open one holds; validation then names the missing field.
absl::Status NeedWorker(const Principal& p, const v1::Namespace& ns, absl::string_view what) {
  if (p.IsWorkerOf(ns.tenant()) || p.Has(Role::kAdmin)) return absl::OkStatus();
  return Denied(p, absl::StrCat(what, " in tenant \"", ns.tenant(), "\"'s namespaces"));
}

// A worker of the tenant, a router granted it, or an admin.
absl::Status NeedProbe(const Principal& p, const v1::Namespace& ns, absl::string_view what) {
  if (p.MayProbe(ns.tenant()) || p.Has(Role::kAdmin)) return absl::OkStatus();
  return Denied(p, absl::StrCat(what, " in tenant \"", ns.tenant(), "\"'s namespaces"));
}

absl::Status NeedAdmin(const Principal& p, absl::string_view what) {
  if (p.Has(Role::kAdmin)) return absl::OkStatus();
  return Denied(p, absl::StrCat(what, " (role admin only)"));
}

}  // namespace

absl::Status Authorize(const Principal& p, const v1::RegisterModelRequest& req) {
  // The answer carries the namespace's hash key: only its own tenant may have it (its
  // engines' bridges too: they hash the engines' blocks with it).
  if (p.Has(Role::kEngine) && p.tenant == req.namespace_().tenant()) return absl::OkStatus();
  // A router reads an existing namespace's key to hash what it probes (RegisterModelSource).
  if (p.MayProbe(req.namespace_().tenant())) return absl::OkStatus();
  return NeedWorker(p, req.namespace_(), "register models");
}

CacheIndex::NamespaceSource RegisterModelSource(const Principal& p, const v1::Namespace& ns) {
  const bool may_create = p.IsWorkerOf(ns.tenant()) || p.Has(Role::kAdmin) ||
                          (p.Has(Role::kEngine) && p.tenant == ns.tenant());
  return may_create ? CacheIndex::NamespaceSource::kClient : CacheIndex::NamespaceSource::kReader;
}

absl::Status Authorize(const Principal& p, const v1::MatchRequest& req) {
  return req.probe() ? NeedProbe(p, req.namespace_(), "probe")
                     : NeedWorker(p, req.namespace_(), "match (without probe)");
}

absl::Status Authorize(const Principal& p, const v1::InsertRequest& req) {
  if (p.IsWorkerOf(req.namespace_().tenant()) || p.Has(Role::kAdmin) || !p.Has(Role::kAgent)) {
    return NeedWorker(p, req.namespace_(), "insert");
  }
  // An agent indexes the replica its BlockAgent.Fetch pulled, for a worker of the tenant the
  // agent checked: into its own pool, blocks of its epoch, by page hashes (the namespace
  // must exist and the scheme match its key), never from a reservation.
  if (!p.IsAgent(req.pool().agent_id())) {
    return Denied(p, absl::StrCat("insert into agent \"", req.pool().agent_id(),
                                  "\"'s pool (an agent inserts into its own pools only)"));
  }
  if (req.agent_epoch() == 0) {
    return Denied(p, "insert without agent_epoch (an agent inserts blocks of its epoch only)");
  }
  if (!req.prompt().has_page_hashes()) {
    return Denied(p, "insert a prompt of tokens (an agent inserts page hashes only)");
  }
  if (req.use_reservation()) {
    return Denied(p, "insert with use_reservation (a reservation is its tenant's workers')");
  }
  return absl::OkStatus();
}

absl::Status Authorize(const Principal& p, const v1::ReleaseRequest& req) {
  return NeedWorker(p, req.namespace_(), "release pins");
}

absl::Status Authorize(const Principal& p, const v1::RenewLeaseRequest& req) {
  return NeedWorker(p, req.namespace_(), "renew pins");
}

absl::Status Authorize(const Principal& p, const v1::RouteRequest& req) {
  return req.probe() ? NeedProbe(p, req.namespace_(), "route")
                     : NeedWorker(p, req.namespace_(), "route without probe");
}

absl::Status Authorize(const Principal& p, const v1::EvictRequest& /*req*/) {
  return NeedAdmin(p, "evict");
}

absl::Status Authorize(const Principal& p, const v1::ReserveRequest& req) {
  // Workers reserve within their tenant's byte quota; the index charges the reservation to
  // the tenant ReservationTenant names.
  if (p.Has(Role::kAdmin)) return absl::OkStatus();
  if (!p.Has(Role::kWorker)) return Denied(p, "reserve pool headroom (roles worker or admin)");
  if (req.tenant().empty() || p.IsWorkerOf(req.tenant())) return absl::OkStatus();
  return Denied(p, absl::StrCat("reserve headroom for tenant ", req.tenant(),
                                " (a worker reserves for its own tenant only)"));
}

std::string ReservationTenant(const Principal& p, const v1::ReserveRequest& req) {
  if (!req.tenant().empty()) return req.tenant();
  if (p.Has(Role::kWorker) && !p.worker_of_any_tenant && !p.Has(Role::kAdmin)) return p.tenant;
  return "";
}

absl::Status Authorize(const Principal& p, const v1::StatsRequest& /*req*/) {
  // Anyone authenticated; CacheManagerService::Stats shows each caller only its tenants.
  (void)p;
  return absl::OkStatus();
}

absl::Status Authorize(const Principal& p, const v1::WatchEventsRequest& req) {
  if (p.Has(Role::kAdmin)) return absl::OkStatus();
  if (!req.has_namespace_()) {
    // Unfiltered: the stream is cut down to the tenants the caller may probe.
    if (p.Has(Role::kWorker) || p.Has(Role::kRouter)) return absl::OkStatus();
    return Denied(p, "watch events (roles worker, router or admin)");
  }
  return NeedProbe(p, req.namespace_(), "watch events");
}

absl::Status Authorize(const Principal& p, const v1::DeleteNamespaceRequest& /*req*/) {
  return NeedAdmin(p, "delete namespaces");
}

absl::Status Authorize(const Principal& p, const v1::ForgetAgentRequest& /*req*/) {
  return NeedAdmin(p, "forget agents");
}

absl::Status Authorize(const Principal& p, const v1::PublishEngineEventsRequest& req) {
  if (p.IsEngineOf(req.engine_id(), req.namespace_().tenant())) return absl::OkStatus();
  return Denied(p, absl::StrCat("publish the events of engine \"", req.engine_id(),
                                "\" into tenant \"", req.namespace_().tenant(),
                                "\"'s namespaces (role engine, engine= and tenant= only)"));
}

absl::Status AuthorizeAgent(const Principal& p, absl::string_view agent_id) {
  if (p.IsAgent(agent_id)) return absl::OkStatus();
  return Denied(p, absl::StrCat("act as agent \"", agent_id, "\""));
}

absl::Status Authorize(const Principal& p, const v1::RegisterAgentRequest& req) {
  return AuthorizeAgent(p, req.agent_id());
}

absl::Status Authorize(const Principal& p, const v1::HeartbeatRequest& req) {
  return AuthorizeAgent(p, req.agent_id());
}

absl::Status Authorize(const Principal& p, const v1::NcclBootstrapRequest& req) {
  return AuthorizeAgent(p, req.agent_id());
}

absl::Status Authorize(const Principal& p, const v1::LookupAgentRequest& req) {
  return AuthorizeAgent(p, req.agent_id());
}

absl::Status Authorize(const Principal& p, const v1::MakeRoomRequest& req) {
  return AuthorizeAgent(p, req.agent_id());
}

}  // namespace kvcm
