// The TCP Transport: a listening socket that serves this agent's committed blocks to peers,
// and pulls from peers over one connection per transfer, in the framing described above
// PullBlocksRequest in proto/kvcm/v1/agent.proto: one request, then the blocks' raw bytes in
// order, with no round trip per block.
//
// Given a LinkPort, the same data port moves the block bytes over BlockLinks instead
// (PULL_MODE_NCCL; link_transfer.h): its pulls ask for them, bootstrapping a link when the
// server answers link_needed, and it serves pullers over the links they offered. This is
// the NCCL transport's data path (nccl_transport.h) with the NCCL parts behind LinkCache.
#ifndef KVCM_GPU_AGENT_TCP_TRANSPORT_H_
#define KVCM_GPU_AGENT_TCP_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/agent/agent_state.h"
#include "gpu/agent/block_pool.h"
#include "gpu/agent/data_tls.h"
#include "gpu/agent/link_cache.h"
#include "gpu/agent/transport.h"
#include "kvcm/v1/agent.pb.h"

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

// Block bytes over links rather than the data connection.
struct LinkPort {
  // This agent's id: named in its pulls (puller_agent_id), and answered to pullers whose
  // link it does not know (PullBlocksHeader.agent_id).
  std::string agent_id;
  // The links; not owned, must outlive the transport. Its connector bootstraps pull links.
  LinkCache* links = nullptr;
  // How long a pull waits for another pull's link to the same peer to be connected, on top
  // of the io timeout.
  uint32_t connect_timeout_ms = 30'000;
};

// The checks a served pull's request gets before any block is read, in order: `pool`, the
// pool its tier names, exists (null: it does not); the namespace is valid; block_ids is not
// empty; page_hashes holds 16 bytes per block. Returns the namespace, or INVALID_ARGUMENT
// naming the field, which the server answers in the header.
absl::StatusOr<NamespaceId> CheckPullRequest(const v1::PullBlocksRequest& req,
                                             const BlockPool* pool);

// Listens at once and serves the committed blocks of `pools` (the main pool registered as
// `main_tier`, and TIER_HOST for pools.host). The pools must outlive the transport; its
// destructor stops listening, cancels pulls and served transfers (and `links`' transfers),
// and joins their threads. UNAVAILABLE when the address cannot be bound; INVALID_ARGUMENT
// for a LinkPort without its cache or agent id.
absl::StatusOr<std::unique_ptr<Transport>> MakeTcpTransport(
    TcpTransportOptions options, AgentPools pools, Tier main_tier,
    std::optional<LinkPort> links = std::nullopt);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TCP_TRANSPORT_H_
