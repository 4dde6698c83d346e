// Issue 10's attacks, replayed against a real ManagerServer with a tokens file, over a
// loopback channel: a hostile tenant ("evil") with a valid worker token tries every move the
// issue lists against a victim tenant ("acme"). Each refusal is checked for its code, for a
// message that says why, and for the victim's state being unchanged (the admin's Stats before
// and after, and the victim's own Match).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/mla_spec.h"

namespace kvcm {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::kvcm::testing::MlaSpecProto;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr uint32_t kPageSize = 16;

// Bearer tokens (the file holds only their SHA-256).
constexpr char kAcme[] = "acme-worker-token-5d1c0f";
constexpr char kEvil[] = "evil-worker-token-88a2e1";
constexpr char kAcmeRouter[] = "acme-router-token-a9e0c3";
constexpr char kAgent0[] = "agent-gpu-0-token-61f7d2";
constexpr char kAdmin[] = "ops-admin-token-0b7d44e2";
constexpr char kLater[] = "added-later-token-3c8e19";
constexpr char kAcmeEngine[] = "acme-engine-token-7e21b4";

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

std::string TokensFile() {
  return absl::StrCat("# test principals\n",                                      //
                      Sha256Hex(kAcme), " acme-vllm roles=worker tenant=acme\n",  //
                      Sha256Hex(kEvil), " evil-vllm roles=worker tenant=evil\n",  //
                      Sha256Hex(kAcmeRouter), " edge roles=router tenants=acme\n",
                      Sha256Hex(kAgent0), " gpu-0 roles=agent agent=gpu-0\n",  //
                      Sha256Hex(kAdmin), " ops roles=admin\n",                 //
                      Sha256Hex(kAcmeEngine), " acme-sglang roles=engine engine=acme-engine-1",
                      " tenant=acme\n");
}

class TenantAttackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_path_ = absl::StrCat(::testing::TempDir(), "/kvcm_tokens_", getpid());
    WriteFile(tokens_path_, TokensFile());
    ServerOptions options;
    options.tls.insecure = true;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.hash_secret_hex = "000102030405060708090a0b0c0d0e0f";
    options.tokens_file = tokens_path_;
    options.lease_sweep_interval_ms = 10;
    options.shutdown_grace_ms = 500;
    options.max_namespaces_per_tenant = 3;
    absl::StatusOr<std::unique_ptr<ManagerServer>> server = ManagerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = MakeInsecureChannel(server_->address());
    stub_ = v1::CacheManager::NewStub(channel_);
    agent_stub_ = v1::AgentControl::NewStub(channel_);
    acme_.set_tenant("acme");
    acme_.set_model("deepseek-v3");
    evil_.set_tenant("evil");
    evil_.set_model("deepseek-v3");

    // The victim's cache: acme registers, the admin creates an index-only pool, acme
    // inserts a 4-page prompt and pins it.
    ASSERT_TRUE(Register(kAcme, acme_).ok());
    ASSERT_TRUE(Register(kEvil, evil_).ok());
    v1::InsertResponse ins;
    ASSERT_TRUE(Insert(kAdmin, acme_, Tokens(0, 1), "pool-a", {100}, &ins).ok());
    ASSERT_TRUE(Insert(kAcme, acme_, Tokens(0, 4), "pool-a", {100, 101, 102, 103}, &ins).ok());
    v1::MatchResponse m;
    ASSERT_TRUE(Match(kAcme, acme_, Tokens(0, 4), /*pin=*/true, /*probe=*/false, &m).ok());
    ASSERT_EQ(m.matched_pages(), 4u);
    acme_pin_ = m.pin_id();
    before_ = AdminStats();
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    std::remove(tokens_path_.c_str());
  }

  // A context carrying `token` (none when empty), with a deadline.
  static std::unique_ptr<grpc::ClientContext> Ctx(absl::string_view token) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return ctx;
  }

  // Tokens of pages [first, first + pages) of a fixed conversation.
  static v1::Prompt Tokens(int first, int pages) {
    v1::Prompt p;
    for (int i = first * kPageSize; i < (first + pages) * static_cast<int>(kPageSize); ++i) {
      p.mutable_tokens()->add_ids(1000 + i);
    }
    return p;
  }

  grpc::Status Register(absl::string_view token, const v1::Namespace& ns,
                        v1::RegisterModelResponse* resp = nullptr) {
    v1::RegisterModelRequest req;
    *req.mutable_namespace_() = ns;
    *req.mutable_spec() = MlaSpecProto(kPageSize);
    v1::RegisterModelResponse local;
    return stub_->RegisterModel(Ctx(token).get(), req, resp != nullptr ? resp : &local);
  }

  grpc::Status Insert(absl::string_view token, const v1::Namespace& ns, const v1::Prompt& prompt,
                      const std::string& agent, std::vector<uint32_t> blocks,
                      v1::InsertResponse* resp) {
    v1::InsertRequest req;
    *req.mutable_namespace_() = ns;
    *req.mutable_prompt() = prompt;
    req.mutable_pool()->set_agent_id(agent);
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    req.mutable_block_ids()->Add(blocks.begin(), blocks.end());
    return stub_->Insert(Ctx(token).get(), req, resp);
  }

  grpc::Status Match(absl::string_view token, const v1::Namespace& ns, const v1::Prompt& prompt,
                     bool pin, bool probe, v1::MatchResponse* resp) {
    v1::MatchRequest req;
    *req.mutable_namespace_() = ns;
    *req.mutable_prompt() = prompt;
    req.set_pin(pin);
    req.set_probe(probe);
    return stub_->Match(Ctx(token).get(), req, resp);
  }

  grpc::Status Stats(absl::string_view token, v1::StatsResponse* resp) {
    return stub_->Stats(Ctx(token).get(), v1::StatsRequest(), resp);
  }

  v1::StatsResponse AdminStats() {
    v1::StatsResponse s;
    EXPECT_TRUE(Stats(kAdmin, &s).ok());
    return s;
  }

  // The victim's state is as SetUp left it: the same Stats, its pin alive, its pages there.
  void ExpectVictimUnchanged() {
    v1::StatsResponse now = AdminStats();
    EXPECT_TRUE(MessageDifferencer::Equals(before_, now)) << "before:\n"
                                                          << before_.DebugString() << "\nafter:\n"
                                                          << now.DebugString();
    v1::RenewLeaseRequest renew;
    *renew.mutable_namespace_() = acme_;
    renew.set_pin_id(acme_pin_);
    v1::RenewLeaseResponse renewed;
    EXPECT_TRUE(stub_->RenewLease(Ctx(kAcme).get(), renew, &renewed).ok()) << "acme's pin died";
    v1::MatchResponse m;
    ASSERT_TRUE(Match(kAcme, acme_, Tokens(0, 4), false, /*probe=*/true, &m).ok());
    EXPECT_EQ(m.matched_pages(), 4u);
  }

  static void ExpectDenied(const grpc::Status& s, absl::string_view principal,
                           absl::string_view what) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("principal ", principal)));
    EXPECT_THAT(s.error_message(), HasSubstr(what));
  }

  std::string tokens_path_;
  std::unique_ptr<ManagerServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CacheManager::Stub> stub_;
  std::unique_ptr<v1::AgentControl::Stub> agent_stub_;
  v1::Namespace acme_, evil_;
  uint64_t acme_pin_ = 0;
  v1::StatsResponse before_;
};

TEST_F(TenantAttackTest, NoTokenOrAWrongOneIsUnauthenticatedForEveryKindOfCall) {
  for (absl::string_view token :
       {absl::string_view(), absl::string_view("not-a-known-token-xyz")}) {
    v1::RegisterModelResponse reg;
    grpc::Status s = Register(token, acme_, &reg);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_TRUE(reg.hash_key().empty());
    v1::MatchResponse m;
    EXPECT_EQ(Match(token, acme_, Tokens(0, 4), false, true, &m).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    v1::StatsResponse st;
    EXPECT_EQ(Stats(token, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    // A server stream and a client stream are refused just the same.
    auto ctx = Ctx(token);
    std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> events =
        stub_->WatchEvents(ctx.get(), v1::WatchEventsRequest());
    v1::CacheEvent event;
    EXPECT_FALSE(events->Read(&event));
    EXPECT_EQ(events->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    auto inv_ctx = Ctx(token);
    v1::InventoryReply reply;
    std::unique_ptr<grpc::ClientWriter<v1::InventoryChunk>> inventory =
        agent_stub_->ReportInventory(inv_ctx.get(), &reply);
    inventory->WritesDone();
    EXPECT_EQ(inventory->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Basic YWxhZGRpbjpvcGVuc2VzYW1l");
    v1::StatsResponse st;
    grpc::Status s = stub_->Stats(ctx.get(), v1::StatsRequest(), &st);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), HasSubstr("Bearer"));
  }
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, RegisterModelNeverHandsAnotherTenantsHashKey) {
  v1::RegisterModelResponse reg;
  ExpectDenied(Register(kEvil, acme_, &reg), "evil-vllm", "tenant \"acme\"");
  EXPECT_TRUE(reg.hash_key().empty());
  // A router of acme reads the key of acme's existing namespace (to hash what it probes),
  // but creates nothing, tightens no retention, and reads no other tenant's key.
  v1::RegisterModelResponse acme_reg;
  ASSERT_TRUE(Register(kAcme, acme_, &acme_reg).ok());
  reg.Clear();
  ASSERT_TRUE(Register(kAcmeRouter, acme_, &reg).ok());
  EXPECT_EQ(reg.hash_key(), acme_reg.hash_key());
  EXPECT_FALSE(reg.created());
  v1::Namespace fresh = acme_;
  fresh.set_model("not-yet-registered");
  reg.Clear();
  grpc::Status s = Register(kAcmeRouter, fresh, &reg);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("a router only reads an existing namespace"));
  EXPECT_TRUE(reg.hash_key().empty());
  ExpectDenied(Register(kAcmeRouter, evil_, &reg), "edge", "register models");
  EXPECT_TRUE(reg.hash_key().empty());
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, AGuessedPromptProbedInAnotherTenantsNamespaceIsDenied) {
  v1::MatchResponse m;
  ExpectDenied(Match(kEvil, acme_, Tokens(0, 4), false, /*probe=*/true, &m), "evil-vllm", "probe");
  EXPECT_EQ(m.matched_pages(), 0u);
  EXPECT_EQ(m.segments_size(), 0);
  ExpectDenied(Match(kEvil, acme_, Tokens(0, 4), /*pin=*/true, false, &m), "evil-vllm", "match");
  // The same guess in its own namespace hashes under its own key: no page of acme's.
  ASSERT_TRUE(Match(kEvil, evil_, Tokens(0, 4), false, true, &m).ok());
  EXPECT_EQ(m.matched_pages(), 0u);
  // acme's router probes acme (granted) but may not pin, and may not probe evil.
  ASSERT_TRUE(Match(kAcmeRouter, acme_, Tokens(0, 4), false, true, &m).ok());
  EXPECT_EQ(m.matched_pages(), 4u);
  ExpectDenied(Match(kAcmeRouter, acme_, Tokens(0, 4), true, false, &m), "edge", "match");
  ExpectDenied(Match(kAcmeRouter, evil_, Tokens(0, 4), false, true, &m), "edge", "\"evil\"");
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, StatsShowOnlyTheCallersOwnTenants) {
  v1::StatsResponse evil_view;
  ASSERT_TRUE(Stats(kEvil, &evil_view).ok());
  for (const v1::NamespaceStats& n : evil_view.namespaces()) {
    EXPECT_EQ(n.namespace_().tenant(), "evil") << n.DebugString();
  }
  EXPECT_EQ(evil_view.namespaces_size(), 1);
  EXPECT_EQ(evil_view.counters().matched_pages(), 0u) << "manager-wide counters are admin-only";
  // The default policy's choice, but not the other tenants' prompts it was made from.
  ASSERT_TRUE(evil_view.has_selection());
  EXPECT_EQ(evil_view.selection().active(), "conversation");  // SelectParams::initial
  EXPECT_EQ(evil_view.selection().candidates_size(), 5);
  EXPECT_EQ(evil_view.selection().pools(), 0u);
  EXPECT_EQ(evil_view.selection().min_sample_rate(), 0);
  for (const v1::PolicySelection::Candidate& c : evil_view.selection().candidates()) {
    EXPECT_EQ(c.shadow_hit_rate(), 0) << c.name();
  }
  v1::StatsResponse admin_view = AdminStats();
  EXPECT_EQ(admin_view.namespaces_size(), 2);
  EXPECT_GT(admin_view.counters().inserted_pages(), 0u);
  EXPECT_EQ(admin_view.selection().pools(), 1u);  // pool-a, sampled at some rate
  EXPECT_GT(admin_view.selection().min_sample_rate(), 0);
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, WatchEventsNeverCarriesAnotherTenantsPageHashes) {
  auto ctx = Ctx(kEvil);
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> evil_stream =
      stub_->WatchEvents(ctx.get(), v1::WatchEventsRequest());
  evil_stream->WaitForInitialMetadata();
  // acme stores pages; then evil stores one, which must be the first event evil sees.
  v1::InsertResponse ins;
  ASSERT_TRUE(
      Insert(kAcme, acme_, Tokens(0, 6), "pool-a", {100, 101, 102, 103, 104, 105}, &ins).ok());
  ASSERT_TRUE(Insert(kEvil, evil_, Tokens(0, 1), "pool-a", {200}, &ins).ok());
  v1::CacheEvent event;
  ASSERT_TRUE(evil_stream->Read(&event));
  EXPECT_EQ(event.namespace_().tenant(), "evil") << event.DebugString();
  ctx->TryCancel();
  evil_stream->Finish();

  // Asking for acme's events by name is refused outright.
  auto named_ctx = Ctx(kEvil);
  v1::WatchEventsRequest named;
  *named.mutable_namespace_() = acme_;
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> named_stream =
      stub_->WatchEvents(named_ctx.get(), named);
  EXPECT_FALSE(named_stream->Read(&event));
  grpc::Status s = named_stream->Finish();
  ExpectDenied(s, "evil-vllm", "watch events");
}

// WatchEvents' sequence numbers are the stream's own: evil's two events are 1 and 2 however
// many events acme caused between them, so the numbers count nothing of acme's.
TEST_F(TenantAttackTest, WatchEventsSequencesCountNoOtherTenantsEvents) {
  auto evil_ctx = Ctx(kEvil);
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> evil_stream =
      stub_->WatchEvents(evil_ctx.get(), v1::WatchEventsRequest());
  evil_stream->WaitForInitialMetadata();
  auto admin_ctx = Ctx(kAdmin);
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> admin_stream =
      stub_->WatchEvents(admin_ctx.get(), v1::WatchEventsRequest());
  admin_stream->WaitForInitialMetadata();

  v1::InsertResponse ins;
  ASSERT_TRUE(Insert(kEvil, evil_, Tokens(0, 1), "pool-a", {200}, &ins).ok());
  for (int i = 0; i < 5; ++i) {  // acme's traffic, one stored event per new prompt
    ASSERT_TRUE(
        Insert(kAcme, acme_, Tokens(10 + i, 1), "pool-a", {static_cast<uint32_t>(110 + i)}, &ins)
            .ok());
  }
  ASSERT_TRUE(Insert(kEvil, evil_, Tokens(20, 1), "pool-a", {201}, &ins).ok());

  v1::CacheEvent first, second;
  ASSERT_TRUE(evil_stream->Read(&first));
  ASSERT_TRUE(evil_stream->Read(&second));
  EXPECT_EQ(first.namespace_().tenant(), "evil");
  EXPECT_EQ(second.namespace_().tenant(), "evil");
  EXPECT_EQ(first.sequence(), 1u);
  EXPECT_EQ(second.sequence(), 2u) << "the gap would count acme's events";
  // The admin's stream carries all seven, numbered 1..7 without a gap.
  v1::CacheEvent event;
  for (uint64_t want = 1; want <= 7; ++want) {
    ASSERT_TRUE(admin_stream->Read(&event));
    EXPECT_EQ(event.sequence(), want);
  }
  EXPECT_EQ(event.namespace_().tenant(), "evil");
  evil_ctx->TryCancel();
  evil_stream->Finish();
  admin_ctx->TryCancel();
  admin_stream->Finish();
}

// Route tells no tenant which engine ids another tenant runs: naming acme's live engine
// answers exactly as naming an id nobody uses, and a Route without candidates ranks only the
// caller's own tenant's engines.
TEST_F(TenantAttackTest, RouteTellsNoTenantWhichEnginesAnotherRuns) {
  v1::RegisterModelResponse reg;
  ASSERT_TRUE(Register(kAcme, acme_, &reg).ok());
  v1::PublishEngineEventsRequest hello;  // a heartbeat: acme's engine session begins
  hello.set_engine_id("acme-engine-1");
  *hello.mutable_namespace_() = acme_;
  *hello.mutable_scheme() = reg.scheme();
  hello.set_session(7);
  hello.set_sequence(1);
  v1::PublishEngineEventsResponse published;
  ASSERT_TRUE(stub_->PublishEngineEvents(Ctx(kAcmeEngine).get(), hello, &published).ok());

  auto route = [&](absl::string_view token, const v1::Namespace& ns,
                   std::vector<std::string> candidates, v1::RouteResponse* resp) {
    v1::RouteRequest req;
    *req.mutable_namespace_() = ns;
    *req.mutable_prompt() = Tokens(0, 2);
    for (const std::string& id : candidates) req.add_candidates()->set_agent_id(id);
    return stub_->Route(Ctx(token).get(), req, resp);
  };
  v1::RouteResponse resp;
  // acme itself routes to its engine, by name and unnamed (the check can fail).
  ASSERT_TRUE(route(kAcme, acme_, {"acme-engine-1"}, &resp).ok());
  ASSERT_TRUE(route(kAcme, acme_, {}, &resp).ok());
  ASSERT_EQ(resp.ranked_size(), 1);
  EXPECT_EQ(resp.ranked(0).agent_id(), "acme-engine-1");

  const grpc::Status real = route(kEvil, evil_, {"acme-engine-1"}, &resp);
  const grpc::Status made_up = route(kEvil, evil_, {"acme-engine-2"}, &resp);
  EXPECT_EQ(real.error_code(), grpc::StatusCode::NOT_FOUND) << real.error_message();
  EXPECT_EQ(real.error_code(), made_up.error_code());
  std::string real_message = real.error_message();
  real_message.replace(real_message.find("acme-engine-1"), 13, "acme-engine-2");
  EXPECT_EQ(real_message, made_up.error_message());
  // Unnamed, evil has nothing to route to: acme's engine is not listed.
  v1::RouteResponse none;
  const grpc::Status unnamed = route(kEvil, evil_, {}, &none);
  EXPECT_EQ(unnamed.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << unnamed.error_message();
  EXPECT_EQ(none.ranked_size(), 0);
}

TEST_F(TenantAttackTest, AnotherTenantsPinCanBeNeitherReleasedNorRenewed) {
  v1::ReleaseRequest rel;
  *rel.mutable_namespace_() = acme_;
  rel.set_pin_id(acme_pin_);
  v1::ReleaseResponse rel_resp;
  ExpectDenied(stub_->Release(Ctx(kEvil).get(), rel, &rel_resp), "evil-vllm", "call Release");
  // Through its own namespace the id is simply unknown: pins are bound to their namespace.
  *rel.mutable_namespace_() = evil_;
  grpc::Status s = stub_->Release(Ctx(kEvil).get(), rel, &rel_resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  v1::RenewLeaseRequest renew;
  *renew.mutable_namespace_() = acme_;
  renew.set_pin_id(acme_pin_);
  v1::RenewLeaseResponse renewed;
  ExpectDenied(stub_->RenewLease(Ctx(kEvil).get(), renew, &renewed), "evil-vllm",
               "call RenewLease");
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, OnlyAnAdminEvicts) {
  v1::EvictRequest by_ns;
  *by_ns.mutable_namespace_() = acme_;
  by_ns.set_bytes(1);
  v1::EvictResponse ev;
  ExpectDenied(stub_->Evict(Ctx(kEvil).get(), by_ns, &ev), "evil-vllm", "call Evict");
  ExpectDenied(stub_->Evict(Ctx(kAcme).get(), by_ns, &ev), "acme-vllm", "role admin only");
  v1::EvictRequest by_pool;
  by_pool.mutable_pool()->set_agent_id("pool-a");
  by_pool.mutable_pool()->set_tier(v1::TIER_GPU);
  by_pool.set_bytes(1);
  ExpectDenied(stub_->Evict(Ctx(kEvil).get(), by_pool, &ev), "evil-vllm", "call Evict");
  ExpectVictimUnchanged();
  // The admin may (acme's 4 pinned pages stay; its 5th and 6th do not exist, so this
  // evicts nothing pinned: RESOURCE_EXHAUSTED with nothing unpinned).
  grpc::Status s = stub_->Evict(Ctx(kAdmin).get(), by_ns, &ev);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
}

TEST_F(TenantAttackTest, AWorkerCannotMakeUpPools) {
  v1::InsertResponse ins;
  for (int i = 0; i < 20; ++i) {
    grpc::Status s = Insert(kEvil, evil_, Tokens(0, 1), absl::StrCat("fake-", i), {1}, &ins);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("pools come from agents"));
  }
  EXPECT_EQ(AdminStats().pools_size(), before_.pools_size());
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, ATenantCannotCreateNamespacesWithoutBound) {
  v1::Namespace ns = evil_;
  int created = 1;  // SetUp registered evil/deepseek-v3
  grpc::Status last;
  for (int i = 0; i < 10 && last.ok(); ++i) {
    ns.set_model(absl::StrCat("fake-model-", i));
    last = Register(kEvil, ns);
    if (last.ok()) ++created;
  }
  EXPECT_EQ(created, 3);
  EXPECT_EQ(last.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(last.error_message(), HasSubstr("max_namespaces_per_tenant"));
  // acme's quota is its own: it can still register.
  v1::Namespace acme2 = acme_;
  acme2.set_model("llama-3-70b");
  EXPECT_TRUE(Register(kAcme, acme2).ok());
}

TEST_F(TenantAttackTest, OnlyAnAdminDeletesANamespaceAndThenItIsGone) {
  v1::DeleteNamespaceRequest del;
  *del.mutable_namespace_() = acme_;
  v1::DeleteNamespaceResponse resp;
  ExpectDenied(stub_->DeleteNamespace(Ctx(kEvil).get(), del, &resp), "evil-vllm",
               "call DeleteNamespace");
  ExpectDenied(stub_->DeleteNamespace(Ctx(kAcme).get(), del, &resp), "acme-vllm",
               "call DeleteNamespace");
  ExpectVictimUnchanged();

  ASSERT_TRUE(stub_->DeleteNamespace(Ctx(kAdmin).get(), del, &resp).ok());
  EXPECT_EQ(resp.removed_pages(), 4u);
  EXPECT_EQ(resp.dropped_pins(), 1u);
  v1::StatsResponse after = AdminStats();
  EXPECT_EQ(after.namespaces_size(), 1);
  EXPECT_EQ(after.active_pins(), 0u);
  for (const v1::PoolStats& p : after.pools()) EXPECT_EQ(p.used_bytes(), 0u);
  v1::ReleaseRequest rel;
  *rel.mutable_namespace_() = acme_;
  rel.set_pin_id(acme_pin_);
  v1::ReleaseResponse rel_resp;
  EXPECT_EQ(stub_->Release(Ctx(kAcme).get(), rel, &rel_resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  grpc::Status again = stub_->DeleteNamespace(Ctx(kAdmin).get(), del, &resp);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::NOT_FOUND);
}

// Only an admin forgets an agent: a worker, a router, an engine or the agent itself is
// denied and the agent stays as it was; the admin's refusals (a live agent without force,
// an unknown id) change nothing either.
TEST_F(TenantAttackTest, OnlyAnAdminForgetsAnAgent) {
  v1::RegisterAgentRequest reg;
  reg.set_agent_id("gpu-0");
  reg.set_device("host");
  reg.set_tier(v1::TIER_GPU);
  reg.set_epoch(1);
  *reg.mutable_geometry()->mutable_spec() = MlaSpecProto(kPageSize);
  const uint64_t page_bytes = 61ull * (512 + 64) * 2 * kPageSize;
  reg.mutable_geometry()->set_bytes_per_block(page_bytes);
  reg.mutable_geometry()->set_num_blocks(8);
  reg.set_capacity_bytes(8 * page_bytes);
  v1::RegisterAgentResponse reg_resp;
  const grpc::Status registered = agent_stub_->Register(Ctx(kAgent0).get(), reg, &reg_resp);
  ASSERT_TRUE(registered.ok()) << registered.error_message();
  // Stats with the agent as it is now; its heartbeat age changes, so it is compared apart.
  v1::StatsResponse before = AdminStats();
  ASSERT_EQ(before.agents_size(), 1);
  before.clear_agents();
  auto expect_unchanged = [&] {
    v1::StatsResponse now = AdminStats();
    ASSERT_EQ(now.agents_size(), 1);
    EXPECT_EQ(now.agents(0).agent_id(), "gpu-0");
    EXPECT_EQ(now.agents(0).epoch(), 1u);
    EXPECT_TRUE(now.agents(0).alive());
    now.clear_agents();
    EXPECT_TRUE(MessageDifferencer::Equals(before, now)) << now.DebugString();
  };

  v1::ForgetAgentRequest req;
  req.set_agent_id("gpu-0");
  req.set_force(true);
  v1::ForgetAgentResponse resp;
  for (auto [token, principal] :
       std::vector<std::pair<const char*, const char*>>{{kEvil, "evil-vllm"},
                                                        {kAcme, "acme-vllm"},
                                                        {kAcmeRouter, "edge"},
                                                        {kAcmeEngine, "acme-sglang"},
                                                        {kAgent0, "gpu-0"}}) {
    ExpectDenied(stub_->ForgetAgent(Ctx(token).get(), req, &resp), principal, "call ForgetAgent");
  }
  expect_unchanged();

  req.set_force(false);
  grpc::Status s = stub_->ForgetAgent(Ctx(kAdmin).get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  req.set_agent_id("gpu-7");
  s = stub_->ForgetAgent(Ctx(kAdmin).get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  expect_unchanged();

  req.set_agent_id("gpu-0");
  req.set_force(true);
  s = stub_->ForgetAgent(Ctx(kAdmin).get(), req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.was_alive());
  EXPECT_EQ(AdminStats().agents_size(), 0);
}

TEST_F(TenantAttackTest, AgentControlIsForAgentsAsThemselves) {
  v1::RegisterAgentRequest reg;
  reg.set_agent_id("gpu-0");
  reg.set_epoch(1);
  v1::RegisterAgentResponse resp;
  ExpectDenied(agent_stub_->Register(Ctx(kAcme).get(), reg, &resp), "acme-vllm",
               "act as agent \"gpu-0\"");
  ExpectDenied(agent_stub_->Register(Ctx(kAdmin).get(), reg, &resp), "ops", "act as agent");
  reg.set_agent_id("gpu-1");
  ExpectDenied(agent_stub_->Register(Ctx(kAgent0).get(), reg, &resp), "gpu-0",
               "act as agent \"gpu-1\"");
  v1::HeartbeatRequest hb;
  hb.set_agent_id("gpu-1");
  hb.set_epoch(1);
  v1::HeartbeatResponse hb_resp;
  ExpectDenied(agent_stub_->Heartbeat(Ctx(kAgent0).get(), hb, &hb_resp), "gpu-0", "gpu-1");

  // The Commands stream: the hello names another agent.
  auto ctx = Ctx(kAgent0);
  auto commands = agent_stub_->Commands(ctx.get());
  v1::AgentCommandAck hello;
  hello.set_agent_id("gpu-1");
  hello.set_epoch(1);
  commands->Write(hello);
  commands->WritesDone();
  v1::AgentCommand cmd;
  EXPECT_FALSE(commands->Read(&cmd));
  ExpectDenied(commands->Finish(), "gpu-0", "act as agent \"gpu-1\"");

  // An inventory as another agent.
  auto inv_ctx = Ctx(kAgent0);
  v1::InventoryReply reply;
  auto inventory = agent_stub_->ReportInventory(inv_ctx.get(), &reply);
  v1::InventoryChunk chunk;
  chunk.set_agent_id("gpu-1");
  chunk.set_epoch(1);
  inventory->Write(chunk);
  inventory->WritesDone();
  ExpectDenied(inventory->Finish(), "gpu-0", "gpu-1");
  EXPECT_THAT(AdminStats().agents(), IsEmpty());
  ExpectVictimUnchanged();
}

// LookupAgent (a Fetch's source) answers only an agent, as itself; an id nobody registered
// is NOT_FOUND naming the field, and a bad one INVALID_ARGUMENT.
TEST_F(TenantAttackTest, LookupAgentIsForAgentsAsThemselves) {
  v1::LookupAgentRequest req;
  req.set_agent_id("gpu-0");
  req.set_peer_agent_id("gpu-1");
  v1::LookupAgentResponse resp;
  ExpectDenied(agent_stub_->LookupAgent(Ctx(kAcme).get(), req, &resp), "acme-vllm",
               "act as agent \"gpu-0\"");
  req.set_agent_id("gpu-1");
  ExpectDenied(agent_stub_->LookupAgent(Ctx(kAgent0).get(), req, &resp), "gpu-0",
               "act as agent \"gpu-1\"");
  req.set_agent_id("gpu-0");
  grpc::Status s = agent_stub_->LookupAgent(Ctx(kAgent0).get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("peer_agent_id \"gpu-1\""));
  req.set_peer_agent_id("10.0.0.7:7002/x");
  s = agent_stub_->LookupAgent(Ctx(kAgent0).get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("peer_agent_id"));
  EXPECT_TRUE(resp.data_address().empty());
  ExpectVictimUnchanged();
}

// MakeRoom (an agent's allocation into its full pool) answers only an agent, as itself: no
// worker or other agent can make the manager evict a pool. Bad fields are INVALID_ARGUMENT
// naming them, an agent nobody registered NOT_FOUND; nothing is evicted.
TEST_F(TenantAttackTest, MakeRoomIsForAgentsAsThemselves) {
  v1::MakeRoomRequest req;
  req.set_agent_id("gpu-0");
  req.set_epoch(1);
  req.set_tier(v1::TIER_GPU);
  req.set_blocks(1);
  req.set_allocation_blocks(1);
  req.mutable_namespace_()->set_tenant("acme");
  req.mutable_namespace_()->set_model("deepseek-v3");
  v1::MakeRoomResponse resp;
  ExpectDenied(agent_stub_->MakeRoom(Ctx(kAcme).get(), req, &resp), "acme-vllm",
               "act as agent \"gpu-0\"");
  req.set_agent_id("gpu-1");
  ExpectDenied(agent_stub_->MakeRoom(Ctx(kAgent0).get(), req, &resp), "gpu-0",
               "act as agent \"gpu-1\"");
  req.set_agent_id("gpu-0");
  for (auto [field, bad] :
       std::vector<std::pair<std::string, std::function<void(v1::MakeRoomRequest&)>>>{
           {"epoch", [](v1::MakeRoomRequest& r) { r.set_epoch(0); }},
           {"blocks", [](v1::MakeRoomRequest& r) { r.set_blocks(0); }},
           {"allocation_blocks", [](v1::MakeRoomRequest& r) { r.set_allocation_blocks(0); }},
           {"namespace", [](v1::MakeRoomRequest& r) { r.clear_namespace_(); }},
           {"tier", [](v1::MakeRoomRequest& r) { r.set_tier(v1::TIER_UNSPECIFIED); }}}) {
    v1::MakeRoomRequest broken = req;
    bad(broken);
    const grpc::Status s = agent_stub_->MakeRoom(Ctx(kAgent0).get(), broken, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(field));
  }
  const grpc::Status s = agent_stub_->MakeRoom(Ctx(kAgent0).get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(resp.evicted_pages(), 0u);
  ExpectVictimUnchanged();
}

// An agent's Insert (what its Fetch pulled) reaches its own pools only, by page hashes.
TEST_F(TenantAttackTest, AnAgentInsertsOnlyIntoItsOwnPools) {
  v1::RegisterModelResponse reg;
  ASSERT_TRUE(Register(kAcme, acme_, &reg).ok());
  v1::InsertRequest req;
  *req.mutable_namespace_() = acme_;
  req.mutable_prompt()->set_page_hashes(std::string(16, 'h'));
  *req.mutable_prompt()->mutable_scheme() = reg.scheme();
  req.mutable_pool()->set_agent_id("pool-a");
  req.mutable_pool()->set_tier(v1::TIER_GPU);
  req.add_block_ids(105);
  req.set_agent_epoch(1);
  v1::InsertResponse resp;
  ExpectDenied(stub_->Insert(Ctx(kAgent0).get(), req, &resp), "gpu-0",
               "insert into agent \"pool-a\"'s pool");
  req.mutable_pool()->set_agent_id("gpu-0");
  *req.mutable_prompt() = Tokens(0, 1);
  ExpectDenied(stub_->Insert(Ctx(kAgent0).get(), req, &resp), "gpu-0", "page hashes only");
  ExpectVictimUnchanged();
}

TEST_F(TenantAttackTest, ATokenAddedToTheFileWorksWithoutARestart) {
  v1::StatsResponse st;
  EXPECT_EQ(Stats(kLater, &st).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // A new file (a new size, so the change is seen even within one mtime tick).
  WriteFile(tokens_path_,
            absl::StrCat(TokensFile(), Sha256Hex(kLater), " later roles=worker tenant=later\n"));
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  grpc::Status s;
  do {
    absl::SleepFor(absl::Milliseconds(20));
    s = Stats(kLater, &st);
  } while (!s.ok() && absl::Now() < give_up);
  EXPECT_TRUE(s.ok()) << s.error_message();
  // A file that no longer parses keeps the tokens loaded before.
  WriteFile(tokens_path_, "this is not a tokens file\n");
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(Stats(kLater, &st).ok());
  EXPECT_TRUE(Stats(kAcme, &st).ok());
}

}  // namespace
}  // namespace kvcm
