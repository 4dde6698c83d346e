// LocalSession: one engine connection of the agent's local data path (proto/kvcm/v1/local.proto,
// docs/AGENTS.md "Local data path"), without its socket: the state of the connection and the
// answer to each request datagram.
//
// The engine registers its own KV memory (LocalHello: the memfd that holds it, or the CUDA IPC
// handles of its device memory); the session maps or opens that region (an EngineRegion) and
// copies whole blocks between the pool and the region itself (LocalCopy): LOAD = pool ->
// region, STORE = region -> pool, one memcpy (cudaMemcpyAsync) per segment.
// The session's principal comes from the hello's token, authenticated as a BlockAgent call's,
// and again on every copy: a token revoked since (the tokens file reloaded without it) ends
// the session, its copy refused. A copy is authorized and checked exactly as ReadBlocks
// (LOAD) or WriteBlocks (STORE) for that principal: every check (generations, ownership,
// immutability of committed blocks, the page check) of every block first, under the pool's
// lock, so a refused copy moves no byte; then the copies in chunks of at most
// local_copy_chunk_bytes (whole segments, at least one), each in its own critical section
// of the pool's lock that checks again the blocks it copies. A block freed, reallocated or
// recommitted between two chunks stops the copy there (the reply says how many blocks were
// copied whole); no chunk ever copies a block that fails its check.
//
// Not thread-safe: one session per connection, driven by one thread (LocalSocketServer).
#ifndef KVCM_GPU_AGENT_LOCAL_LOCAL_SESSION_H_
#define KVCM_GPU_AGENT_LOCAL_LOCAL_SESSION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/authenticator.h"
#include "common/token_table.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/local/engine_region.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/server/agent_metrics.h"
#include "kvcm/v1/local.pb.h"

namespace kvcm {

// What every session of one agent works over; nothing owned, all of it outlives the sessions.
struct LocalSessionEnv {
  const AgentOptions* options = nullptr;  // tier, max_blocks_per_call, local_copy_chunk_bytes
  AgentPools pools;
  const AgentEpoch* epoch = nullptr;
  const Authenticator* authenticator = nullptr;  // required (Authenticator::Open() when open)
  AgentMetrics* metrics = nullptr;               // optional
  // Principals that may be used only from the listed peer uids (local_principal_uids);
  // others from any uid. Optional.
  const LocalPrincipalUids* principal_uids = nullptr;
};

class LocalSession {
 public:
  // Most bytes of one request datagram; a longer one is INVALID_ARGUMENT.
  static constexpr size_t kMaxRequestBytes = 1 << 20;
  // Largest region a hello may register (1 TiB), most segments per block, most engine blocks.
  static constexpr uint64_t kMaxRegionBytes = 1ull << 40;
  static constexpr int kMaxSegments = 4096;
  static constexpr uint32_t kMaxEngineBlocks = 1u << 24;

  // `peer` names the connection in logs (e.g. "uid 1000 pid 4242"); `peer_uid` is its
  // SO_PEERCRED uid (env.principal_uids).
  LocalSession(LocalSessionEnv env, std::string peer, uint32_t peer_uid);
  ~LocalSession();  // unmaps or closes the region
  LocalSession(const LocalSession&) = delete;
  LocalSession& operator=(const LocalSession&) = delete;

  // The reply to one request datagram and the file descriptors that came with it (SCM_RIGHTS).
  // The session takes every fd: it keeps the mapping of a hello's, and closes them all.
  // `truncated`: the datagram was longer than kMaxRequestBytes (what arrived is cut).
  v1::LocalReply Handle(absl::string_view datagram, std::vector<int> fds, bool truncated = false);

  // Whether a hello registered a region.
  bool registered() const { return region_ != nullptr; }
  // Whether the session ended (its token was revoked): the connection must be closed after
  // the reply just returned.
  bool ended() const { return ended_; }

 private:
  // The principal of `token` (empty: none sent), if it may be used from peer_uid_.
  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(const std::string& token) const;
  absl::Status Hello(const v1::LocalHello& hello, std::span<const int> fds, v1::LocalReply* reply);
  absl::Status Copy(const v1::LocalCopy& copy, v1::LocalReply* reply);

  const LocalSessionEnv env_;
  const std::string peer_;
  const uint32_t peer_uid_;
  std::shared_ptr<const Principal> principal_;
  std::string token_;  // the hello's, authenticated again on every copy
  bool ended_ = false;
  // The engine's memory; null before a hello.
  std::unique_ptr<EngineRegion> region_;
  // The layout (LocalHello): engine block b's segment s at segment_offsets_[s] + b x stride
  // of segment s's memory.
  std::vector<uint64_t> segment_offsets_;
  uint64_t segment_bytes_ = 0;
  uint64_t segment_stride_ = 0;
  uint32_t num_engine_blocks_ = 0;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_LOCAL_LOCAL_SESSION_H_
