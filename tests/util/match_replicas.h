// Test helpers: a MatchResult's replicas as plain values, for comparing with gmock.
#ifndef KVCM_TESTS_UTIL_MATCH_REPLICAS_H_
#define KVCM_TESTS_UTIL_MATCH_REPLICAS_H_

#include <span>
#include <vector>

#include "common/types.h"
#include "server/core/cache_index.h"

namespace kvcm {

struct TestReplica {
  const PoolKey* pool = nullptr;
  std::vector<BlockId> block_ids;
};

// The replicas of `seg` (a segment of `m`) in the result's order, with copies of their
// block ids.
inline std::vector<TestReplica> ReplicasOf(const MatchResult& m, const MatchedSegment& seg) {
  std::vector<TestReplica> out;
  for (const MatchedReplica& r : m.Replicas(seg)) {
    const std::span<const BlockId> ids = m.BlockIds(seg, r);
    out.push_back(TestReplica{r.pool, std::vector<BlockId>(ids.begin(), ids.end())});
  }
  return out;
}

}  // namespace kvcm

#endif  // KVCM_TESTS_UTIL_MATCH_REPLICAS_H_
