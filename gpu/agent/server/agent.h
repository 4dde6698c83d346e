// Agent: a running kvcm-agent. Owns the block pool (over the backend CreateBackend chose)
// and, when host_capacity_bytes > 0, a host-DRAM pool of the same geometry that the manager
// demotes pages into, the epoch (agent_state.h) and the metrics; starts and stops the
// components over them: the BlockAgent gRPC server (block_agent_service.h), the optional
// local data path (local_socket_server.h), the ControlLoop
// that registers, reports the inventory and heartbeats, the CommandLoop that runs the manager's
// commands, and the optional Prometheus exposer.
//
// Used by gpu/agent/main.cc and by tests. Thread-safe: Shutdown and Wait may be called from
// any thread, concurrently and more than once; the accessors are safe at any time.
#ifndef KVCM_GPU_AGENT_SERVER_AGENT_H_
#define KVCM_GPU_AGENT_SERVER_AGENT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/authenticator.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/namespace_specs.h"
#include "gpu/agent/server/fetcher.h"
#include "gpu/agent/transport/transport.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace kvcm {

class AgentMetrics;
class DataTls;
class BlockAgentService;
class CommandLoop;
class ControlLoop;
class LocalSocketServer;
class RoomMaker;

class Agent {
 public:
  // Validates `options`, reads its TLS, token and tokens files, creates the backend and pool,
  // serves BlockAgent and starts the control and command threads. INVALID_ARGUMENT for bad options
  // or TLS / token files (naming the option and the path), UNAVAILABLE when an
  // address cannot be bound, RESOURCE_EXHAUSTED when the pool's memory cannot be allocated,
  // FAILED_PRECONDITION for transport kNccl in a build without NCCL or with the pool not on
  // a CUDA device. The manager need not be up yet.
  static absl::StatusOr<std::unique_ptr<Agent>> Start(AgentOptions options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // "host:port" of the BlockAgent server with the bound port filled in.
  const std::string& address() const { return address_; }
  // Where peers pull this agent's blocks ("host:port").
  const std::string& data_address() const { return data_address_; }
  // Path of the local data path's socket; empty when off.
  const std::string& local_socket() const { return options_.local_socket; }
  // "host:port" of /metrics; empty when disabled.
  const std::string& metrics_address() const { return metrics_address_; }
  // The current epoch; changes when the manager refuses it (ABORTED, see ControlLoop).
  uint64_t epoch() const { return epoch_.current(); }
  // Why this backend was chosen, e.g. "no CUDA device (...): using host DRAM".
  const std::string& backend_reason() const { return backend_reason_; }
  BlockPool& pool() { return *pool_; }
  // The host pool; null when host_capacity_bytes is 0.
  BlockPool* host_pool() { return host_pool_.get(); }
  const AgentOptions& options() const { return options_; }
  AgentMetrics& metrics() { return *metrics_; }
  // Whether the last Register or Heartbeat succeeded.
  bool registered() const { return epoch_.registered(); }

  // Stops the control and command threads, the BlockAgent server and the exposer.
  // Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(shutdown_mu_);
  // Blocks until Shutdown has completed.
  void Wait();

 private:
  explicit Agent(AgentOptions options);
  AgentPools pools() { return {.main = pool_.get(), .host = host_pool_.get()}; }
  // The transport options_.transport names, over the pools (which must exist).
  absl::StatusOr<std::unique_ptr<Transport>> CreateTransport();
  // AgentControl.NcclBootstrap for the NCCL transport's new links.
  absl::Status BootstrapLink(const std::string& peer_agent_id, uint64_t link_id,
                             const std::string& unique_id);

  // Declared in the order they are built; the server stops (in Shutdown) before the
  // service and the metrics it uses are destroyed.
  const AgentOptions options_;
  AgentEpoch epoch_;
  std::string backend_reason_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<BlockPool> host_pool_;
  // Specs of the committed namespaces: the CommandLoop writes, the ControlLoop reports.
  NamespaceSpecs specs_;
  std::unique_ptr<AgentMetrics> metrics_;
  // The data path to peers, and the Fetch work over it; the manager stub Fetch inserts with.
  // Made before the transport, which may bootstrap NCCL links through it.
  std::unique_ptr<v1::AgentControl::Stub> control_;
  // The data port's TLS; null when insecure.
  std::shared_ptr<DataTls> data_tls_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<v1::CacheManager::Stub> manager_;
  // Cache allocations a full pool cannot serve wait here while the manager makes room.
  std::unique_ptr<RoomMaker> room_maker_;
  std::unique_ptr<Fetcher> fetcher_;
  // Who may call BlockAgent (open without tokens_file); re-read by the control loop.
  std::unique_ptr<Authenticator> authenticator_;
  std::shared_ptr<TokenAuthMetadataProcessor> auth_processor_;
  std::unique_ptr<BlockAgentService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  // The local data path (--local_socket); null when off.
  std::unique_ptr<LocalSocketServer> local_;
  std::string address_;
  std::string data_address_;
  std::string metrics_address_;
  std::unique_ptr<CommandLoop> command_loop_;
  std::unique_ptr<ControlLoop> control_loop_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  absl::Notification shutdown_done_;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_AGENT_H_
