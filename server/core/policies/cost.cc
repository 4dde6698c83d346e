// "cost": recency credited with the reuses a node had, weighted by its recompute cost per
// byte; replicated nodes first.
#include "server/core/eviction_policy.h"
#include "server/core/policies/policy_internal.h"

namespace kvcm {
namespace {

using policy_internal::CreditedScore;

class CostAwarePolicy final : public EvictionPolicy {
 public:
  explicit CostAwarePolicy(absl::Duration reuse_credit)
      : reuse_credit_s_(absl::ToDoubleSeconds(reuse_credit)) {}
  absl::string_view name() const override { return "cost"; }
  bool trims_nodes() const override { return true; }
  bool demotes_to_host() const override { return true; }

 protected:
  double Score(const RadixNode& node) const override {
    return CreditedScore(node, reuse_credit_s_);
  }

 private:
  const double reuse_credit_s_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> MakeCostAwarePolicy(absl::Duration reuse_credit) {
  return std::make_unique<CostAwarePolicy>(reuse_credit);
}

}  // namespace kvcm
