#include "server/service/server_options.h"

#include <climits>
#include <fstream>
#include <random>
#include <sstream>
#include <variant>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/core/policies/registry.h"

namespace kvcm {
namespace {

// Where an option lives in a ServerOptions.
using Value = std::variant<std::string*, uint32_t*, uint64_t*, bool*>;

struct Field {
  absl::string_view name;
  Value (*get)(ServerOptions&);
};

template <auto kMember>
Value Top(ServerOptions& o) {
  return &(o.*kMember);
}
template <auto kMember>
Value Tls(ServerOptions& o) {
  return &(o.tls.*kMember);
}
template <auto kMember>
Value Limit(ServerOptions& o) {
  return &(o.limits.*kMember);
}

// Every option, in declaration order. Set, Names and DebugString go through this table.
const std::vector<Field>& Fields() {
  static const auto* const kFields = new std::vector<Field>{
      {"listen_address", &Top<&ServerOptions::listen_address>},
      {"metrics_address", &Top<&ServerOptions::metrics_address>},
      {"policy", &Top<&ServerOptions::policy>},
      {"default_pool_capacity_bytes", &Top<&ServerOptions::default_pool_capacity_bytes>},
      {"default_lease_ttl_ms", &Top<&ServerOptions::default_lease_ttl_ms>},
      {"max_lease_ttl_ms", &Top<&ServerOptions::max_lease_ttl_ms>},
      {"expired_pin_memory_ms", &Top<&ServerOptions::expired_pin_memory_ms>},
      {"regret_window_ms", &Top<&ServerOptions::regret_window_ms>},
      {"max_tokens_per_request", &Top<&ServerOptions::max_tokens_per_request>},
      {"max_pages_per_request", &Top<&ServerOptions::max_pages_per_request>},
      {"max_message_bytes", &Top<&ServerOptions::max_message_bytes>},
      {"lease_sweep_interval_ms", &Top<&ServerOptions::lease_sweep_interval_ms>},
      {"hash_secret_hex", &Top<&ServerOptions::hash_secret_hex>},
      {"hash_secret_file", &Top<&ServerOptions::hash_secret_file>},
      {"tokens_file", &Top<&ServerOptions::tokens_file>},
      {"agent_identity_dns_suffix", &Top<&ServerOptions::agent_identity_dns_suffix>},
      {"max_event_queue", &Top<&ServerOptions::max_event_queue>},
      {"shutdown_grace_ms", &Top<&ServerOptions::shutdown_grace_ms>},
      {"agent_heartbeat_timeout_ms", &Top<&ServerOptions::agent_heartbeat_timeout_ms>},
      {"max_agent_epoch_ahead_s", &Top<&ServerOptions::max_agent_epoch_ahead_s>},
      {"gone_agent_memory_s", &Top<&ServerOptions::gone_agent_memory_s>},
      {"engine_session_ttl_ms", &Top<&ServerOptions::engine_session_ttl_ms>},
      {"max_namespaces", &Top<&ServerOptions::max_namespaces>},
      {"max_namespaces_per_tenant", &Top<&ServerOptions::max_namespaces_per_tenant>},
      {"max_pins_per_tenant", &Top<&ServerOptions::max_pins_per_tenant>},
      {"route_prefill_tokens_per_s", &Top<&ServerOptions::route_prefill_tokens_per_s>},
      {"route_tcp_link_gbps", &Top<&ServerOptions::route_tcp_link_gbps>},
      {"route_nccl_link_gbps", &Top<&ServerOptions::route_nccl_link_gbps>},
      {"default_max_page_age_s", &Top<&ServerOptions::default_max_page_age_s>},
      {"tls_cert_file", &Tls<&TlsOptions::cert_file>},
      {"tls_key_file", &Tls<&TlsOptions::key_file>},
      {"tls_ca_file", &Tls<&TlsOptions::ca_file>},
      {"tls_reload_interval_s", &Tls<&TlsOptions::reload_interval_s>},
      {"insecure", &Tls<&TlsOptions::insecure>},
      {"tenant_max_bytes", &Top<&ServerOptions::tenant_max_bytes>},
      {"tenant_max_pinned_bytes", &Top<&ServerOptions::tenant_max_pinned_bytes>},
      {"etcd_endpoints", &Top<&ServerOptions::etcd_endpoints>},
      {"etcd_election_key", &Top<&ServerOptions::etcd_election_key>},
      {"etcd_lease_ttl_s", &Top<&ServerOptions::etcd_lease_ttl_s>},
      {"advertise_address", &Top<&ServerOptions::advertise_address>},
      {"etcd_ca_file", &Top<&ServerOptions::etcd_ca_file>},
      {"etcd_cert_file", &Top<&ServerOptions::etcd_cert_file>},
      {"etcd_key_file", &Top<&ServerOptions::etcd_key_file>},
      {"default_tenant_pool_share_pct", &Top<&ServerOptions::default_tenant_pool_share_pct>},
      {"max_engine_pages_per_engine", &Top<&ServerOptions::max_engine_pages_per_engine>},
      {"max_engine_pages_per_tenant", &Top<&ServerOptions::max_engine_pages_per_tenant>},
      {"grpc_handshake_timeout_ms", &Limit<&ServerLimitsOptions::handshake_timeout_ms>},
      {"grpc_max_connection_idle_ms", &Limit<&ServerLimitsOptions::max_connection_idle_ms>},
      {"grpc_keepalive_time_ms", &Limit<&ServerLimitsOptions::keepalive_time_ms>},
      {"grpc_keepalive_timeout_ms", &Limit<&ServerLimitsOptions::keepalive_timeout_ms>},
      {"grpc_min_client_ping_interval_ms",
       &Limit<&ServerLimitsOptions::min_client_ping_interval_ms>},
      {"grpc_max_ping_strikes", &Limit<&ServerLimitsOptions::max_ping_strikes>},
      {"grpc_max_concurrent_streams", &Limit<&ServerLimitsOptions::max_concurrent_streams>},
      {"grpc_memory_bytes", &Limit<&ServerLimitsOptions::memory_bytes>},
      {"grpc_max_threads", &Limit<&ServerLimitsOptions::max_threads>},
      {"grpc_max_connections", &Limit<&ServerLimitsOptions::max_connections>},
      {"grpc_max_connections_per_peer", &Limit<&ServerLimitsOptions::max_connections_per_peer>},
      {"grpc_fd_reserve", &Limit<&ServerLimitsOptions::fd_reserve>},
      {"max_streams_per_principal", &Top<&ServerOptions::max_streams_per_principal>},
  };
  return *kFields;
}

const Field* FindField(absl::string_view name) {
  for (const Field& f : Fields()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool IsHex(absl::string_view s) {
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// "host:port" with a decimal port in [0, 65535]; the host may be empty or "[v6]".
bool IsHostPort(absl::string_view address) {
  size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return false;
  absl::string_view port = address.substr(colon + 1);
  uint32_t value = 0;
  return !port.empty() && port.size() <= 5 && absl::ascii_isdigit(port[0]) &&
         absl::SimpleAtoi(port, &value) && value <= 65535;
}

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

// One of TLS (certificate and key) or insecure; the files themselves are read at Start.
// Agent identity by certificate is checked here too: it needs TLS.
absl::Status ValidateTransportSecurity(const ServerOptions& o) {
  if (o.tls.insecure) {
    for (const auto& [name, value] :
         {std::pair{"tls_cert_file", &o.tls.cert_file}, std::pair{"tls_key_file", &o.tls.key_file},
          std::pair{"tls_ca_file", &o.tls.ca_file}}) {
      if (!value->empty()) {
        return Invalid("insecure", absl::StrCat("= true excludes ", name, " (got both)"));
      }
    }
    if (!o.agent_identity_dns_suffix.empty()) {
      return Invalid("agent_identity_dns_suffix", "needs mutual TLS, not --insecure");
    }
    return absl::OkStatus();
  }
  if (o.tls.cert_file.empty() && o.tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        "no transport security: pass --tls_cert_file and --tls_key_file (and --tls_ca_file for "
        "mutual TLS), or --insecure to serve plaintext on a trusted network (in a --config "
        "file: tls_cert_file = ..., insecure = true)");
  }
  if (o.tls.cert_file.empty()) return Invalid("tls_cert_file", "is required with tls_key_file");
  if (o.tls.key_file.empty()) return Invalid("tls_key_file", "is required with tls_cert_file");
  if (o.tls.reload_interval_s < 1 || o.tls.reload_interval_s > 86'400) {
    return Invalid("tls_reload_interval_s",
                   absl::StrCat("must be in [1, 86400], got ", o.tls.reload_interval_s));
  }
  return ValidateAgentIdentity(o.agent_identity_dns_suffix, o.tokens_file, o.tls.ca_file);
}

// The etcd_* options and advertise_address; all of them but the election key and lease
// ttl need etcd_endpoints.
absl::Status ValidateHighAvailability(const ServerOptions& o) {
  const std::vector<std::string> endpoints = o.EtcdEndpoints();
  if (endpoints.empty()) {
    for (const auto& [name, value] : {std::pair{"etcd_ca_file", &o.etcd_ca_file},
                                      std::pair{"etcd_cert_file", &o.etcd_cert_file},
                                      std::pair{"etcd_key_file", &o.etcd_key_file},
                                      std::pair{"advertise_address", &o.advertise_address}}) {
      if (!value->empty()) return Invalid(name, "is set but etcd_endpoints is empty");
    }
    return absl::OkStatus();
  }
  for (const std::string& e : endpoints) {
    if (!IsHostPort(e) || absl::StartsWith(e, ":")) {
      return Invalid("etcd_endpoints",
                     absl::StrCat("must be a comma-separated list of host:port, got \"", e, "\""));
    }
  }
  if (o.etcd_election_key.empty() || o.etcd_election_key.size() > 1024) {
    return Invalid("etcd_election_key", "must be 1..1024 bytes");
  }
  if (o.etcd_lease_ttl_s < 2 || o.etcd_lease_ttl_s > 60) {
    return Invalid("etcd_lease_ttl_s",
                   absl::StrCat("must be in [2, 60], got ", o.etcd_lease_ttl_s));
  }
  if (!o.advertise_address.empty() && !IsHostPort(o.advertise_address)) {
    return Invalid("advertise_address",
                   absl::StrCat("must be host:port or empty, got \"", o.advertise_address, "\""));
  }
  // Two managers that drew their own random secrets would hand out different hash keys: after
  // a takeover every client's cached key would be stale.
  if (o.hash_secret_hex.empty() && o.hash_secret_file.empty()) {
    return Invalid("etcd_endpoints",
                   "needs a hash secret every manager shares: set hash_secret_file (or "
                   "hash_secret_hex / KVCM_HASH_SECRET_HEX)");
  }
  if (o.etcd_ca_file.empty() && !(o.etcd_cert_file.empty() && o.etcd_key_file.empty())) {
    return Invalid(o.etcd_cert_file.empty() ? "etcd_key_file" : "etcd_cert_file",
                   "needs etcd_ca_file (TLS to etcd)");
  }
  if (o.etcd_cert_file.empty() != o.etcd_key_file.empty()) {
    return Invalid(o.etcd_cert_file.empty() ? "etcd_cert_file" : "etcd_key_file",
                   o.etcd_cert_file.empty() ? "is required with etcd_key_file"
                                            : "is required with etcd_cert_file");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ServerOptions::Validate() const {
  if (listen_address.empty() ||
      !(absl::StartsWith(listen_address, "unix:") || IsHostPort(listen_address))) {
    return Invalid("listen_address",
                   absl::StrCat("must be host:port or unix:path, got \"", listen_address, "\""));
  }
  if (!metrics_address.empty() && !IsHostPort(metrics_address)) {
    return Invalid("metrics_address",
                   absl::StrCat("must be host:port or empty, got \"", metrics_address, "\""));
  }
  if (const PolicyEntry* p = FindPolicy(policy); p == nullptr || p->clairvoyant) {
    return Invalid("policy", absl::StrCat("\"", policy, "\" is ",
                                          p == nullptr ? "unknown" : "clairvoyant (simulator only)",
                                          "; the manager's policies: ", PolicyNames(false)));
  }
  if (max_lease_ttl_ms < 1) return Invalid("max_lease_ttl_ms", "must be >= 1");
  if (default_lease_ttl_ms < 1 || default_lease_ttl_ms > max_lease_ttl_ms) {
    return Invalid("default_lease_ttl_ms",
                   absl::StrCat("must be in [1, max_lease_ttl_ms = ", max_lease_ttl_ms, "], got ",
                                default_lease_ttl_ms));
  }
  if (max_tokens_per_request < 1) return Invalid("max_tokens_per_request", "must be >= 1");
  if (max_pages_per_request < 1) return Invalid("max_pages_per_request", "must be >= 1");
  if (max_message_bytes < 4096 || max_message_bytes > static_cast<uint32_t>(INT_MAX)) {
    return Invalid("max_message_bytes",
                   absl::StrCat("must be in [4096, ", INT_MAX, "], got ", max_message_bytes));
  }
  if (lease_sweep_interval_ms < 1) return Invalid("lease_sweep_interval_ms", "must be >= 1");
  if (!hash_secret_hex.empty() && (hash_secret_hex.size() != 32 || !IsHex(hash_secret_hex))) {
    return Invalid("hash_secret_hex", absl::StrCat("must be empty or 32 hex digits, got ",
                                                   hash_secret_hex.size(), " characters"));
  }
  if (!hash_secret_hex.empty() && !hash_secret_file.empty()) {
    return Invalid("hash_secret_file", "and hash_secret_hex are exclusive: set one");
  }
  if (max_event_queue < 1) return Invalid("max_event_queue", "must be >= 1");
  if (agent_heartbeat_timeout_ms < 1) return Invalid("agent_heartbeat_timeout_ms", "must be >= 1");
  if (gone_agent_memory_s < 60 || gone_agent_memory_s > 2'592'000) {
    return Invalid("gone_agent_memory_s",
                   absl::StrCat("must be in [60, 2592000], got ", gone_agent_memory_s));
  }
  if (max_agent_epoch_ahead_s < 1 || max_agent_epoch_ahead_s > 86'400) {
    return Invalid("max_agent_epoch_ahead_s",
                   absl::StrCat("must be in [1, 86400], got ", max_agent_epoch_ahead_s));
  }
  if (engine_session_ttl_ms < 1 || engine_session_ttl_ms > 600'000) {
    return Invalid("engine_session_ttl_ms", "must be in 1..600000");
  }
  if (max_namespaces < 1) return Invalid("max_namespaces", "must be >= 1");
  if (max_namespaces_per_tenant < 1) return Invalid("max_namespaces_per_tenant", "must be >= 1");
  if (max_pins_per_tenant < 1) return Invalid("max_pins_per_tenant", "must be >= 1");
  if (route_prefill_tokens_per_s < 1) return Invalid("route_prefill_tokens_per_s", "must be >= 1");
  if (route_tcp_link_gbps < 1) return Invalid("route_tcp_link_gbps", "must be >= 1");
  if (route_nccl_link_gbps < 1) return Invalid("route_nccl_link_gbps", "must be >= 1");
  if (default_max_page_age_s > kMaxPageAgeS) {
    return Invalid("default_max_page_age_s",
                   absl::StrCat("must be at most ", kMaxPageAgeS, " (10 years; 0: no limit), got ",
                                default_max_page_age_s));
  }
  if (tenant_max_bytes > 0 && tenant_max_pinned_bytes > tenant_max_bytes) {
    return Invalid("tenant_max_pinned_bytes",
                   absl::StrCat("must be at most tenant_max_bytes = ", tenant_max_bytes,
                                " (0: unlimited), got ", tenant_max_pinned_bytes));
  }
  if (default_tenant_pool_share_pct < 1 || default_tenant_pool_share_pct > 100) {
    return Invalid("default_tenant_pool_share_pct",
                   absl::StrCat("must be in [1, 100] (100: no default share), got ",
                                default_tenant_pool_share_pct));
  }
  if (max_engine_pages_per_engine < 1)
    return Invalid("max_engine_pages_per_engine", "must be >= 1");
  if (max_engine_pages_per_tenant < 1)
    return Invalid("max_engine_pages_per_tenant", "must be >= 1");
  if (absl::Status s = limits.Validate("grpc_"); !s.ok()) return s;
  if (max_streams_per_principal < 1) return Invalid("max_streams_per_principal", "must be >= 1");
  if (absl::Status s = ValidateHighAvailability(*this); !s.ok()) return s;
  return ValidateTransportSecurity(*this);
}

TlsOptions ServerOptions::EtcdTls() const {
  return TlsOptions{.insecure = etcd_ca_file.empty(),
                    .cert_file = etcd_cert_file,
                    .key_file = etcd_key_file,
                    .ca_file = etcd_ca_file,
                    .reload_interval_s = tls.reload_interval_s};
}

std::vector<std::string> ServerOptions::EtcdEndpoints() const {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(etcd_endpoints, ',')) {
    e = absl::StripAsciiWhitespace(e);
    if (!e.empty()) out.emplace_back(e);
  }
  return out;
}

absl::StatusOr<CacheIndexOptions> ServerOptions::ToCacheIndexOptions() const {
  if (absl::Status s = Validate(); !s.ok()) return s;
  CacheIndexOptions out;
  std::string secret_hex = hash_secret_hex;
  if (!hash_secret_file.empty()) {
    std::ifstream in(hash_secret_file);
    if (!in) return Invalid("hash_secret_file", absl::StrCat("cannot read ", hash_secret_file));
    std::ostringstream text;
    text << in.rdbuf();
    secret_hex = std::string(absl::StripAsciiWhitespace(text.str()));
    if (secret_hex.size() != 32 || !IsHex(secret_hex)) {
      return Invalid("hash_secret_file",
                     absl::StrCat(hash_secret_file, " must hold 32 hex digits, it holds ",
                                  secret_hex.size(), " characters"));
    }
  }
  if (secret_hex.empty()) {
    std::random_device rd;
    auto draw64 = [&rd] { return (static_cast<uint64_t>(rd()) << 32) | rd(); };
    out.hash_secret.k0 = draw64();
    out.hash_secret.k1 = draw64();
  } else {
    out.hash_secret = HashKey::FromBytes(absl::HexStringToBytes(secret_hex));
  }
  out.policy = policy;
  out.default_pool_capacity_bytes = default_pool_capacity_bytes;
  out.default_lease_ttl = absl::Milliseconds(default_lease_ttl_ms);
  out.max_lease_ttl = absl::Milliseconds(max_lease_ttl_ms);
  out.expired_pin_memory = absl::Milliseconds(expired_pin_memory_ms);
  out.regret_window = absl::Milliseconds(regret_window_ms);
  out.max_namespaces = max_namespaces;
  out.max_namespaces_per_tenant = max_namespaces_per_tenant;
  out.max_pins_per_tenant = max_pins_per_tenant;
  out.default_max_page_age = absl::Seconds(default_max_page_age_s);
  out.tenant_max_bytes = tenant_max_bytes;
  out.tenant_max_pinned_bytes = tenant_max_pinned_bytes;
  out.default_tenant_pool_share_pct = default_tenant_pool_share_pct;
  out.max_engine_pages_per_engine = max_engine_pages_per_engine;
  out.max_engine_pages_per_tenant = max_engine_pages_per_tenant;
  return out;
}

absl::Status ServerOptions::Set(absl::string_view name, absl::string_view value) {
  const Field* field = FindField(name);
  if (field == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown option \"", name, "\" (known: ", absl::StrJoin(Names(), ", "), ")"));
  }
  auto bad_number = [&](absl::string_view type) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": \"", value, "\" is not a ", type, " decimal number"));
  };
  const Value target = field->get(*this);
  if (auto* str = std::get_if<std::string*>(&target)) {
    **str = std::string(value);
  } else if (auto* u32 = std::get_if<uint32_t*>(&target)) {
    uint32_t v = 0;
    if (value.empty() || !absl::ascii_isdigit(value[0]) || !absl::SimpleAtoi(value, &v)) {
      return bad_number("32-bit unsigned");
    }
    **u32 = v;
  } else if (auto* u64 = std::get_if<uint64_t*>(&target)) {
    uint64_t v = 0;
    if (value.empty() || !absl::ascii_isdigit(value[0]) || !absl::SimpleAtoi(value, &v)) {
      return bad_number("64-bit unsigned");
    }
    **u64 = v;
  } else {
    bool v = false;
    if (value == "true" || value == "1") {
      v = true;
    } else if (value != "false" && value != "0") {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": \"", value, "\" is not true, false, 1 or 0"));
    }
    **std::get_if<bool*>(&target) = v;
  }
  return absl::OkStatus();
}

absl::Status ServerOptions::MergeConfigText(absl::string_view text, absl::string_view source) {
  absl::flat_hash_map<std::string, int> seen;  // name -> line it was set on
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    auto error = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_no, ": ", what));
    };
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return error(absl::StrCat("expected `name = value`, got \"", line, "\""));
    }
    absl::string_view name = absl::StripAsciiWhitespace(line.substr(0, eq));
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(eq + 1));
    if (name.empty()) return error("missing option name before '='");
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
      value = value.substr(1, value.size() - 2);
    } else if (!value.empty() && (value.front() == '"' || value.back() == '"')) {
      return error(absl::StrCat(name, ": unbalanced double quote in ", line.substr(eq + 1)));
    }
    if (auto [it, inserted] = seen.emplace(std::string(name), line_no); !inserted) {
      return error(absl::StrCat(name, " is set twice (first on line ", it->second, ")"));
    }
    if (absl::Status s = Set(name, value); !s.ok()) return error(s.message());
  }
  return absl::OkStatus();
}

absl::Status ServerOptions::MergeConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open config file ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading config file ", path));
  return MergeConfigText(text.str(), path);
}

std::string ServerOptions::DebugString() const {
  std::string out;
  ServerOptions copy = *this;  // Field::get hands out mutable pointers
  for (const Field& f : Fields()) {
    std::string value;
    const Value v = f.get(copy);
    if (auto* str = std::get_if<std::string*>(&v)) {
      value = absl::StrCat("\"", **str, "\"");
    } else if (auto* u32 = std::get_if<uint32_t*>(&v)) {
      value = absl::StrCat(**u32);
    } else if (auto* u64 = std::get_if<uint64_t*>(&v)) {
      value = absl::StrCat(**u64);
    } else {
      value = **std::get_if<bool*>(&v) ? "true" : "false";
    }
    // Where the secret comes from, never the secret.
    if (f.name == "hash_secret_hex") {
      value = !hash_secret_hex.empty()    ? "(set)"
              : !hash_secret_file.empty() ? "(from hash_secret_file)"
                                          : "(random)";
    }
    absl::StrAppend(&out, f.name, " = ", value, "\n");
  }
  return out;
}

std::vector<absl::string_view> ServerOptions::Names() {
  std::vector<absl::string_view> names;
  for (const Field& f : Fields()) names.push_back(f.name);
  return names;
}

}  // namespace kvcm
