// NamespaceSpecs: the ModelSpec each namespace's pages were committed with, and the
// namespace's own max page age (CommitBlocks carries both), so that an inventory can tell a
// restarted manager how to register the namespaces of the blocks it reports. One entry per
// namespace ever committed on this agent; entries are never removed (a namespace's spec does
// not change, and there are few).
//
// Thread-safe: the command thread sets specs while the control thread reads them.
#ifndef KVCM_GPU_AGENT_POOL_NAMESPACE_SPECS_H_
#define KVCM_GPU_AGENT_POOL_NAMESPACE_SPECS_H_

#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/model_spec.h"
#include "common/types.h"

namespace kvcm {

class NamespaceSpecs {
 public:
  NamespaceSpecs() = default;
  NamespaceSpecs(const NamespaceSpecs&) = delete;
  NamespaceSpecs& operator=(const NamespaceSpecs&) = delete;

  // Records `spec` as the spec of `ns` and `max_page_age_s` as its max page age (0: none),
  // replacing earlier ones (the last commit wins; the manager only ever lowers an age),
  // except that a spec without a kv_layout, otherwise equal, keeps the recorded layout.
  void Set(const NamespaceId& ns, const ModelSpec& spec, uint32_t max_page_age_s = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The spec recorded for `ns`; nullopt when none was.
  std::optional<ModelSpec> Get(const NamespaceId& ns) const ABSL_LOCKS_EXCLUDED(mu_);
  // The max page age recorded for `ns`, seconds; 0 when none was.
  uint32_t MaxPageAgeS(const NamespaceId& ns) const ABSL_LOCKS_EXCLUDED(mu_);
  // Every recorded spec, by namespace.
  absl::flat_hash_map<NamespaceId, ModelSpec> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<NamespaceId, ModelSpec> specs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<NamespaceId, uint32_t> max_page_age_s_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_NAMESPACE_SPECS_H_
