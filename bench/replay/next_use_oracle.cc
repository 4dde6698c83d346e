#include "bench/replay/next_use_oracle.h"

#include <algorithm>
#include <limits>

namespace kvcm::bench {

TraceNextUseOracle::TraceNextUseOracle(const Trace& trace, std::span<const uint32_t> routes,
                                       uint32_t gpu) {
  const auto wanted = [&](uint32_t i) { return routes.empty() || routes[i] == gpu; };
  // Pass 1: number the pages and count each one's requests. A chained page occurs at most
  // once per prompt (its hash fixes its position), but a malformed trace could repeat one;
  // `last` drops such repeats so every slice stays strictly ascending.
  std::vector<uint32_t> counts;
  std::vector<uint32_t> last;
  for (uint32_t i = 0; i < trace.requests.size(); ++i) {
    if (!wanted(i)) continue;
    for (const PageHash& page : trace.requests[i].pages) {
      auto [it, inserted] = slot_.try_emplace(page, static_cast<uint32_t>(counts.size()));
      if (inserted) {
        counts.push_back(0);
        last.push_back(std::numeric_limits<uint32_t>::max());
      }
      if (last[it->second] == i) continue;
      last[it->second] = i;
      ++counts[it->second];
    }
  }
  offsets_.resize(counts.size() + 1, 0);
  for (size_t s = 0; s < counts.size(); ++s) offsets_[s + 1] = offsets_[s] + counts[s];
  // Pass 2: fill the slices in request order, so each comes out sorted.
  uses_.resize(offsets_.back());
  std::vector<uint32_t> fill(offsets_.begin(), offsets_.end() - 1);
  std::fill(last.begin(), last.end(), std::numeric_limits<uint32_t>::max());
  for (uint32_t i = 0; i < trace.requests.size(); ++i) {
    if (!wanted(i)) continue;
    for (const PageHash& page : trace.requests[i].pages) {
      const uint32_t s = slot_.at(page);
      if (last[s] == i) continue;
      last[s] = i;
      uses_[fill[s]++] = i;
    }
  }
}

uint64_t TraceNextUseOracle::NextUse(const PageHash& page) const {
  auto it = slot_.find(page);
  if (it == slot_.end()) return std::numeric_limits<uint64_t>::max();
  const auto begin = uses_.begin() + offsets_[it->second];
  const auto end = uses_.begin() + offsets_[it->second + 1];
  const auto next = std::upper_bound(begin, end, cursor_);
  return next == end ? std::numeric_limits<uint64_t>::max() : *next;
}

}  // namespace kvcm::bench
