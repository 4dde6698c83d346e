// PublishEngineEvents against a real ManagerServer with a tokens file, over loopback with raw
// stubs: an engine's bridge mirrors its prefix cache into engine pools, routers rank engines
// by what they hold, and nobody but the engine's own token changes what an engine holds.
// Every refusal is checked for its code, for a message naming the field or the principal, and
// for the admin's Stats being unchanged.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::HasSubstr;

constexpr uint32_t kPageSize = 16;
constexpr char kEngine0[] = "vllm-0-engine-token-1f2e3d";
constexpr char kEngine1[] = "vllm-1-engine-token-4a5b6c";
constexpr char kWorker[] = "acme-worker-token-7d8e9f";
constexpr char kRouter[] = "acme-router-token-0a1b2c";
constexpr char kAdmin[] = "ops-admin-token-3d4e5f6a";

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

class EngineEventsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_path_ = absl::StrCat(::testing::TempDir(), "/kvcm_engine_tokens_", getpid());
    WriteFile(tokens_path_,
              absl::StrCat(Sha256Hex(kEngine0), " vllm-0 roles=engine engine=vllm-0 tenant=acme\n",
                           Sha256Hex(kEngine1), " vllm-1 roles=engine engine=vllm-1 tenant=acme\n",
                           Sha256Hex(kWorker), " acme-worker roles=worker tenant=acme\n",
                           Sha256Hex(kRouter), " edge roles=router tenants=acme\n",
                           Sha256Hex(kAdmin), " ops roles=admin\n"));
    ServerOptions options;
    options.tls.insecure = true;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.hash_secret_hex = "000102030405060708090a0b0c0d0e0f";
    options.tokens_file = tokens_path_;
    options.lease_sweep_interval_ms = 10;
    options.shutdown_grace_ms = 500;
    absl::StatusOr<std::unique_ptr<ManagerServer>> server = ManagerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = v1::CacheManager::NewStub(MakeInsecureChannel(server_->address()));
    ns_.set_tenant("acme");
    ns_.set_model("llama-3-8b");

    // The bridge registers the namespace with its engine's token to learn the hash key.
    v1::RegisterModelRequest reg;
    *reg.mutable_namespace_() = ns_;
    v1::ModelSpec* spec = reg.mutable_spec();
    spec->set_attention(v1::ATTENTION_KIND_GQA);
    spec->set_num_layers(32);
    spec->set_num_heads(32);
    spec->set_num_kv_heads(8);
    spec->set_head_dim(128);
    spec->set_dtype(v1::KV_DTYPE_BF16);
    spec->set_page_size_tokens(kPageSize);
    v1::RegisterModelResponse resp;
    grpc::Status s = stub_->RegisterModel(Ctx(kEngine0).get(), reg, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    key_ = HashKey::FromBytes(resp.hash_key());
    scheme_ = resp.scheme();
    registration_ = reg;
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    std::remove(tokens_path_.c_str());
  }

  static std::unique_ptr<grpc::ClientContext> Ctx(absl::string_view token) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return ctx;
  }

  // Tokens of a prompt whose page i is filled with ids[i].
  static std::vector<int32_t> TokensOf(const std::vector<int32_t>& ids) {
    std::vector<int32_t> tokens;
    for (int32_t id : ids) tokens.insert(tokens.end(), kPageSize, id);
    return tokens;
  }

  std::string Hashes(const std::vector<int32_t>& ids) {
    return EncodePageHashes(HashPages(key_, TokensOf(ids), kPageSize));
  }

  v1::EngineChange Change(v1::EngineChange::Kind kind, const std::vector<int32_t>& ids,
                          v1::Tier tier = v1::TIER_GPU) {
    v1::EngineChange c;
    c.set_kind(kind);
    c.set_tier(tier);
    if (!ids.empty()) c.set_page_hashes(Hashes(ids));
    return c;
  }

  v1::PublishEngineEventsRequest Request(const std::string& engine, uint64_t session,
                                         uint64_t sequence, std::vector<v1::EngineChange> changes) {
    v1::PublishEngineEventsRequest req;
    req.set_engine_id(engine);
    *req.mutable_namespace_() = ns_;
    *req.mutable_scheme() = scheme_;
    req.set_session(session);
    req.set_sequence(sequence);
    for (v1::EngineChange& c : changes) *req.add_changes() = std::move(c);
    return req;
  }

  grpc::Status Publish(absl::string_view token, const v1::PublishEngineEventsRequest& req,
                       v1::PublishEngineEventsResponse* resp = nullptr) {
    v1::PublishEngineEventsResponse local;
    return stub_->PublishEngineEvents(Ctx(token).get(), req, resp != nullptr ? resp : &local);
  }

  v1::MatchResponse Probe(const std::vector<int32_t>& ids) {
    v1::MatchRequest req;
    *req.mutable_namespace_() = ns_;
    for (int32_t t : TokensOf(ids)) req.mutable_prompt()->mutable_tokens()->add_ids(t);
    req.set_probe(true);
    v1::MatchResponse resp;
    grpc::Status s = stub_->Match(Ctx(kRouter).get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  v1::StatsResponse AdminStats() {
    v1::StatsResponse resp;
    grpc::Status s = stub_->Stats(Ctx(kAdmin).get(), v1::StatsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    // Ages move with the clock; everything else must not.
    for (v1::EngineStats& e : *resp.mutable_engines()) e.clear_last_publish_age_ms();
    for (v1::AgentStats& a : *resp.mutable_agents()) a.clear_last_heartbeat_age_ms();
    return resp;
  }

  void ExpectRefused(absl::string_view token, const v1::PublishEngineEventsRequest& req,
                     grpc::StatusCode code, absl::string_view message) {
    const v1::StatsResponse before = AdminStats();
    grpc::Status s = Publish(token, req);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(message));
    EXPECT_TRUE(MessageDifferencer::Equals(before, AdminStats()))
        << "refused with " << s.error_message() << " but changed the index";
  }

  std::string tokens_path_;
  std::unique_ptr<ManagerServer> server_;
  std::unique_ptr<v1::CacheManager::Stub> stub_;
  v1::Namespace ns_;
  HashKey key_;
  v1::HashScheme scheme_;
  v1::RegisterModelRequest registration_;
};

// A worker of the tenant gives the namespace an age limit after the engine published: the
// engine's pages are the engine's whatever their age, and the sweeps that follow (every 10
// ms here) must neither expire them nor touch pages the engine has since removed. Before
// 33e3752 the removed pages' expiry entries outlived their nodes and the next sweep read
// freed memory: a tenant's RegisterModel could crash the manager.
TEST_F(EngineEventsTest, AnAgeLimitSetLaterLeavesTheEnginesPagesToTheEngine) {
  v1::PublishEngineEventsResponse resp;
  ASSERT_TRUE(
      Publish(kEngine0, Request("vllm-0", 5, 1, {Change(v1::EngineChange::KIND_STORED, {1, 2, 3})}))
          .ok());
  v1::RegisterModelRequest limited = registration_;
  limited.set_max_page_age_s(1);
  v1::RegisterModelResponse registered;
  grpc::Status s = stub_->RegisterModel(Ctx(kWorker).get(), limited, &registered);
  ASSERT_TRUE(s.ok()) << s.error_message();
  s = Publish(kEngine0, Request("vllm-0", 5, 2, {Change(v1::EngineChange::KIND_REMOVED, {1})}),
              &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.removed_pages(), 3u);
  s = Publish(kEngine0, Request("vllm-0", 5, 3, {Change(v1::EngineChange::KIND_STORED, {1, 2})}));
  ASSERT_TRUE(s.ok()) << s.error_message();
  absl::SleepFor(absl::Milliseconds(2500));  // past the limit: a couple of hundred sweeps
  s = Publish(kEngine0, Request("vllm-0", 5, 4, {}), &resp);  // a heartbeat
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.pages(), 2u) << "the sweep expired an engine's pages";
  EXPECT_EQ(Probe({1, 2}).matched_pages(), 2u);
}

TEST_F(EngineEventsTest, StoredChainsMatchInTheEnginesPool) {
  v1::PublishEngineEventsResponse resp;
  grpc::Status s = Publish(kEngine0,
                           Request("vllm-0", 42, 1,
                                   {Change(v1::EngineChange::KIND_STORED, {1, 2, 3}),
                                    Change(v1::EngineChange::KIND_STORED, {1, 2, 4})}),
                           &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.stored_pages(), 4u);
  EXPECT_EQ(resp.pages(), 4u);
  v1::MatchResponse m = Probe({1, 2, 3, 9});
  EXPECT_EQ(m.matched_pages(), 3u);
  ASSERT_GE(m.segments_size(), 1);
  const v1::Replica& r = m.segments(0).replicas(0);
  EXPECT_EQ(r.pool().agent_id(), "vllm-0");
  EXPECT_EQ(r.block_ids(0), 0xFFFFFFFEu);

  // One removal takes page 2 and everything under it.
  s = Publish(kEngine0, Request("vllm-0", 42, 2, {Change(v1::EngineChange::KIND_REMOVED, {1, 2})}),
              &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.removed_pages(), 3u);
  EXPECT_EQ(Probe({1, 2, 3}).matched_pages(), 1u);

  const v1::StatsResponse stats = AdminStats();
  ASSERT_EQ(stats.engines_size(), 1);
  EXPECT_EQ(stats.engines(0).engine_id(), "vllm-0");
  EXPECT_EQ(stats.engines(0).session(), 42u);
  EXPECT_EQ(stats.engines(0).sequence(), 2u);
  EXPECT_EQ(stats.engines(0).pages(), 1u);
  bool found = false;
  for (const v1::PoolStats& p : stats.pools()) {
    if (p.pool().agent_id() != "vllm-0") continue;
    found = true;
    EXPECT_TRUE(p.engine());
    EXPECT_EQ(p.capacity_bytes(), 0u);
  }
  EXPECT_TRUE(found);
  // Metrics count the engine's work.
  const std::string text = server_->metrics().RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_engine_sessions 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_engine_pages_stored_total 4"));
  EXPECT_THAT(text, HasSubstr("kvcm_engine_pages_removed_total 3"));
}

TEST_F(EngineEventsTest, RouteRanksEnginesByWhatTheyHoldAndTheirQueues) {
  ASSERT_TRUE(Publish(kEngine0, Request("vllm-0", 1, 1,
                                        {Change(v1::EngineChange::KIND_STORED, {1, 2, 3, 4})}))
                  .ok());
  ASSERT_TRUE(
      Publish(kEngine1, Request("vllm-1", 2, 1, {Change(v1::EngineChange::KIND_STORED, {7, 8})}))
          .ok());
  auto route = [&](const std::vector<int32_t>& ids, uint64_t queued0) {
    v1::RouteRequest req;
    *req.mutable_namespace_() = ns_;
    for (int32_t t : TokensOf(ids)) req.mutable_prompt()->mutable_tokens()->add_ids(t);
    req.set_probe(true);
    v1::RouteCandidate* c0 = req.add_candidates();
    c0->set_agent_id("vllm-0");
    c0->set_queued_prefill_tokens(queued0);
    req.add_candidates()->set_agent_id("vllm-1");
    v1::RouteResponse resp;
    grpc::Status s = stub_->Route(Ctx(kRouter).get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  };
  v1::RouteResponse r = route({1, 2, 3, 4, 5}, 0);
  ASSERT_EQ(r.ranked_size(), 2);
  EXPECT_EQ(r.ranked(0).agent_id(), "vllm-0");
  EXPECT_EQ(r.ranked(0).cached_pages(), 4u);
  EXPECT_EQ(r.ranked(0).fetch_pages(), 0u);  // an engine cannot fetch
  EXPECT_EQ(r.ranked(1).cached_pages(), 0u);
  EXPECT_EQ(r.ranked(1).fetch_pages(), 0u);
  EXPECT_EQ(route({7, 8, 9}, 0).ranked(0).agent_id(), "vllm-1");
  // A long queue on the holder outweighs what it saves (4 pages = 64 tokens).
  EXPECT_EQ(route({1, 2, 3, 4, 5}, 100'000).ranked(0).agent_id(), "vllm-1");

  // No candidates: every live engine. An engine without a session is unknown.
  v1::RouteRequest all;
  *all.mutable_namespace_() = ns_;
  for (int32_t t : TokensOf({7, 8})) all.mutable_prompt()->mutable_tokens()->add_ids(t);
  all.set_probe(true);
  v1::RouteResponse resp;
  ASSERT_TRUE(stub_->Route(Ctx(kRouter).get(), all, &resp).ok());
  ASSERT_EQ(resp.ranked_size(), 2);
  EXPECT_EQ(resp.ranked(0).agent_id(), "vllm-1");
  all.add_candidates()->set_agent_id("vllm-9");
  grpc::Status s = stub_->Route(Ctx(kRouter).get(), all, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("candidates[0].agent_id \"vllm-9\""));
}

TEST_F(EngineEventsTest, OnlyTheEnginesOwnTokenPublishes) {
  ASSERT_TRUE(
      Publish(kEngine0, Request("vllm-0", 1, 1, {Change(v1::EngineChange::KIND_STORED, {1, 2})}))
          .ok());
  const auto req = [&](const std::string& engine) {
    return Request(engine, 1, 2, {Change(v1::EngineChange::KIND_CLEARED, {})});
  };
  ExpectRefused("", req("vllm-0"), grpc::StatusCode::UNAUTHENTICATED, "authorization");
  ExpectRefused("not-a-known-token-123456", req("vllm-0"), grpc::StatusCode::UNAUTHENTICATED, "");
  ExpectRefused(kWorker, req("vllm-0"), grpc::StatusCode::PERMISSION_DENIED,
                "principal acme-worker");
  ExpectRefused(kAdmin, req("vllm-0"), grpc::StatusCode::PERMISSION_DENIED, "principal ops");
  ExpectRefused(kRouter, req("vllm-0"), grpc::StatusCode::PERMISSION_DENIED, "principal edge");
  ExpectRefused(kEngine1, req("vllm-0"), grpc::StatusCode::PERMISSION_DENIED,
                "publish the events of engine \"vllm-0\"");
  v1::PublishEngineEventsRequest other_tenant = req("vllm-0");
  other_tenant.mutable_namespace_()->set_tenant("globex");
  ExpectRefused(kEngine0, other_tenant, grpc::StatusCode::PERMISSION_DENIED,
                "into tenant \"globex\"");
  EXPECT_EQ(Probe({1, 2}).matched_pages(), 2u);
}

TEST_F(EngineEventsTest, BadRequestsNameTheFieldAndChangeNothing) {
  ASSERT_TRUE(
      Publish(kEngine0, Request("vllm-0", 1, 1, {Change(v1::EngineChange::KIND_STORED, {1, 2})}))
          .ok());
  using C = v1::EngineChange;
  auto next = [&](std::vector<v1::EngineChange> changes) {
    return Request("vllm-0", 1, 2, std::move(changes));
  };
  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  v1::PublishEngineEventsRequest r = next({});
  r.set_session(0);
  ExpectRefused(kEngine0, r, kInvalid, "session must be non-zero");
  r = next({});
  r.set_sequence(0);
  ExpectRefused(kEngine0, r, kInvalid, "sequence must be at least 1");
  r = next({});
  r.set_ttl_ms(600'001);
  ExpectRefused(kEngine0, r, kInvalid, "ttl_ms 600001 exceeds");
  r = next({});
  r.clear_scheme();
  ExpectRefused(kEngine0, r, kInvalid, "scheme is required");
  r = next({});
  r.clear_namespace_();
  ExpectRefused(kEngine0, r, grpc::StatusCode::PERMISSION_DENIED, "tenant \"\"");
  r = next({Change(C::KIND_STORED, {3}), Change(C::KIND_UNSPECIFIED, {3})});
  ExpectRefused(kEngine0, r, kInvalid, "changes[1].kind");
  r = next({Change(C::KIND_STORED, {3}, v1::TIER_UNSPECIFIED)});
  ExpectRefused(kEngine0, r, kInvalid, "changes[0].tier");
  r = next({Change(C::KIND_STORED, {3})});
  r.mutable_changes(0)->mutable_page_hashes()->push_back('x');
  ExpectRefused(kEngine0, r, kInvalid, "changes[0].page_hashes must be a non-empty multiple of 16");
  r = next({Change(C::KIND_REMOVED, {})});
  ExpectRefused(kEngine0, r, kInvalid, "changes[0].page_hashes must be a non-empty");
  r = next({Change(C::KIND_CLEARED, {1})});
  ExpectRefused(kEngine0, r, kInvalid, "changes[0].page_hashes must be empty for KIND_CLEARED");
  r = next({});
  r.mutable_scheme()->set_key_fingerprint(r.scheme().key_fingerprint() + 1);
  ExpectRefused(kEngine0, r, grpc::StatusCode::FAILED_PRECONDITION, "scheme.key_fingerprint");
  r = next({});
  r.mutable_scheme()->set_page_size_tokens(kPageSize * 2);
  ExpectRefused(kEngine0, r, kInvalid, "scheme.page_size_tokens 32");
  r = next({});
  r.mutable_namespace_()->set_model("unknown-model");
  ExpectRefused(kEngine0, r, grpc::StatusCode::NOT_FOUND, "unknown-model");
  // Sequences: a gap and an unknown session.
  ExpectRefused(kEngine0, Request("vllm-0", 1, 3, {}), grpc::StatusCode::FAILED_PRECONDITION,
                "sequence: engine vllm-0 session 1 expected 2, got 3");
  ExpectRefused(kEngine0, Request("vllm-0", 5, 2, {}), grpc::StatusCode::FAILED_PRECONDITION,
                "sequence: session 5 of engine vllm-0 is unknown");
  // The session is intact: its next request applies, and a retry of it applies once.
  v1::PublishEngineEventsResponse resp;
  ASSERT_TRUE(Publish(kEngine0, next({Change(C::KIND_STORED, {1, 2, 3})}), &resp).ok());
  EXPECT_EQ(resp.stored_pages(), 1u);
  ASSERT_TRUE(Publish(kEngine0, next({Change(C::KIND_STORED, {1, 2, 3})}), &resp).ok());
  EXPECT_EQ(resp.stored_pages(), 0u);
  EXPECT_EQ(Probe({1, 2, 3}).matched_pages(), 3u);
}

TEST_F(EngineEventsTest, EnginesAndAgentsNeverShareAPool) {
  // An admin's insert makes "gpu-0" an index-only pool; no engine may publish as it.
  v1::InsertRequest ins;
  *ins.mutable_namespace_() = ns_;
  for (int32_t t : TokensOf({5})) ins.mutable_prompt()->mutable_tokens()->add_ids(t);
  ins.mutable_pool()->set_agent_id("gpu-0");
  ins.mutable_pool()->set_tier(v1::TIER_GPU);
  ins.add_block_ids(3);
  v1::InsertResponse ins_resp;
  ASSERT_TRUE(stub_->Insert(Ctx(kAdmin).get(), ins, &ins_resp).ok());
  // The tokens file grants no engine gpu-0; with the open dev mode it would be the pool check
  // that refuses, which the core test covers. Here: an engine's pool refuses inserts, evicts.
  ASSERT_TRUE(
      Publish(kEngine0, Request("vllm-0", 1, 1, {Change(v1::EngineChange::KIND_STORED, {1, 2})}))
          .ok());
  const v1::StatsResponse before = AdminStats();
  ins.mutable_pool()->set_agent_id("vllm-0");
  grpc::Status s = stub_->Insert(Ctx(kAdmin).get(), ins, &ins_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("is engine vllm-0's pool"));
  v1::EvictRequest evict;
  evict.mutable_pool()->set_agent_id("vllm-0");
  evict.mutable_pool()->set_tier(v1::TIER_GPU);
  evict.set_bytes(1);
  v1::EvictResponse evict_resp;
  s = stub_->Evict(Ctx(kAdmin).get(), evict, &evict_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  v1::ReserveRequest reserve;
  *reserve.mutable_pool() = evict.pool();
  reserve.set_bytes(1);
  v1::ReserveResponse reserve_resp;
  s = stub_->Reserve(Ctx(kAdmin).get(), reserve, &reserve_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(MessageDifferencer::Equals(before, AdminStats()));
}

TEST_F(EngineEventsTest, ASilentSessionLapsesAndANewOneStartsFromNothing) {
  v1::PublishEngineEventsRequest req =
      Request("vllm-0", 1, 1, {Change(v1::EngineChange::KIND_STORED, {1, 2, 3})});
  req.set_ttl_ms(300);
  ASSERT_TRUE(Publish(kEngine0, req).ok());
  EXPECT_EQ(Probe({1, 2, 3}).matched_pages(), 3u);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (AdminStats().engines_size() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(AdminStats().engines_size(), 0);
  EXPECT_EQ(Probe({1, 2, 3}).matched_pages(), 0u);
  EXPECT_THAT(server_->metrics().RenderText(), HasSubstr("kvcm_engine_sessions_lapsed_total 1"));
  // The bridge's next request is refused; it starts over with its whole view.
  grpc::Status s = Publish(kEngine0, Request("vllm-0", 1, 2, {}));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(
      Publish(kEngine0, Request("vllm-0", 2, 1, {Change(v1::EngineChange::KIND_STORED, {1, 2})}))
          .ok());
  EXPECT_EQ(Probe({1, 2, 3}).matched_pages(), 2u);
  // close ends it at once.
  v1::PublishEngineEventsRequest close = Request("vllm-0", 2, 2, {});
  close.set_close(true);
  ASSERT_TRUE(Publish(kEngine0, close).ok());
  EXPECT_EQ(Probe({1, 2}).matched_pages(), 0u);
  EXPECT_EQ(AdminStats().engines_size(), 0);
}

TEST_F(EngineEventsTest, NonAdminsSeeOnlyTheirTenantsEngines) {
  ASSERT_TRUE(
      Publish(kEngine0, Request("vllm-0", 1, 1, {Change(v1::EngineChange::KIND_STORED, {1})}))
          .ok());
  v1::StatsResponse resp;
  ASSERT_TRUE(stub_->Stats(Ctx(kRouter).get(), v1::StatsRequest(), &resp).ok());
  EXPECT_EQ(resp.engines_size(), 1);  // edge may probe acme
  ASSERT_TRUE(stub_->Stats(Ctx(kEngine1).get(), v1::StatsRequest(), &resp).ok());
  EXPECT_EQ(resp.engines_size(), 0);  // an engine is no prober
}

}  // namespace
}  // namespace kvcm
