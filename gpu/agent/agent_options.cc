#include "gpu/agent/agent_options.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/core/model_catalog.h"

namespace kvcm {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

bool IsAgentIdChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

}  // namespace

absl::StatusOr<PoolGeometry> AgentOptions::Geometry() const {
  ModelSpec resolved = spec;
  if (!model.empty()) {
    absl::StatusOr<ModelSpec> preset = FindModel(model, dtype);
    if (!preset.ok()) return Invalid("model", preset.status().message());
    resolved = *preset;
    resolved.page_size_tokens = page_size_tokens;
  }
  return PoolGeometry::ForCapacity(resolved, capacity_bytes);
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
  if (device_index < 0) return Invalid("device_index", "must be >= 0");
  if (tier != Tier::kGpu && tier != Tier::kHost && tier != Tier::kDisk) {
    return Invalid("tier", "must be gpu, host or disk");
  }
  if (heartbeat_interval_ms < 1 || heartbeat_interval_ms > 600'000) {
    return Invalid("heartbeat_interval_ms",
                   absl::StrCat("must be in [1, 600000], got ", heartbeat_interval_ms));
  }
  if (!metrics_address.empty() && !absl::StrContains(metrics_address, ':')) {
    return Invalid("metrics_address", "must be host:port or empty");
  }
  return Geometry().status();
}

}  // namespace kvcm
