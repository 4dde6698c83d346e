// The data port's options: every transport serves pulls' requests there (the TCP transport
// its bytes too; the NCCL transport its headers and chunk announcements).
#ifndef KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_H_
#define KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gpu/agent/transport/data_tls.h"

namespace kvcm {

struct TcpTransportOptions {
  // Where peers connect, "host:port" with a numeric IPv4 host; port 0 picks a free one.
  std::string listen_address = "127.0.0.1:0";
  // A peer silent for this long (no byte read or written) fails the transfer. >= 1.
  uint32_t io_timeout_ms = 10'000;
  // Connections served at once, all peers together, and from one IP address: a connection
  // over either cap is closed as it is accepted, never queued behind the others. >= 1 each.
  uint32_t max_connections = 64;
  uint32_t max_connections_per_peer = 8;
  // An accepted connection must finish its TLS handshake and send its whole request within
  // this, or it is closed: a silent or byte-dripping peer holds a slot no longer. >= 1.
  uint32_t request_timeout_ms = 2'000;
  // Mutual TLS on every connection, served and pulled (data_tls.h); null: plaintext, for
  // an agent that runs insecure.
  std::shared_ptr<DataTls> tls;

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_H_
