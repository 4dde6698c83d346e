// The one place where kvcm's processes get their gRPC transport security: every server
// (manager, agent) and every channel (client, agent -> manager, kvcmctl -> agents, tests,
// benchmarks) is built through these, so transport security changes here and nowhere else.
//
// TLS identities and trust come from PEM files that gRPC's FileWatcherCertificateProvider
// re-reads every TlsOptions::reload_interval_s: replacing the files rotates a certificate
// without a restart, for new connections (established ones keep theirs). Replace the
// certificate and its key together (write both beside them, then rename over), or a reload
// between the two writes sees a mismatched pair and the handshakes fail until the next.
//
// Plaintext exists only when a caller asks for it by name (TlsOptions::insecure,
// MakeInsecureServerCredentials, ChannelFactory::Insecure): for trusted networks and tests.
#ifndef KVCM_COMMON_CREDENTIALS_H_
#define KVCM_COMMON_CREDENTIALS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/security_options.h"

namespace kvcm {

// Credentials of a server: TLS (mTLS when ca_file is set) from `tls`, or plaintext when
// tls.insecure. Errors as ValidateForServer and CheckFiles.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls);
// Plaintext server credentials, for tests and benchmarks that ask for them by name.
std::shared_ptr<grpc::ServerCredentials> MakeInsecureServerCredentials();

// Opens channels with one set of credentials, and, when a bearer token is given, adds
// "authorization: Bearer <token>" to the metadata of every call on them, unary and
// streaming, in place of any authorization a caller set on its context. The token travels
// in plaintext on an insecure channel.
//
// Copyable (the copies share the credentials, whose certificate watcher is started once);
// thread-safe.
class ChannelFactory {
 public:
  // TLS from `tls` (or plaintext when tls.insecure). Errors as ValidateForChannel,
  // CheckFiles and ValidateBearerToken (for a non-empty token).
  static absl::StatusOr<ChannelFactory> Create(const TlsOptions& tls,
                                               std::string bearer_token = "");
  // Plaintext and no token, for tests, benchmarks and dev mode that ask for it by name.
  static ChannelFactory Insecure();

  // A channel to `address` ("host:port" or any gRPC target), lazily connected.
  std::shared_ptr<grpc::Channel> Open(const std::string& address,
                                      const grpc::ChannelArguments& args = {}) const;

  bool insecure() const { return insecure_; }
  bool has_token() const { return !bearer_token_.empty(); }

 private:
  ChannelFactory(std::shared_ptr<grpc::ChannelCredentials> credentials, bool insecure,
                 std::string bearer_token);

  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  bool insecure_ = true;
  std::string bearer_token_;
};

// A plaintext channel without a token: ChannelFactory::Insecure().Open(address, args).
std::shared_ptr<grpc::Channel> MakeInsecureChannel(const std::string& address,
                                                   const grpc::ChannelArguments& args = {});

}  // namespace kvcm

#endif  // KVCM_COMMON_CREDENTIALS_H_
