#include "gpu/agent/server/agent.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/secure_random.h"
#include "common/server_limits.h"
#include "common/status_macros.h"
#include "gpu/agent/control/command_loop.h"
#include "gpu/agent/control/control_loop.h"
#include "gpu/agent/control/peer_lookup.h"
#include "gpu/agent/control/room_maker.h"
#include "gpu/agent/local/local_socket_server.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "gpu/agent/transport/data_tls.h"
#include "gpu/agent/transport/registry.h"
#include "prometheus/exposer.h"

namespace kvcm {
namespace {

constexpr absl::string_view kInsecureWarning =
    "\n"
    "************************************************************************\n"
    "* WARNING: insecure = true. kvcm-agent speaks PLAINTEXT: its BlockAgent *\n"
    "* port, its data port (block bytes) and its calls to the manager (its  *\n"
    "* token included) can be read and forged by anyone on the network.     *\n"
    "* For development on a trusted machine only; in production set         *\n"
    "* tls_cert_file, tls_key_file and tls_ca_file (mutual TLS).            *\n"
    "************************************************************************";

constexpr absl::string_view kOpenWarning =
    "\n"
    "**************************************************************************\n"
    "* WARNING: tokens_file is not set: BlockAgent callers are NOT            *\n"
    "* authenticated. Anyone who reaches this agent (with a certificate of    *\n"
    "* the cluster CA under TLS) may read, write and free every tenant's      *\n"
    "* blocks and run attention over them. Dev mode only: see docs/AGENTS.md. *\n"
    "**************************************************************************";

absl::string_view HostOf(absl::string_view address) {
  return address.substr(0, address.rfind(':'));
}

absl::string_view PortOf(absl::string_view address) {
  return address.substr(address.rfind(':') + 1);
}

// The host pool's memory: page-locked when the main pool is on a GPU (demotion copies then
// run at full link speed), plain DRAM otherwise or when pinning fails.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateHostPoolBackend(const BlockPool& main,
                                                                     uint64_t bytes) {
#ifdef KVCM_CUDA_ENABLED
  if (main.backend().is_device()) {
    absl::StatusOr<std::unique_ptr<DeviceBackend>> pinned = CreatePinnedHostBackend(bytes);
    if (pinned.ok()) return pinned;
    LogWarning(absl::StrCat("host pool: ", pinned.status().message(), "; using pageable DRAM"));
  }
#endif
  return CreateHostBackend(bytes);
}

}  // namespace

Agent::Agent(AgentOptions options) : options_(std::move(options)) {}

Agent::~Agent() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(AgentOptions options) {
  KVCM_RETURN_IF_ERROR(options.Validate());
  KVCM_ASSIGN_OR_RETURN(PoolGeometry geometry, options.Geometry());
  if (!options.token_file.empty()) {
    KVCM_ASSIGN_OR_RETURN(options.token, ReadBearerTokenFile(options.token_file, "token_file"));
  }
  std::unique_ptr<Authenticator> authenticator;
  if (options.tokens_file.empty()) {
    authenticator = Authenticator::Open();
    LogWarning(kOpenWarning);
  } else {
    KVCM_ASSIGN_OR_RETURN(
        authenticator,
        Authenticator::FromFile(options.tokens_file, options.agent_identity_dns_suffix));
  }
  // Every certificate file is read now, so that a missing or mismatched one stops the start.
  const TlsOptions tls = options.tls;
  auto tls_error = [](const absl::Status& s) {  // "cert_file ..." -> "tls_cert_file ..."
    return absl::Status(s.code(), absl::StrCat("tls_", s.message()));
  };
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      MakeServerCredentials(tls);
  if (!server_credentials.ok()) return tls_error(server_credentials.status());
  absl::StatusOr<ChannelFactory> channels = ChannelFactory::Create(tls, options.token);
  if (!channels.ok()) return tls_error(channels.status());
  std::shared_ptr<DataTls> data_tls;
  if (!tls.insecure) {
    absl::StatusOr<std::shared_ptr<DataTls>> made = DataTls::Create(tls);
    if (!made.ok()) return tls_error(made.status());
    data_tls = *std::move(made);
  } else {
    LogWarning(kInsecureWarning);
  }

  std::unique_ptr<Agent> a(new Agent(std::move(options)));
  const AgentOptions& opts = a->options_;
  a->data_tls_ = std::move(data_tls);
  a->authenticator_ = std::move(authenticator);

  KVCM_ASSIGN_OR_RETURN(BackendChoice choice, CreateBackend({.arena_bytes = geometry.pool_bytes(),
                                                             .device_index = opts.device_index,
                                                             .allow_device = opts.use_device}));
  a->backend_reason_ = std::move(choice.reason);
  KVCM_ASSIGN_OR_RETURN(a->pool_, BlockPool::Create(geometry, std::move(choice.backend)));
  if (opts.host_capacity_bytes > 0) {
    KVCM_ASSIGN_OR_RETURN(PoolGeometry host_geometry, opts.HostGeometry());
    KVCM_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBackend> host_backend,
                          CreateHostPoolBackend(*a->pool_, host_geometry.pool_bytes()));
    KVCM_ASSIGN_OR_RETURN(a->host_pool_, BlockPool::Create(host_geometry, std::move(host_backend)));
  }
  if (opts.verify_block_digests) {
    // One secret key for both pools (a demoted copy keeps its digest), unknown outside.
    SecureRandom random;
    const uint64_t k0 = random.Next64(), k1 = random.Next64();
    a->pool_->EnableDigests(k0, k1);
    if (a->host_pool_ != nullptr) a->host_pool_->EnableDigests(k0, k1);
  }
  a->metrics_ = std::make_unique<AgentMetrics>(opts.agent_id, a->pools(), &a->epoch_);

  // Reconnect as often as the control loop retries, not after gRPC's default 1 s backoff: an
  // agent started before its manager registers as soon as the manager listens.
  grpc::ChannelArguments manager_args;
  manager_args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                      static_cast<int>(std::min<uint32_t>(opts.heartbeat_interval_ms, 1'000)));
  manager_args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                      static_cast<int>(std::min<uint32_t>(opts.heartbeat_interval_ms, 1'000)));
  std::shared_ptr<grpc::Channel> manager = channels->Open(opts.manager_address, manager_args);
  // Before the transport: an NCCL transport bootstraps its links through it.
  a->control_ = v1::AgentControl::NewStub(manager);
  KVCM_ASSIGN_OR_RETURN(a->transport_, a->CreateTransport());
  a->data_address_ = a->transport_->address();
  if (!opts.advertise_host.empty()) {
    a->data_address_ = absl::StrCat(opts.advertise_host, ":", PortOf(a->data_address_));
  }
  a->manager_ = v1::CacheManager::NewStub(manager);
  if (opts.allocate_wait_ms > 0) {
    a->room_maker_ = std::make_unique<RoomMaker>(
        a->pool_.get(), opts.tier, opts.agent_id, &a->epoch_,
        [control = a->control_.get()](const v1::MakeRoomRequest& request,
                                      absl::Time deadline) -> absl::StatusOr<v1::MakeRoomResponse> {
          grpc::ClientContext ctx;
          ctx.set_deadline(absl::ToChronoTime(deadline));
          v1::MakeRoomResponse response;
          if (grpc::Status s = control->MakeRoom(&ctx, request, &response); !s.ok()) {
            return FromGrpcStatus(s);
          }
          return response;
        },
        RoomMakerOptions{.allocate_wait_ms = opts.allocate_wait_ms},
        a->metrics_->room_maker_observer());
    a->room_maker_->Start();
  }
  // A Fetch's source is an agent the manager knows: its address comes from there, within
  // the same bound as the Insert that follows the pull's.
  constexpr uint32_t kLookupTimeoutMs = 10'000;
  a->fetcher_ = std::make_unique<Fetcher>(
      opts.agent_id, opts.tier, a->pools(), &a->epoch_, a->transport_.get(),
      LookupAtManager(a->control_.get(), opts.agent_id, kLookupTimeoutMs), a->manager_.get(),
      a->metrics_.get(), a->room_maker_.get());
  a->service_ = std::make_unique<BlockAgentService>(&opts, a->pools(), &a->epoch_,
                                                    a->metrics_.get(), a->fetcher_.get(),
                                                    a->authenticator_.get(), a->room_maker_.get());
  // Tokens are checked on a call's headers, before its request is read (TLS only; the
  // handlers check again either way).
  a->auth_processor_ =
      InstallAuthProcessor(a->authenticator_.get(), !tls.insecure, server_credentials->get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(opts.listen_address, *server_credentials, &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Room for a full data chunk plus the message's framing.
  builder.SetMaxReceiveMessageSize(static_cast<int>(opts.max_message_bytes + 1024));
  const ServerLimitsOptions conn_limits = opts.limits;
  ApplyServerLimits(conn_limits, &builder);
  RateLimitGrpcLog();
  const uint64_t fd_limit = RaiseFileLimit();
  const uint32_t max_connections = InstallAcceptGuard(conn_limits, fd_limit);
  LogInfo(absl::StrCat("BlockAgent connection limits: ", max_connections, " connections (",
                       conn_limits.max_connections_per_peer, " per peer address) of ", fd_limit,
                       " fds; handshake within ", conn_limits.handshake_timeout_ms, " ms"));
  builder.RegisterService(a->service_.get());
  a->server_ = builder.BuildAndStart();
  if (a->server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve BlockAgent on listen_address ", opts.listen_address));
  }
  a->address_ = absl::StrCat(
      opts.advertise_host.empty() ? HostOf(opts.listen_address) : opts.advertise_host, ":", port);
  if (!opts.local_socket.empty()) {
    KVCM_ASSIGN_OR_RETURN(LocalPrincipalUids principal_uids,
                          ParseLocalPrincipalUids(opts.local_principal_uids));
    KVCM_ASSIGN_OR_RETURN(a->local_, LocalSocketServer::Start(
                                         {.path = opts.local_socket,
                                          .max_sessions = opts.local_max_sessions,
                                          .max_sessions_per_uid = opts.local_max_sessions_per_uid,
                                          .allowed_uids = opts.local_allowed_uids,
                                          .allowed_gids = opts.local_allowed_gids,
                                          .socket_group = opts.local_socket_group,
                                          .hello_timeout_ms = opts.local_hello_timeout_ms,
                                          .principal_uids = std::move(principal_uids)},
                                         LocalSessionEnv{.options = &opts,
                                                         .pools = a->pools(),
                                                         .epoch = &a->epoch_,
                                                         .authenticator = a->authenticator_.get(),
                                                         .metrics = a->metrics_.get()}));
  }

  if (!opts.metrics_address.empty()) {
    // prometheus-cpp reports a bind failure by throwing; turned into a Status here only.
    try {
      a->exposer_ =
          std::make_unique<prometheus::Exposer>(MetricsServerOptions(opts.metrics_address, 1));
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on metrics_address ",
                                                 opts.metrics_address, ": ", e.what()));
    }
    for (const std::weak_ptr<prometheus::Collectable>& c : a->metrics_->collectables()) {
      a->exposer_->RegisterCollectable(c);
    }
    std::vector<int> ports = a->exposer_->GetListeningPorts();
    a->metrics_address_ =
        absl::StrCat(HostOf(opts.metrics_address), ":", ports.empty() ? 0 : ports.front());
  }

  a->command_loop_ = std::make_unique<CommandLoop>(
      &opts, a->pools(), &a->epoch_, a->control_.get(), &a->specs_,
      [transport = a->transport_.get()](const v1::NcclConnect& c) {
        const LinkOffer offer{.from_agent_id = c.from_agent_id(),
                              .link_id = c.link_id(),
                              .unique_id = c.unique_id(),
                              .rank = c.rank(),
                              .peer_rank = c.peer_rank(),
                              .nranks = c.nranks()};
        LinkOfferHandler* handler = transport->link_offers();
        absl::Status s =
            handler != nullptr
                ? handler->AcceptLinkOffer(offer)
                : absl::FailedPreconditionError(absl::StrCat(
                      "this agent's transport takes no link offers; start it with a transport "
                      "that has links (--transport=nccl)"));
        if (!s.ok()) {
          LogWarning(absl::StrCat("NCCL link offer ", c.link_id(), " of ", c.from_agent_id(), ": ",
                                  s.ToString()));
        }
      });
  // The open Commands stream belongs to the old epoch.
  a->control_loop_ = std::make_unique<ControlLoop>(
      &opts, a->pools(), &a->epoch_, a->control_.get(), a->address_, a->data_address_, &a->specs_,
      a->metrics_.get(), [commands = a->command_loop_.get()] { commands->CancelStream(); },
      [authenticator = a->authenticator_.get(), pool = a->pool_.get(), epoch = &a->epoch_,
       ttl_ms = opts.allocation_ttl_ms] {
        if (absl::Status s = authenticator->ReloadIfChanged(); !s.ok()) {
          LogError(absl::StrCat("tokens_file: ", s.message()));
        }
        if (ttl_ms == 0) return;
        // Stores whose worker died between Allocate and Insert.
        if (const uint64_t freed = pool->FreeAllocatedBefore(
                epoch->current(), absl::Now() - absl::Milliseconds(ttl_ms));
            freed > 0) {
          LogWarning(absl::StrCat("freed ", freed, " blocks allocated over allocation_ttl_ms (",
                                  ttl_ms, " ms) ago and never committed nor freed"));
        }
      });
  a->control_loop_->Start();
  a->command_loop_->Start();
  return a;
}

absl::StatusOr<std::unique_ptr<Transport>> Agent::CreateTransport() {
  const AgentOptions& opts = options_;
  const TcpTransportOptions data{.listen_address = opts.data_listen_address,
                                 .io_timeout_ms = opts.transfer_io_timeout_ms,
                                 .max_connections = opts.data_max_connections,
                                 .max_connections_per_peer = opts.data_max_connections_per_peer,
                                 .max_handshakes = opts.data_max_handshakes,
                                 .max_handshakes_per_peer = opts.data_max_handshakes_per_peer,
                                 .handshake_timeout_ms = opts.data_handshake_timeout_ms,
                                 .request_timeout_ms = opts.data_request_timeout_ms,
                                 .tls = data_tls_,
                                 .counters = metrics_->data_port_counters()};
  KVCM_ASSIGN_OR_RETURN(const TransportEntry* transport, FindTransport(opts.transport));
  return transport->create(TransportContext{
      .options = &opts,
      .data = data,
      .pools = pools(),
      .main_tier = opts.tier,
      .pool_on_device = pool_->backend().is_device(),
      .pool_memory = absl::StrCat(pool_->backend().name(), " memory (", backend_reason_, ")"),
      .bootstrap_link = [this](const std::string& peer, uint64_t link_id,
                               const std::string& unique_id) {
        return BootstrapLink(peer, link_id, unique_id);
      }});
}

absl::Status Agent::BootstrapLink(const std::string& peer_agent_id, uint64_t link_id,
                                  const std::string& unique_id) {
  v1::NcclBootstrapRequest req;
  req.set_agent_id(options_.agent_id);
  req.set_epoch(epoch_.current());
  req.set_peer_agent_id(peer_agent_id);
  req.set_link_id(link_id);
  req.set_unique_id(unique_id);
  v1::NcclBootstrapResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(options_.nccl_connect_timeout_ms));
  return FromGrpcStatus(control_->NcclBootstrap(&ctx, req, &resp));
}

void Agent::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  // Allocations waiting for room end first (UNAVAILABLE), so the server's drain below
  // does not wait for them.
  if (room_maker_ != nullptr) room_maker_->Stop();
  if (command_loop_ != nullptr) command_loop_->Stop();
  if (control_loop_ != nullptr) {
    control_loop_->Stop();
    // Stopping on purpose: the manager forgets this agent now, not after it is gone.
    control_loop_->Leave();
  }
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  if (local_ != nullptr) local_->Stop();
  transport_.reset();  // cancels pulls in flight (their fetches fail) and joins its threads
  exposer_.reset();
  shutdown_done_.Notify();
}

void Agent::Wait() { shutdown_done_.WaitForNotification(); }

}  // namespace kvcm
