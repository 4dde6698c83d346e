#include "client/fetch_plan.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const PoolRef kA{"gpu-a", Tier::kGpu};
const PoolRef kB{"gpu-b", Tier::kGpu};
const PoolRef kC{"gpu-c", Tier::kGpu};

MatchReply::Segment Seg(uint32_t first, uint32_t n, std::vector<MatchReply::Replica> replicas) {
  return MatchReply::Segment{.first_page = first, .num_pages = n, .replicas = std::move(replicas)};
}

MatchReply Match(std::vector<MatchReply::Segment> segments) {
  MatchReply m;
  for (const MatchReply::Segment& s : segments) m.matched_pages += s.num_pages;
  m.segments = std::move(segments);
  return m;
}

TEST(PlanFetchTest, PullsThePagesTheDestinationLacksFromTheFirstOtherReplica) {
  // Pages 0-1 on B and A, 2-3 on A and C, 4 on C only.
  const MatchReply m = Match({Seg(0, 2, {{kB, {10, 11}}, {kA, {0, 1}}}),
                              Seg(2, 2, {{kA, {2, 3}}, {kC, {7, 8}}}), Seg(4, 1, {{kC, {9}}})});
  absl::StatusOr<FetchPlan> plan = PlanFetch(m, kB);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->local_blocks, ElementsAre(10, 11));
  ASSERT_EQ(plan->runs.size(), 2u);
  EXPECT_EQ(plan->runs[0].source, kA);
  EXPECT_EQ(plan->runs[0].first_page, 2u);
  EXPECT_THAT(plan->runs[0].source_blocks, ElementsAre(2, 3));
  EXPECT_EQ(plan->runs[1].source, kC);
  EXPECT_EQ(plan->runs[1].first_page, 4u);
  EXPECT_THAT(plan->runs[1].source_blocks, ElementsAre(9));
  EXPECT_EQ(plan->fetch_pages(), 3u);
  EXPECT_EQ(plan->end_page(), 5u);
}

TEST(PlanFetchTest, FromStopsWhereTheNamedAgentStops) {
  const MatchReply m = Match({Seg(0, 2, {{kA, {0, 1}}, {kC, {5, 6}}}), Seg(2, 1, {{kA, {2}}})});
  absl::StatusOr<FetchPlan> plan = PlanFetch(m, kB, "gpu-c");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->local_blocks.empty());
  ASSERT_EQ(plan->runs.size(), 1u);
  EXPECT_EQ(plan->runs[0].source, kC);
  EXPECT_THAT(plan->runs[0].source_blocks, ElementsAre(5, 6));
}

TEST(PlanFetchTest, MaxPagesBoundsThePlan) {
  const MatchReply m = Match({Seg(0, 4, {{kA, {0, 1, 2, 3}}})});
  absl::StatusOr<FetchPlan> plan = PlanFetch(m, kB, std::nullopt, 3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->runs.at(0).source_blocks, ElementsAre(0, 1, 2));
}

TEST(PlanFetchTest, PendingBlocksAndTheDestinationsOtherTiersAreNoSource) {
  const PoolRef b_host{"gpu-b", Tier::kHost};
  const PoolRef a_host{"gpu-a", Tier::kHost};
  const MatchReply m = Match({Seg(0, 1, {{b_host, {4}}, {a_host, {kPendingBlock}}, {kA, {0}}})});
  absl::StatusOr<FetchPlan> plan = PlanFetch(m, kB);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->runs.size(), 1u);
  EXPECT_EQ(plan->runs[0].source, kA);
}

TEST(PlanFetchTest, RefusalsSayWhy) {
  EXPECT_EQ(PlanFetch(MatchReply{}, kB).status().code(), absl::StatusCode::kNotFound);

  const MatchReply on_b = Match({Seg(0, 2, {{kB, {0, 1}}, {kA, {3, 4}}})});
  absl::Status held = PlanFetch(on_b, kB).status();
  EXPECT_EQ(held.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(held.message(), HasSubstr("gpu-b:gpu already holds 2 matched pages"));

  const MatchReply on_a = Match({Seg(0, 2, {{kA, {0, 1}}})});
  absl::Status not_on_c = PlanFetch(on_a, kB, "gpu-c").status();
  EXPECT_EQ(not_on_c.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(not_on_c.message(), HasSubstr("agent gpu-c holds page 0"));
  EXPECT_EQ(PlanFetch(on_a, kB, std::nullopt, 0).status().code(), absl::StatusCode::kAlreadyExists);

  const MatchReply pending = Match({Seg(0, 1, {{kA, {kPendingBlock}}})});
  EXPECT_EQ(PlanFetch(pending, kB).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvcm
