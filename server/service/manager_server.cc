#include "server/service/manager_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <exception>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/log.h"
#include "common/server_limits.h"
#include "common/status_macros.h"
#include "prometheus/exposer.h"

namespace kvcm {
namespace {

constexpr absl::string_view kInsecureWarning =
    "\n"
    "************************************************************************\n"
    "* WARNING: insecure = true. kvcm-manager serves PLAINTEXT gRPC:        *\n"
    "* anyone who can reach listen_address can read and change the cache,  *\n"
    "* and tokens cross the network in the clear. For development on a     *\n"
    "* trusted machine only; in production set tls_cert_file, tls_key_file *\n"
    "* and tls_ca_file (mutual TLS).                                        *\n"
    "************************************************************************";

// Threads of the Prometheus exporter: scrapes are rare and each takes one Stats() snapshot.
constexpr size_t kExposerThreads = 2;

// "host:port" -> "host"; the caller has validated the form.
absl::string_view HostOf(absl::string_view address) {
  return address.substr(0, address.rfind(':'));
}

AgentCommandResult AgentCommandResultOf(CommandEnd end) {
  switch (end) {
    case CommandEnd::kAcked:
      return AgentCommandResult::kAcked;
    case CommandEnd::kFailed:
      return AgentCommandResult::kFailed;
    case CommandEnd::kDropped:
      return AgentCommandResult::kDropped;
  }
  return AgentCommandResult::kDropped;
}

}  // namespace

ManagerServer::ManagerServer(ServerOptions options) : options_(std::move(options)) {}

ManagerServer::~ManagerServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<ManagerServer>> ManagerServer::Start(
    ServerOptions options, Clock* index_clock, std::unique_ptr<prometheus::Exposer> exposer) {
  KVCM_RETURN_IF_ERROR(options.Validate());
  KVCM_ASSIGN_OR_RETURN(CacheIndexOptions index_options, options.ToCacheIndexOptions());
  index_options.clock = index_clock;
  // The certificate files are read now, so that a missing or mismatched one stops the start.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.tls);
  if (!credentials.ok()) {  // "cert_file ..." -> "tls_cert_file ...", the option's name
    return absl::Status(credentials.status().code(),
                        absl::StrCat("tls_", credentials.status().message()));
  }
  if (options.tls.insecure) LogWarning(kInsecureWarning);
  std::unique_ptr<ManagerServer> s(new ManagerServer(std::move(options)));
  const ServerOptions& opts = s->options_;
  KVCM_ASSIGN_OR_RETURN(s->index_, CacheIndex::Create(std::move(index_options)));
  if (opts.hash_secret_hex.empty() && opts.hash_secret_file.empty()) {
    LogWarning(
        "no hash secret is set: using a random secret. Namespace hash keys change on "
        "every restart, so clients must re-register (they get FAILED_PRECONDITION until they "
        "do). Set hash_secret_file (or KVCM_HASH_SECRET_HEX) to keep keys stable.");
  }

  if (opts.tokens_file.empty()) {
    s->authenticator_ = Authenticator::Open();
    LogWarning(
        "\n********************************************************************************\n"
        "* tokens_file is not set: callers are NOT authenticated. Anyone who reaches the   *\n"
        "* manager may read and change every tenant's cache, evict, reserve and act as any  *\n"
        "* agent. Dev mode only; see docs/SECURITY.md.                                      *\n"
        "********************************************************************************");
  } else {
    KVCM_ASSIGN_OR_RETURN(s->authenticator_, Authenticator::FromFile(
                                                 opts.tokens_file, opts.agent_identity_dns_suffix));
  }
  // The tenants the tokens file names are owed their fair share of every pool from its
  // first byte (CacheIndex::SetConfiguredTenants), and again after each reload.
  s->index_->SetConfiguredTenants(s->authenticator_->TenantCount());

  s->hub_ = std::make_unique<EventHub>(opts.max_event_queue);
  EventHub* hub = s->hub_.get();
  s->agents_ = std::make_unique<AgentRegistry>(
      RealClock::Get(), absl::Milliseconds(opts.agent_heartbeat_timeout_ms),
      absl::Seconds(opts.max_agent_epoch_ahead_s), absl::Seconds(opts.gone_agent_memory_s));
  s->engines_ = std::make_unique<EngineSessions>(s->index_.get(), RealClock::Get(),
                                                 absl::Milliseconds(opts.engine_session_ttl_ms));
  s->metrics_ =
      std::make_unique<ServiceMetrics>(s->index_.get(), hub, s->agents_.get(), s->engines_.get());
  s->commands_ = std::make_unique<AgentCommandBook>(
      AgentCommandBookOptions{.on_command_end = [metrics = s->metrics_.get()](CommandEnd end) {
        metrics->RecordAgentCommand(AgentCommandResultOf(end));
      }});
  s->block_commands_ = std::make_unique<BlockCommandIssuer>(s->index_.get(), s->commands_.get());
  BlockCommandIssuer* block_commands = s->block_commands_.get();
  s->index_->SetEventListener([hub, block_commands](const CacheEvent& event) {
    hub->Publish(event);
    block_commands->OnEvent(event);  // evicted blocks -> FreeBlocks to the agent holding them
  });
  const ServerLimitsOptions conn_limits = opts.limits;
  RateLimitGrpcLog();
  const uint64_t fd_limit = RaiseFileLimit();
  const uint32_t max_connections = InstallAcceptGuard(conn_limits, fd_limit);
  LogInfo(absl::StrCat("gRPC connection limits: ", max_connections, " connections (",
                       conn_limits.max_connections_per_peer, " per peer address) of ", fd_limit,
                       " fds; handshake within ", conn_limits.handshake_timeout_ms, " ms"));
  RequestLimits limits;
  limits.max_streams_per_principal = opts.max_streams_per_principal;
  limits.grpc_max_connections = max_connections;
  limits.grpc_max_connections_per_peer = conn_limits.max_connections_per_peer;
  limits.grpc_handshake_timeout_ms = conn_limits.handshake_timeout_ms;
  limits.grpc_max_concurrent_streams = conn_limits.max_concurrent_streams;
  limits.max_tokens_per_request = opts.max_tokens_per_request;
  limits.max_pages_per_request = opts.max_pages_per_request;
  limits.max_lease_ttl_ms = opts.max_lease_ttl_ms;
  limits.default_lease_ttl_ms = opts.default_lease_ttl_ms;
  s->inserter_ =
      std::make_unique<AgentInserter>(s->index_.get(), s->commands_.get(), s->agents_.get());
  s->nccl_relay_ = std::make_unique<NcclBootstrapRelay>();
  s->service_ = std::make_unique<CacheManagerService>(
      s->index_.get(), hub, s->metrics_.get(), limits, s->agents_.get(), s->inserter_.get(),
      s->engines_.get(), s->commands_.get(), s->nccl_relay_.get(), s->authenticator_.get(),
      RouteDefaults{
          .prefill_tokens_per_s = static_cast<double>(opts.route_prefill_tokens_per_s),
          .link_gbps = {{"tcp", opts.route_tcp_link_gbps}, {"nccl", opts.route_nccl_link_gbps}}});
  // Numbers this process's commands apart from a predecessor's in the same agent epochs.
  const uint64_t incarnation = absl::Uniform<uint64_t>(absl::BitGen(), 1, ~uint64_t{0});
  s->agent_service_ = std::make_unique<AgentControlService>(
      s->index_.get(), s->agents_.get(), s->metrics_.get(), s->commands_.get(),
      s->nccl_relay_.get(), incarnation, s->authenticator_.get());

  // Long-lived streams per principal (docs/SECURITY.md "Connection limits"); not in the
  // open dev mode, where every caller is one principal.
  s->stream_slots_ =
      StreamSlots::Create(opts.max_streams_per_principal, "max_streams_per_principal");
  s->service_->SetStreamSlots(s->stream_slots_);
  s->agent_service_->SetStreamSlots(s->stream_slots_);
  // Tokens are checked on a call's headers, before its request is read (TLS only: gRPC's
  // insecure credentials take no processor; the handlers check again either way).
  s->auth_processor_ =
      InstallAuthProcessor(s->authenticator_.get(), !opts.tls.insecure, credentials->get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(opts.listen_address, *credentials, &s->port_);
  // gRPC sets SO_REUSEPORT by default, which would let a second manager share the port
  // silently; a busy port must be an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(opts.max_message_bytes));
  ApplyServerLimits(conn_limits, &builder);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->agent_service_.get());
  s->server_ = builder.BuildAndStart();
  const bool is_unix = absl::StartsWith(opts.listen_address, "unix:");
  if (s->server_ == nullptr || (!is_unix && s->port_ == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on listen_address ",
                                               opts.listen_address,
                                               " (address in use or not local?)"));
  }
  s->address_ =
      is_unix ? opts.listen_address : absl::StrCat(HostOf(opts.listen_address), ":", s->port_);
  if (grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    health->SetServingStatus(v1::CacheManager::service_full_name(), true);
    health->SetServingStatus(v1::AgentControl::service_full_name(), true);
  }

  if (!opts.metrics_address.empty()) {
    // /metrics is plaintext HTTP even when gRPC is TLS: the exporter is not given TLS here
    // (civetweb could take a certificate; not wired). Bind it to a trusted interface.
    // prometheus-cpp reports a bind failure by throwing (civetweb); this is the one place
    // where an exception is turned into a Status.
    if (exposer != nullptr) {
      s->exposer_ = std::move(exposer);
    } else {
      try {
        s->exposer_ = std::make_unique<prometheus::Exposer>(
            MetricsServerOptions(opts.metrics_address, kExposerThreads));
      } catch (const std::exception& e) {
        return absl::UnavailableError(absl::StrCat("cannot serve metrics on metrics_address ",
                                                   opts.metrics_address, ": ", e.what()));
      }
    }
    for (const std::weak_ptr<prometheus::Collectable>& c : s->metrics_->collectables()) {
      s->exposer_->RegisterCollectable(c);
    }
    std::vector<int> ports = s->exposer_->GetListeningPorts();
    s->metrics_port_ = ports.empty() ? 0 : ports.front();
    s->metrics_address_ = absl::StrCat(HostOf(opts.metrics_address), ":", s->metrics_port_);
  }

  s->sweeper_ = std::thread([raw = s.get()] { raw->SweepLeases(); });
  return s;
}

void ManagerServer::SweepLeases() {
  const absl::Duration interval = absl::Milliseconds(options_.lease_sweep_interval_ms);
  while (!stop_sweeper_.WaitForNotificationWithTimeout(interval)) {
    if (absl::Status s = authenticator_->ReloadIfChanged(); !s.ok()) LogError(s.message());
    index_->SetConfiguredTenants(authenticator_->TenantCount());
    index_->ExpireLeases();
    DropGoneAgents();
    for (const EngineSessionInfo& e : engines_->ExpireIdle()) {
      LogWarning(absl::StrCat("engine ", e.engine_id, " session ", e.session,
                              " lapsed (no request for ", absl::FormatDuration(e.ttl),
                              "): emptied its ", e.pages, " pages from the index"));
    }
    // Dropped pools leave the tree in small steps, so no call waits long for the lock.
    constexpr size_t kSweepStep = 256;
    while (!stop_sweeper_.HasBeenNotified() &&
           index_->SweepRetired(kSweepStep).removed_replicas == kSweepStep) {
    }
    // Pages past their age leave the same way; their kRemoved events free the blocks.
    while (!stop_sweeper_.HasBeenNotified() && index_->SweepExpired(kSweepStep).more) {
    }
  }
}

void ManagerServer::DropGoneAgents() {
  absl::MutexLock lifecycle(&agents_->lifecycle_mu());
  for (const AgentRegistration& r : agents_->TakeForgotten()) {
    EndAgent(*index_, *commands_, *nccl_relay_, r, /*forget=*/true);
    LogInfo(absl::StrCat("agent ", r.agent_id, " epoch ", r.epoch, " forgotten: gone for ",
                         absl::FormatDuration(absl::Seconds(options_.gone_agent_memory_s)),
                         " (gone_agent_memory_s); its pools left the index"));
  }
  for (const AgentRegistration& r : agents_->TakeGone()) {
    const uint64_t pages = EndAgent(*index_, *commands_, *nccl_relay_, r, /*forget=*/false);
    LogWarning(absl::StrCat("agent ", r.agent_id, " epoch ", r.epoch, " is gone (no heartbeat for ",
                            absl::FormatDuration(agents_->heartbeat_timeout()), "): dropped its ",
                            pages, " pages from the index"));
  }
}

void ManagerServer::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  // Watch streams never end on their own: close them first so the server can drain.
  if (hub_ != nullptr) hub_->Close();
  if (commands_ != nullptr) commands_->Close();
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.shutdown_grace_ms);
    server_->Shutdown(absl::ToChronoTime(deadline));
  }
  if (on_stopped_serving_) on_stopped_serving_();
  exposer_.reset();
  stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  if (hub_ != nullptr) hub_->Stop();
  if (index_ != nullptr) index_->SetEventListener(nullptr);
  shutdown_done_.Notify();
}

void ManagerServer::OnStoppedServing(std::function<void()> f) {
  absl::MutexLock lock(&shutdown_mu_);
  on_stopped_serving_ = std::move(f);
}

void ManagerServer::Wait() { shutdown_done_.WaitForNotification(); }

}  // namespace kvcm
