// A worker's store into a full agent pool (issue 33), end to end through an in-process
// ManagerServer and Agent, the real client and BlockAgent stubs: the worker path
// (Allocate -> WriteBlocks -> Insert) keeps storing after the pool fills, because the
// agent's Allocate asks the manager to evict the shortfall (AgentControl.MakeRoom) and
// waits for the FreeBlocks commands. Also as an adversary would try it: nothing evictable
// (everything pinned) is RESOURCE_EXHAUSTED naming the pins and changes nothing; workers
// racing for the last blocks never read another prompt's bytes, never double-free and
// leak nothing; a worker that dies mid-store gets its blocks reaped.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/in_process_cluster.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateTo;
using ::kvcm::testing::BlockAgentStub;
using ::kvcm::testing::Bytes;
using ::kvcm::testing::ConnectAndRegister;
using ::kvcm::testing::Counts;
using ::kvcm::testing::CountsOf;
using ::kvcm::testing::FailedCommands;
using ::kvcm::testing::FreeBlocksOf;
using ::kvcm::testing::kBlockBytes;
using ::kvcm::testing::MatchedBlocks;
using ::kvcm::testing::MetricsHave;
using ::kvcm::testing::ReadAll;
using ::kvcm::testing::StartAgent;
using ::kvcm::testing::StartManager;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::HasSubstr;

constexpr uint32_t kPages = 3;  // pages per prompt

// One worker store: Allocate -> WriteBlocks -> Insert, freeing the blocks when the insert
// fails. Returns the first failing call's status.
absl::Status Store(Client& client, v1::BlockAgent::Stub& agent, uint64_t epoch,
                   const NamespaceId& ns, const std::vector<int32_t>& prompt,
                   const std::string& bytes, const PoolRef& pool) {
  std::vector<BlockId> ids;
  std::vector<uint64_t> gens;
  if (grpc::Status s = AllocateTo(agent, kPages, epoch, ns, &ids, &gens); !s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  if (grpc::Status s = WriteAll(agent, ids, epoch, bytes, gens); !s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  absl::StatusOr<InsertReply> r = client.Insert(ns, prompt, pool, ids, {.agent_epoch = epoch});
  if (!r.ok()) {
    (void)testing::FreeAsWorker(agent, ids, epoch, gens);
    return r.status();
  }
  return absl::OkStatus();
}

std::string AgentMetricsText(Agent& agent) { return agent.metrics().RenderText(); }

class FullPoolTest : public ::testing::Test {
 protected:
  void SetUpCluster(uint64_t blocks) {
    manager_ = StartManager();
    agent_ = StartAgent(manager_->address(), blocks);
    ASSERT_TRUE(WaitFor([&] { return agent_->registered(); }));
    client_ = ConnectAndRegister(manager_->address(), ns_, agent_->pool().geometry().spec);
    ASSERT_NE(client_, nullptr);
    stub_ = BlockAgentStub(*agent_);
  }
  std::vector<int32_t> Prompt(int seed) const {
    return Tokens(kPages, agent_->pool().geometry().spec.page_size_tokens, seed);
  }

  const NamespaceId ns_{"acme", "deepseek-v3"};
  const PoolRef pool_{"gpu-3", Tier::kGpu};
  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Agent> agent_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::BlockAgent::Stub> stub_;
};

// The repro: 3-page prompts into a 10-block pool. The fourth store used to fail
// (and every later one); now each evicts exactly its shortfall by the manager's policy and
// succeeds. Whatever the policy kept matches with its own bytes, the last prompt whole,
// and the accounting is exact: committed blocks = indexed pages = stored - evicted.
TEST_F(FullPoolTest, StoresIntoAFullPoolEvictTheShortfall) {
  SetUpCluster(10);
  constexpr int kPrompts = 8;
  for (int i = 0; i < kPrompts; ++i) {
    const absl::Status s = Store(*client_, *stub_, agent_->epoch(), ns_, Prompt(i),
                                 Bytes(kPages * kBlockBytes, i), pool_);
    ASSERT_TRUE(s.ok()) << "store " << i << ": " << s;
  }
  uint64_t matched = 0;
  for (int i = 0; i < kPrompts; ++i) {
    const std::vector<BlockId> blocks = MatchedBlocks(*client_, ns_, Prompt(i));
    if (i == kPrompts - 1) EXPECT_EQ(blocks.size(), kPages) << "the last store is cached";
    if (blocks.empty()) continue;
    matched += blocks.size();
    absl::StatusOr<std::string> got = ReadAll(*stub_, blocks, agent_->epoch());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == Bytes(kPages * kBlockBytes, i).substr(0, blocks.size() * kBlockBytes))
        << "prompt " << i << " has other bytes";
  }
  // Whole shortfalls only: the pool is full (0 or 1 block free: a node is the unit a
  // policy that does not trim evicts).
  EXPECT_GE(matched, 9u);
  EXPECT_EQ(agent_->pool().Stats().committed_blocks, matched);
  EXPECT_EQ(FreeBlocksOf(*stub_) + matched, 10u);
  EXPECT_EQ(FailedCommands(*manager_), 0u);
  const uint64_t evicted = kPrompts * kPages - matched;
  EXPECT_TRUE(
      MetricsHave(*manager_, absl::StrCat("kvcm_allocation_evicted_pages_total ", evicted)));
  EXPECT_TRUE(MetricsHave(*manager_, "kvcm_allocation_room_refusals_total 0"));
  const std::string agent_metrics = AgentMetricsText(*agent_);
  EXPECT_THAT(agent_metrics,
              HasSubstr(absl::StrCat("kvcm_agent_room_evicted_pages_total ", evicted)));
  EXPECT_THAT(agent_metrics,
              HasSubstr("kvcm_agent_allocation_failures_total{reason=\"pinned\"} 0"));
  // The default policy, as the client reads it: "select", still on its starting candidate
  // (SelectParams::initial; no Match here names a requester, so no dwell of lookups has
  // passed), having seen the stores into the agent's GPU pool.
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->policy, "select");
  ASSERT_TRUE(stats->selection.has_value());
  EXPECT_EQ(stats->selection->active, "conversation");
  EXPECT_EQ(stats->selection->candidates.size(), 5u);
  EXPECT_EQ(stats->selection->switches, 0u);
  EXPECT_EQ(stats->selection->pools, 1u);
  EXPECT_GT(stats->selection->sampled_store_pages, 0u);
}

// With a HOST pool, the victims of a store into a full GPU pool move there before they
// leave (the default policy demotes, as an Insert's eviction does): the evicted prompt
// still matches, from HOST, with its own bytes, and both pools' ledgers equal the index.
TEST_F(FullPoolTest, VictimsAreDemotedToTheHostPoolFirst) {
  manager_ = StartManager();
  agent_ = StartAgent(manager_->address(), /*blocks=*/6, /*host_blocks=*/6);
  ASSERT_TRUE(WaitFor([&] { return agent_->registered(); }));
  client_ = ConnectAndRegister(manager_->address(), ns_, agent_->pool().geometry().spec);
  ASSERT_NE(client_, nullptr);
  stub_ = BlockAgentStub(*agent_);
  for (int i = 0; i < 3; ++i) {
    const absl::Status s = Store(*client_, *stub_, agent_->epoch(), ns_, Prompt(i),
                                 Bytes(kPages * kBlockBytes, i), pool_);
    ASSERT_TRUE(s.ok()) << "store " << i << ": " << s;
  }
  // Some page of the first two prompts left the GPU pool for the HOST pool; once the agent
  // acknowledged the demotion, its HOST blocks hold the page's bytes.
  uint64_t host_pages = 0;
  for (int i = 0; i < 2; ++i) {
    std::vector<BlockId> host_blocks;
    ASSERT_TRUE(WaitFor([&] {
      absl::StatusOr<MatchReply> m = client_->Match(ns_, Prompt(i), {.probe = true});
      if (!m.ok()) return false;
      host_blocks.clear();
      for (const MatchReply::Segment& seg : m->segments) {
        if (seg.first_page != host_blocks.size()) break;
        bool found = false;
        for (const MatchReply::Replica& r : seg.replicas) {
          if (r.pool.tier != Tier::kHost) continue;
          host_blocks.insert(host_blocks.end(), r.block_ids.begin(), r.block_ids.end());
          found = true;
        }
        if (!found) break;
      }
      for (BlockId b : host_blocks) {
        if (b == kPendingBlock) return false;
      }
      return true;
    }));
    if (host_blocks.empty()) continue;
    host_pages += host_blocks.size();
    absl::StatusOr<std::string> got = ReadAll(*stub_, host_blocks, agent_->epoch(), v1::TIER_HOST);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == Bytes(kPages * kBlockBytes, i).substr(0, host_blocks.size() * kBlockBytes))
        << "prompt " << i << ": the HOST copy holds other bytes";
  }
  EXPECT_GE(host_pages, 3u) << "the store needed 3 blocks: 3 pages were demoted";
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  for (const ManagerStats::Pool& p : stats->pools) {
    BlockPool* pool = p.pool.tier == Tier::kHost ? agent_->host_pool() : &agent_->pool();
    EXPECT_EQ(pool->Stats().committed_blocks, p.pages) << p.pool.ToString();
  }
  EXPECT_EQ(FailedCommands(*manager_), 0u);
}

// Nothing evictable: every cached page pinned. The allocation is RESOURCE_EXHAUSTED with
// the manager's reason (the pinned bytes) and nothing changes on either side; once the
// pins go, the same allocation succeeds.
TEST_F(FullPoolTest, AllPinnedIsResourceExhaustedNamingThePinsAndChangesNothing) {
  SetUpCluster(10);
  std::vector<PinnedPrefix> pins;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Store(*client_, *stub_, agent_->epoch(), ns_, Prompt(i),
                      Bytes(kPages * kBlockBytes, i), pool_)
                    .ok());
    absl::StatusOr<PinnedPrefix> pin = client_->MatchAndPin(ns_, Prompt(i));
    ASSERT_TRUE(pin.ok()) << pin.status();
    ASSERT_EQ(pin->match().matched_pages, kPages);
    pins.push_back(*std::move(pin));
  }
  const Counts before = CountsOf(*client_, *stub_);
  std::vector<BlockId> ids;
  const grpc::Status refused = AllocateTo(*stub_, kPages, agent_->epoch(), ns_, &ids);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("asked for 3 blocks, 1 of 10 are free"));
  EXPECT_THAT(refused.error_message(), HasSubstr("pinned"));
  EXPECT_TRUE(ids.empty());
  EXPECT_EQ(CountsOf(*client_, *stub_), before);
  EXPECT_THAT(AgentMetricsText(*agent_),
              HasSubstr("kvcm_agent_allocation_failures_total{reason=\"pinned\"} 1"));
  EXPECT_TRUE(MetricsHave(*manager_, "kvcm_allocation_room_refusals_total 1"));

  pins.clear();  // releases the pins
  const grpc::Status after = AllocateTo(*stub_, kPages, agent_->epoch(), ns_, &ids);
  EXPECT_TRUE(after.ok()) << after.error_message();
  EXPECT_EQ(ids.size(), kPages);
}

// One tenant cannot take a shared pool's every block and so evict every other tenant's
// pages: its stores in flight count against its default share (50 %) like a reservation.
TEST_F(FullPoolTest, AnotherTenantsStoresInFlightStopAtItsShare) {
  SetUpCluster(10);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Store(*client_, *stub_, agent_->epoch(), ns_, Prompt(i),
                      Bytes(kPages * kBlockBytes, i), pool_)
                    .ok());
  }
  const NamespaceId globex{"globex", "deepseek-v3"};
  ASSERT_NE(ConnectAndRegister(manager_->address(), globex, agent_->pool().geometry().spec),
            nullptr);
  std::vector<BlockId> held;
  ASSERT_TRUE(AllocateTo(*stub_, 4, agent_->epoch(), globex, &held).ok());  // 1 free + 3 evicted
  const Counts before = CountsOf(*client_, *stub_);
  const grpc::Status refused = AllocateTo(*stub_, 2, agent_->epoch(), globex, &held);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("default_tenant_pool_share_pct"));
  EXPECT_EQ(held.size(), 4u);
  EXPECT_EQ(CountsOf(*client_, *stub_), before);
  EXPECT_THAT(AgentMetricsText(*agent_),
              HasSubstr("kvcm_agent_allocation_failures_total{reason=\"share\"} 1"));
  // acme's own stores still make room (its in-flight blocks are within its share).
  EXPECT_TRUE(Store(*client_, *stub_, agent_->epoch(), ns_, Prompt(9),
                    Bytes(kPages * kBlockBytes, 9), pool_)
                  .ok());
}

// Blocks that are not the cache's (no namespace, or another owner epoch) never make the
// manager evict: a short pool answers RESOURCE_EXHAUSTED at once.
TEST_F(FullPoolTest, PrivateAllocationsNeverEvict) {
  SetUpCluster(4);
  ASSERT_TRUE(Store(*client_, *stub_, agent_->epoch(), ns_, Prompt(1),
                    Bytes(kPages * kBlockBytes, 1), pool_)
                  .ok());
  const Counts before = CountsOf(*client_, *stub_);
  std::vector<BlockId> ids;
  EXPECT_EQ(AllocateTo(*stub_, 2, /*owner_epoch=*/7, ns_, &ids).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(CountsOf(*client_, *stub_), before);
  EXPECT_EQ(MatchedBlocks(*client_, ns_, Prompt(1)).size(), kPages);
  EXPECT_THAT(AgentMetricsText(*agent_),
              HasSubstr("kvcm_agent_allocation_failures_total{reason=\"private\"} 1"));
}

// Workers racing for the last blocks of a small pool, each loading (under a pin) what it
// matched: every load reads exactly the bytes stored for its prompt, no command fails (no
// double free), no store fails for want of room, and at the end the pool's blocks are the
// index's pages plus free ones (nothing stranded, nothing leaked).
TEST_F(FullPoolTest, RacingWorkersNeverReadOtherBytesAndLeakNothing) {
  // Room for every worker's store in flight (3 blocks) and its pinned load (3) at once:
  // what is allocated or pinned cannot be evicted.
  SetUpCluster(26);
  constexpr int kWorkers = 4;
  constexpr int kStoresPerWorker = 6;
  std::atomic<int> failed_stores{0};
  std::atomic<int> wrong_bytes{0};
  std::atomic<int> loads{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      std::unique_ptr<Client> client =
          ConnectAndRegister(manager_->address(), ns_, agent_->pool().geometry().spec);
      auto stub = BlockAgentStub(*agent_);
      for (int i = 0; i < kStoresPerWorker; ++i) {
        const int seed = 100 * w + i;
        const absl::Status s = Store(*client, *stub, agent_->epoch(), ns_, Prompt(seed),
                                     Bytes(kPages * kBlockBytes, seed), pool_);
        if (!s.ok()) {
          ADD_FAILURE() << "worker " << w << " store " << i << ": " << s;
          ++failed_stores;
          continue;
        }
        // Load an earlier prompt of this worker, as an engine would: match with a pin,
        // read the blocks, release.
        const int back = 100 * w + i / 2;
        absl::StatusOr<PinnedPrefix> pin = client->MatchAndPin(ns_, Prompt(back));
        if (!pin.ok() || pin->match().matched_pages != kPages) continue;  // evicted: a miss
        const std::vector<BlockId>& blocks = pin->match().segments[0].replicas[0].block_ids;
        absl::StatusOr<std::string> got = ReadAll(*stub, blocks, agent_->epoch());
        ++loads;
        if (!got.ok() || *got != Bytes(kPages * kBlockBytes, back)) ++wrong_bytes;
      }
    });
  }
  for (std::thread& t : workers) t.join();
  EXPECT_EQ(failed_stores.load(), 0);
  EXPECT_EQ(wrong_bytes.load(), 0) << "of " << loads.load() << " loads";
  EXPECT_EQ(FailedCommands(*manager_), 0u);
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  uint64_t indexed = 0;
  for (const auto& p : stats->pools) indexed += p.pages;
  EXPECT_TRUE(WaitFor([&] {
    return agent_->pool().Stats().committed_blocks == indexed &&
           FreeBlocksOf(*stub_) + indexed == 26;
  })) << "committed "
      << agent_->pool().Stats().committed_blocks << " indexed " << indexed << " free "
      << FreeBlocksOf(*stub_);
  EXPECT_EQ(agent_->pool().Stats().held_blocks, 0u);
}

// A worker that dies between Allocate and Insert: its blocks come back after
// allocation_ttl_ms, and a late write to them is ABORTED (its allocation ended).
TEST(FullPoolTtlTest, AStoreAbandonedMidWayIsReaped) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "gpu-3";
  o.manager_address = manager->address();
  o.use_device = false;
  o.capacity_bytes = 4 * kBlockBytes;
  o.heartbeat_interval_ms = 50;
  o.allocation_ttl_ms = 1'000;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  ASSERT_TRUE(agent.ok()) << agent.status();
  ASSERT_TRUE(WaitFor([&] { return (*agent)->registered(); }));
  auto stub = BlockAgentStub(**agent);
  const NamespaceId ns{"acme", "deepseek-v3"};
  std::vector<BlockId> ids;
  std::vector<uint64_t> gens;
  ASSERT_TRUE(AllocateTo(*stub, 3, (*agent)->epoch(), ns, &ids, &gens).ok());
  // Blocks of another owner (a worker's private ones) are its own business: never reaped.
  std::vector<BlockId> mine;
  ASSERT_TRUE(testing::AllocateTo(*stub, 1, (*agent)->epoch() + 1, ns, &mine).ok());
  EXPECT_EQ(FreeBlocksOf(*stub), 0u);
  ASSERT_TRUE(WaitFor([&] { return FreeBlocksOf(*stub) == 3; }));
  const grpc::Status late =
      WriteAll(*stub, ids, (*agent)->epoch(), Bytes(3 * kBlockBytes, 1), gens);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::ABORTED) << late.error_message();
}

// Randomized workers over a small full pool with a real manager (the BlockAgent fuzz, with
// full pools): stores (Allocate -> WriteBlocks -> Insert), abandoned stores, frees, pinned
// loads that check every byte, and malformed or private allocations, in a random order
// with several stores and pins outstanding at once. After every step: what a load read is
// the bytes stored for its prompt; a refused Allocate is RESOURCE_EXHAUSTED saying why (or
// INVALID_ARGUMENT naming the field); no command failed (no double free); and the pool's
// blocks are exactly free + outstanding allocations + committed, with committed == the
// index's pages. At the end, after allocation_ttl_ms, nothing is stranded.
// KVCM_FUZZ_SEED=<n> picks the seed, KVCM_FUZZ_STEPS=<n> the steps.
TEST(FullPoolFuzzTest, RandomWorkersKeepTheLedgerAndTheIndexInStep) {
  const char* seed_env = std::getenv("KVCM_FUZZ_SEED");
  const char* steps_env = std::getenv("KVCM_FUZZ_STEPS");
  const uint32_t seed = seed_env != nullptr
                            ? static_cast<uint32_t>(std::atoi(seed_env))
                            : static_cast<uint32_t>(absl::ToUnixMicros(absl::Now()));
  const int steps = steps_env != nullptr ? std::atoi(steps_env) : 300;
  std::cout << "KVCM_FUZZ_SEED=" << seed << " KVCM_FUZZ_STEPS=" << steps << "\n";
  std::mt19937 rng(seed);

  std::unique_ptr<ManagerServer> manager = StartManager();
  constexpr uint32_t kPoolBlocks = 16;
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "gpu-3";
  o.manager_address = manager->address();
  o.use_device = false;
  o.model = "";
  o.spec = ModelSpec{.attention = AttentionKind::kMla,
                     .num_layers = 1,
                     .num_heads = 16,
                     .kv_lora_rank = 512,
                     .rope_dim = 64,
                     .dtype = KvDtype::kBf16,
                     .page_size_tokens = 16};
  o.page_size_tokens = 16;
  const uint64_t block_bytes = o.spec.BytesPerPage();
  o.capacity_bytes = kPoolBlocks * block_bytes;
  o.heartbeat_interval_ms = 50;
  o.allocation_ttl_ms = 1'000;
  absl::StatusOr<std::unique_ptr<Agent>> started = Agent::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  Agent& agent = **started;
  ASSERT_TRUE(WaitFor([&] { return agent.registered(); }));
  const NamespaceId acme{"acme", "mla"};
  const NamespaceId globex{"globex", "mla"};
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), acme, o.spec);
  ASSERT_NE(client, nullptr);
  ASSERT_NE(ConnectAndRegister(manager->address(), globex, o.spec), nullptr);
  auto stub = BlockAgentStub(agent);
  const uint64_t epoch = agent.epoch();
  const PoolRef pool{"gpu-3", Tier::kGpu};

  // Prompts: 12 per tenant, 1-3 pages, in families sharing a first page.
  struct Prompt {
    NamespaceId ns;
    std::vector<int32_t> tokens;
  };
  std::vector<Prompt> prompts;
  for (const NamespaceId& ns : {acme, globex}) {
    for (int p = 0; p < 12; ++p) {
      std::vector<int32_t> t = Tokens(1, 16, 1000 + p % 3);  // shared first page
      const std::vector<int32_t> rest = Tokens(1 + p % 3, 16, 2000 + p);
      t.insert(t.end(), rest.begin(), rest.end() - (p % 3 == 2 ? 16 : 0));
      prompts.push_back({ns, t});
    }
  }
  auto page_bytes = [&](const std::vector<int32_t>& tokens, size_t page) {
    // A page's bytes depend on its tokens up to it (its prefix), so equal pages hold equal
    // bytes whoever stored them.
    int32_t h = 17;
    for (size_t i = 0; i < (page + 1) * 16; ++i) h = h * 31 + tokens[i];
    return Bytes(block_bytes, h);
  };

  struct Store {
    size_t prompt = 0;
    std::vector<BlockId> ids;
    std::vector<uint64_t> gens;
    absl::Time at;  // allocated; past the ttl the agent may have reaped it
  };
  const absl::Duration kMaybeReaped = absl::Milliseconds(900);
  std::vector<Store> outstanding;  // allocated, not yet inserted or freed
  uint64_t abandoned = 0;          // blocks of stores dropped without a Free
  std::vector<PinnedPrefix> pins;
  int stores = 0, loads = 0, refused = 0;
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(absl::StrCat("seed ", seed, " step ", step));
    int op = static_cast<int>(rng() % 10);
    if (op <= 2 && outstanding.size() >= 3) op = 3;  // at most 3 stores in flight
    if (op <= 2 || outstanding.empty()) {            // allocate for a store
      Store st{.prompt = rng() % prompts.size(), .at = absl::Now()};
      const Prompt& p = prompts[st.prompt];
      const uint32_t pages = static_cast<uint32_t>(p.tokens.size() / 16);
      const grpc::Status s = AllocateTo(*stub, pages, epoch, p.ns, &st.ids, &st.gens);
      if (s.ok()) {
        outstanding.push_back(std::move(st));
      } else {
        ++refused;
        ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
        ASSERT_THAT(
            s.error_message(),
            ::testing::AnyOf(HasSubstr("evictable"), HasSubstr("default_tenant_pool_share_pct")));
      }
    } else if (op <= 5) {  // write and insert an outstanding store
      std::swap(outstanding[rng() % outstanding.size()], outstanding.back());
      Store st = std::move(outstanding.back());
      outstanding.pop_back();
      const Prompt& p = prompts[st.prompt];
      std::string bytes;
      for (size_t i = 0; i < st.ids.size(); ++i) bytes += page_bytes(p.tokens, i);
      if (const grpc::Status w = WriteAll(*stub, st.ids, epoch, bytes, st.gens); !w.ok()) {
        // Only a store older than the ttl may have lost its blocks.
        ASSERT_EQ(w.error_code(), grpc::StatusCode::ABORTED) << w.error_message();
        ASSERT_GT(absl::Now() - st.at, kMaybeReaped);
        continue;
      }
      absl::StatusOr<InsertReply> r =
          client->Insert(p.ns, p.tokens, pool, st.ids, {.agent_epoch = epoch});
      if (!r.ok()) {
        // A prefix page this store reused was evicted meanwhile: the blocks are ours.
        ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
        ASSERT_TRUE(testing::FreeAsWorker(*stub, st.ids, epoch, st.gens).ok());
      } else {
        ++stores;
        // Duplicates (pages the pool already held) come back to us: free them.
        std::vector<BlockId> dup;
        std::vector<uint64_t> dup_gens;
        for (size_t i = 0; i < st.ids.size(); ++i) {
          if (i < r->existing_block_ids.size() && r->existing_block_ids[i] != st.ids[i]) {
            dup.push_back(st.ids[i]);
            dup_gens.push_back(st.gens[i]);
          }
        }
        if (!dup.empty()) ASSERT_TRUE(testing::FreeAsWorker(*stub, dup, epoch, dup_gens).ok());
      }
    } else if (op == 6) {  // a worker dies mid-store, or frees what it allocated
      Store st = std::move(outstanding.back());
      outstanding.pop_back();
      if (rng() % 4 == 0) {  // dies: the ttl must reap its blocks
        abandoned += st.ids.size();
      } else if (const grpc::Status f = testing::FreeAsWorker(*stub, st.ids, epoch, st.gens);
                 !f.ok()) {
        ASSERT_EQ(f.error_code(), grpc::StatusCode::ABORTED) << f.error_message();
        ASSERT_GT(absl::Now() - st.at, kMaybeReaped);
      }
    } else if (op == 7) {  // a pinned load of a prompt: every matched byte is its own
      const Prompt& p = prompts[rng() % prompts.size()];
      absl::StatusOr<PinnedPrefix> pin = client->MatchAndPin(p.ns, p.tokens);
      if (!pin.ok()) {
        ASSERT_EQ(pin.status().code(), absl::StatusCode::kResourceExhausted) << pin.status();
      } else if (pin->match().matched_pages > 0) {
        const MatchReply::Replica& rep = pin->match().segments[0].replicas[0];
        absl::StatusOr<std::string> got = ReadAll(*stub, rep.block_ids, epoch);
        ASSERT_TRUE(got.ok()) << got.status();
        std::string want;
        for (size_t i = 0; i < rep.block_ids.size(); ++i) want += page_bytes(p.tokens, i);
        ASSERT_TRUE(*got == want) << "a pinned load read bytes of another page";
        ++loads;
        if (pins.size() < 3) pins.push_back(*std::move(pin));
      }
    } else if (op == 8) {
      if (!pins.empty()) pins.erase(pins.begin());
    } else {  // malformed or private allocations change nothing
      std::vector<BlockId> ids;
      const int kind = static_cast<int>(rng() % 3);
      const grpc::Status s = kind == 0   ? AllocateTo(*stub, 0, epoch, acme, &ids)
                             : kind == 1 ? AllocateTo(*stub, kPoolBlocks + 1, epoch, acme, &ids)
                                         : AllocateTo(*stub, kPoolBlocks, epoch + 1, acme, &ids);
      ASSERT_TRUE(kind == 2 ? s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
                                  (s.ok() && testing::FreeAsWorker(*stub, ids, epoch + 1).ok())
                            : !s.ok())
          << kind << ": " << s.error_message();
    }
    // The pool: free + outstanding + abandoned (until reaped) + committed = every block;
    // committed = the index's pages.
    uint64_t in_flight = 0, maybe_reaped = abandoned;
    const absl::Time now = absl::Now();
    for (const Store& st : outstanding) {
      (now - st.at < kMaybeReaped ? in_flight : maybe_reaped) += st.ids.size();
    }
    const BlockPoolStats ps = agent.pool().Stats();
    ASSERT_LE(ps.free_blocks + in_flight + ps.committed_blocks, kPoolBlocks);
    ASSERT_GE(ps.free_blocks + in_flight + maybe_reaped + ps.committed_blocks, kPoolBlocks);
    absl::StatusOr<ManagerStats> stats = client->Stats();
    ASSERT_TRUE(stats.ok());
    uint64_t indexed = 0;
    for (const ManagerStats::Pool& mp : stats->pools) indexed += mp.pages;
    ASSERT_EQ(ps.committed_blocks, indexed);
  }
  EXPECT_EQ(FailedCommands(*manager), 0u);
  // Everything let go: after the ttl only the cache's blocks are not free.
  pins.clear();
  for (const Store& st : outstanding) abandoned += st.ids.size();
  outstanding.clear();
  EXPECT_TRUE(WaitFor([&] {
    const BlockPoolStats ps = agent.pool().Stats();
    return ps.free_blocks + ps.committed_blocks == kPoolBlocks;
  })) << "stranded blocks";
  std::cout << stores << " stores, " << loads << " pinned loads, " << refused
            << " refused allocations, " << abandoned << " blocks abandoned\n";
  EXPECT_GT(stores, 0);
  EXPECT_THAT(AgentMetricsText(agent),
              ::testing::ContainsRegex("kvcm_agent_room_allocations_total [1-9]"));
}

}  // namespace
}  // namespace kvcm
