// NcclLink: a BlockLink over one NCCL communicator of two ranks, one per agent (GPU), with a
// dedicated non-blocking CUDA stream and a device staging buffer. Compiled only with NCCL
// (KVCM_HAVE_NCCL).
//
// The communicator is non-blocking (ncclConfig_t.blocking = 0), so no NCCL call waits
// forever: creation and every send or receive are polled (ncclCommGetAsyncError, then
// cudaStreamQuery on the link's stream) until done, the deadline, a cancel or the caller's
// check; an unfinished operation leaves the link broken and its owner drops it, which
// aborts the communicator (ncclCommAbort in the destructor). A send or receive is one
// ncclGroupStart/ncclSend or ncclRecv/ncclGroupEnd of one chunk on the link's stream.
// Creation ends with a warm-up: each rank sends and receives 8 bytes in one group, so a
// link is only handed out once both ranks have joined and moved bytes.
//
// Thread-compatible (BlockLink): one transfer at a time; Cancel from any thread. Every
// method sets the link's device on the calling thread first.
#ifndef KVCM_GPU_AGENT_TRANSPORT_NCCL_NCCL_LINK_H_
#define KVCM_GPU_AGENT_TRANSPORT_NCCL_NCCL_LINK_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gpu/agent/transport/block_link.h"

namespace kvcm {

struct NcclLinkOptions {
  // CUDA device of this end (the agent's pool device).
  int device = 0;
  // Bytes of the device staging buffer; >= 16 (the warm-up's two 8-byte halves).
  uint64_t staging_bytes = 64ull << 20;
  // How long ncclCommInitRankConfig and the warm-up may take together.
  absl::Duration connect_timeout = absl::Seconds(30);
};

// A new ncclUniqueId (ncclGetUniqueId), as its 128 bytes: the caller hosts NCCL's bootstrap
// root for it. The NCCL error as a Status.
absl::StatusOr<std::string> NewNcclUniqueId();

// Joins the communicator `unique_id` (128 bytes) as `rank` (0 or 1) of two on
// options.device, then exchanges the warm-up. DEADLINE_EXCEEDED when the other rank does not
// join within connect_timeout, CANCELLED when `stop` turns true, INVALID_ARGUMENT for a bad
// id, rank or options, the CUDA or NCCL error otherwise; nothing is left allocated then.
absl::StatusOr<std::unique_ptr<BlockLink>> MakeNcclLink(const NcclLinkOptions& options,
                                                        const std::string& unique_id, int rank,
                                                        const std::atomic<bool>& stop);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_NCCL_NCCL_LINK_H_
