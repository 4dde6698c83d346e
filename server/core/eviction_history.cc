#include "server/core/eviction_history.h"

namespace kvcm {

void EvictionHistory::Record(const PageHash& first, Run run) {
  if (!enabled()) return;
  const absl::Time at = run.at;
  runs_[first] = std::move(run);
  order_.emplace_back(at, first);
}

std::optional<EvictionHistory::Run> EvictionHistory::Take(const PageHash& first) {
  auto it = runs_.find(first);
  if (it == runs_.end()) return std::nullopt;
  Run run = std::move(it->second);
  runs_.erase(it);
  return run;
}

const EvictionHistory::Run* EvictionHistory::FindRecent(const PageHash& first,
                                                        absl::Time now) const {
  auto it = runs_.find(first);
  if (it == runs_.end() || it->second.at + window_ < now) return nullptr;
  return &it->second;
}

void EvictionHistory::Forget(absl::Time now) {
  while (!order_.empty() && order_.front().first + window_ < now) {
    auto [at, page] = order_.front();
    order_.pop_front();
    auto it = runs_.find(page);
    // A run recorded again since keeps its newer entry.
    if (it != runs_.end() && it->second.at == at) runs_.erase(it);
  }
}

}  // namespace kvcm
