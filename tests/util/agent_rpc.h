// In-process agent tests (an Agent and a ManagerServer in the test binary): polling for a
// condition and BlockAgent calls through a stub. Header-only, test code. Child processes are
// child_process.h.
#ifndef KVCM_TESTS_UTIL_AGENT_RPC_H_
#define KVCM_TESTS_UTIL_AGENT_RPC_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/types.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"

namespace kvcm::testing {

// Polls `pred` every 10 ms until it holds or 5 s pass; returns its last value.
template <typename Pred>
bool WaitFor(Pred pred) {
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (!pred()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// BlockAgent.Stats; a failed call is a test failure (EXPECT) and returns an empty response.
inline v1::BlockAgentStatsResponse StatsOf(v1::BlockAgent::Stub& agent) {
  grpc::ClientContext ctx;
  v1::BlockAgentStatsResponse s;
  const grpc::Status status = agent.Stats(&ctx, v1::BlockAgentStatsRequest(), &s);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return s;
}

// BlockAgent.Allocate of `count` blocks for `owner_epoch`; a failed call is a test failure
// (EXPECT) and returns no blocks.
inline std::vector<BlockId> AllocateBlocks(v1::BlockAgent::Stub& agent, uint32_t count,
                                           uint64_t owner_epoch) {
  v1::AllocateBlocksRequest req;
  req.set_count(count);
  req.set_owner_epoch(owner_epoch);
  v1::AllocateBlocksResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status status = agent.Allocate(&ctx, req, &resp);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return {resp.block_ids().begin(), resp.block_ids().end()};
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_AGENT_RPC_H_
