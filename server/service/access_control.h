// Access control of kvcm-manager: who is calling (Authenticator, common/authenticator.h) and
// what that caller may do (Authorize: the rule each method's proto states, and the custom
// rules in access_control.cc; the whole policy of docs/SECURITY.md).
//
// Every handler of CacheManager and AgentControl, the streaming ones included, starts with
// AccessControl::Check (unary) or Authenticate + Authorize (streams, whose agent id arrives
// in their first message), before it validates or touches anything: a refused call changes
// nothing. UNAUTHENTICATED for a missing, malformed or unknown token; PERMISSION_DENIED for
// a known caller asking for a namespace, pool, agent id or call its roles do not grant.
// Messages name the principal and what it lacks, never the token.
//
// Without a tokens file (the documented insecure dev mode) every caller is OpenPrincipal():
// all roles, all tenants, all agent ids.
//
// Thread-safe.
#ifndef KVCM_SERVER_SERVICE_ACCESS_CONTROL_H_
#define KVCM_SERVER_SERVICE_ACCESS_CONTROL_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/authenticator.h"
#include "common/token_table.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "kvcm/v1/agent.pb.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "kvcm/v1/common.pb.h"
#include "server/core/cache_index.h"

namespace kvcm {

// Who may call each method is the `(kvcm.v1.access)` option the proto gives it
// (kvcm/v1/common.proto's Access): ANY, ADMIN, AGENT (as the request's agent_id) or
// TENANT_WORKER (of the request's namespace) are enforced from the descriptors alone. A
// method marked ACCESS_CUSTOM has its rule here, as an AuthorizeCustom overload for its
// request type. Authorize(p, req) is the one entry: it returns OK or PERMISSION_DENIED
// naming the principal, and is called before the request is validated (a malformed
// namespace in a request is then refused as a namespace the caller does not hold; validation
// names the field afterwards for callers that may use it).
//
// Fail closed: a method with no rule, a request type whose methods state different rules, a
// CUSTOM method without its overload, or an overload for a method the proto does not mark
// CUSTOM is refused to every caller (access_control_test checks the proto).

// The rule the proto states for the methods taking requests of type `request`
// (ACCESS_UNSPECIFIED when none, or when they disagree).
v1::Access AccessRuleOf(const google::protobuf::Descriptor* request);
// ACCESS_ANY, ADMIN, AGENT or TENANT_WORKER, as AccessRuleOf(req's type) states; any other
// rule is PERMISSION_DENIED.
absl::Status AuthorizeByRule(const Principal& p, const google::protobuf::Message& req);
// PERMISSION_DENIED: `req`'s type has a custom rule the proto does not ask for.
absl::Status CustomRuleNotStated(const Principal& p, const google::protobuf::Message& req);

// The custom rules.
absl::Status AuthorizeCustom(const Principal& p, const v1::RegisterModelRequest& req);
// Whether RegisterModel by `p` may create `ns` (a worker or an engine of its tenant, an
// admin) or only read an existing one (a router of the tenant: kReader).
CacheIndex::NamespaceSource RegisterModelSource(const Principal& p, const v1::Namespace& ns);
absl::Status AuthorizeCustom(const Principal& p, const v1::MatchRequest& req);
// A worker of the namespace's tenant or an admin; or an agent indexing what its Fetch
// pulled: into its own pool only (pool.agent_id its agent id), with agent_epoch set, a
// prompt of page hashes, and no use_reservation.
absl::Status AuthorizeCustom(const Principal& p, const v1::InsertRequest& req);
absl::Status AuthorizeCustom(const Principal& p, const v1::RouteRequest& req);
// Reserve and Unreserve (they share the request type): a worker for its own tenant only.
absl::Status AuthorizeCustom(const Principal& p, const v1::ReserveRequest& req);
// Whose reservation an authorized Reserve or Unreserve is: the tenant the request names; when
// it names none, a worker's own tenant, or "" (an operator's reservation) for an admin or the
// open dev-mode caller, who are workers of no single tenant.
std::string ReservationTenant(const Principal& p, const v1::ReserveRequest& req);
absl::Status AuthorizeCustom(const Principal& p, const v1::WatchEventsRequest& req);
// Only the engine itself (role engine, its engine id, the namespace's tenant): what an
// engine holds is its own word, which no worker, router or admin may speak for it.
absl::Status AuthorizeCustom(const Principal& p, const v1::PublishEngineEventsRequest& req);
// Rule AGENT, and the streams of AgentControl (Commands, ReportInventory), whose agent id
// comes in their first message.
absl::Status AuthorizeAgent(const Principal& p, absl::string_view agent_id);

// The access rule of `req`'s method, custom or stated.
template <typename Request>
absl::Status Authorize(const Principal& p, const Request& req) {
  if constexpr (requires { AuthorizeCustom(p, req); }) {
    static const bool stated = AccessRuleOf(Request::descriptor()) == v1::ACCESS_CUSTOM;
    return stated ? AuthorizeCustom(p, req) : CustomRuleNotStated(p, req);
  } else {
    return AuthorizeByRule(p, req);
  }
}

// Authenticate then Authorize: the first line of every unary handler.
class AccessControl {
 public:
  // Not owned; must outlive this.
  explicit AccessControl(const Authenticator* authenticator) : authenticator_(authenticator) {}

  template <typename Request>
  absl::StatusOr<std::shared_ptr<const Principal>> Check(const grpc::ServerContextBase& ctx,
                                                         const Request& req) const {
    absl::StatusOr<std::shared_ptr<const Principal>> p = authenticator_->Authenticate(ctx);
    if (!p.ok()) return p.status();
    if (absl::Status s = Authorize(**p, req); !s.ok()) return s;
    return p;
  }

  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(
      const grpc::ServerContextBase& ctx) const {
    return authenticator_->Authenticate(ctx);
  }

 private:
  const Authenticator* const authenticator_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_ACCESS_CONTROL_H_
