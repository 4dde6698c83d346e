#include "gpu/agent/agent_options.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/model_catalog.h"
#include "common/security_options.h"
#include "gpu/agent/transport/registry.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"

namespace kvcm {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

bool IsAgentIdChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

// One of TLS (all three files) or insecure, and one token source at most.
absl::Status ValidateSecurity(const AgentOptions& o) {
  const std::pair<const char*, const std::string*> files[] = {{"tls_cert_file", &o.tls.cert_file},
                                                              {"tls_key_file", &o.tls.key_file},
                                                              {"tls_ca_file", &o.tls.ca_file}};
  if (o.tls.insecure) {
    for (const auto& [name, value] : files) {
      if (!value->empty()) {
        return Invalid("insecure", absl::StrCat("= true excludes ", name, " (got both)"));
      }
    }
  } else {
    if (o.tls.cert_file.empty() && o.tls.key_file.empty() && o.tls.ca_file.empty()) {
      return absl::InvalidArgumentError(
          "no transport security: set tls_cert_file, tls_key_file and tls_ca_file (mutual "
          "TLS), or insecure = true for plaintext on a trusted network");
    }
    for (const auto& [name, value] : files) {
      if (value->empty()) {
        return Invalid(name,
                       "is required for TLS (with tls_cert_file, tls_key_file and "
                       "tls_ca_file)");
      }
    }
    if (o.tls.reload_interval_s < 1 || o.tls.reload_interval_s > 86'400) {
      return Invalid("tls_reload_interval_s",
                     absl::StrCat("must be in [1, 86400], got ", o.tls.reload_interval_s));
    }
  }
  if (o.tls.insecure && !o.agent_identity_dns_suffix.empty()) {
    return Invalid("agent_identity_dns_suffix", "needs mutual TLS, not insecure = true");
  }
  if (absl::Status s =
          ValidateAgentIdentity(o.agent_identity_dns_suffix, o.tokens_file, o.tls.ca_file);
      !s.ok()) {
    return s;
  }
  if (!o.advertise_host.empty() &&
      (absl::StrContains(o.advertise_host, ':') || absl::StrContains(o.advertise_host, '/'))) {
    return Invalid("advertise_host",
                   absl::StrCat("is a host name or IPv4 address without a port, got \"",
                                o.advertise_host, "\""));
  }
  if (!o.token.empty() && !o.token_file.empty()) {
    return Invalid("token_file", "excludes a token given directly ($KVCM_TOKEN)");
  }
  if (!o.token.empty()) {
    if (absl::Status s = ValidateBearerToken(o.token); !s.ok()) {
      return Invalid("token", s.message());
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string HostMemoryTierNote(Tier tier, bool pool_on_device) {
  if (pool_on_device || tier != Tier::kGpu) return "";
  return "the pool is in host memory and registers as tier gpu: the tier is its "
         "role (the engines' pool, demoting into a host pool and fetched into by the vLLM "
         "connector), not its memory; --tier=host registers it as a host-tier pool instead";
}

absl::StatusOr<LocalPrincipalUids> ParseLocalPrincipalUids(absl::string_view text) {
  LocalPrincipalUids out;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos || eq == 0 || eq + 1 == entry.size()) {
      return Invalid("local_principal_uids",
                     absl::StrCat("entry \"", entry, "\" is not principal=uid[:uid...]"));
    }
    std::vector<uint32_t>& uids = out[entry.substr(0, eq)];
    if (!uids.empty()) {
      return Invalid("local_principal_uids",
                     absl::StrCat("principal ", entry.substr(0, eq), " is listed twice"));
    }
    for (absl::string_view u : absl::StrSplit(entry.substr(eq + 1), ':')) {
      uint32_t uid = 0;
      if (!absl::SimpleAtoi(u, &uid)) {
        return Invalid("local_principal_uids", absl::StrCat("\"", u, "\" is not a uid"));
      }
      uids.push_back(uid);
    }
  }
  return out;
}

absl::StatusOr<PoolGeometry> AgentOptions::Geometry() const {
  ModelSpec resolved = spec;
  if (!model.empty()) {
    // The preset replaces the explicit geometry; both given is a mistake (the agent once ran
    // DeepSeek-V3 geometry silently for `--num_layers=32 ...` without `--model=`).
    if (spec.num_layers != 0 || spec.num_heads != 0 || spec.num_kv_heads != 0 ||
        spec.head_dim != 0 || spec.kv_lora_rank != 0 || spec.rope_dim != 0) {
      return Invalid("model",
                     absl::StrCat("preset \"", model,
                                  "\" and explicit geometry (--num_layers, --num_heads, "
                                  "--num_kv_heads, --head_dim, --kv_lora_rank, --rope_dim) were "
                                  "both given; pass --model= (empty) to use the explicit "
                                  "geometry, or drop those flags to use the preset"));
    }
    absl::StatusOr<ModelSpec> preset = FindModel(model, dtype);
    if (!preset.ok()) return Invalid("model", preset.status().message());
    resolved = *preset;
    resolved.page_size_tokens = page_size_tokens;
  }
  return PoolGeometry::ForCapacity(resolved, capacity_bytes);
}

absl::StatusOr<PoolGeometry> AgentOptions::HostGeometry() const {
  absl::StatusOr<PoolGeometry> main = Geometry();
  if (!main.ok()) return main.status();
  absl::StatusOr<PoolGeometry> host = PoolGeometry::ForCapacity(main->spec, host_capacity_bytes);
  if (!host.ok()) return Invalid("host_capacity_bytes", host.status().message());
  return host;
}

absl::Status AgentOptions::Validate() const {
  if (agent_id.empty() || agent_id.size() > 128) {
    return Invalid("agent_id", absl::StrCat("must be 1..128 bytes, got ", agent_id.size()));
  }
  for (char c : agent_id) {
    if (!IsAgentIdChar(c)) return Invalid("agent_id", "must be of [A-Za-z0-9._:-]");
  }
  if (manager_address.empty()) return Invalid("manager_address", "is required");
  if (listen_address.empty() || !absl::StrContains(listen_address, ':')) {
    return Invalid("listen_address", "must be host:port");
  }
  if (transfer_io_timeout_ms < 1) return Invalid("transfer_io_timeout_ms", "must be >= 1");
  if (absl::Status s =
          TcpTransportOptions{.listen_address = data_listen_address,
                              .max_connections = data_max_connections,
                              .max_connections_per_peer = data_max_connections_per_peer,
                              .max_handshakes = data_max_handshakes,
                              .max_handshakes_per_peer = data_max_handshakes_per_peer,
                              .handshake_timeout_ms = data_handshake_timeout_ms,
                              .request_timeout_ms = data_request_timeout_ms}
              .Validate();
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("data_", s.message()));  // data_<field>
  }
  if (absl::Status s = limits.Validate("grpc_"); !s.ok()) return s;
  if (device_index < 0) return Invalid("device_index", "must be >= 0");
  if (tier != Tier::kGpu && tier != Tier::kHost && tier != Tier::kDisk) {
    return Invalid("tier", "must be gpu, host or disk");
  }
  if (allocate_wait_ms > 600'000) {
    return Invalid("allocate_wait_ms",
                   absl::StrCat("must be in [0, 600000], got ", allocate_wait_ms));
  }
  if (allocation_ttl_ms != 0 && (allocation_ttl_ms < 1'000 || allocation_ttl_ms > 86'400'000)) {
    return Invalid("allocation_ttl_ms",
                   absl::StrCat("must be 0 or in [1000, 86400000], got ", allocation_ttl_ms));
  }
  if (heartbeat_interval_ms < 1 || heartbeat_interval_ms > 600'000) {
    return Invalid("heartbeat_interval_ms",
                   absl::StrCat("must be in [1, 600000], got ", heartbeat_interval_ms));
  }
  if (!metrics_address.empty() && !absl::StrContains(metrics_address, ':')) {
    return Invalid("metrics_address", "must be host:port or empty");
  }
  if (max_blocks_per_call < 1 || max_blocks_per_call > 65'536) {
    return Invalid("max_blocks_per_call",
                   absl::StrCat("must be in [1, 65536], got ", max_blocks_per_call));
  }
  if (max_message_bytes < 1024 || max_message_bytes > (1ull << 30)) {
    return Invalid("max_message_bytes",
                   absl::StrCat("must be in [1024, 1073741824], got ", max_message_bytes));
  }
  if (read_chunk_bytes < 1 || read_chunk_bytes > max_message_bytes) {
    return Invalid("read_chunk_bytes",
                   absl::StrCat("must be in [1, max_message_bytes ", max_message_bytes, "], got ",
                                read_chunk_bytes));
  }
  if (max_streams_per_principal < 1 || max_streams_per_principal > 65'536) {
    return Invalid("max_streams_per_principal",
                   absl::StrCat("must be in [1, 65536], got ", max_streams_per_principal));
  }
  if (local_socket.size() > 107) {
    return Invalid("local_socket",
                   absl::StrCat("must be at most 107 bytes, got ", local_socket.size()));
  }
  if (local_max_sessions < 1 || local_max_sessions > 4096) {
    return Invalid("local_max_sessions",
                   absl::StrCat("must be in [1, 4096], got ", local_max_sessions));
  }
  if (local_max_sessions_per_uid < 1 || local_max_sessions_per_uid > 4096) {
    return Invalid("local_max_sessions_per_uid",
                   absl::StrCat("must be in [1, 4096], got ", local_max_sessions_per_uid));
  }
  if (local_hello_timeout_ms < 1 || local_hello_timeout_ms > 600'000) {
    return Invalid("local_hello_timeout_ms",
                   absl::StrCat("must be in [1, 600000], got ", local_hello_timeout_ms));
  }
  if (local_copy_chunk_bytes < 1 || local_copy_chunk_bytes > (1ull << 40)) {
    return Invalid("local_copy_chunk_bytes",
                   absl::StrCat("must be in [1, 2^40], got ", local_copy_chunk_bytes));
  }
  if (absl::StatusOr<LocalPrincipalUids> bound = ParseLocalPrincipalUids(local_principal_uids);
      !bound.ok()) {
    return bound.status();
  }
  if (host_capacity_bytes > 0) {
    if (tier != Tier::kGpu) return Invalid("host_capacity_bytes", "is only for tier gpu");
    if (absl::StatusOr<PoolGeometry> host = HostGeometry(); !host.ok()) return host.status();
  }
  absl::StatusOr<const TransportEntry*> transport_entry = FindTransport(transport);
  if (!transport_entry.ok()) return transport_entry.status();
  if (nccl_max_links < 1 || nccl_max_links > 1024) {
    return Invalid("nccl_max_links", absl::StrCat("must be in [1, 1024], got ", nccl_max_links));
  }
  if (nccl_connect_timeout_ms < 1) return Invalid("nccl_connect_timeout_ms", "must be >= 1");
  absl::StatusOr<PoolGeometry> geometry = Geometry();
  if (!geometry.ok()) return geometry.status();
  if ((*transport_entry)->validate != nullptr) {
    if (absl::Status s = (*transport_entry)->validate(*this, *geometry); !s.ok()) return s;
  }
  return ValidateSecurity(*this);
}

}  // namespace kvcm
