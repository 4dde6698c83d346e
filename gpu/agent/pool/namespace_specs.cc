#include "gpu/agent/pool/namespace_specs.h"

#include <string>
#include <utility>

namespace kvcm {

void NamespaceSpecs::Set(const NamespaceId& ns, const ModelSpec& spec, uint32_t max_page_age_s) {
  absl::MutexLock lock(&mu_);
  auto [it, added] = specs_.try_emplace(ns, spec);
  if (!added) {
    // Pages committed with a layout keep it: a later commit that states none (a manager
    // that restarted and has not heard it again yet) does not make the inventory forget it.
    const bool keep_layout = spec.kv_layout.empty() && it->second.CompatibleWith(spec);
    std::string layout = keep_layout ? it->second.kv_layout : spec.kv_layout;
    it->second = spec;
    it->second.kv_layout = std::move(layout);
  }
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
