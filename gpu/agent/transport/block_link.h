// BlockLink: a byte pipe between this agent and one peer, that block transfers of the
// PULL_MODE_NCCL data protocol move over (agent.proto, above PullBlocksRequest). The NCCL
// backend is one communicator of two ranks with its own CUDA stream and staging buffer
// (nccl_link.h); tests use in-memory links (link_transfer_test.cc).
//
// A link has one staging buffer. A transfer fills it from pool blocks (StageIn, under the
// pool's lock, one block at a time), sends or receives it whole (Send / Recv: the network
// wait, under no lock), and empties it into pool blocks (StageOut, under the pool's lock).
// So no pool lock is ever held across a network wait.
//
// Not thread-safe: one transfer uses a link at a time (LinkCache leases it), except Cancel,
// which any thread may call.
#ifndef KVCM_GPU_AGENT_TRANSPORT_BLOCK_LINK_H_
#define KVCM_GPU_AGENT_TRANSPORT_BLOCK_LINK_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvcm {

class BlockLink {
 public:
  // Called while Send / Recv wait; a non-OK answer ends the wait with that status (e.g. the
  // data connection of the transfer closed).
  using WaitCheck = std::function<absl::Status()>;

  virtual ~BlockLink() = default;

  // Bytes of the staging buffer: the most one Send / Recv moves.
  virtual uint64_t staging_bytes() const = 0;

  // Copies `bytes` from `src` (a pool arena: host or device memory) into the staging buffer
  // at `staging_offset`, or from the staging buffer out to `dst`; done when it returns.
  // OUT_OF_RANGE when the range leaves the staging buffer; a device error as a Status.
  virtual absl::Status StageIn(const std::byte* src, uint64_t staging_offset, uint64_t bytes) = 0;
  virtual absl::Status StageOut(uint64_t staging_offset, std::byte* dst, uint64_t bytes) = 0;

  // Sends the first `bytes` of the staging buffer to the peer, or receives as many from it;
  // both sides name the same count. DEADLINE_EXCEEDED when it does not complete within
  // `timeout`, CANCELLED after Cancel, `check`'s error, or the transport's error: in every
  // failure the link is broken (its operation may still be pending) and must be dropped.
  virtual absl::Status Send(uint64_t bytes, absl::Duration timeout, const WaitCheck& check) = 0;
  virtual absl::Status Recv(uint64_t bytes, absl::Duration timeout, const WaitCheck& check) = 0;

  // Makes a Send or Recv in progress (on another thread) return CANCELLED soon, and every
  // later one at once. Thread-safe.
  virtual void Cancel() = 0;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_BLOCK_LINK_H_
