#include "common/server_flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"

namespace {
const kvcm::ServerLimitsOptions kLimits;
const kvcm::TlsOptions kTls;
}  // namespace

ABSL_FLAG(std::string, tls_cert_file, kTls.cert_file,
          "PEM certificate chain this process presents (with tls_key_file): the manager's "
          "gRPC port; an agent's BlockAgent and data ports, and its client certificate to the "
          "manager and peers.");
ABSL_FLAG(std::string, tls_key_file, kTls.key_file, "PEM private key of tls_cert_file.");
ABSL_FLAG(std::string, tls_ca_file, kTls.ca_file,
          "PEM CA bundle. The manager, given one, requires every client (agents too) to present "
          "a certificate it signed (mutual TLS); an agent needs one, to verify the manager, "
          "peers and BlockAgent clients.");
ABSL_FLAG(uint32_t, tls_reload_interval_s, kTls.reload_interval_s,
          "How often the TLS files are re-read, so that rotating them needs no restart (s).");
ABSL_FLAG(bool, insecure, kTls.insecure,
          "Plaintext instead of TLS (an agent's data port too): development on a trusted "
          "machine only.");
ABSL_FLAG(uint32_t, grpc_handshake_timeout_ms, kLimits.handshake_timeout_ms,
          "A gRPC connection that has not finished its TLS handshake and HTTP/2 preface "
          "within this is closed (ms).");
ABSL_FLAG(uint32_t, grpc_max_connection_idle_ms, kLimits.max_connection_idle_ms,
          "A gRPC connection with no call for this long gets GOAWAY (ms; 0: never).");
ABSL_FLAG(uint32_t, grpc_keepalive_time_ms, kLimits.keepalive_time_ms,
          "The server pings a connection silent for this long (ms).");
ABSL_FLAG(uint32_t, grpc_keepalive_timeout_ms, kLimits.keepalive_timeout_ms,
          "A connection that does not answer the server's ping within this is closed (ms).");
ABSL_FLAG(uint32_t, grpc_min_client_ping_interval_ms, kLimits.min_client_ping_interval_ms,
          "Clients may ping no more often than this without data (ms).");
ABSL_FLAG(uint32_t, grpc_max_ping_strikes, kLimits.max_ping_strikes,
          "Pings too early a client may send before it gets GOAWAY.");
ABSL_FLAG(uint32_t, grpc_max_concurrent_streams, kLimits.max_concurrent_streams,
          "Calls one gRPC connection may have open at once.");
ABSL_FLAG(uint64_t, grpc_memory_bytes, kLimits.memory_bytes,
          "Memory gRPC may use for connections and calls (its resource quota), bytes.");
ABSL_FLAG(uint32_t, grpc_max_threads, kLimits.max_threads,
          "Threads gRPC's server may use (its resource quota).");
ABSL_FLAG(uint32_t, grpc_max_connections, kLimits.max_connections,
          "TCP connections open at once on the gRPC port, all peers together (more are "
          "closed as they are accepted; capped at RLIMIT_NOFILE - grpc_fd_reserve).");
ABSL_FLAG(uint32_t, grpc_max_connections_per_peer, kLimits.max_connections_per_peer,
          "TCP connections open at once on the gRPC port from one IP address.");
ABSL_FLAG(uint32_t, grpc_fd_reserve, kLimits.fd_reserve,
          "File descriptors kept free for everything but accepted gRPC connections.");

namespace kvcm {

void ReadServerFlags(ServerLimitsOptions* limits, TlsOptions* tls) {
  tls->cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  tls->key_file = absl::GetFlag(FLAGS_tls_key_file);
  tls->ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  tls->reload_interval_s = absl::GetFlag(FLAGS_tls_reload_interval_s);
  tls->insecure = absl::GetFlag(FLAGS_insecure);
  ServerLimitsOptions& l = *limits;
  l.handshake_timeout_ms = absl::GetFlag(FLAGS_grpc_handshake_timeout_ms);
  l.max_connection_idle_ms = absl::GetFlag(FLAGS_grpc_max_connection_idle_ms);
  l.keepalive_time_ms = absl::GetFlag(FLAGS_grpc_keepalive_time_ms);
  l.keepalive_timeout_ms = absl::GetFlag(FLAGS_grpc_keepalive_timeout_ms);
  l.min_client_ping_interval_ms = absl::GetFlag(FLAGS_grpc_min_client_ping_interval_ms);
  l.max_ping_strikes = absl::GetFlag(FLAGS_grpc_max_ping_strikes);
  l.max_concurrent_streams = absl::GetFlag(FLAGS_grpc_max_concurrent_streams);
  l.memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes);
  l.max_threads = absl::GetFlag(FLAGS_grpc_max_threads);
  l.max_connections = absl::GetFlag(FLAGS_grpc_max_connections);
  l.max_connections_per_peer = absl::GetFlag(FLAGS_grpc_max_connections_per_peer);
  l.fd_reserve = absl::GetFlag(FLAGS_grpc_fd_reserve);
}

}  // namespace kvcm
