#include "common/authenticator.h"

#include <grpc/grpc_security_constants.h>
#include <sys/stat.h>

#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/agent_identity.h"

namespace kvcm {
namespace {

constexpr absl::string_view kAuthorization = "authorization";

bool SameFile(const struct stat& st, const timespec& mtime, off_t size) {
  return st.st_mtim.tv_sec == mtime.tv_sec && st.st_mtim.tv_nsec == mtime.tv_nsec &&
         st.st_size == size;
}

}  // namespace

std::unique_ptr<Authenticator> Authenticator::Open() {
  return std::unique_ptr<Authenticator>(new Authenticator(""));
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(
    std::string path, std::string agent_identity_dns_suffix) {
  if (path.empty()) return absl::InvalidArgumentError("tokens_file is empty");
  std::unique_ptr<Authenticator> a(
      new Authenticator(std::move(path), std::move(agent_identity_dns_suffix)));
  struct stat st {};
  if (stat(a->path_.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot read tokens_file ", a->path_));
  }
  absl::StatusOr<TokenTable> table = TokenTable::Load(a->path_);
  if (!table.ok()) return table.status();
  absl::MutexLock lock(&a->mu_);
  a->table_ = std::make_shared<const TokenTable>(*std::move(table));
  a->mtime_ = st.st_mtim;
  a->size_ = st.st_size;
  return a;
}

absl::StatusOr<std::shared_ptr<const Principal>> Authenticator::Authenticate(
    const grpc::ServerContextBase& ctx) const {
  if (open()) return OpenPrincipal();
  const std::multimap<grpc::string_ref, grpc::string_ref>& md = ctx.client_metadata();
  auto it = md.find(grpc::string_ref(kAuthorization.data(), kAuthorization.size()));
  if (it == md.end()) return AuthenticateValue(nullptr, ctx.auth_context().get());
  const absl::string_view value(it->second.data(), it->second.size());
  return AuthenticateValue(&value);
}

absl::StatusOr<std::shared_ptr<const Principal>> Authenticator::AgentFromCertificate(
    const grpc::AuthContext* peer) const {
  // Certificate properties exist only for a peer whose certificate the TLS handshake
  // verified against the CA (servers that require and verify client certificates). The
  // certificate itself is read: gRPC's subjectAltName property mixes DNS, URI, email and IP
  // names, of which only DNS names identify an agent.
  if (agent_identity_dns_suffix_.empty() || peer == nullptr || !peer->IsPeerAuthenticated()) {
    return nullptr;
  }
  const std::vector<grpc::string_ref> pems =
      peer->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME);
  if (pems.size() != 1) return nullptr;
  absl::StatusOr<std::optional<std::string>> name = AgentNameOfCertificate(
      absl::string_view(pems[0].data(), pems[0].size()), agent_identity_dns_suffix_);
  if (!name.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat("no bearer token, and ", name.status().message()));
  }
  if (!name->has_value()) return nullptr;
  auto p = std::make_shared<Principal>();
  p->name = absl::StrCat("certificate ", **name, agent_identity_dns_suffix_);
  p->roles = static_cast<uint8_t>(Role::kAgent);
  p->agent_id = **std::move(name);
  p->agent_gpu_ids = true;
  return p;
}

absl::StatusOr<std::shared_ptr<const Principal>> Authenticator::AuthenticateValue(
    const absl::string_view* authorization, const grpc::AuthContext* peer) const {
  if (open()) return OpenPrincipal();
  if (authorization == nullptr) {
    absl::StatusOr<std::shared_ptr<const Principal>> agent = AgentFromCertificate(peer);
    if (!agent.ok() || *agent != nullptr) return agent;
    return absl::UnauthenticatedError(
        "no bearer token: send metadata \"authorization: Bearer <token>\" (kvcmctl --token_file "
        "or KVCM_TOKEN)");
  }
  absl::StatusOr<absl::string_view> token = BearerToken(*authorization);
  if (!token.ok()) return token.status();
  std::shared_ptr<const TokenTable> table;
  {
    absl::ReaderMutexLock lock(&mu_);
    table = table_;
  }
  std::shared_ptr<const Principal> p = table->Find(*token);
  if (p == nullptr) return absl::UnauthenticatedError("unknown bearer token");
  return p;
}

size_t Authenticator::TenantCount() const {
  absl::ReaderMutexLock lock(&mu_);
  return table_ == nullptr ? 0 : table_->tenant_count();
}

absl::Status Authenticator::ReloadIfChanged() {
  if (open()) return absl::OkStatus();
  struct stat st {};
  if (stat(path_.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot stat tokens_file ", path_, "; keeping the tokens loaded before"));
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    if (SameFile(st, mtime_, size_)) return absl::OkStatus();
  }
  absl::StatusOr<TokenTable> table = TokenTable::Load(path_);
  absl::MutexLock lock(&mu_);
  // Remember this version either way, so a bad file is reported once, not every sweep.
  mtime_ = st.st_mtim;
  size_ = st.st_size;
  if (!table.ok()) {
    return absl::Status(table.status().code(), absl::StrCat(table.status().message(),
                                                            "; keeping the tokens loaded before"));
  }
  table_ = std::make_shared<const TokenTable>(*std::move(table));
  return absl::OkStatus();
}

grpc::Status TokenAuthMetadataProcessor::Process(const InputMetadata& auth_metadata,
                                                 grpc::AuthContext* context,
                                                 OutputMetadata* /*consumed_auth_metadata*/,
                                                 OutputMetadata* /*response_metadata*/) {
  constexpr absl::string_view kPath = ":path";
  constexpr absl::string_view kHealth = "/grpc.health.v1.Health/";
  auto path = auth_metadata.find(grpc::string_ref(kPath.data(), kPath.size()));
  if (path != auth_metadata.end() &&
      absl::StartsWith(absl::string_view(path->second.data(), path->second.size()), kHealth)) {
    return grpc::Status::OK;
  }
  auto it = auth_metadata.find(grpc::string_ref(kAuthorization.data(), kAuthorization.size()));
  absl::string_view value;
  if (it != auth_metadata.end()) value = absl::string_view(it->second.data(), it->second.size());
  absl::StatusOr<std::shared_ptr<const Principal>> p =
      authenticator_->AuthenticateValue(it != auth_metadata.end() ? &value : nullptr, context);
  if (!p.ok()) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(p.status().message()));
  }
  context->AddProperty(kAuthPrincipalProperty, (*p)->name);
  return grpc::Status::OK;
}

std::shared_ptr<TokenAuthMetadataProcessor> InstallAuthProcessor(
    const Authenticator* authenticator, bool tls, grpc::ServerCredentials* credentials) {
  if (!tls || authenticator->open()) return nullptr;
  auto processor = std::make_shared<TokenAuthMetadataProcessor>(authenticator);
  credentials->SetAuthMetadataProcessor(processor);
  return processor;
}

}  // namespace kvcm
