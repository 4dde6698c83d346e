// AgentCommandRouter: the manager's side of AgentControl.Commands.
//
// The index's event listener hands it every CacheEvent. A kRemoved event of an agent's pool
// becomes FreeBlocks, a demotion into its HOST pool (kStored with demoted_from) becomes
// DemoteBlocks. Commands go into the agent's outbox, one per registered agent epoch, where
// they stay until the agent acknowledges them: a stream that opens (or reopens after a
// break) first resends every unacknowledged command, so nothing the index did while the
// agent was disconnected is lost. The ack of a DemoteBlocks names the new HOST blocks,
// which the router records in the index (CacheIndex::AssignBlocks); blocks the index no
// longer wants (the pages left the HOST pool meanwhile) are freed with a new FreeBlocks.
// Acks are counted in kvcm_agent_commands_total{result}.
//
// Thread-safe. Lock order: CacheIndex's lock, then mu_ (OnEvent runs under the index lock);
// the router never calls the index while holding mu_. Every stream's state is guarded by
// mu_; gRPC operations are started under mu_ and their reactions run later on gRPC threads,
// never inline.
#ifndef KVCM_SERVER_SERVICE_AGENT_COMMANDS_H_
#define KVCM_SERVER_SERVICE_AGENT_COMMANDS_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvcm/v1/agent.pb.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/service/metrics.h"

namespace kvcm {

class AgentCommandRouter {
 public:
  // Unacknowledged commands one agent may have queued; more are dropped (and counted).
  static constexpr size_t kDefaultMaxQueuedCommands = 4096;

  // `index`, `agents` and `metrics` are not owned and must outlive the router. REQUIRES:
  // max_queued_commands >= 1.
  AgentCommandRouter(CacheIndex* index, const AgentRegistry* agents, ServiceMetrics* metrics,
                     size_t max_queued_commands = kDefaultMaxQueuedCommands);
  // REQUIRES: every stream Open returned is done (the gRPC server has shut down).
  ~AgentCommandRouter() = default;
  AgentCommandRouter(const AgentCommandRouter&) = delete;
  AgentCommandRouter& operator=(const AgentCommandRouter&) = delete;

  // CacheEventListener: queues the command an event of a registered agent's pool needs.
  void OnEvent(const CacheEvent& event) ABSL_LOCKS_EXCLUDED(mu_);

  // The registry accepted `agent_id` in `epoch`. A new epoch starts an empty outbox: the
  // old epoch's commands are dropped (their blocks died with that process) and its stream,
  // if any, ends with ABORTED. The same epoch again changes nothing.
  void OnRegistered(const std::string& agent_id, uint64_t epoch) ABSL_LOCKS_EXCLUDED(mu_);

  // The agent was declared gone: its outbox is dropped and its stream ends with NOT_FOUND.
  void Forget(const std::string& agent_id) ABSL_LOCKS_EXCLUDED(mu_);

  // The reactor of one Commands call (it deletes itself when the call is done).
  grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* Open();

  // Ends every open stream with UNAVAILABLE and refuses new ones. Idempotent.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

  // Agents with an attached stream: its hello was accepted and the call is not finishing.
  size_t open_streams() const ABSL_LOCKS_EXCLUDED(mu_);
  // Commands queued for `agent_id` and not yet acknowledged.
  size_t unacked_commands(const std::string& agent_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Stream;

  // Where a DemoteBlocks' answer goes in the index.
  struct Demotion {
    NamespaceId ns;
    PoolKey pool;                // the HOST pool
    std::vector<PageHash> path;  // a prompt's leading pages, ending with the demoted ones
    uint32_t first_page = 0;     // first demoted page of `path`
  };
  struct Pending {
    v1::AgentCommand command;  // sequence assigned
    std::optional<Demotion> demotion;
  };
  // Commands of one agent epoch, in sequence order.
  struct Outbox {
    uint64_t epoch = 0;
    uint64_t next_sequence = 1;
    uint64_t acked_through = 0;
    std::deque<Pending> unacked;
    // unacked[0, sent) went out on the current stream.
    size_t sent = 0;
    Stream* stream = nullptr;
  };

  // Appends `command` (demotion: its index context) to the outbox of `agent_id`, if the
  // agent is registered and the outbox has room, and writes it if the stream is idle.
  void Enqueue(const std::string& agent_id, v1::AgentCommand command,
               std::optional<Demotion> demotion) ABSL_LOCKS_EXCLUDED(mu_);
  void EnqueueLocked(Outbox& outbox, v1::AgentCommand command, std::optional<Demotion> demotion)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts writing the next unsent command when the outbox's stream is idle.
  void MaybeWriteLocked(Outbox& outbox) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `n` commands as dropped.
  void CountDropped(size_t n);

  // Hello of `stream` for (agent_id, epoch) accepted by the registry: attaches it to the
  // agent's outbox (replacing an older stream) and starts resending. A non-OK status
  // (nothing attached) to finish the stream with.
  grpc::Status Attach(Stream* stream, const std::string& agent_id, uint64_t epoch)
      ABSL_LOCKS_EXCLUDED(mu_);
  // An ack read on `stream`. Pops the acknowledged command; a demotion's blocks go to the
  // index (outside mu_). False when the ack broke the protocol and the stream is finishing.
  bool OnAck(Stream* stream, const v1::AgentCommandAck& ack) ABSL_LOCKS_EXCLUDED(mu_);
  // The stream wrote one message (ok: it went out).
  void OnWriteDone(Stream* stream, bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // Finishes `stream` with `status` now or after its write in flight, and detaches it from
  // its outbox (unsent commands stay queued for the next stream). Only the first call counts.
  void FinishLocked(Stream* stream, const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stream's call is done: forget every pointer to it.
  void OnDone(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  CacheIndex* const index_;
  const AgentRegistry* const agents_;
  ServiceMetrics* const metrics_;
  const size_t max_queued_commands_;

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // By agent id: the outbox of its registered epoch.
  absl::flat_hash_map<std::string, Outbox> outboxes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_AGENT_COMMANDS_H_
