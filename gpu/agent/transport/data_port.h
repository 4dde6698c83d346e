// The data port's options: every transport serves pulls' requests there (the TCP transport
// its bytes too; the NCCL transport its headers and chunk announcements).
#ifndef KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_H_
#define KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gpu/agent/transport/data_port_counters.h"
#include "gpu/agent/transport/data_tls.h"

namespace kvcm {

struct TcpTransportOptions {
  // Where peers connect, "host:port" with a numeric IPv4 host; port 0 picks a free one.
  std::string listen_address = "127.0.0.1:0";
  // A peer silent for this long (no byte read or written) fails the transfer. >= 1.
  uint32_t io_timeout_ms = 10'000;
  // Connections served at once, all peers together, and from one IP address. A connection
  // takes a slot only once its handshake completed (TLS: the handshake; plaintext: its
  // request frame arrived); over either cap it is then closed, never queued. >= 1 each.
  uint32_t max_connections = 64;
  uint32_t max_connections_per_peer = 8;
  // Accepted connections whose handshake has not completed, all peers together and from
  // one IP address, apart from the slots above. Over the per-address cap a connection is
  // closed as accepted; with the budget full, a connection from an address holding fewer
  // pending takes the place of the oldest pending one of the address holding the most
  // (handshake_budget.h). >= 1 each.
  uint32_t max_handshakes = 64;
  uint32_t max_handshakes_per_peer = 8;
  // A pending connection is closed when its handshake has not completed within this. >= 1.
  uint32_t handshake_timeout_ms = 1'000;
  // An accepted connection must finish its TLS handshake and send its whole request within
  // this, or it is closed: a silent or byte-dripping peer holds a slot no longer. >= 1.
  uint32_t request_timeout_ms = 2'000;
  // Mutual TLS on every connection, served and pulled (data_tls.h); null: plaintext, for
  // an agent that runs insecure.
  std::shared_ptr<DataTls> tls;
  // Where the transport counts what it did with accepted connections; null: its own.
  std::shared_ptr<DataPortCounters> counters;

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_H_
