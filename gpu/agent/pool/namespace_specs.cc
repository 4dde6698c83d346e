#include "gpu/agent/pool/namespace_specs.h"

namespace kvcm {

void NamespaceSpecs::Set(const NamespaceId& ns, const ModelSpec& spec, uint32_t max_page_age_s) {
  absl::MutexLock lock(&mu_);
  specs_.insert_or_assign(ns, spec);
  max_page_age_s_.insert_or_assign(ns, max_page_age_s);
}

uint32_t NamespaceSpecs::MaxPageAgeS(const NamespaceId& ns) const {
  absl::MutexLock lock(&mu_);
  auto it = max_page_age_s_.find(ns);
  return it == max_page_age_s_.end() ? 0 : it->second;
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
