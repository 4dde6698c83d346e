#include "client/fetch_plan.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// The replica of `seg` in `pool`, or null.
const MatchReply::Replica* ReplicaIn(const MatchReply::Segment& seg, const PoolRef& pool) {
  for (const MatchReply::Replica& r : seg.replicas) {
    if (r.pool == pool) return &r;
  }
  return nullptr;
}

// The replica of `seg` that page `page` (inside it) is pulled from: in `from` when given,
// else the first one on an agent other than `dest`'s; null when there is none.
const MatchReply::Replica* SourceOf(const MatchReply::Segment& seg, uint32_t page,
                                    const PoolRef& dest, const std::optional<std::string>& from) {
  for (const MatchReply::Replica& r : seg.replicas) {
    const bool eligible =
        from.has_value() ? r.pool.agent_id == *from : r.pool.agent_id != dest.agent_id;
    if (eligible && r.block_ids[page - seg.first_page] != kPendingBlock) return &r;
  }
  return nullptr;
}

}  // namespace

uint32_t FetchPlan::fetch_pages() const {
  uint32_t pages = 0;
  for (const FetchRun& run : runs) pages += static_cast<uint32_t>(run.source_blocks.size());
  return pages;
}

uint32_t FetchPlan::end_page() const {
  return static_cast<uint32_t>(local_blocks.size()) + fetch_pages();
}

std::vector<BlockId> LeadingBlocksIn(const MatchReply& match, const PoolRef& dest) {
  std::vector<BlockId> blocks;
  for (const MatchReply::Segment& seg : match.segments) {
    const MatchReply::Replica* mine =
        seg.first_page == blocks.size() ? ReplicaIn(seg, dest) : nullptr;
    if (mine == nullptr) break;
    for (BlockId b : mine->block_ids) {
      if (b == kPendingBlock) return blocks;
      blocks.push_back(b);
    }
  }
  return blocks;
}

absl::StatusOr<FetchPlan> PlanFetch(const MatchReply& match, const PoolRef& dest,
                                    const std::optional<std::string>& from, uint32_t max_pages) {
  if (match.matched_pages == 0) {
    return absl::NotFoundError("nothing of the prompt is cached");
  }
  // One entry per matched page: its segment.
  std::vector<const MatchReply::Segment*> segment_of(match.matched_pages, nullptr);
  for (const MatchReply::Segment& seg : match.segments) {
    for (uint32_t p = seg.first_page; p < seg.first_page + seg.num_pages; ++p) {
      if (p < segment_of.size()) segment_of[p] = &seg;
    }
  }
  FetchPlan plan{.local_blocks = LeadingBlocksIn(match, dest)};
  const uint32_t local = static_cast<uint32_t>(plan.local_blocks.size());
  const uint32_t end = local + std::min(match.matched_pages - local, max_pages);
  if (local == end) {
    return absl::AlreadyExistsError(absl::StrCat(dest.ToString(), " already holds ", local,
                                                 " matched pages: nothing to fetch"));
  }
  for (uint32_t p = local; p < end && segment_of[p] != nullptr; ++p) {
    const MatchReply::Replica* src = SourceOf(*segment_of[p], p, dest, from);
    if (src == nullptr) break;
    if (plan.runs.empty() || !(plan.runs.back().source == src->pool)) {
      plan.runs.push_back(FetchRun{.source = src->pool, .first_page = p});
    }
    plan.runs.back().source_blocks.push_back(src->block_ids[p - segment_of[p]->first_page]);
  }
  if (plan.runs.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(from.has_value() ? absl::StrCat("agent ", *from) : "no other agent",
                     " holds page ", local, " of the prompt (", dest.ToString(),
                     " holds pages [0, ", local, ") of ", match.matched_pages, " matched)"));
  }
  return plan;
}

}  // namespace kvcm
