// Which pages a worker pulls from which agents before serving a prompt on a destination agent
// (BlockAgent.Fetch): from a Match or Route answer, the destination's blocks of the leading
// pages it holds, then runs of consecutive pages, each from one source pool. Pure logic, no
// RPC; kvcmctl fetch and the tests' worker simulator both plan with it.
#ifndef KVCM_CLIENT_FETCH_PLAN_H_
#define KVCM_CLIENT_FETCH_PLAN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/types.h"

namespace kvcm {

// Pages [first_page, first_page + source_blocks.size()) of the prompt, in `source`.
struct FetchRun {
  PoolRef source;
  uint32_t first_page = 0;
  std::vector<BlockId> source_blocks;
};

struct FetchPlan {
  // The destination pool's block of each of the prompt's leading pages [0, size) it holds.
  std::vector<BlockId> local_blocks;
  // In page order, the first starting at page local_blocks.size(), each right after the last.
  std::vector<FetchRun> runs;

  uint32_t fetch_pages() const;
  // local_blocks.size() + fetch_pages(): pages the destination holds once the plan ran.
  uint32_t end_page() const;
};

// The blocks of the leading pages of `match` that pool `dest` holds (a pending block ends
// them).
std::vector<BlockId> LeadingBlocksIn(const MatchReply& match, const PoolRef& dest);

// Plans pages [local, min(match.matched_pages, local + max_pages)) for pool `dest`, where
// `local` counts the leading pages `dest` itself holds. Each page comes from `from` when it
// is given (the plan stops where `from` stops holding the pages), else from the first replica
// of its segment on another agent; a replica whose block is still pending (kPendingBlock)
// is never a source. Errors: NOT_FOUND when nothing matched; ALREADY_EXISTS when `dest`
// holds every matched page (or max_pages is 0); FAILED_PRECONDITION when no other agent (or
// not `from`) holds page `local`.
absl::StatusOr<FetchPlan> PlanFetch(const MatchReply& match, const PoolRef& dest,
                                    const std::optional<std::string>& from = std::nullopt,
                                    uint32_t max_pages = UINT32_MAX);

}  // namespace kvcm

#endif  // KVCM_CLIENT_FETCH_PLAN_H_
