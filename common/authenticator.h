// Authenticator: who is calling a kvcm gRPC server, from the `authorization: Bearer <token>`
// metadata and a tokens file (common/token_table.h) it re-reads when the file changes. The
// manager and the agent both authenticate with it; what a caller may then do is each
// server's own policy (server/service/access_control.h, gpu/agent/server/block_agent_access.h).
//
// Without a tokens file (the documented insecure dev mode) every caller is OpenPrincipal().
//
// Agents may instead be identified by their certificate (docs/SECURITY.md, "Agent
// identity"): with an agent identity suffix, a call that sends no bearer token, over mutual
// TLS whose client certificate verified, is the agent principal N when the certificate's DNS
// subjectAltNames under the suffix name the one agent N (common/agent_identity.h: never the
// common name or a URI, email or IP name; a certificate naming two agents is none and is
// UNAUTHENTICATED); that principal may act as agent N and N-gpu<K>. A bearer token, when
// sent, decides alone.
//
// Thread-safe.
#ifndef KVCM_COMMON_AUTHENTICATOR_H_
#define KVCM_COMMON_AUTHENTICATOR_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <atomic>
#include <ctime>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/token_table.h"

namespace kvcm {

class Authenticator {
 public:
  // Every caller is OpenPrincipal().
  static std::unique_ptr<Authenticator> Open();
  // Callers are the principals of the tokens file at `path` (its errors are returned), and
  // agents named by their certificate under `agent_identity_dns_suffix` (empty: none).
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(
      std::string path, std::string agent_identity_dns_suffix = "");

  // The caller of `ctx`, from its `authorization: Bearer <token>` metadata.
  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(
      const grpc::ServerContextBase& ctx) const ABSL_LOCKS_EXCLUDED(mu_);
  // The caller whose `authorization` metadata value is `*authorization` (null: none sent),
  // on a connection whose peer is `peer` (null: unknown, as in insecure mode).
  absl::StatusOr<std::shared_ptr<const Principal>> AuthenticateValue(
      const absl::string_view* authorization, const grpc::AuthContext* peer = nullptr) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Re-reads the tokens file when its modification time or size changed. A file that no
  // longer parses keeps the previous table (the error is returned, for the log): a typo must
  // not lock every caller out. Returns OK when nothing changed; no-op when open.
  absl::Status ReloadIfChanged() ABSL_LOCKS_EXCLUDED(mu_);

  bool open() const { return path_.empty(); }
  // The tenants the tokens file's workers and engines belong to (0 when open).
  size_t TenantCount() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& path() const { return path_; }

 private:
  explicit Authenticator(std::string path, std::string agent_identity_dns_suffix = "")
      : path_(std::move(path)), agent_identity_dns_suffix_(std::move(agent_identity_dns_suffix)) {}

  // The agent principal `peer`'s verified certificate names (AgentNameOfCertificate), or
  // null; UNAUTHENTICATED for a certificate naming several agents.
  absl::StatusOr<std::shared_ptr<const Principal>> AgentFromCertificate(
      const grpc::AuthContext* peer) const;

  const std::string path_;
  const std::string agent_identity_dns_suffix_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
  timespec mtime_ ABSL_GUARDED_BY(mu_) = {};
  off_t size_ ABSL_GUARDED_BY(mu_) = -1;
};

// Authenticates every call on a TLS port from its initial metadata, before gRPC reads any
// request message: a call without a known bearer token ends UNAUTHENTICATED there, so an
// unauthenticated request body is never parsed, nor buffered beyond HTTP/2 flow control.
// The principal's name goes into the AuthContext as kAuthPrincipalProperty. Handlers still
// call Authenticator::Authenticate (the same check; it is what the insecure mode, which has
// no processor, relies on). Health checks (grpc.health.v1.Health) pass without a token, for
// probes. Non-blocking: it runs inline on gRPC's thread (a hash and a table lookup).
//
// Set it with ServerCredentials::SetAuthMetadataProcessor on TLS credentials only
// (InstallAuthProcessor). Thread-safe.
class TokenAuthMetadataProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `authenticator` is not owned and must outlive the server.
  explicit TokenAuthMetadataProcessor(const Authenticator* authenticator)
      : authenticator_(authenticator) {}

  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

  // Calls refused so far (for tests and logs).
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  const Authenticator* const authenticator_;
  std::atomic<uint64_t> refused_{0};
};

inline constexpr char kAuthPrincipalProperty[] = "kvcm.principal";

// Installs a TokenAuthMetadataProcessor of `authenticator` on `credentials` when both
// authentication (a tokens file) and TLS are on; returns it (null when not installed).
// REQUIRES: `tls` says whether `credentials` are TLS (the insecure ones cannot take one).
std::shared_ptr<TokenAuthMetadataProcessor> InstallAuthProcessor(
    const Authenticator* authenticator, bool tls, grpc::ServerCredentials* credentials);

}  // namespace kvcm

#endif  // KVCM_COMMON_AUTHENTICATOR_H_
