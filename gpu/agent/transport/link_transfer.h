// The two ends of one PULL_MODE_NCCL transfer after the header (agent.proto, above
// PullBlocksRequest): the server stages and sends chunks of committed blocks over a
// BlockLink, announcing each on the data connection; the puller receives them into its
// pulled blocks. Both also speak the plain TCP answer (tag 1), which a server without links
// gives.
//
// Locks: a pool's lock is taken per block, only around the copy between the block and the
// link's staging buffer (BlockPool::WithCommittedBlock / WithWritableBlock); the network
// waits (socket I/O, BlockLink::Send / Recv) hold none. A chunk is only announced once all
// of its blocks were checked and staged, so a block evicted mid-pull ends the transfer
// with FAILED_PRECONDITION before its bytes are sent, and the link stays usable.
//
// Free functions; each call owns its connection and its leased link.
#ifndef KVCM_GPU_AGENT_TRANSPORT_LINK_TRANSFER_H_
#define KVCM_GPU_AGENT_TRANSPORT_LINK_TRANSFER_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/transport/block_link.h"
#include "gpu/agent/transport/data_socket.h"
#include "gpu/agent/transport/transport.h"

namespace kvcm {

// Sent by the puller once every chunk arrived, so that the server closes the connection
// only after the puller's last receive completed (a close earlier means failure). The
// puller then waits for that close, which comes after the server released its link.
inline constexpr uint8_t kTagDone = 4;

// How one link transfer ended: its status, and whether the link is broken (an operation
// failed or may still be pending on it; the caller drops it).
struct LinkTransferResult {
  absl::Status status;
  bool link_broken = false;
};

// Blocks per chunk: the largest whole number of blocks that fits both the link's staging
// buffer and the puller's `puller_chunk_bytes` (0: no limit of the puller's).
// INVALID_ARGUMENT when not even one block fits.
absl::StatusOr<uint32_t> LinkChunkBlocks(uint64_t block_bytes, uint64_t link_staging_bytes,
                                         uint64_t puller_chunk_bytes);

// Server side, after an OK header on `conn`: sends `ids` of `pool`, each still committed to
// pages[i] of `ns`, in chunks of `chunk_blocks`, then waits for the puller's kTagDone.
// REQUIRES: ids.size() == pages.size() >= 1, chunk_blocks >= 1 and fits the link.
LinkTransferResult ServeOverLink(DataConn& conn, const BlockPool& pool, const NamespaceId& ns,
                                 std::span<const BlockId> ids, std::span<const PageHash> pages,
                                 uint32_t chunk_blocks, BlockLink& link, absl::Duration timeout);

// Puller side, after an OK header of the right block size on `conn`: receives every block of
// `spec` (tag 1 on the socket, or tag 3 chunks on `link`, which may be null when the request
// asked for none) into spec.dst_blocks. Returns the bytes received.
absl::StatusOr<uint64_t> ReceiveBlocks(DataConn& conn, const PullSpec& spec, BlockLink* link,
                                       absl::Duration timeout, bool* link_broken);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_LINK_TRANSFER_H_
