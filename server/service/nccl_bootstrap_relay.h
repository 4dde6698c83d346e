// NcclBootstrapRelay: the manager's side of NCCL link bootstraps (AgentControl.NcclBootstrap).
//
// It remembers which agents registered a transport that bootstraps its links through the
// manager (common/transports.h: "nccl"), per epoch, and which Commands stream each agent has
// open, and holds the link offers (NcclConnect) waiting to be written on that stream. An offer is
// not a numbered command: the agent never acknowledges it and it is never resent, because an
// ncclUniqueId is good only while its maker waits in ncclCommInitRank. So an offer for an agent
// with no open stream is refused to its maker (who retries later), and offers still waiting when a
// stream ends are dropped with it.
//
// Plain protocol state (no gRPC): the Commands reactor moves offers out (TakeNext), the
// AgentControlService moves them in (Relay). It keeps its own record of each agent's
// transport per epoch (AgentRegistration has it too) so that the check and the queueing of an
// offer happen under one lock; see docs/AGENTS.md, "NCCL transport".
//
// Thread-safe. Lock order: a stream's own lock (its Wake calls TakeNext), then mu_. Wake is
// called after mu_ is released.
#ifndef KVCM_SERVER_SERVICE_NCCL_BOOTSTRAP_RELAY_H_
#define KVCM_SERVER_SERVICE_NCCL_BOOTSTRAP_RELAY_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/core/agent_command_book.h"

namespace kvcm {

// One link offer, as the peer receives it (v1::NcclConnect).
struct NcclLinkOffer {
  std::string from_agent_id;  // the agent that made the id; it pulls over the link
  uint64_t link_id = 0;       // its name for the link, non-zero
  std::string unique_id;      // ncclUniqueId, kNcclUniqueIdBytes opaque bytes
  int32_t rank = 1;           // the receiver's rank
  int32_t peer_rank = 0;      // the maker's rank (it hosts NCCL's bootstrap root)
  int32_t nranks = 2;
};

// NCCL_UNIQUE_ID_BYTES, without including nccl.h: the manager never links NCCL.
inline constexpr size_t kNcclUniqueIdBytes = 128;

class NcclBootstrapRelay {
 public:
  using StreamId = uint64_t;

  // At most `max_offers_per_agent` offers wait for one agent's stream. REQUIRES: >= 1.
  explicit NcclBootstrapRelay(size_t max_offers_per_agent = 64);
  NcclBootstrapRelay(const NcclBootstrapRelay&) = delete;
  NcclBootstrapRelay& operator=(const NcclBootstrapRelay&) = delete;

  // `agent_id` registered `epoch` with `transport` (RegisterAgentRequest.transport). A new
  // epoch drops the offers waiting for the old one.
  void OnRegistered(const std::string& agent_id, uint64_t epoch, const std::string& transport)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The agent was declared gone: forgets it and its offers.
  void Forget(const std::string& agent_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Whether `agent_id` registered a transport that uses this relay in `epoch`.
  bool IsNccl(const std::string& agent_id, uint64_t epoch) const ABSL_LOCKS_EXCLUDED(mu_);

  // Queues `offer` for `to` in `to_epoch` and wakes its stream. Errors queue nothing:
  // FAILED_PRECONDITION ("peer_agent_id") when `to` did not register such a transport in
  // `to_epoch`,
  // UNAVAILABLE when it has no open stream of that epoch, RESOURCE_EXHAUSTED when
  // max_offers_per_agent offers wait for it already.
  absl::Status Relay(const std::string& to, uint64_t to_epoch, NcclLinkOffer offer)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The agent's Commands stream of `epoch` is open: offers go to `stream` (replacing an
  // older one; the AgentCommandBook ends that). Returns its id for TakeNext and Detach.
  StreamId Attach(const std::string& agent_id, uint64_t epoch,
                  std::shared_ptr<CommandStream> stream) ABSL_LOCKS_EXCLUDED(mu_);
  // The stream ended: if it is still the agent's, the waiting offers go with it. Unknown
  // ids are ignored.
  void Detach(StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);
  // The next offer for `stream` to write; nullopt when none waits or the stream is not the
  // agent's current one.
  std::optional<NcclLinkOffer> TakeNext(StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Offers waiting for `agent_id`.
  size_t queued(const std::string& agent_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Agent {
    uint64_t epoch = 0;
    bool nccl = false;
    StreamId stream_id = 0;  // 0: no stream open
    uint64_t stream_epoch = 0;
    std::shared_ptr<CommandStream> stream;
    std::deque<NcclLinkOffer> offers;
  };

  const size_t max_offers_per_agent_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Agent> agents_ ABSL_GUARDED_BY(mu_);
  // Agent id of each attached stream.
  absl::flat_hash_map<StreamId, std::string> stream_agents_ ABSL_GUARDED_BY(mu_);
  StreamId next_stream_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_NCCL_BOOTSTRAP_RELAY_H_
