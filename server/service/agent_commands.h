// AgentCommandRouter: the manager's side of AgentControl.Commands. The index's event
// listener hands it every CacheEvent; each kRemoved event of an agent's pool becomes a
// FreeBlocks command queued on that agent's open Commands stream, and a reactor per stream
// writes the commands one at a time and reads the agent's acks (counted in
// kvcm_agent_commands_total{result}).
//
// Thread-safe: OnEvent may be called from any thread, including under the CacheIndex lock
// (it never blocks on the network: it appends to a bounded queue and at most starts an
// asynchronous gRPC write); Open, Close and open_streams may be called concurrently.
// Lock order: mu_ of the router, then a stream's mu_. gRPC operations may be started under
// the router's mu_; their reactions run later on gRPC threads, never inline.
#ifndef KVCM_SERVER_SERVICE_AGENT_COMMANDS_H_
#define KVCM_SERVER_SERVICE_AGENT_COMMANDS_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <string>

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
  // Commands one agent may have waiting to be written; more are dropped (and counted).
  static constexpr size_t kDefaultMaxQueuedCommands = 4096;

  // `agents` and `metrics` are not owned and must outlive the router. REQUIRES:
  // max_queued_commands >= 1.
  AgentCommandRouter(const AgentRegistry* agents, ServiceMetrics* metrics,
                     size_t max_queued_commands = kDefaultMaxQueuedCommands);
  // REQUIRES: every stream Open returned is done (the gRPC server has shut down).
  ~AgentCommandRouter() = default;
  AgentCommandRouter(const AgentCommandRouter&) = delete;
  AgentCommandRouter& operator=(const AgentCommandRouter&) = delete;

  // CacheEventListener: a kRemoved event of the pool an agent registered, while that agent
  // has an open stream, queues FreeBlocks{pool tier, block ids other than kPendingBlock}.
  // Every other event is ignored.
  void OnEvent(const CacheEvent& event) ABSL_LOCKS_EXCLUDED(mu_);

  // The reactor of one Commands call (it deletes itself when the call is done).
  grpc::ServerBidiReactor<v1::AgentCommandAck, v1::AgentCommand>* Open();

  // Ends every open stream with UNAVAILABLE and refuses new ones. Idempotent.
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

  // Agents with an attached stream: its hello was accepted and the call is not done.
  size_t open_streams() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Stream;

  // Makes `stream` the one of its agent, finishing an older one with ABORTED. False (and
  // nothing changed) after Close.
  bool Attach(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets `stream` if it is still its agent's. Called from the stream's OnDone.
  void Detach(Stream* stream) ABSL_LOCKS_EXCLUDED(mu_);

  const AgentRegistry* const agents_;
  ServiceMetrics* const metrics_;
  const size_t max_queued_commands_;

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // By agent id; a stream stays here until its OnDone.
  absl::flat_hash_map<std::string, Stream*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_AGENT_COMMANDS_H_
