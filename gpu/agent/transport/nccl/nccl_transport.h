// The NCCL Transport: block bytes between GPUs over NCCL links (nccl_link.h), requests and
// answers over the data port (tcp_transport.h with a LinkPort, PULL_MODE_NCCL in
// agent.proto). Compiled only with NCCL (KVCM_HAVE_NCCL); Agent::Start refuses
// --transport=nccl otherwise, and without a CUDA device.
//
// Links are made lazily, one per (puller, server) pair and direction, and cached
// (LinkCache, bounded by max_links): a pull that finds no link the server knows makes an
// ncclUniqueId (this agent hosts NCCL's bootstrap root, rank 0), has the manager relay it to
// the server (`bootstrap`: AgentControl.NcclBootstrap; no id travels between agents
// directly), and joins while the server joins as rank 1 on receiving the offer
// (AcceptLinkOffer, from the Commands stream). Both exchange a warm-up message, then the
// pull is asked again over the new link. A link whose operation fails or does not complete
// within io_timeout_ms is aborted and dropped on its side, and the pull fails
// (DEADLINE_EXCEEDED, or UNAVAILABLE when the other side gave up first); the next pull
// bootstraps a new one.
//
// Staging: the server copies each still-committed block device-to-device into the link's
// staging buffer under its pool's lock, then sends the staged chunk with no lock held; the
// puller receives into its staging buffer, then copies each block out under its pool's
// lock. See link_transfer.h.
//
// Thread-safe (Transport). The implementation is hidden behind a pimpl in
// nccl_transport.cc.
#ifndef KVCM_GPU_AGENT_TRANSPORT_NCCL_NCCL_TRANSPORT_H_
#define KVCM_GPU_AGENT_TRANSPORT_NCCL_NCCL_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/transport/registry.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"
#include "gpu/agent/transport/transport.h"

namespace kvcm {

struct NcclTransportOptions {
  // The data port that carries requests, headers and chunk announcements.
  TcpTransportOptions data;
  // This agent's id (registered with the manager; pullers name it in requests).
  std::string agent_id;
  // CUDA device of the links: the pool's.
  int device = 0;
  // Bytes of each link end's device staging buffer; at least one block of the pools.
  uint64_t staging_bytes = 64ull << 20;
  // Most pull links and most served links held at once. >= 1.
  uint32_t max_links = 16;
  // How long making a link may take (relay, join, warm-up). >= 1.
  uint32_t connect_timeout_ms = 30'000;

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

// LinkBootstrapFn (transport.h) for NCCL links: `unique_id` is the ncclUniqueId (128 bytes).
using NcclBootstrapFn = LinkBootstrapFn;

// Serves the committed blocks of `pools` (as MakeTcpTransport) and pulls over NCCL links.
// Errors as MakeTcpTransport and NcclTransportOptions::Validate.
absl::StatusOr<std::unique_ptr<Transport>> MakeNcclTransport(NcclTransportOptions options,
                                                             AgentPools pools, Tier main_tier,
                                                             NcclBootstrapFn bootstrap);

// The registry's factory and options check (registry.h; nccl_factory.cc, built with or
// without NCCL): FAILED_PRECONDITION in a build without NCCL or for a pool not on a GPU.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportContext& context);
// nccl_staging_bytes holds a block; nccl_max_links in [1, 1024]; nccl_connect_timeout_ms >= 1.
absl::Status ValidateNcclTransportOptions(const AgentOptions& options,
                                          const PoolGeometry& geometry);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_NCCL_NCCL_TRANSPORT_H_
