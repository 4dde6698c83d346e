// Fair by default (issue 22), end to end: a real ManagerServer with a tokens file and no
// tenant quota configured, called over loopback by the workers of two tenants, an admin and
// one tenant's engines. Replays the attacks: globex reserving 94% of a pool acme uses,
// globex pinning past its share, and one engine token storing page-locations without bound.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/mla_spec.h"

namespace kvcm {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::kvcm::testing::MlaSpecProto;
using ::testing::HasSubstr;

constexpr uint32_t kPageSize = 16;
constexpr uint64_t kBytesPerPage = 70'272u * kPageSize;  // DeepSeek-V3 MLA bf16
constexpr uint64_t kPoolPages = 16;
// Small caps, so that the flood is quick; the defaults are in docs/SECURITY.md.
constexpr uint64_t kEnginePages = 64;
constexpr uint64_t kTenantEnginePages = 96;

constexpr char kAcmeToken[] = "acme-worker-token-0123456789";
constexpr char kGlobexToken[] = "globex-worker-token-0123456789";
constexpr char kGlobexEngine0[] = "globex-engine-0-token-0123456789";
constexpr char kGlobexEngine1[] = "globex-engine-1-token-0123456789";
constexpr char kAdminToken[] = "admin-token-0123456789abcdef";

class FairShareRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_path_ = absl::StrCat(::testing::TempDir(), "/fair_share_tokens_", getpid());
    std::ofstream(tokens_path_) << Sha256Hex(kAcmeToken) << " acme-vllm roles=worker tenant=acme\n"
                                << Sha256Hex(kGlobexToken)
                                << " globex-vllm roles=worker tenant=globex\n"
                                << Sha256Hex(kGlobexEngine0)
                                << " globex-e0 roles=engine engine=vllm-g0 tenant=globex\n"
                                << Sha256Hex(kGlobexEngine1)
                                << " globex-e1 roles=engine engine=vllm-g1 tenant=globex\n"
                                << Sha256Hex(kAdminToken) << " ops roles=admin\n";
    ServerOptions options;
    options.tls.insecure = true;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.hash_secret_hex = "000102030405060708090a0b0c0d0e0f";
    options.tokens_file = tokens_path_;
    options.shutdown_grace_ms = 1000;
    options.default_pool_capacity_bytes = kPoolPages * kBytesPerPage;
    // No tenant quota: what the README's TLS set-up runs with. The share is the default.
    options.max_engine_pages_per_engine = kEnginePages;
    options.max_engine_pages_per_tenant = kTenantEnginePages;
    absl::StatusOr<std::unique_ptr<ManagerServer>> server = ManagerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ =
        v1::CacheManager::NewStub(MakeInsecureChannel(absl::StrCat("127.0.0.1:", server_->port())));
    for (const char* tenant : {"acme", "globex"}) {
      v1::RegisterModelRequest req;
      *req.mutable_namespace_() = Ns(tenant);
      *req.mutable_spec() = MlaSpecProto(kPageSize);
      v1::RegisterModelResponse resp;
      grpc::Status s = stub_->RegisterModel(Ctx(kAdminToken).get(), req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(resp.bytes_per_page(), kBytesPerPage);
      if (std::string(tenant) == "globex") {
        globex_key_ = HashKey::FromBytes(resp.hash_key());
        globex_scheme_ = resp.scheme();
      }
    }
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    std::remove(tokens_path_.c_str());
  }

  static v1::Namespace Ns(const std::string& tenant) {
    v1::Namespace ns;
    ns.set_tenant(tenant);
    ns.set_model("deepseek-v3");
    return ns;
  }

  static std::unique_ptr<grpc::ClientContext> Ctx(const char* token) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ctx->AddMetadata("authorization", absl::StrCat("Bearer ", token));
    return ctx;
  }

  static std::vector<int32_t> Tokens(int first, int n) {
    std::vector<int32_t> t;
    for (int i = 0; i < n * static_cast<int>(kPageSize); ++i) t.push_back(first * 1000 + i);
    return t;
  }

  static v1::Prompt Pages(int first, int n) {
    v1::Prompt p;
    for (int32_t id : Tokens(first, n)) p.mutable_tokens()->add_ids(id);
    return p;
  }

  // Pages first..first+n-1 of `tenant`'s prompt `first` into the index-only pool gpu-0
  // (created by the first insert, an admin's).
  grpc::Status Insert(const char* token, const char* tenant, int first, int n) {
    v1::InsertRequest req;
    *req.mutable_namespace_() = Ns(tenant);
    *req.mutable_prompt() = Pages(first, n);
    req.mutable_pool()->set_agent_id("gpu-0");
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    for (int i = 0; i < n; ++i) req.add_block_ids(first * 100 + i);
    v1::InsertResponse resp;
    return stub_->Insert(Ctx(token).get(), req, &resp);
  }

  grpc::Status Reserve(const char* token, uint64_t bytes, bool unreserve = false) {
    v1::ReserveRequest req;
    req.mutable_pool()->set_agent_id("gpu-0");
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    req.set_bytes(bytes);
    if (unreserve) {
      v1::UnreserveResponse resp;
      return stub_->Unreserve(Ctx(token).get(), req, &resp);
    }
    v1::ReserveResponse resp;
    return stub_->Reserve(Ctx(token).get(), req, &resp);
  }

  absl::StatusOr<v1::MatchResponse> Match(const char* token, const char* tenant, int first, int n,
                                          bool pin) {
    v1::MatchRequest req;
    *req.mutable_namespace_() = Ns(tenant);
    *req.mutable_prompt() = Pages(first, n);
    req.set_pin(pin);
    v1::MatchResponse resp;
    grpc::Status s = stub_->Match(Ctx(token).get(), req, &resp);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    }
    return resp;
  }

  // Probe of acme's prompt: how many of its pages are still cached.
  uint32_t AcmeCached(int first, int n) {
    absl::StatusOr<v1::MatchResponse> m = Match(kAcmeToken, "acme", first, n, false);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? m->matched_pages() : 0;
  }

  v1::StatsResponse Stats() {
    v1::StatsResponse resp;
    grpc::Status s = stub_->Stats(Ctx(kAdminToken).get(), v1::StatsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    for (v1::EngineStats& e : *resp.mutable_engines()) e.clear_last_publish_age_ms();
    for (v1::AgentStats& a : *resp.mutable_agents()) a.clear_last_heartbeat_age_ms();
    return resp;
  }

  static v1::TenantStats Tenant(const v1::StatsResponse& stats, const std::string& name) {
    for (const v1::TenantStats& t : stats.tenants()) {
      if (t.tenant() == name) return t;
    }
    return v1::TenantStats();
  }

  static v1::PoolStats Pool(const v1::StatsResponse& stats, const std::string& agent) {
    for (const v1::PoolStats& p : stats.pools()) {
      if (p.pool().agent_id() == agent) return p;
    }
    return v1::PoolStats();
  }

  // One engine request storing `chains` chains of `pages` pages each, every chain new
  // (prompt ids from `first`).
  grpc::Status PublishChains(const char* token, const std::string& engine, uint64_t session,
                             uint64_t sequence, int first, int chains, int pages) {
    v1::PublishEngineEventsRequest req;
    req.set_engine_id(engine);
    *req.mutable_namespace_() = Ns("globex");
    *req.mutable_scheme() = globex_scheme_;
    req.set_session(session);
    req.set_sequence(sequence);
    for (int c = 0; c < chains; ++c) {
      v1::EngineChange* change = req.add_changes();
      change->set_kind(v1::EngineChange::KIND_STORED);
      change->set_tier(v1::TIER_GPU);
      change->set_page_hashes(
          EncodePageHashes(HashPages(globex_key_, Tokens(first + c, pages), kPageSize)));
    }
    v1::PublishEngineEventsResponse resp;
    return stub_->PublishEngineEvents(Ctx(token).get(), req, &resp);
  }

  std::string tokens_path_;
  std::unique_ptr<ManagerServer> server_;
  std::unique_ptr<v1::CacheManager::Stub> stub_;
  HashKey globex_key_;
  v1::HashScheme globex_scheme_;
};

TEST_F(FairShareRpcTest, ATenantCannotReserveMostOfAPoolAnotherUses) {
  ASSERT_TRUE(Insert(kAdminToken, "acme", 1, 4).ok());  // acme's 4 of the pool's 16 pages
  v1::StatsResponse stats = Stats();
  EXPECT_EQ(stats.limits().default_tenant_pool_share_pct(), 50u);
  EXPECT_EQ(Pool(stats, "gpu-0").tenant_share_bytes(), kPoolPages / 2 * kBytesPerPage);

  // The attack: 94% of the pool. Refused, naming the option, and nothing changed.
  const uint64_t most = kPoolPages * kBytesPerPage * 94 / 100;
  grpc::Status s = Reserve(kGlobexToken, most);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("default_tenant_pool_share_pct: tenant globex"));
  EXPECT_TRUE(MessageDifferencer::Equals(stats, Stats())) << "a refused Reserve changed state";

  // As much as it can: half the pool, then not a byte more.
  s = Reserve(kGlobexToken, kPoolPages / 2 * kBytesPerPage);
  ASSERT_TRUE(s.ok()) << s.error_message();
  s = Reserve(kGlobexToken, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("default_tenant_pool_share_pct"));
  EXPECT_EQ(Tenant(Stats(), "globex").reserved_bytes(), kPoolPages / 2 * kBytesPerPage);

  // acme's pages are all still matched, and its next Insert (by its own worker) succeeds.
  EXPECT_EQ(AcmeCached(1, 4), 4u);
  s = Insert(kAcmeToken, "acme", 2, 4);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(AcmeCached(2, 4), 4u);
  EXPECT_EQ(AcmeCached(1, 4), 4u);
}

TEST_F(FairShareRpcTest, TheFirstTenantInAPoolGetsItsShareNotThePool) {
  // Issue 35: alone in a pool, globex reserved 90% of it, and acme, arriving next, found
  // the rest. The tokens file names two tenants, so the share holds from the first byte.
  ASSERT_TRUE(Insert(kAdminToken, "globex", 1, 1).ok());  // the pool holds only globex's page
  const v1::StatsResponse before = Stats();
  const uint64_t most = kPoolPages * kBytesPerPage * 90 / 100;
  grpc::Status s = Reserve(kGlobexToken, most);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("default_tenant_pool_share_pct: tenant globex"));
  EXPECT_THAT(s.error_message(), HasSubstr("2 tenants are configured"));
  EXPECT_TRUE(MessageDifferencer::Equals(before, Stats())) << "a refused Reserve changed state";

  ASSERT_TRUE(Reserve(kGlobexToken, kPoolPages / 2 * kBytesPerPage).ok());
  EXPECT_EQ(Reserve(kGlobexToken, 1).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  s = Reserve(kAcmeToken, kPoolPages / 2 * kBytesPerPage);
  EXPECT_TRUE(s.ok()) << "the next tenant's half is still there: " << s.error_message();
}

TEST_F(FairShareRpcTest, ATenantsPinsStopAtTheSameShare) {
  ASSERT_TRUE(Insert(kAdminToken, "acme", 1, 2).ok());
  ASSERT_TRUE(Insert(kGlobexToken, "globex", 7, 12).ok());  // globex's 12 of 16 pages
  ASSERT_TRUE(Reserve(kGlobexToken, 2 * kBytesPerPage).ok());

  // 2 reserved + 7 pinned would pass 8 pages (half the pool): nothing matched or pinned.
  const v1::StatsResponse before = Stats();
  absl::StatusOr<v1::MatchResponse> big = Match(kGlobexToken, "globex", 7, 7, /*pin=*/true);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("default_tenant_pool_share_pct: tenant globex"));
  EXPECT_TRUE(MessageDifferencer::Equals(before, Stats())) << "a refused pin changed state";

  absl::StatusOr<v1::MatchResponse> six = Match(kGlobexToken, "globex", 7, 6, /*pin=*/true);
  ASSERT_TRUE(six.ok()) << six.status();
  EXPECT_NE(six->pin_id(), 0u);
  EXPECT_EQ(Tenant(Stats(), "globex").pinned_bytes(), 6 * kBytesPerPage);
  EXPECT_EQ(Reserve(kGlobexToken, 1).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  // acme's worker still inserts: globex's unpinned pages are evictable (acme's own, used
  // just now, are not the least recently used).
  EXPECT_EQ(AcmeCached(1, 2), 2u);
  grpc::Status s = Insert(kAcmeToken, "acme", 2, 6);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(AcmeCached(1, 2), 2u);
  EXPECT_EQ(AcmeCached(2, 6), 6u);
}

TEST_F(FairShareRpcTest, AnEngineFloodIsRefusedAndThePageCountStaysBounded) {
  // One engine token floods its pool with new chains, 8 pages each, 4 chains a request.
  uint64_t sequence = 0;
  grpc::Status s;
  int first = 0;
  for (; first < 1000 && s.ok(); first += 4) {
    s = PublishChains(kGlobexEngine0, "vllm-g0", 1, ++sequence, first, 4, 8);
    const v1::StatsResponse stats = Stats();
    ASSERT_LE(Pool(stats, "vllm-g0").pages(), kEnginePages);
    ASSERT_LE(Tenant(stats, "globex").engine_pages(), kTenantEnginePages);
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_engine_pages_per_engine: engine vllm-g0"));
  EXPECT_LT(first, 100) << "refused as soon as the cap was reached";
  // The refusal ended the session and emptied its pool: nothing of it is left.
  v1::StatsResponse stats = Stats();
  EXPECT_EQ(Pool(stats, "vllm-g0").pages(), 0u);
  EXPECT_EQ(Tenant(stats, "globex").engine_pages(), 0u);
  EXPECT_EQ(stats.engines_size(), 0);
  EXPECT_EQ(stats.limits().max_engine_pages_per_engine(), kEnginePages);
  EXPECT_EQ(Tenant(stats, "globex").max_engine_pages(), kTenantEnginePages);

  // Two engines of one tenant: the tenant's cap binds (64 + 32 = 96).
  ASSERT_TRUE(PublishChains(kGlobexEngine0, "vllm-g0", 2, 1, 0, 8, 8).ok());  // 64 pages
  s = PublishChains(kGlobexEngine1, "vllm-g1", 3, 1, 100, 4, 8);              // 32 pages
  ASSERT_TRUE(s.ok()) << s.error_message();
  s = PublishChains(kGlobexEngine1, "vllm-g1", 3, 2, 200, 1, 8);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_engine_pages_per_tenant: the engines of tenant "
                                           "globex"));
  stats = Stats();
  EXPECT_EQ(Tenant(stats, "globex").engine_pages(), kEnginePages);
  EXPECT_EQ(Pool(stats, "vllm-g1").pages(), 0u);
  EXPECT_EQ(stats.engines_size(), 1);
}

}  // namespace
}  // namespace kvcm
