// The TCP Transport: a listening socket that serves this agent's committed blocks to peers,
// and pulls from peers over one connection per transfer, in the framing described above
// PullBlocksRequest in proto/kvcm/v1/agent.proto: one request, then the blocks' raw bytes in
// order, with no round trip per block.
//
// Given a LinkPort, the same data port moves the block bytes over BlockLinks instead
// (PULL_MODE_NCCL; link_transfer.h): its pulls ask for them, bootstrapping a link when the
// server answers link_needed, and it serves pullers over the links they offered. This is
// the NCCL transport's data path (nccl_transport.h) with the NCCL parts behind LinkCache.
#ifndef KVCM_GPU_AGENT_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define KVCM_GPU_AGENT_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/transport/data_port.h"
#include "gpu/agent/transport/data_tls.h"
#include "gpu/agent/transport/link_cache.h"
#include "gpu/agent/transport/registry.h"
#include "gpu/agent/transport/transport.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

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

// The registry's factory (registry.h): MakeTcpTransport over the context's data port.
absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TransportContext& context);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_TCP_TCP_TRANSPORT_H_
