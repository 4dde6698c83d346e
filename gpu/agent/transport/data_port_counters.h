// DataPortCounters: what the data port (data_port.h) did with the connections it accepted.
// Apart from data_port.h so that the agent's metrics can read it without the socket headers.
#ifndef KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_COUNTERS_H_
#define KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_COUNTERS_H_

#include <atomic>
#include <cstdint>

namespace kvcm {

// What the data port did with the connections it accepted, for the agent's metrics
// (kvcm_agent_data_connections_*_total). Thread-safe: the transport adds, anyone reads.
struct DataPortCounters {
  std::atomic<uint64_t> accepted{0};
  // Closed as accepted: their address held max_handshakes_per_peer pending handshakes, or
  // the handshake budget was full and their address was not lighter than the heaviest.
  std::atomic<uint64_t> refused_max_handshakes_per_peer{0};
  std::atomic<uint64_t> refused_max_handshakes{0};
  // Pending handshakes closed to make room for a newer one (handshake_budget.h).
  std::atomic<uint64_t> handshakes_evicted{0};
  // Pending handshakes closed at handshake_timeout_ms, and those that failed by themselves
  // (a refused certificate, not TLS, a malformed first frame, a peer that hung up).
  std::atomic<uint64_t> handshake_timeouts{0};
  std::atomic<uint64_t> handshakes_failed{0};
  // Handshakes that completed with max_connections (all, or from their address) served.
  std::atomic<uint64_t> refused_max_connections{0};
  std::atomic<uint64_t> refused_max_connections_per_peer{0};
  // Connections that completed their handshake and took a slot.
  std::atomic<uint64_t> served{0};
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_DATA_PORT_COUNTERS_H_
