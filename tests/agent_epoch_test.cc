// Agent epochs across a manager restart, in process: a ManagerServer and an Agent (host
// backend). When the manager restarts on the same address it no longer knows the agent;
// the agent must free every block of its old epoch (the old index referred to them, the new
// one never will), keep blocks other owners allocated, move to a larger epoch and register
// it with the new manager.
//
// The agent notices the restart when a Heartbeat reaches the new manager (NOT_FOUND). While
// the manager is down it keeps heartbeating the same epoch (an outage alone must not cost
// its cache), so a restart that takes several heartbeat intervals is noticed the same way.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "gpu/agent/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/agent_test_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateBlocks;
using ::kvcm::testing::StatsOf;
using ::kvcm::testing::WaitFor;

constexpr uint64_t kBlockBytes = 1152ull * 61 * 64;  // a DeepSeek-V3 bf16 page
constexpr uint64_t kBlocks = 8;
constexpr char kAgentId[] = "gpu-0";

// A manager on 127.0.0.1:`port` (0: any free port); null (with a test failure) if it never
// binds. Rebinding the port of a manager that has just shut down succeeded first time in
// every run so far (the listener is closed by then and nothing lingers in TIME_WAIT on
// it), but a listener still closing would make Start UNAVAILABLE, so that is retried for
// up to 5 s rather than failing the test.
std::unique_ptr<ManagerServer> StartManagerOn(int port) {
  ServerOptions o;
  o.listen_address = absl::StrCat("127.0.0.1:", port);
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (true) {
    absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
    if (m.ok()) return *std::move(m);
    if (m.status().code() != absl::StatusCode::kUnavailable || absl::Now() > give_up) {
      ADD_FAILURE() << m.status();
      return nullptr;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// The registry's entry for `agent_id`; agent_id empty when the manager does not know it.
AgentInfo AgentInfoOf(ManagerServer& manager, const std::string& agent_id) {
  for (const AgentInfo& a : manager.agents().Snapshot()) {
    if (a.registration.agent_id == agent_id) return a;
  }
  return AgentInfo{};
}

// ReadBlocks of `ids` as `owner_epoch`: OK only while that owner holds every block.
grpc::Status Read(v1::BlockAgent::Stub& agent, const std::vector<BlockId>& ids,
                  uint64_t owner_epoch) {
  v1::ReadBlocksRequest req;
  req.mutable_block_ids()->Add(ids.begin(), ids.end());
  req.set_owner_epoch(owner_epoch);
  grpc::ClientContext ctx;
  auto reader = agent.ReadBlocks(&ctx, req);
  v1::ReadBlocksResponse chunk;
  while (reader->Read(&chunk)) {
  }
  return reader->Finish();
}

// A manager, an agent registered with it, and blocks of two owners in the agent's pool:
// kCacheBlocks of the agent's epoch (what the manager indexes) and kPrivateBlocks of a
// worker's own epoch.
class AgentEpochTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kCacheBlocks = 3;
  static constexpr uint32_t kPrivateBlocks = 2;
  static constexpr uint64_t kWorkerEpoch = 42;

  void SetUp() override {
    manager_ = StartManagerOn(0);
    ASSERT_NE(manager_, nullptr);
    port_ = manager_->port();

    AgentOptions o;
    o.agent_id = kAgentId;
    o.manager_address = manager_->address();
    o.use_device = false;
    o.capacity_bytes = kBlocks * kBlockBytes;
    // Long enough that a manager restart fits between two heartbeats (see the file comment).
    o.heartbeat_interval_ms = 100;
    absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = *std::move(agent);
    ASSERT_TRUE(WaitFor([&] { return agent_->registered(); }));
    old_epoch_ = agent_->epoch();
    ASSERT_EQ(AgentInfoOf(*manager_, kAgentId).registration.epoch, old_epoch_);

    ba_ = v1::BlockAgent::NewStub(MakeChannel(agent_->address()));
    cache_blocks_ = AllocateBlocks(*ba_, kCacheBlocks, old_epoch_);
    private_blocks_ = AllocateBlocks(*ba_, kPrivateBlocks, kWorkerEpoch);
    ASSERT_EQ(cache_blocks_.size(), kCacheBlocks);
    ASSERT_EQ(private_blocks_.size(), kPrivateBlocks);
    ASSERT_EQ(StatsOf(*ba_).free_blocks(), kBlocks - kCacheBlocks - kPrivateBlocks);
  }

  void TearDown() override {
    if (agent_ != nullptr) agent_->Shutdown();
  }

  // The agent renewed its epoch, registered it with the (new) manager, freed exactly the
  // old epoch's blocks and kept the worker's.
  void ExpectRenewedAndRegistered() {
    EXPECT_TRUE(WaitFor([&] { return agent_->epoch() > old_epoch_; }))
        << "the agent kept epoch " << agent_->epoch() << " across the manager restart";
    const uint64_t new_epoch = agent_->epoch();
    EXPECT_TRUE(WaitFor([&] {
      const AgentInfo info = AgentInfoOf(*manager_, kAgentId);
      return info.alive && info.registration.epoch == new_epoch;
    })) << "the new manager has epoch "
        << AgentInfoOf(*manager_, kAgentId).registration.epoch << ", the agent " << new_epoch;
    EXPECT_TRUE(WaitFor([&] { return agent_->registered(); }));

    const v1::BlockAgentStatsResponse after = StatsOf(*ba_);
    EXPECT_EQ(after.free_blocks(), kBlocks - kPrivateBlocks);
    EXPECT_EQ(after.used_bytes(), kPrivateBlocks * kBlockBytes);
    EXPECT_EQ(after.epoch(), new_epoch);
    EXPECT_TRUE(after.registered());
    const grpc::Status cache_read = Read(*ba_, cache_blocks_, old_epoch_);
    EXPECT_FALSE(cache_read.ok()) << "the old epoch still owns its blocks";
    const grpc::Status worker_read = Read(*ba_, private_blocks_, kWorkerEpoch);
    EXPECT_TRUE(worker_read.ok()) << worker_read.error_message();
  }

  std::unique_ptr<ManagerServer> manager_;
  int port_ = 0;
  std::unique_ptr<Agent> agent_;
  uint64_t old_epoch_ = 0;
  std::unique_ptr<v1::BlockAgent::Stub> ba_;
  std::vector<BlockId> cache_blocks_;
  std::vector<BlockId> private_blocks_;
};

TEST_F(AgentEpochTest, ManagerRestartFreesTheOldEpochsBlocksAndRegistersANewEpoch) {
  // Restart right after a heartbeat, so that the agent's next call reaches the new manager.
  const uint64_t beats = AgentInfoOf(*manager_, kAgentId).heartbeats;
  ASSERT_TRUE(WaitFor([&] { return AgentInfoOf(*manager_, kAgentId).heartbeats > beats; }));
  manager_->Shutdown();
  manager_.reset();
  manager_ = StartManagerOn(port_);
  ASSERT_NE(manager_, nullptr);
  ASSERT_EQ(manager_->port(), port_);
  ASSERT_TRUE(manager_->agents().Snapshot().empty());

  // The agent's next Heartbeat is NOT_FOUND: it frees the old epoch's blocks and registers a
  // larger epoch.
  ExpectRenewedAndRegistered();
}

// Down for several heartbeat intervals: the agent sees UNAVAILABLE meanwhile, keeps its epoch,
// and renews it once its heartbeat reaches the new manager.
TEST_F(AgentEpochTest, ManagerDownForLongerThanAHeartbeatIntervalStillRenewsTheEpoch) {
  manager_->Shutdown();
  manager_.reset();
  ASSERT_TRUE(WaitFor([&] { return !agent_->registered(); }));  // the agent saw UNAVAILABLE
  manager_ = StartManagerOn(port_);
  ASSERT_NE(manager_, nullptr);
  ExpectRenewedAndRegistered();
}

}  // namespace
}  // namespace kvcm
