#include "server/core/retention_queue.h"

namespace kvcm {

bool RetentionQueue::SetMaxAge(absl::Duration limit) {
  const bool had_limit = limited();
  max_age_ = limit;
  return !had_limit && limited();
}

int64_t RetentionQueue::CutoffMs(absl::Time now) const {
  if (!limited()) return INT64_MIN;
  return absl::ToUnixMillis(now - max_age_);
}

void RetentionQueue::Add(const Entry& entry) {
  if (limited()) entries_.insert(entry);
}

void RetentionQueue::Remove(const Entry& entry) {
  if (limited()) entries_.erase(entry);
}

std::optional<RetentionQueue::Entry> RetentionQueue::First(int64_t cutoff_ms) const {
  return PastCutoff(resume_.has_value() ? entries_.lower_bound(*resume_) : entries_.begin(),
                    cutoff_ms);
}

std::optional<RetentionQueue::Entry> RetentionQueue::Next(const Entry& entry,
                                                          int64_t cutoff_ms) const {
  return PastCutoff(entries_.upper_bound(entry), cutoff_ms);
}

std::optional<RetentionQueue::Entry> RetentionQueue::PastCutoff(
    absl::btree_set<Entry>::const_iterator it, int64_t cutoff_ms) const {
  if (it == entries_.end() || it->committed_ms > cutoff_ms) return std::nullopt;
  return *it;
}

}  // namespace kvcm
