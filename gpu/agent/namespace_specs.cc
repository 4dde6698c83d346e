#include "gpu/agent/namespace_specs.h"

namespace kvcm {

void NamespaceSpecs::Set(const NamespaceId& ns, const ModelSpec& spec) {
  absl::MutexLock lock(&mu_);
  specs_.insert_or_assign(ns, spec);
}

std::optional<ModelSpec> NamespaceSpecs::Get(const NamespaceId& ns) const {
  absl::MutexLock lock(&mu_);
  auto it = specs_.find(ns);
  if (it == specs_.end()) return std::nullopt;
  return it->second;
}

absl::flat_hash_map<NamespaceId, ModelSpec> NamespaceSpecs::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return specs_;
}

}  // namespace kvcm
