// A manager restart, in process: a ManagerServer and an Agent (host backend). The agent is
// the source of truth (ARCHITECTURE §2): when the manager restarts on the same address and no
// longer knows it, the agent keeps its epoch and every block, registers the same epoch again
// and reports its inventory, and the new manager rebuilds the index from it, so the pages
// cached before the restart match again with the same blocks.
//
// The agent notices the restart when a Heartbeat reaches the new manager (NOT_FOUND). While
// the manager is down it keeps heartbeating the same epoch, so a restart that takes several
// heartbeat intervals is noticed the same way.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateBlocks;
using ::kvcm::testing::StatsOf;
using ::kvcm::testing::WaitFor;

constexpr uint64_t kBlockBytes = 1152ull * 61 * 64;  // a DeepSeek-V3 bf16 page
constexpr uint64_t kBlocks = 8;
constexpr char kAgentId[] = "gpu-0";
// The same secret across the restart, so namespaces keep their hash keys.
constexpr char kSecret[] = "00112233445566778899aabbccddeeff";

// A manager on 127.0.0.1:`port` (0: any free port); null (with a test failure) if it never
// binds. A listener still closing would make Start UNAVAILABLE, so that is retried for up
// to 5 s rather than failing the test.
std::unique_ptr<ManagerServer> StartManagerOn(int port) {
  ServerOptions o;
  o.tls.insecure = true;
  o.listen_address = absl::StrCat("127.0.0.1:", port);
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  o.hash_secret_hex = kSecret;
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

// `count` blocks of the agent's epoch for namespace `ns`, written (ready to insert).
std::vector<BlockId> AllocateFor(v1::BlockAgent::Stub& agent, uint32_t count, uint64_t epoch,
                                 const NamespaceId& ns) {
  return ::kvcm::testing::AllocateIn(agent, count, epoch, ns);
}

// A manager, an agent registered with it, a prompt of kCacheBlocks pages cached in the
// agent's blocks (committed), one block allocated for the namespace and not yet inserted (a
// request in flight), and kPrivateBlocks of a worker's own epoch.
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
    o.tls.insecure = true;
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
    epoch_ = agent_->epoch();
    ASSERT_EQ(AgentInfoOf(*manager_, kAgentId).registration.epoch, epoch_);

    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.address = manager_->address(), .insecure = true});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    spec_ = agent_->pool().geometry().spec;
    ASSERT_TRUE(client_->RegisterModel(ns_, spec_).ok());
    tokens_.resize(kCacheBlocks * spec_.page_size_tokens);
    for (size_t i = 0; i < tokens_.size(); ++i) tokens_[i] = static_cast<int32_t>(i * 7 + 1);

    ba_ = v1::BlockAgent::NewStub(MakeInsecureChannel(agent_->address()));
    cache_blocks_ = AllocateFor(*ba_, kCacheBlocks, epoch_, ns_);
    in_flight_ = AllocateFor(*ba_, 1, epoch_, ns_);
    private_blocks_ = AllocateBlocks(*ba_, kPrivateBlocks, kWorkerEpoch);
    ASSERT_EQ(cache_blocks_.size(), kCacheBlocks);
    ASSERT_EQ(private_blocks_.size(), kPrivateBlocks);
    absl::StatusOr<InsertReply> ins =
        client_->Insert(ns_, tokens_, PoolRef{kAgentId, Tier::kGpu}, cache_blocks_);
    ASSERT_TRUE(ins.ok()) << ins.status();
    ASSERT_EQ(ins->new_pages, kCacheBlocks);
    ASSERT_EQ(MatchedBlocks(), cache_blocks_);
    free_before_ = StatsOf(*ba_).free_blocks();
    ASSERT_EQ(free_before_, kBlocks - kCacheBlocks - 1 - kPrivateBlocks);
  }

  void TearDown() override {
    if (agent_ != nullptr) agent_->Shutdown();
  }

  // Block ids of the agent's replica of the prompt's leading pages, as the manager matches
  // them (a fresh client: the old one's channel may still be reconnecting).
  std::vector<BlockId> MatchedBlocks() {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.address = manager_->address(), .insecure = true});
    if (!client.ok()) return {};
    absl::StatusOr<MatchReply> m = (*client)->Match(ns_, tokens_, {.probe = true});
    std::vector<BlockId> out;
    if (!m.ok()) return out;
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        if (r.pool.agent_id == kAgentId)
          out.insert(out.end(), r.block_ids.begin(), r.block_ids.end());
      }
    }
    return out;
  }

  // The new manager rebuilt the index from the agent: same epoch, same blocks, same usage,
  // and the namespace back with its spec; nothing freed, nothing leaked.
  void ExpectRebuiltFromTheAgent() {
    EXPECT_TRUE(WaitFor([&] { return MatchedBlocks() == cache_blocks_; }))
        << "the restarted manager did not match the prompt in its blocks";
    EXPECT_EQ(agent_->epoch(), epoch_) << "the agent changed epoch across a manager restart";
    const AgentInfo info = AgentInfoOf(*manager_, kAgentId);
    EXPECT_TRUE(info.alive);
    EXPECT_EQ(info.registration.epoch, epoch_);
    bool found = false;
    for (const NamespaceStats& n : manager_->index().Stats().namespaces) {
      if (n.ns != ns_) continue;
      found = true;
      EXPECT_EQ(n.spec, spec_);
      EXPECT_EQ(n.page_locations, kCacheBlocks);
    }
    EXPECT_TRUE(found) << "the namespace did not come back";

    const v1::BlockAgentStatsResponse after = StatsOf(*ba_);
    EXPECT_EQ(after.free_blocks(), free_before_);
    EXPECT_EQ(after.epoch(), epoch_);
    EXPECT_TRUE(WaitFor([&] { return agent_->registered(); }));
    EXPECT_TRUE(Read(*ba_, cache_blocks_, epoch_).ok());
    EXPECT_TRUE(Read(*ba_, in_flight_, epoch_).ok()) << "a request's allocated block was freed";
    const grpc::Status worker_read = Read(*ba_, private_blocks_, kWorkerEpoch);
    EXPECT_TRUE(worker_read.ok()) << worker_read.error_message();

    // The new manager takes inserts again, through the agent's ledger.
    std::vector<int32_t> longer = tokens_;
    longer.resize(longer.size() + spec_.page_size_tokens, 5);
    std::vector<BlockId> blocks = cache_blocks_;
    blocks.push_back(in_flight_[0]);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.address = manager_->address(), .insecure = true});
    ASSERT_TRUE(client.ok());
    absl::StatusOr<InsertReply> ins =
        (*client)->Insert(ns_, longer, PoolRef{kAgentId, Tier::kGpu}, blocks);
    ASSERT_TRUE(ins.ok()) << ins.status();
    EXPECT_EQ(ins->already_present_pages, kCacheBlocks);
    EXPECT_EQ(ins->new_pages, 1u);
  }

  std::unique_ptr<ManagerServer> manager_;
  int port_ = 0;
  std::unique_ptr<Agent> agent_;
  uint64_t epoch_ = 0;
  std::unique_ptr<Client> client_;
  const NamespaceId ns_{"acme", "dsv3"};
  ModelSpec spec_;
  std::vector<int32_t> tokens_;
  std::unique_ptr<v1::BlockAgent::Stub> ba_;
  std::vector<BlockId> cache_blocks_;
  std::vector<BlockId> in_flight_;
  std::vector<BlockId> private_blocks_;
  uint64_t free_before_ = 0;
};

TEST_F(AgentEpochTest, ARestartedManagerRebuildsItsIndexFromTheAgent) {
  // Restart right after a heartbeat, so that the agent's next call reaches the new manager.
  const uint64_t beats = AgentInfoOf(*manager_, kAgentId).heartbeats;
  ASSERT_TRUE(WaitFor([&] { return AgentInfoOf(*manager_, kAgentId).heartbeats > beats; }));
  manager_->Shutdown();
  manager_.reset();
  manager_ = StartManagerOn(port_);
  ASSERT_NE(manager_, nullptr);
  ASSERT_EQ(manager_->port(), port_);
  ASSERT_TRUE(manager_->agents().Snapshot().empty());
  ASSERT_TRUE(manager_->index().Stats().namespaces.empty());

  // The agent's next Heartbeat is NOT_FOUND: it registers the same epoch and reports its
  // inventory.
  ExpectRebuiltFromTheAgent();
}

// Down for several heartbeat intervals: the agent sees UNAVAILABLE meanwhile, keeps its epoch
// and its blocks, and reports them once its heartbeat reaches the new manager.
TEST_F(AgentEpochTest, ManagerDownForLongerThanAHeartbeatIntervalStillRebuilds) {
  manager_->Shutdown();
  manager_.reset();
  ASSERT_TRUE(WaitFor([&] { return !agent_->registered(); }));  // the agent saw UNAVAILABLE
  absl::SleepFor(absl::Milliseconds(350));
  manager_ = StartManagerOn(port_);
  ASSERT_NE(manager_, nullptr);
  ExpectRebuiltFromTheAgent();
}

// A namespace's kv_layout lives where its pages do: the agent records the spec each
// CommitBlocks carries and reports it in its inventory, so a restarted manager still knows
// the layout the namespace took and refuses another.
TEST_F(AgentEpochTest, ARestartedManagerKeepsTheNamespacesKvLayout) {
  ModelSpec cpu = spec_;
  cpu.kv_layout = "vllm-cpu:[kv_heads,block,2*head_dim]:bf16";
  ModelSpec flash = spec_;
  flash.kv_layout = "flash-attn:[2,block,heads,dim]:bf16";
  absl::StatusOr<RegisterModelReply> adopted = client_->RegisterModel(ns_, cpu);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  ASSERT_EQ(adopted->spec, cpu) << "the namespace registered without a layout takes cpu's";
  // A page committed since, so the agent holds the namespace's spec with its layout.
  std::vector<int32_t> longer = tokens_;
  longer.resize(longer.size() + spec_.page_size_tokens, 5);
  std::vector<BlockId> blocks = cache_blocks_;
  blocks.push_back(in_flight_[0]);
  absl::StatusOr<InsertReply> ins =
      client_->Insert(ns_, longer, PoolRef{kAgentId, Tier::kGpu}, blocks);
  ASSERT_TRUE(ins.ok()) << ins.status();
  ASSERT_EQ(ins->new_pages, 1u);

  const uint64_t beats = AgentInfoOf(*manager_, kAgentId).heartbeats;
  ASSERT_TRUE(WaitFor([&] { return AgentInfoOf(*manager_, kAgentId).heartbeats > beats; }));
  manager_->Shutdown();
  manager_.reset();
  manager_ = StartManagerOn(port_);
  ASSERT_NE(manager_, nullptr);
  ASSERT_TRUE(manager_->index().Stats().namespaces.empty());
  ASSERT_TRUE(WaitFor([&] { return MatchedBlocks() == cache_blocks_; }));

  const std::vector<NamespaceStats> namespaces = manager_->index().Stats().namespaces;
  ASSERT_EQ(namespaces.size(), 1u);
  EXPECT_EQ(namespaces[0].spec, cpu);
  EXPECT_EQ(namespaces[0].page_locations, kCacheBlocks + 1);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.address = manager_->address(), .insecure = true});
  ASSERT_TRUE(client.ok());
  absl::StatusOr<RegisterModelReply> refused = (*client)->RegisterModel(ns_, flash);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      std::string(refused.status().message()),
      ::testing::AllOf(::testing::HasSubstr(cpu.kv_layout), ::testing::HasSubstr(flash.kv_layout)));
  absl::StatusOr<RegisterModelReply> unstated = (*client)->RegisterModel(ns_, spec_);
  ASSERT_TRUE(unstated.ok()) << unstated.status();
  EXPECT_EQ(unstated->spec, cpu);
  EXPECT_FALSE(unstated->created);
}

// A pin does not survive the restart: its holder gets NOT_FOUND and matches again.
TEST_F(AgentEpochTest, PinsDoNotSurviveAManagerRestart) {
  absl::StatusOr<MatchReply> pinned = client_->Match(ns_, tokens_, {.pin = true});
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_NE(pinned->pin_id, 0u);
  manager_->Shutdown();
  manager_.reset();
  manager_ = StartManagerOn(port_);
  ASSERT_NE(manager_, nullptr);
  ASSERT_TRUE(WaitFor([&] { return MatchedBlocks() == cache_blocks_; }));
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.address = manager_->address(), .insecure = true});
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->RegisterModel(ns_, spec_).ok());
  EXPECT_EQ((*client)->RenewLease(ns_, pinned->pin_id, 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*client)->Release(ns_, pinned->pin_id).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvcm
