// Hostile inserts over gRPC: a manager and an agent (host pool) in process, two tenants'
// workers and an attacker making random calls — allocate blocks for either namespace, insert
// prompts naming their own blocks, the other tenant's, random or out-of-range ids, evict,
// free, route. After every step the index must agree with the agent's block ledger: every
// block a Match or Route returns is committed, on the agent, to exactly that page of that
// namespace, and no block is returned for two pages. So no sequence of calls can make a
// Match answer bytes that belong to another prefix or tenant.
//
// KVCM_FUZZ_SEED=<n> picks the seed (printed; a failure names the seed and step) and
// KVCM_FUZZ_STEPS=<n> the number of calls.

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm {
namespace {

using ::kvcm::testing::WaitFor;

constexpr uint64_t kBlocks = 24;
constexpr int kPromptsPerTenant = 6;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

class InsertFuzzer {
 public:
  InsertFuzzer(ManagerServer* manager, Agent* agent, uint64_t seed)
      : manager_(manager), agent_(agent), rng_(seed) {
    ba_ = v1::BlockAgent::NewStub(MakeInsecureChannel(agent_->address()));
    client_ = *Client::Connect({.address = manager_->address(), .insecure = true});
    spec_ = agent_->pool().geometry().spec;
    for (int t = 0; t < 2; ++t) {
      EXPECT_TRUE(client_->RegisterModel(ns_[t], spec_).ok());
      for (int p = 0; p < kPromptsPerTenant; ++p) {
        // Prompts of 1..3 pages; prompts p and p + 3 share their first page.
        std::vector<int32_t> tokens((1 + p % 3) * spec_.page_size_tokens);
        for (size_t i = 0; i < tokens.size(); ++i) {
          tokens[i] = static_cast<int32_t>(i < spec_.page_size_tokens ? p % 3 : 1000 * p + i);
        }
        prompts_[t].push_back(std::move(tokens));
      }
    }
  }

  void Step() {
    const int tenant = Pick(2);
    switch (Pick(7)) {
      case 0:
      case 1:
        Allocate(tenant);
        break;
      case 2:
      case 3:
        Insert(tenant);
        break;
      case 4: {
        const uint64_t bytes = (1 + Pick(3)) * spec_.BytesPerPage();
        if (Pick(2) == 0) {
          (void)client_->EvictFromNamespace(ns_[tenant], bytes);
        } else {
          (void)client_->EvictFromPool(pool_, bytes);
        }
        break;
      }
      case 5:
        Free(tenant);
        break;
      case 6:
        Route(tenant);
        break;
    }
  }

  // Every block a Match (or a Route's match) returns is committed to that page of that
  // namespace on the agent, and no block serves two (namespace, page) pairs.
  void CheckIndexAgreesWithTheLedger() {
    absl::flat_hash_map<BlockId, CommittedBlock> ledger;
    for (const CommittedBlock& c : agent_->pool().Inventory()) ledger[c.block] = c;
    std::map<BlockId, std::pair<int, PageHash>> owner;
    for (int t = 0; t < 2; ++t) {
      for (const std::vector<int32_t>& tokens : prompts_[t]) {
        absl::StatusOr<std::vector<PageHash>> pages = manager_->index().HashTokens(ns_[t], tokens);
        ASSERT_TRUE(pages.ok());
        absl::StatusOr<MatchReply> m = client_->Match(ns_[t], tokens, {.probe = true});
        ASSERT_TRUE(m.ok()) << m.status();
        absl::StatusOr<RouteReply> r = client_->Route(ns_[t], tokens, {.probe = true});
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->match.matched_pages, m->matched_pages);
        for (const MatchReply* match : {&*m, &r->match}) {
          for (const MatchReply::Segment& seg : match->segments) {
            for (const MatchReply::Replica& rep : seg.replicas) {
              for (uint32_t i = 0; i < seg.num_pages; ++i) {
                const BlockId b = rep.block_ids[i];
                const PageHash& page = (*pages)[seg.first_page + i];
                auto it = ledger.find(b);
                ASSERT_NE(it, ledger.end()) << "block " << b << " is indexed but not committed";
                EXPECT_EQ(*it->second.ns, ns_[t]) << "block " << b << " holds another namespace";
                EXPECT_EQ(it->second.page, page) << "block " << b << " holds another page";
                auto [o, fresh] = owner.try_emplace(b, t, page);
                EXPECT_TRUE(fresh || o->second == std::make_pair(t, page))
                    << "block " << b << " serves two pages";
              }
            }
          }
        }
      }
    }
  }

  uint64_t accepted_inserts() const { return accepted_; }
  uint64_t refused_inserts() const { return refused_; }

 private:
  uint64_t Pick(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }

  void Allocate(int tenant) {
    v1::AllocateBlocksRequest req;
    req.set_count(1 + Pick(3));
    req.set_owner_epoch(agent_->epoch());
    if (Pick(5) != 0) {  // now and then blocks of no namespace, which can never be indexed
      req.mutable_namespace_()->set_tenant(ns_[tenant].tenant);
      req.mutable_namespace_()->set_model(ns_[tenant].model);
    }
    v1::AllocateBlocksResponse resp;
    grpc::ClientContext ctx;
    if (ba_->Allocate(&ctx, req, &resp).ok()) {
      const std::vector<BlockId> ids(resp.block_ids().begin(), resp.block_ids().end());
      const std::vector<uint64_t> gens(resp.block_generations().begin(),
                                       resp.block_generations().end());
      // Mostly written whole, as a worker's; now and then not, which no commit may take.
      if (Pick(4) != 0) testing::WriteZeros(*ba_, ids, agent_->epoch(), gens);
      for (BlockId b : ids) mine_[tenant].push_back(b);
    }
  }

  // Names blocks for a prompt: the tenant's own, the other tenant's, anything in or past the
  // pool, or the same block twice.
  void Insert(int tenant) {
    const std::vector<int32_t>& tokens = prompts_[tenant][Pick(kPromptsPerTenant)];
    const size_t pages = tokens.size() / spec_.page_size_tokens;
    std::vector<BlockId> blocks;
    for (size_t i = 0; i < pages; ++i) {
      const int source = static_cast<int>(Pick(4));
      const std::vector<BlockId>& pool = mine_[source < 2 ? tenant : 1 - tenant];
      if (source < 3 && !pool.empty()) {
        blocks.push_back(pool[Pick(pool.size())]);
      } else {
        blocks.push_back(static_cast<BlockId>(Pick(kBlocks + 2)));
      }
    }
    absl::StatusOr<InsertReply> r = client_->Insert(ns_[tenant], tokens, pool_, blocks);
    if (r.ok()) {
      ++accepted_;
    } else {
      ++refused_;
      const absl::StatusCode c = r.status().code();
      EXPECT_TRUE(c == absl::StatusCode::kInvalidArgument ||
                  c == absl::StatusCode::kFailedPrecondition ||
                  c == absl::StatusCode::kResourceExhausted)
          << r.status();
    }
  }

  // A Route as a router or a worker makes it: probe, plain, or pinned and released at once;
  // now and then naming an agent that does not exist (NOT_FOUND, nothing changes).
  void Route(int tenant) {
    const std::vector<int32_t>& tokens = prompts_[tenant][Pick(kPromptsPerTenant)];
    RouteParams params;
    const uint64_t kind = Pick(4);
    params.probe = kind == 0;
    params.pin = kind == 1;
    if (kind == 3) params.candidates = {{.agent_id = "gpu-0"}, {.agent_id = "nobody"}};
    absl::StatusOr<RouteReply> r = client_->Route(ns_[tenant], tokens, params);
    if (kind == 3) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
      return;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->ranked.size(), 1u);
    EXPECT_EQ(r->ranked[0].agent_id, "gpu-0");
    EXPECT_EQ(r->ranked[0].cached_pages, r->match.local_pages);
    if (r->match.pin_id != 0) {
      EXPECT_TRUE(client_->Release(ns_[tenant], r->match.pin_id).ok());
    }
  }

  void Free(int tenant) {
    std::vector<BlockId>& pool = mine_[tenant];
    if (pool.empty()) return;
    const size_t i = Pick(pool.size());
    v1::FreeBlocksRequest req;
    req.add_block_ids(pool[i]);
    req.set_owner_epoch(agent_->epoch());
    v1::FreeBlocksResponse resp;
    grpc::ClientContext ctx;
    // Refused while the block is committed (the cache's) or freed by an eviction already.
    if (ba_->Free(&ctx, req, &resp).ok() || Pick(2) == 0) pool.erase(pool.begin() + i);
  }

  ManagerServer* const manager_;
  Agent* const agent_;
  std::mt19937_64 rng_;
  std::unique_ptr<v1::BlockAgent::Stub> ba_;
  std::unique_ptr<Client> client_;
  ModelSpec spec_;
  const NamespaceId ns_[2] = {{"alice", "dsv3"}, {"mallory", "dsv3"}};
  const PoolRef pool_{"gpu-0", Tier::kGpu};
  std::vector<std::vector<int32_t>> prompts_[2];
  std::vector<BlockId> mine_[2];  // blocks each tenant allocated (some may be gone)
  uint64_t accepted_ = 0;
  uint64_t refused_ = 0;
};

TEST(InsertFuzzTest, NoSequenceOfCallsMakesTheIndexDisagreeWithTheLedger) {
  const uint64_t seed = EnvOr("KVCM_FUZZ_SEED", 20'261'125);
  const int steps = static_cast<int>(EnvOr("KVCM_FUZZ_STEPS", 600));
  std::cout << "KVCM_FUZZ_SEED=" << seed << " KVCM_FUZZ_STEPS=" << steps << std::endl;
  ServerOptions o;
  o.tls.insecure = true;
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  absl::StatusOr<std::unique_ptr<ManagerServer>> manager = ManagerServer::Start(o);
  ASSERT_TRUE(manager.ok()) << manager.status();
  AgentOptions a;
  a.tls.insecure = true;
  a.agent_id = "gpu-0";
  a.manager_address = (*manager)->address();
  a.use_device = false;
  a.capacity_bytes = kBlocks * 1152ull * 61 * 64;
  a.heartbeat_interval_ms = 100;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(a);
  ASSERT_TRUE(agent.ok()) << agent.status();
  ASSERT_TRUE(WaitFor([&] { return (*agent)->registered(); }));

  InsertFuzzer fuzzer(manager->get(), agent->get(), seed);
  for (int step = 0; step < steps && !::testing::Test::HasFailure(); ++step) {
    SCOPED_TRACE(absl::StrCat("KVCM_FUZZ_SEED=", seed, " step ", step));
    fuzzer.Step();
    fuzzer.CheckIndexAgreesWithTheLedger();
  }
  std::cout << "inserts accepted " << fuzzer.accepted_inserts() << ", refused "
            << fuzzer.refused_inserts() << std::endl;
  EXPECT_GT(fuzzer.accepted_inserts(), 0u) << "the fuzz never got a page in";
  EXPECT_GT(fuzzer.refused_inserts(), 0u);
  (*agent)->Shutdown();
}

}  // namespace
}  // namespace kvcm
