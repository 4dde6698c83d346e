#include "server/core/policies/registry.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/core/policies/select.h"

namespace kvcm {
namespace {

using Made = absl::StatusOr<std::unique_ptr<EvictionPolicy>>;

Made Lru(const PolicyContext&) { return MakeLruPolicy(); }

Made LruMha(const PolicyContext&) { return MakeLruMhaPolicy(); }

Made Cost(const PolicyContext& context) { return MakeCostAwarePolicy(context.reuse_credit); }

Made Adaptive(const PolicyContext& context) {
  const AdaptiveParams& p = context.adaptive;
  if (!(p.min_credit >= 0 && p.min_credit <= p.max_credit && p.step > 0 &&
        std::isfinite(p.max_credit) && std::isfinite(p.step) && std::isfinite(p.initial_credit))) {
    return absl::InvalidArgumentError(
        "policy \"adaptive\": needs 0 <= min_credit <= max_credit and step > 0, all finite");
  }
  return MakeAdaptivePolicy(p);
}

Made Density(const PolicyContext& context) {
  const uint32_t classes = context.density.reuse_classes;
  if (classes != 1 && classes != 2 && classes != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy \"density\": reuse_classes must be 1, 2 or 4, not ", classes));
  }
  return MakeHitDensityPolicy(context.density);
}

Made Conversation(const PolicyContext& context) {
  const double shift = context.conversation.shift;
  if (!(std::isfinite(shift) && shift >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy \"conversation\": shift must be finite and >= 0, not ", shift));
  }
  return MakeConversationPolicy(context.conversation);
}

Made Select(const PolicyContext& context) {
  absl::StatusOr<std::unique_ptr<SelectingPolicy>> p = SelectingPolicy::Create(context);
  if (!p.ok()) return p.status();
  return std::unique_ptr<EvictionPolicy>(*std::move(p));
}

absl::Status NeedsOracle(const PolicyContext& context, absl::string_view name) {
  if (context.next_use != nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "policy \"", name, "\" is clairvoyant and needs a next-use oracle (simulator only)"));
}

Made Opt(const PolicyContext& context) {
  if (absl::Status s = NeedsOracle(context, "opt"); !s.ok()) return s;
  return MakeOptPolicy(context.next_use);
}

Made OptWhether(const PolicyContext& context) {
  if (absl::Status s = NeedsOracle(context, "opt-whether"); !s.ok()) return s;
  return MakeOptWhetherPolicy(context.next_use);
}

// "select" simulates the candidates in this order; lru, first, is its choice until it
// knows better.
constexpr PolicyEntry kPolicies[] = {
    {"select",
     "evicts in the order of the candidate whose miniature simulations hit most lately; the "
     "default",
     false, &Select},
    {"lru", "SGLang RadixCache order", false, &Lru, true},
    {"lru-mha", "byte-blind baseline: MHA-shaped bytes", false, &LruMha},
    {"cost", "reuse x recompute cost per byte, replica-aware", false, &Cost, true},
    {"adaptive", "cost with a reuse credit learnt online", false, &Adaptive, true},
    {"density", "hit density learnt online per tenant and age, with an LRU guard", false, &Density,
     true},
    {"conversation", "recency shifted by the learnt odds that a context's conversation continues",
     false, &Conversation, true},
    {"opt", "Belady's clairvoyant order: the simulator's bound", true, &Opt},
    {"opt-whether", "knows whether a node is used again, not when (simulator only)", true,
     &OptWhether},
};

}  // namespace

std::span<const PolicyEntry> PolicyTable() { return kPolicies; }

const PolicyEntry* FindPolicy(absl::string_view name) {
  for (const PolicyEntry& p : kPolicies) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string PolicyNames(bool with_clairvoyant) {
  std::vector<absl::string_view> names;
  for (const PolicyEntry& p : kPolicies) {
    if (with_clairvoyant || !p.clairvoyant) names.push_back(p.name);
  }
  return absl::StrJoin(names, ", ");
}

std::string PolicyHelp() {
  std::vector<std::string> rows;
  for (const PolicyEntry& p : kPolicies) {
    if (!p.clairvoyant) rows.push_back(absl::StrCat(p.name, " (", p.help, ")"));
  }
  return absl::StrJoin(rows, ", ");
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(absl::string_view name,
                                                                   const PolicyContext& context) {
  const PolicyEntry* p = FindPolicy(name);
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy \"", name,
                     "\" is unknown; known policies: ", PolicyNames(/*with_clairvoyant=*/true)));
  }
  return p->make(context);
}

}  // namespace kvcm
