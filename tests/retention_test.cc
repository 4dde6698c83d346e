// Retention end to end, in process: a ManagerServer whose index runs on a FakeClock and an
// Agent (host backend). Pages older than their namespace's max page age leave the index and
// their blocks are freed on the agent (FreeBlocks from the expiry's kRemoved events); across
// a manager restart the agent's ledger keeps each block's commit time and the namespace's
// limit, so a page keeps its age, and a page already too old when rebuilt is dropped and
// its blocks freed (docs/EVICTION.md, "Retention").

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/core/clock.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm {
namespace {

using ::kvcm::testing::StatsOf;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

constexpr uint64_t kBlockBytes = 1152ull * 61 * 64;  // a DeepSeek-V3 bf16 page
constexpr uint64_t kBlocks = 8;
constexpr char kAgentId[] = "gpu-0";
constexpr char kSecret[] = "00112233445566778899aabbccddeeff";
constexpr uint32_t kMaxAgeS = 3600;

class RetentionTest : public ::testing::Test {
 protected:
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
    o.heartbeat_interval_ms = 100;
    absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
    ASSERT_TRUE(agent.ok()) << agent.status();
    agent_ = *std::move(agent);
    ASSERT_TRUE(WaitFor([&] { return agent_->registered(); }));
    epoch_ = agent_->epoch();
    spec_ = agent_->pool().geometry().spec;
    ba_ = v1::BlockAgent::NewStub(MakeInsecureChannel(agent_->address()));

    std::unique_ptr<Client> client = Connect();
    ASSERT_NE(client, nullptr);
    absl::StatusOr<RegisterModelReply> reg =
        client->RegisterModel(ns_, spec_, {.max_page_age_s = kMaxAgeS});
    ASSERT_TRUE(reg.ok()) << reg.status();
    ASSERT_EQ(reg->max_page_age_s, kMaxAgeS);
  }

  void TearDown() override {
    if (agent_ != nullptr) agent_->Shutdown();
  }

  // A manager on 127.0.0.1:`port` whose index runs on clock_, sweeping every 20 ms; null
  // (with a test failure) if it never binds.
  std::unique_ptr<ManagerServer> StartManagerOn(int port) {
    ServerOptions o;
    o.tls.insecure = true;
    o.listen_address = absl::StrCat("127.0.0.1:", port);
    o.metrics_address = "";
    o.shutdown_grace_ms = 100;
    o.hash_secret_hex = kSecret;
    o.lease_sweep_interval_ms = 20;
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (true) {
      absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o, &clock_);
      if (m.ok()) return *std::move(m);
      if (m.status().code() != absl::StatusCode::kUnavailable || absl::Now() > give_up) {
        ADD_FAILURE() << m.status();
        return nullptr;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // Stops the manager right after a heartbeat (so that the agent's next one reaches the
  // new manager, answered NOT_FOUND), lets `down` pass on the index clock, and starts a
  // new one on the same port.
  void RestartManager(absl::Duration down) {
    const uint64_t beats = Heartbeats();
    ASSERT_TRUE(WaitFor([&] { return Heartbeats() > beats; }));
    manager_->Shutdown();
    manager_.reset();
    clock_.Advance(down);
    manager_ = StartManagerOn(port_);
    ASSERT_NE(manager_, nullptr);
    ASSERT_TRUE(manager_->index().Stats().namespaces.empty());
  }

  uint64_t Heartbeats() {
    for (const AgentInfo& a : manager_->agents().Snapshot()) {
      if (a.registration.agent_id == kAgentId) return a.heartbeats;
    }
    return 0;
  }

  // A fresh client (an old one's channel may still be reconnecting after a restart).
  std::unique_ptr<Client> Connect() {
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Connect({.address = manager_->address(), .insecure = true});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::vector<int32_t> Tokens(uint32_t pages, int32_t seed) const {
    std::vector<int32_t> t(pages * spec_.page_size_tokens);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i * 7 + seed);
    return t;
  }

  // Allocates `pages` blocks of the agent for ns_ and inserts the prompt of `seed` in them.
  void InsertPrompt(uint32_t pages, int32_t seed) {
    const std::vector<BlockId> blocks = ::kvcm::testing::AllocateIn(*ba_, pages, epoch_, ns_);
    ASSERT_EQ(blocks.size(), pages);
    std::unique_ptr<Client> client = Connect();
    ASSERT_NE(client, nullptr);
    absl::StatusOr<InsertReply> ins =
        client->Insert(ns_, Tokens(pages, seed), PoolRef{kAgentId, Tier::kGpu}, blocks);
    ASSERT_TRUE(ins.ok()) << ins.status();
    ASSERT_EQ(ins->new_pages, pages);
  }

  // Leading pages of the prompt of `seed` the manager matches (a probe).
  uint32_t Matched(uint32_t pages, int32_t seed) {
    std::unique_ptr<Client> client = Connect();
    if (client == nullptr) return 0;
    absl::StatusOr<MatchReply> m = client->Match(ns_, Tokens(pages, seed), {.probe = true});
    return m.ok() ? m->matched_pages : 0;
  }

  uint64_t FreeBlocks() { return StatsOf(*ba_).free_blocks(); }

  FakeClock clock_;
  std::unique_ptr<ManagerServer> manager_;
  int port_ = 0;
  std::unique_ptr<Agent> agent_;
  uint64_t epoch_ = 0;
  ModelSpec spec_;
  const NamespaceId ns_{"acme", "dsv3"};
  std::unique_ptr<v1::BlockAgent::Stub> ba_;
};

TEST_F(RetentionTest, ExpiredPagesAreFreedOnTheirAgent) {
  absl::Mutex mu;
  std::vector<WatchedEvent> events;
  std::unique_ptr<Client> watcher = Connect();
  ASSERT_NE(watcher, nullptr);
  std::unique_ptr<EventWatch> watch = watcher->WatchEvents(ns_, [&](const WatchedEvent& e) {
    absl::MutexLock lock(&mu);
    events.push_back(e);
  });
  // The stream is live before anything expires: WatchEvents returns before the manager has
  // subscribed it, and an event published before that never reaches it (the watcher thread
  // can lag that long on a loaded machine).
  ASSERT_TRUE(WaitFor([&] {
    return absl::StrContains(manager_->metrics().RenderText(), "\nkvcm_watch_subscribers 1\n");
  }));
  auto expired_events = [&] {
    absl::MutexLock lock(&mu);
    size_t n = 0;
    for (const WatchedEvent& e : events) {
      n += e.kind == WatchedEvent::Kind::kRemoved && e.reason == WatchedEvent::Reason::kExpired;
    }
    return n;
  };

  InsertPrompt(3, 1);
  clock_.Advance(absl::Minutes(30));
  InsertPrompt(2, 2);
  ASSERT_EQ(FreeBlocks(), kBlocks - 5);

  clock_.Advance(absl::Minutes(30));  // the first prompt is 60 minutes old
  EXPECT_TRUE(WaitFor([&] { return FreeBlocks() == kBlocks - 2; }))
      << "the expired pages' blocks were not freed on the agent: " << FreeBlocks() << " free";
  EXPECT_EQ(Matched(3, 1), 0u);
  EXPECT_EQ(Matched(2, 2), 2u);
  const IndexStats stats = manager_->index().Stats();
  EXPECT_EQ(stats.counters.expired_pages, 3u);
  EXPECT_EQ(stats.counters.evicted_pages, 0u);
  EXPECT_THAT(manager_->metrics().RenderText(), HasSubstr("kvcm_pages_expired_total 3"));
  EXPECT_TRUE(WaitFor([&] { return expired_events() >= 1; }))
      << "no KIND_REMOVED event with REASON_EXPIRED reached the watcher";

  clock_.Advance(absl::Minutes(30));
  EXPECT_TRUE(WaitFor([&] { return FreeBlocks() == kBlocks; }));
  EXPECT_EQ(manager_->index().Stats().counters.expired_pages, 5u);
  watch->Cancel();
}

TEST_F(RetentionTest, APageKeepsItsAgeAcrossAManagerRestart) {
  InsertPrompt(3, 1);
  clock_.Advance(absl::Minutes(50));
  ASSERT_NO_FATAL_FAILURE(RestartManager(absl::ZeroDuration()));

  // Rebuilt from the agent's inventory, with the namespace's own limit: no worker has
  // registered with the new manager.
  ASSERT_TRUE(WaitFor([&] { return Matched(3, 1) == 3; })) << "the index was not rebuilt";
  absl::StatusOr<RegisterModelResult> ns = manager_->index().GetNamespace(ns_);
  ASSERT_TRUE(ns.ok()) << ns.status();
  EXPECT_EQ(ns->max_page_age, absl::Seconds(kMaxAgeS));
  EXPECT_EQ(FreeBlocks(), kBlocks - 3);

  clock_.Advance(absl::Minutes(9));         // 59 minutes old: still there
  absl::SleepFor(absl::Milliseconds(200));  // ten sweeps
  EXPECT_EQ(Matched(3, 1), 3u);
  EXPECT_EQ(FreeBlocks(), kBlocks - 3);

  clock_.Advance(absl::Minutes(1));  // 60 minutes old, counted from the first commit
  EXPECT_TRUE(WaitFor([&] { return FreeBlocks() == kBlocks; }));
  EXPECT_EQ(Matched(3, 1), 0u);
  EXPECT_EQ(manager_->index().Stats().counters.expired_pages, 3u);
}

TEST_F(RetentionTest, APageTooOldWhenRebuiltIsDroppedAndItsBlocksFreed) {
  InsertPrompt(3, 1);
  clock_.Advance(absl::Minutes(50));
  InsertPrompt(2, 2);
  // Down for 20 minutes: the first prompt is 70 minutes old when the index comes back.
  ASSERT_NO_FATAL_FAILURE(RestartManager(absl::Minutes(20)));

  ASSERT_TRUE(WaitFor([&] { return Matched(2, 2) == 2; })) << "the index was not rebuilt";
  EXPECT_TRUE(WaitFor([&] { return FreeBlocks() == kBlocks - 2; }))
      << "the too old pages' blocks were not freed: " << FreeBlocks() << " free";
  EXPECT_EQ(Matched(3, 1), 0u);
  for (const NamespaceStats& n : manager_->index().Stats().namespaces) {
    if (n.ns == ns_) {
      EXPECT_EQ(n.page_locations, 2u);
    }
  }
  clock_.Advance(absl::Minutes(40));  // the second prompt is 60 minutes old
  EXPECT_TRUE(WaitFor([&] { return FreeBlocks() == kBlocks; }));
}

}  // namespace
}  // namespace kvcm
