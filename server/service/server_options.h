// ServerOptions: every tunable of kvcm-manager, with its unit in its name and its default.
//
// Sources, later ones winning: the defaults below < a `name = value` config file
// (MergeConfigFile) < flags given on the command line (server/main.cc calls Set for each).
// Plain value type; not thread-safe to mutate concurrently.
#ifndef KVCM_SERVER_SERVICE_SERVER_OPTIONS_H_
#define KVCM_SERVER_SERVICE_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/security_options.h"
#include "common/server_limits.h"
#include "common/transports.h"
#include "server/core/cache_index.h"

namespace kvcm {

struct ServerOptions {
  // gRPC address, "host:port" ("[::]:50051", "127.0.0.1:0" for any free port) or
  // "unix:/path". ManagerServer::port() reports the port actually bound.
  std::string listen_address = "127.0.0.1:50051";
  // Prometheus exporter address, "host:port"; /metrics is served there. Empty disables it.
  std::string metrics_address = "127.0.0.1:9464";
  // Eviction policy by name (a row of server/core/policies/registry.cc). "select" evicts in the
  // order of whichever candidate its miniature simulations find best on the workload served
  // (docs/EVICTION.md, "Selection by miniature simulation").
  std::string policy = "select";
  // Capacity of a pool the first time an Insert names it. 0 makes Insert into an unknown
  // pool NOT_FOUND.
  uint64_t default_pool_capacity_bytes = 64ULL << 30;
  // Lease of a pin when Match/RenewLease send lease_ttl_ms = 0. 1..max_lease_ttl_ms.
  uint32_t default_lease_ttl_ms = 30'000;
  // Longest lease a caller may ask for; larger requests are INVALID_ARGUMENT. >= 1.
  uint32_t max_lease_ttl_ms = 600'000;
  // How long an expired pin id is remembered, so Release answers ABORTED, not NOT_FOUND.
  uint32_t expired_pin_memory_ms = 600'000;
  // An evicted page asked for again within this window counts as eviction regret.
  uint32_t regret_window_ms = 300'000;
  // Most token ids one prompt may carry. >= 1.
  uint32_t max_tokens_per_request = 1u << 20;
  // Most whole pages one prompt may span (Match and Insert). >= 1.
  uint32_t max_pages_per_request = 65'536;
  // gRPC receive limit per message, in bytes. 4 KiB..2 GiB-1.
  uint32_t max_message_bytes = 16u << 20;
  // Period of the timer that expires lapsed leases when no call does it and drops the pages
  // of agents gone past agent_heartbeat_timeout_ms. >= 1.
  uint32_t lease_sweep_interval_ms = 1'000;
  // 128-bit secret every namespace hash key derives from, as 32 hex digits. Empty (with
  // hash_secret_file empty too) draws a random one at start: clients' cached hash keys then
  // stop matching after a restart (they get FAILED_PRECONDITION and must re-register).
  // A secret never comes from the command line: kvcm-manager has no flag for it; set it in
  // the config file, in the environment (KVCM_HASH_SECRET_HEX) or through hash_secret_file.
  std::string hash_secret_hex;
  // A file holding the secret as 32 hex digits (surrounding whitespace ignored), e.g. a
  // mounted Kubernetes Secret. Read at start; exclusive with hash_secret_hex.
  std::string hash_secret_file;
  // Tokens file (common/token_table.h: SHA-256 of each bearer token -> principal, roles).
  // Empty: callers are not authenticated (everyone may do everything), which the manager
  // allows only in the insecure dev mode and announces loudly. Re-read when it changes.
  std::string tokens_file;
  // Agents identified by their certificate instead of a token (docs/SECURITY.md, "Agent
  // identity"): a caller sending no token whose verified client certificate has the DNS
  // subjectAltName N + this suffix (".kvcm-agent.kvcm.svc") is agent N and N-gpu<K>. Empty:
  // off. Needs tokens_file and tls_ca_file (client certificates required); starts with '.'.
  std::string agent_identity_dns_suffix;
  // Events one WatchEvents subscriber may have queued before it is ended with
  // RESOURCE_EXHAUSTED. >= 1.
  uint32_t max_event_queue = 4'096;
  // How long Shutdown lets in-flight RPCs finish before cancelling them. 0 cancels at once.
  uint32_t shutdown_grace_ms = 5'000;
  // An agent with no Register/Heartbeat for longer than this is reported gone (Stats,
  // kvcm_agents{state="gone"}). >= 1.
  uint32_t agent_heartbeat_timeout_ms = 10'000;
  // How far ahead of the manager's clock an agent's Register epoch (its start time in
  // microseconds since the Unix epoch) may be; a later one is OUT_OF_RANGE naming `epoch`,
  // so no caller can pick an epoch the real agent never exceeds (docs/SECURITY.md). Covers
  // clock skew between hosts. 1..86400.
  uint32_t max_agent_epoch_ahead_s = 300;
  // How long an agent gone past agent_heartbeat_timeout_ms is remembered (in Stats,
  // kvcm_agents{state="gone"} and the KvcmAgentGone alert) before it and its pools are
  // forgotten; an agent stopped on purpose (SIGTERM) is forgotten at once. 60..2592000.
  uint32_t gone_agent_memory_s = 3'600;
  // An engine session (PublishEngineEvents) with no request for longer than this, when it
  // asked for no ttl of its own, ends and its pools are emptied. 1..600000.
  uint32_t engine_session_ttl_ms = 30'000;
  // Most namespaces RegisterModel creates, in all and per tenant (RESOURCE_EXHAUSTED
  // beyond; namespaces rebuilt from agents are never refused). >= 1.
  uint32_t max_namespaces = 4'096;
  uint32_t max_namespaces_per_tenant = 64;
  // Most live pins of one tenant (Match/Route with pin beyond: RESOURCE_EXHAUSTED). >= 1.
  uint32_t max_pins_per_tenant = 65'536;
  // Route's cost model. Prefill throughput of one GPU, tokens per second, when a
  // RouteRequest sends none (the cost of recomputing an uncached token). >= 1.
  uint32_t route_prefill_tokens_per_s = 10'000;
  // Link bandwidth, Gbit/s, of an agent that has not measured its pulls yet, by its
  // transport: TCP (a datacentre NIC) and NCCL (NVLink or InfiniBand). Their defaults are
  // the transports' rows in common/transports.h, which also cost a transport without an
  // option here. >= 1.
  uint32_t route_tcp_link_gbps = DefaultLinkGbps("tcp");
  uint32_t route_nccl_link_gbps = DefaultLinkGbps("nccl");
  // Retention (docs/EVICTION.md): seconds a cached page may stay after it was committed,
  // for every namespace; RegisterModel's max_page_age_s may set a shorter one per
  // namespace. Expired pages leave at the lease sweep (and never match). 0: no limit.
  // At most 315360000 (10 years).
  uint32_t default_max_page_age_s = 0;
  // Tenant quotas (docs/EVICTION.md), 0: unlimited. Bytes one tenant may hold: its cached
  // pages in every pool (each replica counts) plus the headroom it reserved; an Insert or
  // Reserve beyond evicts the tenant's own unpinned pages first, and is RESOURCE_EXHAUSTED
  // when that cannot make room.
  uint64_t tenant_max_bytes = 0;
  // Bytes of a tenant's cached pages its pins may hold (each replica counts, a page under
  // several pins once); a pinning Match or Route beyond is RESOURCE_EXHAUSTED. At most
  // tenant_max_bytes when both are set.
  uint64_t tenant_max_pinned_bytes = 0;

  // Transport security of the gRPC port (common/credentials.h; README "TLS"): one of TLS or
  // insecure is required. Each field of `tls` is the option tls_<field> (tls_cert_file,
  // tls_key_file, tls_ca_file, tls_reload_interval_s), `insecure` excepted, which keeps its
  // name. TLS serves tls_cert_file with its key tls_key_file (PEM); tls_ca_file makes it
  // mutual: every client, agents included, must then present a certificate that CA signed.
  // The files are re-read every tls_reload_interval_s (1..86400), so rotating them needs no
  // restart. insecure = true serves plaintext, for development on a trusted machine only,
  // and excludes the tls_* files. /metrics stays plaintext HTTP either way (prometheus-cpp's
  // exporter is not given TLS here): bind it to a trusted interface.
  TlsOptions tls;

  // High availability (docs/OPERATIONS.md): with etcd_endpoints set, managers elect one
  // leader through etcd. A standby serves only /metrics and does not even listen on
  // listen_address until it wins; the leader keeps its etcd lease (etcd_lease_ttl_s, 2..60)
  // alive and exits the moment it cannot confirm it, before etcd could let another manager
  // lead. Empty etcd_endpoints: one manager, no election. etcd_endpoints is a comma-separated
  // list of host:port (tried in turn); the election key holds the leader's
  // advertise_address (default: listen_address, its host replaced by this host's name when
  // it is a wildcard). etcd_ca_file turns on TLS to etcd (etcd_cert_file and etcd_key_file
  // add a client certificate); without it the etcd connection is plaintext.
  std::string etcd_endpoints;
  std::string etcd_election_key = "/kvcm/manager/leader";
  uint32_t etcd_lease_ttl_s = 5;
  std::string advertise_address;
  std::string etcd_ca_file;
  std::string etcd_cert_file;
  std::string etcd_key_file;

  // Fair by default (docs/SECURITY.md "Limits"; CacheIndexOptions): while neither tenant
  // quota is set, what one tenant reserves in a pool that another tenant uses (holds pages
  // or a reservation in) plus what its pins hold there may reach
  // this percent of the pool's capacity (Reserve, Match/Route with pin beyond:
  // RESOURCE_EXHAUSTED). 1..100; 100 turns it off.
  uint32_t default_tenant_pool_share_pct = 50;
  // Page-locations (pages x tiers) one engine's pools, and the engine pools of one tenant,
  // may hold (PublishEngineEvents beyond: RESOURCE_EXHAUSTED, the session ends). >= 1.
  uint64_t max_engine_pages_per_engine = 1ULL << 20;
  uint64_t max_engine_pages_per_tenant = 4ULL << 20;

  // Connection limits of the gRPC port (docs/SECURITY.md "Connection limits"): each field
  // <name> of `limits` is the option grpc_<name> (common/server_limits.h documents it and its
  // range). Handshake and idle deadlines, keepalive policy, streams per connection and gRPC's
  // resource quota are gRPC's own server options; the connection caps are kvcm's accept4
  // guard. RLIMIT_NOFILE is raised to its hard limit at start and grpc_fd_reserve of it kept
  // for everything but accepted connections.
  ServerLimitsOptions limits;
  // Long-lived streams (WatchEvents, Commands, ReportInventory) one principal may hold open
  // at once; one more is RESOURCE_EXHAUSTED naming this option. Not applied without a tokens
  // file (every caller is then the same principal). >= 1.
  uint32_t max_streams_per_principal = 64;

  // INVALID_ARGUMENT naming the first bad option.
  absl::Status Validate() const;

  // How this manager reaches etcd (plaintext unless etcd_ca_file is set).
  TlsOptions EtcdTls() const;
  // etcd_endpoints split at commas, surrounding spaces and empty entries dropped.
  std::vector<std::string> EtcdEndpoints() const;

  // The core's options. Draws a random hash secret when hash_secret_hex is empty.
  // REQUIRES: Validate().ok() (INVALID_ARGUMENT otherwise).
  absl::StatusOr<CacheIndexOptions> ToCacheIndexOptions() const;

  // Sets option `name` from its text form (decimal for numbers, true/false/1/0 for
  // booleans). INVALID_ARGUMENT for an
  // unknown name or a value that does not parse; range checks are left to Validate().
  absl::Status Set(absl::string_view name, absl::string_view value);

  // Applies a config file's text: one `name = value` per line, `#` starts a comment, blank
  // lines are ignored, a value may be wrapped in double quotes, a name may appear once.
  // Errors are INVALID_ARGUMENT "<source>:<line>: ...". Stops at the first error; lines
  // before it stay applied, so callers should discard the options on error.
  absl::Status MergeConfigText(absl::string_view text, absl::string_view source);
  // Reads `path` and MergeConfigText's it. NOT_FOUND when it cannot be opened.
  absl::Status MergeConfigFile(const std::string& path);

  // One "name = value" line per option, the secret redacted; for the startup log.
  std::string DebugString() const;

  // The option names, in declaration order (also the flag names of kvcm-manager).
  static std::vector<absl::string_view> Names();
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_SERVER_OPTIONS_H_
