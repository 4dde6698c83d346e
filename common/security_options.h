// What a process needs to secure its connections, as options structs hold it: TlsOptions
// (the PEM files of its TLS identity and trust, and their checks) and bearer tokens. The
// credentials factory (credentials.h) builds gRPC credentials from them and the agents' data
// port (gpu/agent/transport/data_tls.h) OpenSSL contexts. No gRPC in this header.
#ifndef KVCM_COMMON_SECURITY_OPTIONS_H_
#define KVCM_COMMON_SECURITY_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm {

// agent_identity_dns_suffix (empty: off) needs a tokens file (without one nobody is
// authenticated) and client certificates (tls_ca_file); it starts with '.'.
absl::Status ValidateAgentIdentity(absl::string_view suffix, absl::string_view tokens_file,
                                   absl::string_view tls_ca_file);

// Default period of the certificate files' reload, in seconds.
inline constexpr uint32_t kDefaultTlsReloadIntervalS = 60;

// The PEM files of one process's TLS identity and trust. Plain value type.
struct TlsOptions {
  // Plaintext gRPC: no file below may be set.
  bool insecure = false;
  // Certificate chain this process presents, and its private key. A server needs both; a
  // channel presents them as its client certificate when both are set (mTLS).
  std::string cert_file;
  std::string key_file;
  // CA bundle peers are verified against. A server given one requires and verifies client
  // certificates (mTLS); a channel needs one to verify its server (and its host name or IP,
  // which the server certificate's subjectAltName must hold).
  std::string ca_file;
  // How often the files are re-read for rotation, in seconds. 1..86400.
  uint32_t reload_interval_s = kDefaultTlsReloadIntervalS;

  // INVALID_ARGUMENT naming the field for combinations that cannot work, without touching
  // the files: insecure with a file; for a server, no cert_file and key_file; for a channel,
  // no ca_file, or one of cert_file and key_file without the other.
  absl::Status ValidateForServer() const;
  absl::Status ValidateForChannel() const;
  // Reads every file set and checks that it holds what it should: a certificate chain, a
  // private key that matches that chain's certificate, a CA bundle of one or more
  // certificates. INVALID_ARGUMENT "<field> \"<path>\": <why>" otherwise.
  absl::Status CheckFiles() const;
};

// The metadata key and value prefix of a bearer token ("authorization: Bearer <token>").
inline constexpr absl::string_view kAuthorizationKey = "authorization";
inline constexpr absl::string_view kBearerPrefix = "Bearer ";

// INVALID_ARGUMENT unless `token` is 1..4096 visible ASCII characters (no space or control
// character), i.e. a valid HTTP/2 header value after "Bearer ".
absl::Status ValidateBearerToken(absl::string_view token);

// The oldest error of this thread's OpenSSL queue as text ("no details" when it is empty),
// and the queue emptied.
std::string TakeOpenSslError();

// Reads a bearer token file: its content with surrounding whitespace (a trailing newline) removed.
// INVALID_ARGUMENT naming `field` and the path when it cannot be read or holds no valid
// token.
absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& path, absl::string_view field);

}  // namespace kvcm

#endif  // KVCM_COMMON_SECURITY_OPTIONS_H_
