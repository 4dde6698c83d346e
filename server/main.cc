// kvcm-manager: serves the CacheManager gRPC API and Prometheus /metrics.
//
//   kvcm-manager [--config=path] [--<option>=value ...]
//
// Every kvcm::ServerOptions option is a flag of the same name; those of its connection limits
// and TLS are defined in common/server_flags.cc, shared with kvcm-agent. Precedence: built-in
// defaults < the config file (`name = value` lines) < flags given on the command line.
// Transport security is required: --tls_cert_file and --tls_key_file (and --tls_ca_file for
// mutual TLS), or --insecure for plaintext in development.
// SIGINT / SIGTERM shut the server down cleanly (exit status 0).
// With --etcd_endpoints the managers elect a leader (docs/OPERATIONS.md): a standby serves
// only /metrics until it leads; a leader that cannot renew its lease exits with status 3.
#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/program_flags.h"
#include "common/server_limits.h"
#include "server/core/policies/registry.h"
#include "server/ha/etcd_client.h"
#include "server/ha/leader_election.h"
#include "server/service/manager_server.h"
#include "server/service/server_options.h"

namespace {
const kvcm::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, config, "",
          "Config file of `option = value` lines (# comments); flags given on the command line "
          "override it.");
ABSL_FLAG(std::string, listen_address, kDefaults.listen_address,
          "gRPC address host:port (port 0 picks a free one) or unix:path.");
ABSL_FLAG(std::string, metrics_address, kDefaults.metrics_address,
          "Prometheus /metrics address host:port; empty disables the exporter.");
ABSL_FLAG(std::string, policy, kDefaults.policy,
          absl::StrCat("Eviction policy: ", kvcm::PolicyHelp(), "; docs/EVICTION.md."));
ABSL_FLAG(uint64_t, default_pool_capacity_bytes, kDefaults.default_pool_capacity_bytes,
          "Capacity given to a pool the first time an Insert names it, in bytes.");
ABSL_FLAG(uint32_t, default_lease_ttl_ms, kDefaults.default_lease_ttl_ms,
          "Pin lease when a caller asks for none, in milliseconds.");
ABSL_FLAG(uint32_t, max_lease_ttl_ms, kDefaults.max_lease_ttl_ms,
          "Longest pin lease a caller may ask for, in milliseconds.");
ABSL_FLAG(uint32_t, expired_pin_memory_ms, kDefaults.expired_pin_memory_ms,
          "How long an expired pin id is remembered (Release answers ABORTED), in ms.");
ABSL_FLAG(uint32_t, regret_window_ms, kDefaults.regret_window_ms,
          "An evicted page requested again within this window counts as regret, in ms.");
ABSL_FLAG(uint32_t, max_tokens_per_request, kDefaults.max_tokens_per_request,
          "Most token ids one prompt may carry.");
ABSL_FLAG(uint32_t, max_pages_per_request, kDefaults.max_pages_per_request,
          "Most whole pages one prompt may span.");
ABSL_FLAG(uint32_t, max_message_bytes, kDefaults.max_message_bytes,
          "gRPC receive limit per message, in bytes.");
ABSL_FLAG(uint32_t, lease_sweep_interval_ms, kDefaults.lease_sweep_interval_ms,
          "Period of the sweep that expires leases and drops gone agents' pages, in ms.");
ABSL_FLAG(std::string, hash_secret_file, kDefaults.hash_secret_file,
          "File holding the 128-bit hash secret as 32 hex digits (or set KVCM_HASH_SECRET_HEX, or "
          "hash_secret_hex in the config file; never on the command line). None set draws a "
          "random one: client hash keys then change on every restart.");
ABSL_FLAG(std::string, tokens_file, kDefaults.tokens_file,
          "Bearer tokens file (sha256-of-token name roles=... per line, docs/SECURITY.md); "
          "re-read when it changes. Empty: no authentication (dev mode only).");
ABSL_FLAG(std::string, agent_identity_dns_suffix, kDefaults.agent_identity_dns_suffix,
          "Agents identified by their client certificate instead of a token: a caller sending "
          "no token whose certificate names N + this suffix (e.g. .kvcm-agent.kvcm.svc) is "
          "agent N and N-gpu<K> (docs/SECURITY.md, Agent identity). Empty: off.");
ABSL_FLAG(uint32_t, max_event_queue, kDefaults.max_event_queue,
          "Events a WatchEvents subscriber may have queued before it is dropped.");
ABSL_FLAG(uint32_t, shutdown_grace_ms, kDefaults.shutdown_grace_ms,
          "How long shutdown waits for in-flight calls, in milliseconds.");
ABSL_FLAG(uint32_t, agent_heartbeat_timeout_ms, kDefaults.agent_heartbeat_timeout_ms,
          "An agent silent for longer than this is reported gone, in milliseconds.");
ABSL_FLAG(uint32_t, max_agent_epoch_ahead_s, kDefaults.max_agent_epoch_ahead_s,
          "How far ahead of this manager's clock an agent's Register epoch (its start time in "
          "microseconds) may be, in seconds; a later one is refused OUT_OF_RANGE. 1..86400.");
ABSL_FLAG(uint32_t, gone_agent_memory_s, kDefaults.gone_agent_memory_s,
          "How long an agent gone silent is remembered (Stats, kvcm_agents{state=\"gone\"}, "
          "the KvcmAgentGone alert) before it and its pools are forgotten, in seconds; an "
          "agent stopped on purpose is forgotten at once. 60..2592000.");
ABSL_FLAG(uint32_t, engine_session_ttl_ms, kDefaults.engine_session_ttl_ms,
          "An engine session (PublishEngineEvents) silent for longer than this, in milliseconds, "
          "ends with its pools emptied (unless it asked for its own ttl).");
ABSL_FLAG(uint32_t, max_namespaces, kDefaults.max_namespaces,
          "Most namespaces RegisterModel creates in all (agents' namespaces are never refused).");
ABSL_FLAG(uint32_t, max_namespaces_per_tenant, kDefaults.max_namespaces_per_tenant,
          "Most namespaces RegisterModel creates per tenant.");
ABSL_FLAG(uint32_t, max_pins_per_tenant, kDefaults.max_pins_per_tenant,
          "Most live pins of one tenant; a pinning Match or Route beyond is refused.");
ABSL_FLAG(uint32_t, route_prefill_tokens_per_s, kDefaults.route_prefill_tokens_per_s,
          "Route: prefill throughput of one GPU (tokens/s) when a request sends none.");
ABSL_FLAG(uint32_t, route_tcp_link_gbps, kDefaults.route_tcp_link_gbps,
          "Route: link bandwidth (Gbit/s) of a TCP agent that has not measured its pulls.");
ABSL_FLAG(uint32_t, route_nccl_link_gbps, kDefaults.route_nccl_link_gbps,
          "Route: link bandwidth (Gbit/s) of an NCCL agent that has not measured its pulls.");
ABSL_FLAG(uint32_t, default_max_page_age_s, kDefaults.default_max_page_age_s,
          "Retention: seconds a cached page may stay after it was committed (0: no limit); "
          "RegisterModel's max_page_age_s may only shorten it per namespace.");
ABSL_FLAG(uint64_t, tenant_max_bytes, kDefaults.tenant_max_bytes,
          "Bytes one tenant may hold, cached pages in every pool plus reserved headroom (0: "
          "unlimited); beyond, its own unpinned pages are evicted, or the call is refused.");
ABSL_FLAG(uint64_t, tenant_max_pinned_bytes, kDefaults.tenant_max_pinned_bytes,
          "Bytes of one tenant's cached pages its pins may hold (0: unlimited); a pinning "
          "Match or Route beyond is refused.");
ABSL_FLAG(std::string, etcd_endpoints, kDefaults.etcd_endpoints,
          "High availability: etcd's gRPC endpoints, comma-separated host:port. Set, the "
          "managers elect one leader; a standby serves only /metrics until it leads. Empty: "
          "one manager, no election.");
ABSL_FLAG(std::string, etcd_election_key, kDefaults.etcd_election_key,
          "etcd key the managers of one cluster campaign for; it holds the leader's "
          "advertise_address.");
ABSL_FLAG(uint32_t, etcd_lease_ttl_s, kDefaults.etcd_lease_ttl_s,
          "The leader's etcd lease (2..60 s): a standby takes over at most this long after "
          "the leader dies; a leader that cannot renew it in time exits.");
ABSL_FLAG(std::string, advertise_address, kDefaults.advertise_address,
          "host:port clients reach this manager at, written to the election key (default: "
          "listen_address, a wildcard host replaced by this host's name).");
ABSL_FLAG(std::string, etcd_ca_file, kDefaults.etcd_ca_file,
          "PEM CA bundle etcd's certificate is verified against: TLS to etcd (plaintext "
          "without).");
ABSL_FLAG(std::string, etcd_cert_file, kDefaults.etcd_cert_file,
          "PEM client certificate presented to etcd (with etcd_key_file).");
ABSL_FLAG(std::string, etcd_key_file, kDefaults.etcd_key_file,
          "PEM private key of etcd_cert_file.");
ABSL_FLAG(uint32_t, default_tenant_pool_share_pct, kDefaults.default_tenant_pool_share_pct,
          "With no tenant quota set: percent of a pool's capacity one tenant may reserve and "
          "pin (1..100; 100: no default share).");
ABSL_FLAG(uint64_t, max_engine_pages_per_engine, kDefaults.max_engine_pages_per_engine,
          "Page-locations one engine's pools may hold (PublishEngineEvents beyond is refused).");
ABSL_FLAG(uint64_t, max_engine_pages_per_tenant, kDefaults.max_engine_pages_per_tenant,
          "Page-locations the engine pools of one tenant may hold.");
ABSL_FLAG(uint32_t, max_streams_per_principal, kDefaults.max_streams_per_principal,
          "Long-lived streams (WatchEvents, Commands, ReportInventory) one principal may hold "
          "open at once.");

namespace {

[[noreturn]] void Fail(absl::string_view message) {
  kvcm::LogError(message);
  std::exit(1);
}

// Options that are secrets: no flag, so they never show in `ps` (config file or environment).
constexpr absl::string_view kSecretOptions[] = {"hash_secret_hex"};
constexpr char kHashSecretEnv[] = "KVCM_HASH_SECRET_HEX";

// defaults < config file < environment (secrets) < flags set on the command line.
kvcm::ServerOptions OptionsFromFlags() {
  kvcm::ServerOptions options;
  if (const std::string config = absl::GetFlag(FLAGS_config); !config.empty()) {
    if (absl::Status s = options.MergeConfigFile(config); !s.ok()) Fail(s.message());
  }
  if (const char* secret = std::getenv(kHashSecretEnv); secret != nullptr && *secret != '\0') {
    options.hash_secret_hex = secret;
    options.hash_secret_file.clear();
  }
  for (absl::string_view name : kvcm::ServerOptions::Names()) {
    if (std::find(std::begin(kSecretOptions), std::end(kSecretOptions), name) !=
        std::end(kSecretOptions)) {
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) Fail(absl::StrCat("internal error: option ", name, " has no flag"));
    // Abseil 20220623 keeps CommandLineFlag::IsSpecifiedOnCommandLine private; this is the
    // function it forwards to (it also sees flags read from --flagfile).
    if (!absl::flags_internal::WasPresentOnCommandLine(name)) continue;
    if (absl::Status s = options.Set(name, flag->CurrentValue()); !s.ok()) {
      Fail(absl::StrCat("--", s.message()));
    }
  }
  return options;
}

// What SIGINT / SIGTERM stop: the campaign while this manager is a standby, the server once
// it leads (the lease is kept until the server has drained; Resign follows).
class StopOnSignal {
 public:
  void Stop() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (manager_ != nullptr) {
      manager_->Shutdown();
    } else if (election_ != nullptr) {
      election_->Stop();
    }
  }

  // Campaigns until `election` leads (true) or a stop signal comes (false).
  bool Campaign(kvcm::LeaderElection& election) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return false;
      election_ = &election;
    }
    const bool leads = election.Campaign().ok();
    absl::MutexLock lock(&mu_);
    election_ = nullptr;
    return leads && !stopping_;
  }

  // From now on a stop signal shuts `manager` down (at once if one came already).
  void Serve(kvcm::ManagerServer* manager) {
    absl::MutexLock lock(&mu_);
    manager_ = manager;
    if (stopping_) manager_->Shutdown();
  }

 private:
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  kvcm::LeaderElection* election_ ABSL_GUARDED_BY(mu_) = nullptr;
  kvcm::ManagerServer* manager_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// The address written to the election key: advertise_address, or listen_address with a
// wildcard host replaced by this host's name (a pod's name resolves in its headless Service).
std::string AdvertisedAddress(const kvcm::ServerOptions& options) {
  if (!options.advertise_address.empty()) return options.advertise_address;
  const std::string& listen = options.listen_address;
  const size_t colon = listen.rfind(':');
  if (absl::StartsWith(listen, "unix:") || colon == std::string::npos) return listen;
  const std::string host = listen.substr(0, colon);
  if (host != "" && host != "0.0.0.0" && host != "[::]") return listen;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return listen;
  return absl::StrCat(name, listen.substr(colon));
}

// The leader election of a manager with etcd_endpoints, with its metrics.
struct Election {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<kvcm::LeaderElectionMetrics> metrics;
  std::unique_ptr<kvcm::EtcdClient> etcd;
  std::unique_ptr<kvcm::LeaderElection> election;
  // A standby's /metrics (kvcm_manager_leader and the etcd calls); the server adopts it.
  std::unique_ptr<prometheus::Exposer> standby_exposer;

  // Exits on bad options: a standby checks now what the leader would only read at takeover
  // (TLS files, the hash secret).
  static std::unique_ptr<Election> Create(const kvcm::ServerOptions& options) {
    if (!options.tls.insecure) {
      if (absl::Status s = options.tls.CheckFiles(); !s.ok()) Fail(s.message());
    }
    if (absl::Status s = options.ToCacheIndexOptions().status(); !s.ok()) Fail(s.message());
    auto e = std::make_unique<Election>();
    e->metrics = std::make_unique<kvcm::LeaderElectionMetrics>(*e->registry);
    absl::StatusOr<std::unique_ptr<kvcm::EtcdClient>> etcd =
        kvcm::EtcdClient::Create(options.EtcdEndpoints(), options.EtcdTls());
    if (!etcd.ok()) Fail(etcd.status().message());
    e->etcd = *std::move(etcd);
    kvcm::LeaderElectionOptions election_options;
    election_options.key = options.etcd_election_key;
    election_options.candidate = AdvertisedAddress(options);
    election_options.lease_ttl = absl::Seconds(options.etcd_lease_ttl_s);
    // A tenth of the lease, at least 200 ms: room for the exit after giving up the lead.
    election_options.margin =
        std::max(absl::Milliseconds(200), absl::Seconds(options.etcd_lease_ttl_s) / 10);
    e->election =
        std::make_unique<kvcm::LeaderElection>(e->etcd.get(), election_options, e->metrics.get());
    std::string metrics = "metrics disabled";
    if (!options.metrics_address.empty()) {
      try {
        e->standby_exposer = std::make_unique<prometheus::Exposer>(
            kvcm::MetricsServerOptions(options.metrics_address, 1));
      } catch (const std::exception& error) {
        Fail(absl::StrCat("cannot serve metrics on metrics_address ", options.metrics_address, ": ",
                          error.what()));
      }
      e->standby_exposer->RegisterCollectable(e->registry);
      metrics = absl::StrCat("metrics on ", options.metrics_address);
    }
    std::printf("kvcm-manager standby: campaigning for %s on etcd %s as %s (%s)\n",
                options.etcd_election_key.c_str(), options.etcd_endpoints.c_str(),
                election_options.candidate.c_str(), metrics.c_str());
    std::fflush(stdout);
    return e;
  }
};

}  // namespace

int main(int argc, char** argv) {
  kvcm::ParseProgramFlags(
      argc, argv,
      {.name = "kvcm-manager",
       .usage = "kvcm-manager [--config=path] [--option=value ...]: the kvcm KV-cache prefix "
                "manager.",
       .flag_files = {"server/main.cc", "common/server_flags.cc"}});
  // Debian builds Abseil without NDEBUG, which makes every absl::Mutex lock run the deadlock
  // detector; that costs ~1 % of an RPC and buys nothing in production.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Block SIGINT/SIGTERM before any thread starts, so every thread inherits the mask and the
  // signals are only ever taken by sigwait below, never by an async handler.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  kvcm::ServerOptions options = OptionsFromFlags();
  if (absl::Status s = options.Validate(); !s.ok()) Fail(s.message());

  StopOnSignal stop;
  std::thread signal_waiter([&stop_signals, &stop] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    kvcm::LogInfo(absl::StrCat("received signal ", signal, ", shutting down"));
    stop.Stop();
  });

  std::unique_ptr<Election> election;
  if (!options.etcd_endpoints.empty()) {
    election = Election::Create(options);
    if (!stop.Campaign(*election->election)) {
      signal_waiter.join();
      kvcm::LogInfo("stopped before leading");
      return 0;
    }
    // Renew from now on, not once the server runs: starting it takes a while.
    election->election->KeepLeading([] {
      // Another manager may lead from the moment etcd expires the lease: stop serving now,
      // without waiting for in-flight calls. A supervisor (Kubernetes) restarts this process
      // as a standby.
      kvcm::LogError("lost the lead: exiting so that two managers never serve together");
      std::_Exit(3);
    });
  }

  // A new leader's server adopts the standby's exporter (and so keeps its metrics).
  absl::StatusOr<std::unique_ptr<kvcm::ManagerServer>> server = kvcm::ManagerServer::Start(
      options, nullptr, election != nullptr ? std::move(election->standby_exposer) : nullptr);
  if (!server.ok()) {
    if (election != nullptr) election->election->Resign();
    Fail(server.status().ToString());
  }
  kvcm::ManagerServer* manager = server->get();

  std::string metrics =
      manager->metrics_address().empty()
          ? std::string("metrics disabled")
          : absl::StrCat("metrics on http://", manager->metrics_address(), "/metrics");
  const char* security = options.tls.insecure          ? "PLAINTEXT, insecure"
                         : options.tls.ca_file.empty() ? "TLS"
                                                       : "mutual TLS";
  std::printf("kvcm-manager listening on %s (%s; %s%s)\n", manager->address().c_str(), security,
              metrics.c_str(), election != nullptr ? "; leader" : "");
  std::fflush(stdout);
  kvcm::LogInfo(absl::StrCat("options:\n", options.DebugString()));

  if (election != nullptr) {
    // Once nothing is served (in-flight calls drained): a standby may lead at once.
    manager->OnStoppedServing([&election] { election->election->Resign(); });
  }
  stop.Serve(manager);
  manager->Wait();
  signal_waiter.join();
  server->reset();
  kvcm::LogInfo("stopped");
  return 0;
}
