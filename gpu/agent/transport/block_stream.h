// One block's bytes between a host pool's arena and a data connection with no staging
// buffer (the tag-1 blocks of agent.proto's data framing, unchanged on the wire). The
// socket is waited on with no lock held; each non-blocking send or receive then copies
// straight out of (into) the block under the pool's lock, after the pool checked the block
// again. The lock is so held for a kernel copy of what the socket can take or has buffered
// now (over TLS, encrypting or decrypting the records at hand), never across a network wait (the
// lock order of transport.h), and a block freed between two pieces stops the stream before
// another byte of it moves.
//
// Free functions; thread-compatible per connection.
#ifndef KVCM_GPU_AGENT_TRANSPORT_BLOCK_STREAM_H_
#define KVCM_GPU_AGENT_TRANSPORT_BLOCK_STREAM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/transport/data_socket.h"

namespace kvcm {

// Whether blocks of `pool` can be sent or received in place, over plaintext or TLS: an
// arena in host memory. Device memory goes through a staging buffer on the host.
bool CanSendInPlace(const BlockPool& pool);
bool CanRecvInPlace(const BlockPool& pool);

// Sends kTagBlock and then block `id` of `pool`, which must stay committed to `page` of `ns`
// (BlockPool::WithCommittedBlock; errors name `field`) for every piece. A wait for room
// longer than `timeout` is DEADLINE_EXCEEDED, a peer gone UNAVAILABLE. *answerable is set
// when the error is the block's check and nothing of it was sent: the caller may answer it
// with kTagError. Any other error leaves the stream mid-block, and the caller must close
// the connection (the puller then fails the pull: the block never arrives whole).
// REQUIRES: CanSendInPlace(pool).
absl::Status SendCommittedBlockInPlace(DataConn& conn, const BlockPool& pool, BlockId id,
                                       const NamespaceId& ns, const PageHash& page,
                                       absl::string_view field, absl::Duration timeout,
                                       bool* answerable);

// Receives the bytes of block `id` of `pool` (after its tag), which must stay writable by
// `owner_epoch` and, when `generation` is not 0, in that allocation
// (BlockPool::WithWritableBlock; errors name `field`) for every piece. Silence longer than
// `timeout` is DEADLINE_EXCEEDED, a peer that closes UNAVAILABLE. A failed pull may leave
// part of the bytes in the block (uncommitted, as the bytes of its earlier blocks).
// REQUIRES: CanRecvInPlace(pool).
absl::Status RecvBlockInPlace(DataConn& conn, BlockPool& pool, BlockId id, uint64_t owner_epoch,
                              uint64_t generation, absl::string_view field, absl::Duration timeout);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_BLOCK_STREAM_H_
