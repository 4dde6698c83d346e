// CacheManager.Route end to end, in process: a manager, three agents (host pools, TCP
// transport) and the real client. The agent that holds a prompt is ranked first, the others
// would fetch it; a probe changes nothing (counters, pins, the round-robin step); a pinned
// Route pins for the chosen agent; every bad request is refused with its field named and
// nothing changed; an agent's measured pull bandwidth replaces the manager's default.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/in_process_cluster.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateIn;
using ::kvcm::testing::BlockAgentStub;
using ::kvcm::testing::Bytes;
using ::kvcm::testing::ConnectAndRegister;
using ::kvcm::testing::StartAgent;
using ::kvcm::testing::StartManager;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kBlocks = 8;
constexpr size_t kPages = 3;

std::vector<std::string> Ids(const RouteReply& r) {
  std::vector<std::string> ids;
  for (const RouteReply::Ranked& a : r.ranked) ids.push_back(a.agent_id);
  return ids;
}

class RouteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manager_ = StartManager();
    for (const char* id : {"gpu-a", "gpu-b", "gpu-c"}) {
      agents_.push_back(StartAgent(manager_->address(), kBlocks, 0, id));
    }
    ASSERT_TRUE(WaitFor([&] {
      for (const auto& a : agents_) {
        if (!a->registered()) return false;
      }
      return true;
    }));
    spec_ = agents_[0]->pool().geometry().spec;
    client_ = ConnectAndRegister(manager_->address(), ns_, spec_);
    ASSERT_NE(client_, nullptr);
    tokens_ = Tokens(kPages, spec_.page_size_tokens, 1);
    // The prompt's pages on gpu-b.
    std::unique_ptr<v1::BlockAgent::Stub> b = BlockAgentStub(*agents_[1]);
    blocks_on_b_ = AllocateIn(*b, kPages, agents_[1]->epoch(), ns_);
    ASSERT_TRUE(WriteAll(*b, blocks_on_b_, agents_[1]->epoch(),
                         Bytes(kPages * agents_[1]->pool().geometry().bytes_per_block(), 1))
                    .ok());
    ASSERT_TRUE(client_->Insert(ns_, tokens_, PoolRef{"gpu-b", Tier::kGpu}, blocks_on_b_).ok());
  }

  // What a refused or probing Route must leave as it was.
  std::tuple<uint64_t, uint64_t, uint64_t> Observable() {
    absl::StatusOr<ManagerStats> s = client_->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    return {s->counters.match_requests, s->counters.pins_taken, s->counters.matched_pages};
  }

  // The raw stub, for requests the client would never send.
  grpc::Status RawRoute(const v1::RouteRequest& req, v1::RouteResponse* resp = nullptr) {
    auto stub = v1::CacheManager::NewStub(MakeInsecureChannel(manager_->address()));
    v1::RouteResponse ignored;
    grpc::ClientContext ctx;
    return stub->Route(&ctx, req, resp != nullptr ? resp : &ignored);
  }

  v1::RouteRequest GoodRequest() {
    v1::RouteRequest req;
    req.mutable_namespace_()->set_tenant(ns_.tenant);
    req.mutable_namespace_()->set_model(ns_.model);
    req.mutable_prompt()->mutable_tokens()->mutable_ids()->Add(tokens_.begin(), tokens_.end());
    return req;
  }

  std::unique_ptr<ManagerServer> manager_;
  std::vector<std::unique_ptr<Agent>> agents_;
  ModelSpec spec_;
  const NamespaceId ns_{"acme", "deepseek-v3"};
  std::unique_ptr<Client> client_;
  std::vector<int32_t> tokens_;
  std::vector<BlockId> blocks_on_b_;
};

TEST_F(RouteTest, TheHolderIsRankedFirstAndTheOthersWouldFetch) {
  absl::StatusOr<RouteReply> r = client_->Route(ns_, tokens_);
  ASSERT_TRUE(r.ok()) << r.status();
  // Every live agent (none named), the holder first, the others by id (equal savings).
  EXPECT_THAT(Ids(*r), ElementsAre("gpu-b", "gpu-a", "gpu-c"));
  const RouteReply::Ranked& best = r->ranked[0];
  EXPECT_EQ(best.cached_pages, kPages);
  EXPECT_EQ(best.fetch_pages, 0u);
  EXPECT_EQ(best.transfer_ms, 0);
  const double prefill_ms = 1e3 * kPages * spec_.page_size_tokens / 10'000.0;  // the default
  EXPECT_DOUBLE_EQ(best.saved_prefill_ms, prefill_ms);
  // A DeepSeek-V3 page (4.5 MB) moves in 1.4 ms over the default 25 Gbit/s of a TCP agent
  // and takes 6.4 ms to recompute: the others fetch.
  for (size_t i = 1; i < 3; ++i) {
    const RouteReply::Ranked& other = r->ranked[i];
    EXPECT_EQ(other.cached_pages, 0u);
    EXPECT_EQ(other.fetch_pages, kPages);
    EXPECT_EQ(other.link_gbps, 25);
    EXPECT_DOUBLE_EQ(other.transfer_ms, 1e3 * kPages * spec_.BytesPerPage() * 8 / 25e9);
    EXPECT_LT(other.saved_prefill_ms, best.saved_prefill_ms);
  }
  // The match is the chosen agent's: its replica, its local pages.
  EXPECT_EQ(r->match.matched_pages, kPages);
  EXPECT_EQ(r->match.local_pages, kPages);
  ASSERT_EQ(r->match.segments.size(), 1u);
  EXPECT_EQ(r->match.segments[0].replicas[0].pool.agent_id, "gpu-b");
  EXPECT_EQ(r->match.segments[0].replicas[0].block_ids, blocks_on_b_);
  EXPECT_EQ(r->match.pin_id, 0u);
}

TEST_F(RouteTest, NamedCandidatesOnlyAndAQueueOutweighsTheCache) {
  RouteParams params;
  params.candidates = {{.agent_id = "gpu-c"}, {.agent_id = "gpu-b"}};
  absl::StatusOr<RouteReply> r = client_->Route(ns_, tokens_, params);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(Ids(*r), ElementsAre("gpu-b", "gpu-c"));
  // One second of prefill queued on the holder: fetching to gpu-c saves more.
  params.candidates[1].queued_prefill_tokens = 10'000;
  r = client_->Route(ns_, tokens_, params);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(Ids(*r), ElementsAre("gpu-c", "gpu-b"));
  EXPECT_EQ(r->ranked[1].queue_ms, 1000);
  EXPECT_EQ(r->match.local_pages, 0u);  // the match is gpu-c's now
  EXPECT_EQ(r->match.segments[0].replicas[0].pool.agent_id, "gpu-b");
  // A queue shorter than the transfer it saves (2 ms against 4.3 ms) keeps the holder first.
  params.candidates[1].queued_prefill_tokens = 20;
  r = client_->Route(ns_, tokens_, params);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(Ids(*r), ElementsAre("gpu-b", "gpu-c"));
}

TEST_F(RouteTest, AProbeChangesNothingAndDoesNotStepTheRoundRobin) {
  const auto before = Observable();
  RouteParams probe{.policy = RouteParams::Policy::kRoundRobin, .probe = true};
  absl::StatusOr<RouteReply> first = client_->Route(ns_, tokens_, probe);
  absl::StatusOr<RouteReply> second = client_->Route(ns_, tokens_, probe);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(Observable(), before);
  EXPECT_EQ(Ids(*first), Ids(*second));
  EXPECT_EQ(first->ranked[0].agent_id, "gpu-a");  // step 0 of 3 agents by id
  // A probe's match lists the chosen agent's replicas first like a real one.
  EXPECT_EQ(first->match.local_pages, 0u);
  // A real Route counts as a match and steps the round-robin.
  RouteParams real{.policy = RouteParams::Policy::kRoundRobin};
  absl::StatusOr<RouteReply> r0 = client_->Route(ns_, tokens_, real);
  absl::StatusOr<RouteReply> r1 = client_->Route(ns_, tokens_, real);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_EQ(r0->ranked[0].agent_id, "gpu-a");
  EXPECT_EQ(r1->ranked[0].agent_id, "gpu-b");
  EXPECT_EQ(std::get<0>(Observable()), std::get<0>(before) + 2);
}

TEST_F(RouteTest, APinnedRoutePinsForTheChosenAgent) {
  absl::StatusOr<RouteReply> r =
      client_->Route(ns_, tokens_, {.pin = true, .lease_ttl_ms = 60'000});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->match.pin_id, 0u);
  EXPECT_EQ(r->match.local_pages, kPages);
  absl::StatusOr<ManagerStats> s = client_->Stats();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->counters.pins_taken, 1u);
  EXPECT_TRUE(client_->Release(ns_, r->match.pin_id).ok());
}

TEST_F(RouteTest, BadRequestsNameTheFieldAndChangeNothing) {
  const auto before = Observable();
  struct Case {
    std::string name;
    std::function<void(v1::RouteRequest*)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown agent",
       [](v1::RouteRequest* r) {
         r->add_candidates()->set_agent_id("gpu-a");
         r->add_candidates()->set_agent_id("gpu-z");
       },
       grpc::NOT_FOUND, "candidates[1].agent_id \"gpu-z\" is not a live agent"},
      {"repeated agent",
       [](v1::RouteRequest* r) {
         r->add_candidates()->set_agent_id("gpu-a");
         r->add_candidates()->set_agent_id("gpu-a");
       },
       grpc::INVALID_ARGUMENT, "candidates[1].agent_id repeats candidates[0]"},
      {"malformed agent", [](v1::RouteRequest* r) { r->add_candidates()->set_agent_id("a b"); },
       grpc::INVALID_ARGUMENT, "candidates[0].agent_id"},
      {"too many candidates",
       [](v1::RouteRequest* r) {
         for (int i = 0; i < 257; ++i) r->add_candidates()->set_agent_id(absl::StrCat("g", i));
       },
       grpc::INVALID_ARGUMENT, "candidates: at most 256"},
      {"unknown policy",
       [](v1::RouteRequest* r) { r->set_policy(static_cast<v1::RoutePolicy>(9)); },
       grpc::INVALID_ARGUMENT, "policy 9 is unknown"},
      {"NaN prefill rate", [](v1::RouteRequest* r) { r->set_prefill_tokens_per_s(std::nan("")); },
       grpc::INVALID_ARGUMENT, "prefill_tokens_per_s"},
      {"negative prefill rate", [](v1::RouteRequest* r) { r->set_prefill_tokens_per_s(-5); },
       grpc::INVALID_ARGUMENT, "prefill_tokens_per_s"},
      {"probe and pin",
       [](v1::RouteRequest* r) {
         r->set_probe(true);
         r->set_pin(true);
       },
       grpc::INVALID_ARGUMENT, "probe and pin"},
      {"lease too long", [](v1::RouteRequest* r) { r->set_lease_ttl_ms(4'000'000'000u); },
       grpc::INVALID_ARGUMENT, "lease_ttl_ms"},
      {"no prompt", [](v1::RouteRequest* r) { r->clear_prompt(); }, grpc::INVALID_ARGUMENT,
       "prompt"},
      {"unknown namespace",
       [](v1::RouteRequest* r) { r->mutable_namespace_()->set_model("other"); }, grpc::NOT_FOUND,
       "other"},
  };
  for (const Case& c : cases) {
    v1::RouteRequest req = GoodRequest();
    c.mutate(&req);
    const grpc::Status s = RawRoute(req);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
  }
  EXPECT_EQ(Observable(), before);
  v1::RouteResponse ok;
  ASSERT_TRUE(RawRoute(GoodRequest(), &ok).ok());
}

TEST_F(RouteTest, NoLiveAgentIsFailedPrecondition) {
  for (auto& a : agents_) a.reset();
  ServerOptions o;
  o.agent_heartbeat_timeout_ms = 50;
  manager_ = StartManager(o);  // a manager that never saw an agent
  client_ = ConnectAndRegister(manager_->address(), ns_, spec_);
  ASSERT_NE(client_, nullptr);
  absl::StatusOr<RouteReply> r = client_->Route(ns_, tokens_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("no live agent"));
}

TEST_F(RouteTest, AMeasuredPullBandwidthReplacesTheDefault) {
  // gpu-c fetches the prompt from gpu-b; its next heartbeat carries what it measured.
  std::unique_ptr<v1::BlockAgent::Stub> c = BlockAgentStub(*agents_[2]);
  absl::StatusOr<RouteReply> planned =
      client_->Route(ns_, tokens_, {.candidates = {{.agent_id = "gpu-c"}}});
  ASSERT_TRUE(planned.ok()) << planned.status();
  ASSERT_EQ(planned->ranked[0].fetch_pages, kPages);
  absl::StatusOr<std::vector<PageHash>> hashes = manager_->index().HashTokens(ns_, tokens_);
  ASSERT_TRUE(hashes.ok());
  absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(ns_, spec_);
  ASSERT_TRUE(reg.ok());
  const v1::FetchRequest req =
      testing::FetchRequestFor(ns_, *hashes, spec_.page_size_tokens, reg->key_fingerprint, "gpu-b",
                               planned->match.segments[0].replicas[0].block_ids);
  v1::FetchResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status fetched = c->Fetch(&ctx, req, &resp);
  ASSERT_TRUE(fetched.ok()) << fetched.error_message();
  ASSERT_GT(agents_[2]->metrics().pull_gbps(), 0);
  double reported = 0;
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<RouteReply> r = client_->Route(ns_, tokens_, {.probe = true});
    if (!r.ok()) return false;
    for (const RouteReply::Ranked& a : r->ranked) {
      if (a.agent_id == "gpu-c") reported = a.link_gbps;
    }
    return reported != 25;
  }));
  EXPECT_GT(reported, 0);
  // gpu-c now holds the prompt too: it ties with gpu-b on the cache.
  absl::StatusOr<RouteReply> r = client_->Route(ns_, tokens_, {.probe = true});
  ASSERT_TRUE(r.ok());
  for (const RouteReply::Ranked& a : r->ranked) {
    if (a.agent_id != "gpu-a") {
      EXPECT_EQ(a.cached_pages, kPages) << a.agent_id;
    }
  }
}

}  // namespace
}  // namespace kvcm
