#include "server/service/access_control.h"

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"

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

// Each request type's rule and the method that states it, over the services the manager
// serves, resolved once. Types are keyed by descriptor: Reserve and Unreserve share theirs.
struct StatedRule {
  v1::Access access = v1::ACCESS_UNSPECIFIED;
  std::string method;  // "Release"; the first, when several take the type
  // What the rule reads: the string agent_id (AGENT) or the Namespace namespace
  // (TENANT_WORKER); null for other rules, and when the request has no such field.
  const google::protobuf::FieldDescriptor* field = nullptr;
};

const google::protobuf::FieldDescriptor* RuleField(const google::protobuf::Descriptor* request,
                                                   v1::Access access) {
  const google::protobuf::FieldDescriptor* f = nullptr;
  if (access == v1::ACCESS_AGENT) {
    f = request->FindFieldByName("agent_id");
    if (f != nullptr && f->type() != google::protobuf::FieldDescriptor::TYPE_STRING) f = nullptr;
  } else if (access == v1::ACCESS_TENANT_WORKER) {
    f = request->FindFieldByName("namespace");
    if (f != nullptr && f->message_type() != v1::Namespace::descriptor()) f = nullptr;
  }
  return f != nullptr && !f->is_repeated() ? f : nullptr;
}

const absl::flat_hash_map<const google::protobuf::Descriptor*, StatedRule>& StatedRules() {
  static const auto* const rules = [] {
    auto* by_type = new absl::flat_hash_map<const google::protobuf::Descriptor*, StatedRule>;
    for (const char* name :
         {v1::CacheManager::service_full_name(), v1::AgentControl::service_full_name()}) {
      const google::protobuf::ServiceDescriptor* service =
          google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
      for (int i = 0; i < service->method_count(); ++i) {
        const google::protobuf::MethodDescriptor* m = service->method(i);
        const v1::Access stated = m->options().GetExtension(v1::access);
        auto [it, inserted] = by_type->try_emplace(
            m->input_type(), StatedRule{stated, m->name(), RuleField(m->input_type(), stated)});
        // Methods that share a type but not a rule: no rule holds for the type.
        if (!inserted && it->second.access != stated) {
          it->second.access = v1::ACCESS_UNSPECIFIED;
          it->second.field = nullptr;
        }
      }
    }
    return by_type;
  }();
  return *rules;
}

const StatedRule& RuleOf(const google::protobuf::Descriptor* request) {
  static const StatedRule kNone;
  auto it = StatedRules().find(request);
  return it == StatedRules().end() ? kNone : it->second;
}

std::string CallName(const StatedRule& rule, const google::protobuf::Message& req) {
  return absl::StrCat("call ", rule.method.empty() ? req.GetTypeName() : rule.method);
}

}  // namespace

v1::Access AccessRuleOf(const google::protobuf::Descriptor* request) {
  return RuleOf(request).access;
}

absl::Status AuthorizeByRule(const Principal& p, const google::protobuf::Message& req) {
  const StatedRule& rule = RuleOf(req.GetDescriptor());
  const google::protobuf::Reflection& reflection = *req.GetReflection();
  switch (rule.access) {
    case v1::ACCESS_ANY:
      return absl::OkStatus();
    case v1::ACCESS_ADMIN:
      return NeedAdmin(p, CallName(rule, req));
    case v1::ACCESS_AGENT:
      if (rule.field != nullptr) {
        std::string scratch;
        return AuthorizeAgent(p, reflection.GetStringReference(req, rule.field, &scratch));
      }
      break;
    case v1::ACCESS_TENANT_WORKER:
      if (rule.field != nullptr) {
        const auto& ns = static_cast<const v1::Namespace&>(reflection.GetMessage(req, rule.field));
        return NeedWorker(p, ns, CallName(rule, req));
      }
      break;
    default:
      break;
  }
  // No rule the descriptors can enforce: a stated rule whose field the request lacks,
  // CUSTOM without its code, or none.
  return Denied(
      p, absl::StrCat(CallName(rule, req), " (its proto states no access rule kvcm enforces: ",
                      v1::Access_Name(rule.access), ")"));
}

absl::Status CustomRuleNotStated(const Principal& p, const google::protobuf::Message& req) {
  const StatedRule& rule = RuleOf(req.GetDescriptor());
  return Denied(p, absl::StrCat(CallName(rule, req),
                                " (a custom rule is written for it, but its proto states ",
                                v1::Access_Name(rule.access), ")"));
}

absl::Status AuthorizeCustom(const Principal& p, const v1::RegisterModelRequest& req) {
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

absl::Status AuthorizeCustom(const Principal& p, const v1::MatchRequest& req) {
  return req.probe() ? NeedProbe(p, req.namespace_(), "probe")
                     : NeedWorker(p, req.namespace_(), "match (without probe)");
}

absl::Status AuthorizeCustom(const Principal& p, const v1::InsertRequest& req) {
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

absl::Status AuthorizeCustom(const Principal& p, const v1::RouteRequest& req) {
  return req.probe() ? NeedProbe(p, req.namespace_(), "route")
                     : NeedWorker(p, req.namespace_(), "route without probe");
}

absl::Status AuthorizeCustom(const Principal& p, const v1::ReserveRequest& req) {
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

absl::Status AuthorizeCustom(const Principal& p, const v1::WatchEventsRequest& req) {
  if (p.Has(Role::kAdmin)) return absl::OkStatus();
  if (!req.has_namespace_()) {
    // Unfiltered: the stream is cut down to the tenants the caller may probe.
    if (p.Has(Role::kWorker) || p.Has(Role::kRouter)) return absl::OkStatus();
    return Denied(p, "watch events (roles worker, router or admin)");
  }
  return NeedProbe(p, req.namespace_(), "watch events");
}

absl::Status AuthorizeCustom(const Principal& p, const v1::PublishEngineEventsRequest& req) {
  if (p.IsEngineOf(req.engine_id(), req.namespace_().tenant())) return absl::OkStatus();
  return Denied(p, absl::StrCat("publish the events of engine \"", req.engine_id(),
                                "\" into tenant \"", req.namespace_().tenant(),
                                "\"'s namespaces (role engine, engine= and tenant= only)"));
}

absl::Status AuthorizeAgent(const Principal& p, absl::string_view agent_id) {
  if (p.IsAgent(agent_id)) return absl::OkStatus();
  return Denied(p, absl::StrCat("act as agent \"", agent_id, "\""));
}

}  // namespace kvcm
