// The TCP Transport: a listening socket that serves this agent's committed blocks to peers,
// and pulls from peers over one connection per transfer, in the framing described above
// PullBlocksRequest in proto/kvcm/v1/agent.proto: one request, then the blocks' raw bytes in
// order, with no round trip per block.
#ifndef KVCM_GPU_AGENT_TCP_TRANSPORT_H_
#define KVCM_GPU_AGENT_TCP_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/agent/agent_state.h"
#include "gpu/agent/transport.h"

namespace kvcm {

struct TcpTransportOptions {
  // Where peers connect, "host:port" with a numeric IPv4 host; port 0 picks a free one.
  std::string listen_address = "127.0.0.1:0";
  // A peer silent for this long (no byte read or written) fails the transfer. >= 1.
  uint32_t io_timeout_ms = 10'000;
  // Transfers served at once; further connections wait for the backlog. >= 1.
  uint32_t max_served_transfers = 16;

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

// Listens at once and serves the committed blocks of `pools` (the main pool registered as
// `main_tier`, and TIER_HOST for pools.host). The pools must outlive the transport; its
// destructor stops listening, cancels pulls and served transfers, and joins their threads.
// UNAVAILABLE when the address cannot be bound.
absl::StatusOr<std::unique_ptr<Transport>> MakeTcpTransport(TcpTransportOptions options,
                                                            AgentPools pools, Tier main_tier);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TCP_TRANSPORT_H_
