// Small value types shared by every part of the core.
#ifndef KVCM_COMMON_TYPES_H_
#define KVCM_COMMON_TYPES_H_

#include <cstdint>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcm {

// (tenant, model): the unit of isolation. Pages never match across namespaces.
struct NamespaceId {
  std::string tenant;
  std::string model;

  friend bool operator==(const NamespaceId&, const NamespaceId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const NamespaceId& ns) {
    return H::combine(std::move(h), ns.tenant, ns.model);
  }
  std::string ToString() const { return absl::StrCat(tenant, "/", model); }
};

// Memory tier of a pool. Values match kvcm.v1.Tier.
enum class Tier : uint8_t { kGpu = 1, kHost = 2, kDisk = 3 };

// One byte-budgeted pool: the blocks of one agent in one tier.
struct PoolKey {
  std::string agent_id;
  Tier tier = Tier::kGpu;

  friend bool operator==(const PoolKey&, const PoolKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const PoolKey& p) {
    return H::combine(std::move(h), p.agent_id, p.tier);
  }
  std::string ToString() const;  // "agent:tier"
};

// Dense id of a pool inside one CacheIndex; stable for the index's lifetime.
using PoolId = uint32_t;

// Block id of a page inside its pool (an index into the agent's block array).
using BlockId = uint32_t;

// Block id of a page the manager has moved to a tier (a demotion) whose agent has not yet
// reported where it put it.
inline constexpr BlockId kPendingBlock = 0xFFFFFFFF;
// The block id of every page in an engine's pool (PoolStats::engine): the engine keeps its
// own blocks, which the manager never names.
inline constexpr BlockId kNoBlock = 0xFFFFFFFE;

}  // namespace kvcm

#endif  // KVCM_COMMON_TYPES_H_
