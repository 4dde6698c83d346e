#include "server/core/recency_buffer.h"

namespace kvcm {

size_t RecencyBuffer::Record(RadixNode* node, uint32_t end_page, absl::Time at) {
  absl::MutexLock lock(&mu_);
  pending_.push_back(Entry{.node = node, .end_page = end_page, .stamp = NextStamp(), .at = at});
  return pending_.size();
}

void RecencyBuffer::Take(std::vector<Entry>& out) {
  out.clear();
  absl::MutexLock lock(&mu_);
  pending_.swap(out);
}

}  // namespace kvcm
