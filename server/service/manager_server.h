// ManagerServer: a running kvcm-manager. Owns the CacheIndex, the EventHub and the
// BlockCommandIssuer fed by the index's event listener, the AgentRegistry, the
// AgentCommandBook, the NcclBootstrapRelay, the metrics, the gRPC server of CacheManager and
// AgentControl (with health checking and reflection), the optional Prometheus exposer, and the
// lease-sweep thread.
//
// Used by server/main.cc and by tests (listen_address "127.0.0.1:0", metrics_address
// "127.0.0.1:0" or empty). Thread-safe: Shutdown and Wait may be called from any thread,
// concurrently and more than once.
#ifndef KVCM_SERVER_SERVICE_MANAGER_SERVER_H_
#define KVCM_SERVER_SERVICE_MANAGER_SERVER_H_

#include <grpcpp/grpcpp.h>
#include <prometheus/exposer.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/core/agent_command_book.h"
#include "server/core/agent_registry.h"
#include "server/core/block_command_issuer.h"
#include "server/core/cache_index.h"
#include "server/core/engine_sessions.h"
#include "server/service/access_control.h"
#include "server/service/agent_control_service.h"
#include "server/service/cache_manager_service.h"
#include "server/service/event_hub.h"
#include "server/service/metrics.h"
#include "server/service/nccl_bootstrap_relay.h"
#include "server/service/server_options.h"

namespace kvcm {

class ManagerServer {
 public:
  // Validates `options`, reads the TLS files, builds the index and starts serving.
  // INVALID_ARGUMENT for bad options or TLS files (naming the tls_* option and the path);
  // UNAVAILABLE when an address cannot be bound. Logs a warning when options.tls.insecure.
  // `index_clock` (not owned; must outlive the server) replaces the real clock of the index
  // (leases, page ages): tests pass a FakeClock. Agents' heartbeats keep the real clock.
  // `exposer`, when given, is an exporter already serving options.metrics_address (a
  // standby's, whose collectables stay): the server adds its metrics there instead of
  // binding the address again, which would wait out civetweb's two-second shutdown.
  static absl::StatusOr<std::unique_ptr<ManagerServer>> Start(
      ServerOptions options, Clock* index_clock = nullptr,
      std::unique_ptr<prometheus::Exposer> exposer = nullptr);

  // Shuts down (see Shutdown) and waits for it.
  ~ManagerServer();
  ManagerServer(const ManagerServer&) = delete;
  ManagerServer& operator=(const ManagerServer&) = delete;

  // The gRPC port actually bound (the chosen one when listen_address asked for port 0);
  // 0 for a unix: address.
  int port() const { return port_; }
  // The /metrics port actually bound; 0 when metrics are disabled.
  int metrics_port() const { return metrics_port_; }
  // "host:port" of the gRPC server with the bound port filled in, e.g. "127.0.0.1:41873".
  const std::string& address() const { return address_; }
  // "host:port" of the metrics exporter with the bound port; empty when disabled.
  const std::string& metrics_address() const { return metrics_address_; }

  const ServerOptions& options() const { return options_; }
  CacheIndex& index() { return *index_; }
  AgentRegistry& agents() { return *agents_; }
  EngineSessions& engines() { return *engines_; }
  ServiceMetrics& metrics() { return *metrics_; }
  AgentCommandBook& commands() { return *commands_; }
  NcclBootstrapRelay& nccl_relay() { return *nccl_relay_; }

  // Runs `f` in Shutdown once gRPC no longer serves, before the exporter and the sweeper
  // stop (civetweb takes about a second): a leader resigns there, so that a standby takes
  // over sooner. Set it before Shutdown can run.
  void OnStoppedServing(std::function<void()> f) ABSL_LOCKS_EXCLUDED(shutdown_mu_);

  // Ends every WatchEvents stream, stops accepting calls, lets in-flight calls finish for
  // up to options().shutdown_grace_ms (then cancels them), and stops the exporter and the
  // lease sweeper. Idempotent; concurrent calls return once the first one is done.
  void Shutdown() ABSL_LOCKS_EXCLUDED(shutdown_mu_);

  // Blocks until Shutdown has completed.
  void Wait();

 private:
  explicit ManagerServer(ServerOptions options);
  // Expires leases, drops gone agents, sweeps dropped pools' pages out of the index and
  // removes pages past their max page age, every lease_sweep_interval_ms until Shutdown.
  void SweepLeases();
  // Forgets the pools and queued commands of agents the registry declares gone.
  void DropGoneAgents();

  const ServerOptions options_;
  // Who may call; the tokens file is re-read by the sweeper when it changes.
  std::unique_ptr<Authenticator> authenticator_;
  std::unique_ptr<CacheIndex> index_;
  std::unique_ptr<EventHub> hub_;
  std::unique_ptr<ServiceMetrics> metrics_;
  std::unique_ptr<AgentRegistry> agents_;
  std::unique_ptr<EngineSessions> engines_;
  // Queued demotions complete into block_commands_: Shutdown closes commands_ first.
  std::unique_ptr<AgentCommandBook> commands_;
  std::unique_ptr<BlockCommandIssuer> block_commands_;
  std::unique_ptr<AgentInserter> inserter_;
  // NCCL link offers between agents (AgentControl.NcclBootstrap); outlives the streams.
  std::unique_ptr<NcclBootstrapRelay> nccl_relay_;
  std::unique_ptr<CacheManagerService> service_;
  std::unique_ptr<AgentControlService> agent_service_;
  std::shared_ptr<StreamSlots> stream_slots_;
  std::shared_ptr<TokenAuthMetadataProcessor> auth_processor_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string address_;
  std::string metrics_address_;

  absl::Notification stop_sweeper_;
  std::thread sweeper_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  std::function<void()> on_stopped_serving_ ABSL_GUARDED_BY(shutdown_mu_);
  absl::Notification shutdown_done_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_MANAGER_SERVER_H_
