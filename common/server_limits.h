// Connection and stream limits of a kvcm gRPC server (the manager's port, an agent's
// BlockAgent port), applied in one place: gRPC's own server options and resource quota where
// gRPC 1.51 has them, and an accept4 guard where it has none (docs/SECURITY.md, "Connection
// limits").
//
// gRPC 1.51 (Debian 12) has no bound on connections (grpc.max_allowed_incoming_connections
// came later), and its listener stops accepting for good when accept4 fails with EMFILE
// (src/core/lib/iomgr/tcp_server_posix.cc: any errno but EAGAIN/ECONNABORTED ends the
// listener). kvcm's binaries therefore define accept4 themselves (server_limits.cc, exported
// with --export-dynamic-symbol so that libgrpc's call binds to it): with limits installed
// (InstallAcceptGuard) a TCP connection over max_connections or max_connections_per_peer is
// closed as it is accepted, and EMFILE / ENFILE sheds the pending queue through a reserved fd
// and reports EAGAIN, so the listener lives on and accepts again once fds are free.
#ifndef KVCM_COMMON_SERVER_LIMITS_H_
#define KVCM_COMMON_SERVER_LIMITS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcm {

struct ServerLimitsOptions {
  // A connection that has not finished its TLS handshake and sent HTTP/2 SETTINGS within
  // this is closed (GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS; gRPC's default is 120 s, which let
  // idle sockets pile up). Not lower: a gRPC 1.51 client reconnecting in the background
  // (channel in TRANSIENT_FAILURE, its fail-fast calls failing at once, so nothing polls)
  // advances its TLS handshake only on its 5 s backup poller; at 5 s such a client never got
  // through (BlockReuseAttackTest's sync stub did not, run after run). 100..120000.
  uint32_t handshake_timeout_ms = 20'000;
  // A connection with no call in flight for this long gets GOAWAY
  // (GRPC_ARG_MAX_CONNECTION_IDLE_MS). Long-lived streams keep theirs. 0: never.
  uint32_t max_connection_idle_ms = 300'000;
  // The server pings a connection silent for this long and closes it when the ping is not
  // answered within keepalive_timeout_ms (GRPC_ARG_KEEPALIVE_TIME_MS / _TIMEOUT_MS): dead
  // peers' sockets do not linger. >= 1000 / >= 100.
  uint32_t keepalive_time_ms = 60'000;
  uint32_t keepalive_timeout_ms = 20'000;
  // Clients may ping no more often than this without data; a client that does so more than
  // max_ping_strikes times gets GOAWAY (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
  // GRPC_ARG_HTTP2_MAX_PING_STRIKES). kvcm's clients send no keepalive pings of their own.
  uint32_t min_client_ping_interval_ms = 10'000;
  uint32_t max_ping_strikes = 2;
  // Streams (calls) one connection may have open (GRPC_ARG_MAX_CONCURRENT_STREAMS; HTTP/2
  // SETTINGS, so the client queues the rest). 1..1000000.
  uint32_t max_concurrent_streams = 256;
  // Memory gRPC may use for connections and calls (grpc::ResourceQuota::Resize): past it,
  // gRPC shrinks read buffers and refuses new calls instead of growing. >= 16 MiB.
  uint64_t memory_bytes = 1ull << 30;
  // Threads gRPC's sync/callback server may use (grpc::ResourceQuota::SetMaxThreads). >= 2.
  uint32_t max_threads = 256;
  // TCP connections open at once, all peers together (the accept4 guard); more are closed
  // as they are accepted. Capped at start at RLIMIT_NOFILE minus fd_reserve. >= 1.
  uint32_t max_connections = 8'192;
  // TCP connections open at once from one IP address (the accept4 guard). >= 1.
  uint32_t max_connections_per_peer = 512;
  // File descriptors kept free for everything but accepted connections (files, client
  // channels, the data port, /metrics). 64..1000000.
  uint32_t fd_reserve = 1'024;

  // INVALID_ARGUMENT naming the first bad option as `prefix` + its field name: the
  // manager's and the agent's options are these fields with the prefix "grpc_".
  absl::Status Validate(absl::string_view prefix = "grpc_") const;
};

// Applies `options`' channel arguments and resource quota to `builder`.
// REQUIRES: options.Validate().ok().
void ApplyServerLimits(const ServerLimitsOptions& options, grpc::ServerBuilder* builder);

// Raises this process's RLIMIT_NOFILE soft limit to its hard limit; returns the soft limit
// now in force. Call before any server starts.
uint64_t RaiseFileLimit();

// Installs the accept4 guard for every TCP listener of this process that accepts through
// accept4 (gRPC's), with max_connections capped at `fd_limit` - fd_reserve. Returns the
// total cap in force. Later calls replace the caps (a process has one gRPC port).
// REQUIRES: options.Validate().ok().
uint32_t InstallAcceptGuard(const ServerLimitsOptions& options, uint64_t fd_limit);

// civetweb options for a Prometheus exporter at `address` (prometheus::Exposer's options
// constructor): `threads` workers, a queue of 16 accepted connections behind them (the
// listener waits while it is full), a request that does not arrive within 5 s closed, no
// keep-alive, requests of at most 16 KiB. Bounds /metrics' threads and sockets; a flood
// still delays scrapes (civetweb 1.15 has no per-peer cap).
std::vector<std::string> MetricsServerOptions(const std::string& address, size_t threads);

// What the guard did since the process started; for Stats, metrics and tests. Thread-safe.
struct AcceptGuardCounters {
  uint64_t accepted = 0;           // connections handed to gRPC
  uint64_t refused_total_cap = 0;  // closed at once: max_connections reached
  uint64_t refused_peer_cap = 0;   // closed at once: max_connections_per_peer reached
  uint64_t shed_fd_exhausted = 0;  // closed at once: the process was out of fds
  bool interposed = false;         // whether libgrpc's accept4 calls reach the guard
};
AcceptGuardCounters GetAcceptGuardCounters();

// Sends gRPC's own log lines through kvcm's logger at most `max_lines_per_second` a second,
// counting the rest. gRPC 1.51 logs an ERROR line for every TLS handshake that times out, so
// without this a flood of idle connections writes a line per connection, and once stderr is a
// pipe nobody drains, gRPC's timer thread blocks in that write and no handshake deadline
// fires again (the flood then holds its sockets for good). Process-wide; call before the
// server starts.
void RateLimitGrpcLog(int max_lines_per_second = 20);

// gRPC log lines RateLimitGrpcLog dropped since it was called.
uint64_t SuppressedGrpcLogLines();

}  // namespace kvcm

#endif  // KVCM_COMMON_SERVER_LIMITS_H_
