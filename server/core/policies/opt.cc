// "opt" and "opt-whether": the simulator's clairvoyant bounds, from a next-use oracle.
#include <limits>

#include "server/core/eviction_policy.h"
#include "server/core/policies/policy_internal.h"

namespace kvcm {
namespace {

using policy_internal::kReplicatedFirst;

class OptPolicy final : public EvictionPolicy {
 public:
  explicit OptPolicy(const NextUseOracle* oracle) : oracle_(oracle) {}
  absl::string_view name() const override { return "opt"; }
  bool trims_nodes() const override { return true; }

 protected:
  // Furthest next use first: the score is minus the next use.
  double Score(const RadixNode& node) const override {
    const uint64_t next = oracle_->NextUse(node.pages.front());
    return next == std::numeric_limits<uint64_t>::max() ? -std::numeric_limits<double>::max()
                                                        : -static_cast<double>(next);
  }

 private:
  const NextUseOracle* const oracle_;
};

// "opt-whether": knows whether a node will be used again, not when; least recently used
// first within each of the two groups. What a perfect predictor of reuse could reach.
class OptWhetherPolicy final : public EvictionPolicy {
 public:
  explicit OptWhetherPolicy(const NextUseOracle* oracle) : oracle_(oracle) {}
  absl::string_view name() const override { return "opt-whether"; }
  bool trims_nodes() const override { return true; }

 protected:
  double Score(const RadixNode& node) const override {
    const bool again = oracle_->NextUse(node.pages.front()) != std::numeric_limits<uint64_t>::max();
    return node.last_access_s + (again ? kReplicatedFirst : 0);
  }

 private:
  const NextUseOracle* const oracle_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeOptPolicy(const NextUseOracle* oracle) {
  return std::make_unique<OptPolicy>(oracle);
}

std::unique_ptr<EvictionPolicy> MakeOptWhetherPolicy(const NextUseOracle* oracle) {
  return std::make_unique<OptWhetherPolicy>(oracle);
}

}  // namespace kvcm
