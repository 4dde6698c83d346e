// The eviction policies, in one table (as gpu/agent/transport/registry.cc is for transports):
// each row's name, a one-line help, whether it is clairvoyant (the simulator's bounds, which
// need a next-use oracle), and its factory, which validates the row's parameters in
// PolicyContext. The manager's --policy help and validation, MakeEvictionPolicy and
// kvcm-bench's lists take their names from here: a new policy adds a row (registry.cc) and
// its own file. "select" (select.h) takes its candidates from the rows marked so.
#ifndef KVCM_SERVER_CORE_POLICIES_REGISTRY_H_
#define KVCM_SERVER_CORE_POLICIES_REGISTRY_H_

#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/core/eviction_policy.h"

namespace kvcm {

struct PolicyEntry {
  absl::string_view name;
  absl::string_view help;  // one line, for --policy's help
  bool clairvoyant = false;
  // INVALID_ARGUMENT naming the policy and the parameter for a bad PolicyContext.
  absl::StatusOr<std::unique_ptr<EvictionPolicy>> (*make)(const PolicyContext& context) = nullptr;
  // One of the policies "select" chooses between.
  bool candidate = false;
};

// Every policy, in the order help and errors list them.
std::span<const PolicyEntry> PolicyTable();

// The row named `name`; null when there is none.
const PolicyEntry* FindPolicy(absl::string_view name);

// "lru, lru-mha, ...": every policy's name (the clairvoyant ones with `with_clairvoyant`).
std::string PolicyNames(bool with_clairvoyant);

// "lru (help), cost (help), ...": the servable (not clairvoyant) policies, for a flag's help.
std::string PolicyHelp();

// The policy `name` over `context` (its row's factory). INVALID_ARGUMENT naming the known
// policies for an unknown name, or the row's own error.
absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(
    absl::string_view name, const PolicyContext& context = {});

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_POLICIES_REGISTRY_H_
