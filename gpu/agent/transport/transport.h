// Transport: moves whole blocks from a peer agent's pool into this agent's pool, over a data
// path of its own (not the control RPCs). Backends: TCP (tcp_transport.h), for hosts without
// GPUs and every test; NCCL between GPUs (nccl_transport.h). Each hides its connections
// behind this interface, as Mooncake's transfer engine hides its communicators.
//
// A transfer is a pull: the destination names the peer's blocks and the page each must hold,
// and the bytes land in blocks it allocated. The peer serves a block only while it is
// committed to that page, so a block evicted or reused mid-transfer fails the pull instead of
// sending other bytes. Nothing is committed by the transport: the caller commits the
// destination blocks through the ledger once the pull succeeded, or frees them when it fails.
//
// Lock order: a transport takes a pool's lock only to copy one block, or one piece of one,
// in or out of its arena (BlockPool::ReadCommittedBlock, WriteBlocks, or WithCommittedBlock
// / WithWritableBlock into a link's staging buffer or, for a piece, a non-blocking socket
// call: block_stream.h), one pool at a time, never across a network wait; its own locks
// (the link cache's) are never held while it takes a pool's.
#ifndef KVCM_GPU_AGENT_TRANSPORT_TRANSPORT_H_
#define KVCM_GPU_AGENT_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"

namespace kvcm {

// One pull: peer_blocks[i] of the peer's pool, holding pages[i] of `ns`, into dst_blocks[i]
// of `dst`.
struct PullSpec {
  std::string peer_address;  // the serving agent's data address, "host:port"
  Tier peer_tier = Tier::kGpu;
  NamespaceId ns;
  std::vector<BlockId> peer_blocks;
  std::vector<PageHash> pages;      // one per peer block
  BlockPool* dst = nullptr;         // not owned; must outlive the pull
  std::vector<BlockId> dst_blocks;  // allocated to dst_owner_epoch, one per peer block
  uint64_t dst_owner_epoch = 0;
  // The generations of dst_blocks' allocations, parallel to them (empty: not checked): a
  // destination block freed mid-pull fails the pull before its bytes are copied.
  std::vector<uint64_t> dst_generations;
};

struct TransferStats {
  uint64_t bytes = 0;
  absl::Duration elapsed;
};

// How a pull ended. On an error the destination blocks may hold part of the bytes; they stay
// allocated (never committed) for the caller to free or reuse.
using PullDone = std::function<void(absl::StatusOr<TransferStats> result)>;

// An NCCL link another agent offered through the manager (AgentCommand.nccl_connect).
struct LinkOffer {
  std::string from_agent_id;  // the agent that will pull over the link (rank peer_rank)
  uint64_t link_id = 0;       // its name for the link
  std::string unique_id;      // the ncclUniqueId, 128 bytes
  int32_t rank = 1;           // this agent's rank
  int32_t peer_rank = 0;
  int32_t nranks = 2;
};

// Has the manager relay a link offer to `peer_agent_id` (AgentControl.NcclBootstrap):
// `link_id`, made by this agent, with `unique_id`. Returns once it is queued on the peer's
// Commands stream; the manager's error otherwise.
using LinkBootstrapFn = std::function<absl::Status(const std::string& peer_agent_id,
                                                   uint64_t link_id, const std::string& unique_id)>;

// Transports whose bytes move over links they join on a peer's offer, relayed by the
// manager's Commands stream (NCCL), take the offers here. Thread-safe.
class LinkOfferHandler {
 public:
  virtual ~LinkOfferHandler() = default;
  // Joins the link `offer` names, on a thread of the transport, and serves its puller over
  // it once joined; the offer's errors (INVALID_ARGUMENT naming the field). Returns without
  // waiting for the join.
  virtual absl::Status AcceptLinkOffer(const LinkOffer& offer) = 0;
};

// Thread-safe: Pull may be called from any thread; pulls and served requests run
// concurrently, each on a thread of the transport.
class Transport {
 public:
  virtual ~Transport() = default;
  // Where peers pull from ("host:port").
  virtual std::string address() const = 0;
  // Starts `spec`; `done` runs exactly once, on a transport thread. INVALID_ARGUMENT for a
  // spec whose lists differ in length or are empty, a null dst, or a peer whose block size
  // is not dst's; the peer's FAILED_PRECONDITION for a block that no longer holds its page;
  // UNAVAILABLE / DEADLINE_EXCEEDED when the peer cannot be reached or goes silent.
  virtual void Pull(PullSpec spec, PullDone done) = 0;
  // Where link offers go, for a transport with links of its own; null for the others.
  virtual LinkOfferHandler* link_offers() { return nullptr; }
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_TRANSPORT_H_
