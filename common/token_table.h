// Who is calling: bearer tokens and the principals they stand for.
//
// A kvcm tokens file maps the SHA-256 of each token to one principal, one per line:
//
//   # sha256(token), 64 hex digits, then the principal's name and its grants
//   9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 acme-vllm
//       roles=worker tenant=acme
//   60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752 edge
//       roles=router tenants=acme,globex
//   fd61a03af4f77d870fc21e05e7e80678095c92d808cfb3b5c279ee04c74aca13 gpu-0
//       roles=agent agent=gpu-0
//   2c624232cdd221771294dfbb310aca000a0df6ac8b66b696d90ef06fdefb64a3 vllm-0
//       roles=engine engine=vllm-0 tenant=acme
//   a4e624d686e03ed2767c0abd85c14426b0b1157d2ce81d27bb4fe4f6f01d3cd9 ops roles=admin
//
// (one line each in the file; wrapped here).
//
// The file never holds a token, only its hash, so reading it (or a leaked copy) does not let
// anyone call. A token is 16..4096 visible ASCII characters (no space);
// `openssl rand -hex 32` makes a good one and `printf %s "$TOKEN" | sha256sum` its hash.
//
// Roles (docs/SECURITY.md says what each may do; each method's `(kvcm.v1.access)` option in
// the proto says which role may call it):
//   worker  its own tenant's namespaces (`tenant=`, required);
//   router  probe Match / Route across the granted tenants (`tenants=a,b` or `tenants=*`);
//   agent   AgentControl only, as its own agent id (`agent=`, required);
//   engine  PublishEngineEvents only, as its own engine id (`engine=`, required) into its
//           tenant's namespaces (`tenant=`, required): a bridge mirroring that engine;
//   admin   operator calls (rule ACCESS_ADMIN), Reserve of any pool, Stats of all tenants.
// A principal may hold several roles (`roles=worker,router`).
#ifndef KVCM_COMMON_TOKEN_TABLE_H_
#define KVCM_COMMON_TOKEN_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm {

struct Principal;

// The name a block's allocation records as its allocator, and a commit as its inserter
// (BlockLedger: only the allocator may commit a block): the principal's name, or empty for
// the open, dev-mode caller (without a tokens file every caller is that one principal, so
// there is nothing to tell apart).
std::string AllocatorName(const Principal& p);

enum class Role : uint8_t {
  kWorker = 1 << 0,
  kRouter = 1 << 1,
  kAgent = 1 << 2,
  kAdmin = 1 << 3,
  kEngine = 1 << 4,
};

// The caller an authenticated token names. Immutable once built.
struct Principal {
  // From the tokens file; for logs and error messages only.
  std::string name;
  // Bitwise OR of Role values.
  uint8_t roles = 0;
  // worker: the tenant whose namespaces it may use.
  std::string tenant;
  // worker of every tenant: only the open, dev-mode caller.
  bool worker_of_any_tenant = false;
  // router: the tenants whose namespaces it may probe; all of them when probes_any_tenant.
  std::vector<std::string> router_tenants;
  bool probes_any_tenant = false;
  // agent: the agent id it may act as; every id when any_agent (the open, dev-mode caller).
  // An agent named by its certificate (agent_gpu_ids) may also act as "<agent_id>-gpu<K>",
  // K in 0..255: one agent per GPU of its pod.
  std::string agent_id;
  bool any_agent = false;
  bool agent_gpu_ids = false;
  // engine: the engine id it may publish as (with `tenant`); every id when any_engine (the
  // open, dev-mode caller).
  std::string engine_id;
  bool any_engine = false;

  bool Has(Role role) const { return (roles & static_cast<uint8_t>(role)) != 0; }
  // Whether it may use the namespaces of `t` as a worker (read, write, pin) ...
  bool IsWorkerOf(absl::string_view t) const;
  // ... or only probe them (Match/Route without pin or recency update).
  bool MayProbe(absl::string_view t) const;
  bool IsAgent(absl::string_view id) const;
  // Whether it may publish engine `id`'s events into a namespace of tenant `t`.
  bool IsEngineOf(absl::string_view id, absl::string_view t) const;
};

// Whether `id` is "<name>-gpu<K>" with K a decimal in [0, 255] without leading zeros.
bool IsGpuAgentIdOf(absl::string_view id, absl::string_view name);

// The agent name a certificate's DNS subjectAltName grants under `suffix`
// (".kvcm-agent.kvcm.svc"): N when `san` is N + suffix and N is one DNS label (1-63 of
// [a-z0-9-], not starting or ending with '-'); nullopt otherwise, and for an empty suffix.
std::optional<std::string> AgentNameFromDnsSan(absl::string_view san, absl::string_view suffix);

// The principal of a manager run without a tokens file (the documented insecure dev mode):
// every role, every tenant, every agent id.
std::shared_ptr<const Principal> OpenPrincipal();

// Role names as in the tokens file ("worker,router").
std::string RoleNames(uint8_t roles);

// Lowercase hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);

// The token of an `authorization` metadata value "Bearer <token>" (scheme case-insensitive);
// UNAUTHENTICATED saying what is wrong otherwise.
absl::StatusOr<absl::string_view> BearerToken(absl::string_view authorization);

// The table of a tokens file. Thread-compatible; immutable after Parse.
class TokenTable {
 public:
  // INVALID_ARGUMENT "<source>:<line>: ..." naming the first bad line: a hash that is not 64
  // hex digits or appears twice, a name that is empty or repeated, an unknown key or role, a
  // worker without tenant=, a router without tenants=, an agent without agent=, an engine
  // without engine= and tenant=, a tenant or
  // agent id that kvcm would refuse in a request. A file with no principal is an error too.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source);
  // Reads and parses `path`; NOT_FOUND when it cannot be read.
  static absl::StatusOr<TokenTable> Load(const std::string& path);

  // The principal `token` names; nullptr for an unknown token.
  std::shared_ptr<const Principal> Find(absl::string_view token) const;

  size_t size() const { return by_hash_.size(); }
  // The tenants its workers and engines belong to (router and admin principals name none).
  size_t tenant_count() const { return tenants_.size(); }

 private:
  // Key: the raw 32-byte digest.
  absl::flat_hash_map<std::string, std::shared_ptr<const Principal>> by_hash_;
  absl::flat_hash_set<std::string> tenants_;
};

}  // namespace kvcm

#endif  // KVCM_COMMON_TOKEN_TABLE_H_
