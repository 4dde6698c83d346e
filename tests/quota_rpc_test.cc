// Tenant quotas end to end: a real ManagerServer with a tokens file and tenant_max_bytes /
// tenant_max_pinned_bytes, called over loopback as two workers of different tenants and an
// admin. Reservations belong to the caller's tenant; Stats shows each worker its own.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/mla_spec.h"

namespace kvcm {
namespace {

using ::kvcm::testing::MlaSpecProto;
using ::testing::HasSubstr;

constexpr uint32_t kPageSize = 16;
constexpr uint64_t kBytesPerPage = 70'272u * kPageSize;  // DeepSeek-V3 MLA bf16
constexpr uint64_t kQuotaPages = 4;

constexpr char kAcmeToken[] = "acme-worker-token-0123456789";
constexpr char kGlobexToken[] = "globex-worker-token-0123456789";
constexpr char kAdminToken[] = "admin-token-0123456789abcdef";

class QuotaRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_path_ = absl::StrCat(::testing::TempDir(), "/quota_tokens_", getpid());
    std::ofstream(tokens_path_) << Sha256Hex(kAcmeToken) << " acme-vllm roles=worker tenant=acme\n"
                                << Sha256Hex(kGlobexToken)
                                << " globex-vllm roles=worker tenant=globex\n"
                                << Sha256Hex(kAdminToken) << " ops roles=admin\n";
    ServerOptions options;
    options.tls.insecure = true;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.hash_secret_hex = "000102030405060708090a0b0c0d0e0f";
    options.tokens_file = tokens_path_;
    options.shutdown_grace_ms = 1000;
    options.tenant_max_bytes = kQuotaPages * kBytesPerPage;
    options.tenant_max_pinned_bytes = 2 * kBytesPerPage;
    absl::StatusOr<std::unique_ptr<ManagerServer>> server = ManagerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ =
        v1::CacheManager::NewStub(MakeInsecureChannel(absl::StrCat("127.0.0.1:", server_->port())));
    for (const char* tenant : {"acme", "globex"}) {
      v1::RegisterModelRequest req;
      req.mutable_namespace_()->set_tenant(tenant);
      req.mutable_namespace_()->set_model("deepseek-v3");
      *req.mutable_spec() = MlaSpecProto(kPageSize);
      v1::RegisterModelResponse resp;
      grpc::ClientContext ctx;
      As(ctx, kAdminToken);
      ASSERT_TRUE(stub_->RegisterModel(&ctx, req, &resp).ok());
      ASSERT_EQ(resp.bytes_per_page(), kBytesPerPage);
    }
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    std::remove(tokens_path_.c_str());
  }

  static void As(grpc::ClientContext& ctx, const char* token) {
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }

  static v1::Prompt Pages(int first, int n) {
    v1::Prompt p;
    for (int i = 0; i < n * static_cast<int>(kPageSize); ++i) {
      p.mutable_tokens()->add_ids(first * 1000 + i);
    }
    return p;
  }

  // An index-only pool takes an admin's inserts (the pool is created by the first one).
  grpc::Status Insert(const char* tenant, int first, int n, bool use_reservation = false,
                      const char* token = kAdminToken) {
    v1::InsertRequest req;
    req.mutable_namespace_()->set_tenant(tenant);
    req.mutable_namespace_()->set_model("deepseek-v3");
    *req.mutable_prompt() = Pages(first, n);
    req.mutable_pool()->set_agent_id("gpu-0");
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    for (int i = 0; i < n; ++i) req.add_block_ids(first * 100 + i);
    req.set_use_reservation(use_reservation);
    v1::InsertResponse resp;
    grpc::ClientContext ctx;
    As(ctx, token);
    return stub_->Insert(&ctx, req, &resp);
  }

  grpc::Status Reserve(const char* token, uint64_t bytes, const std::string& tenant = "",
                       bool unreserve = false) {
    v1::ReserveRequest req;
    req.mutable_pool()->set_agent_id("gpu-0");
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    req.set_bytes(bytes);
    req.set_tenant(tenant);
    grpc::ClientContext ctx;
    As(ctx, token);
    if (unreserve) {
      v1::UnreserveResponse resp;
      return stub_->Unreserve(&ctx, req, &resp);
    }
    v1::ReserveResponse resp;
    return stub_->Reserve(&ctx, req, &resp);
  }

  grpc::Status Pin(const char* token, const char* tenant, int first, int n) {
    v1::MatchRequest req;
    req.mutable_namespace_()->set_tenant(tenant);
    req.mutable_namespace_()->set_model("deepseek-v3");
    *req.mutable_prompt() = Pages(first, n);
    req.set_pin(true);
    v1::MatchResponse resp;
    grpc::ClientContext ctx;
    As(ctx, token);
    return stub_->Match(&ctx, req, &resp);
  }

  v1::StatsResponse Stats(const char* token = kAdminToken) {
    v1::StatsResponse resp;
    grpc::ClientContext ctx;
    As(ctx, token);
    grpc::Status s = stub_->Stats(&ctx, v1::StatsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  static v1::TenantStats Tenant(const v1::StatsResponse& stats, const std::string& name) {
    for (const v1::TenantStats& t : stats.tenants()) {
      if (t.tenant() == name) return t;
    }
    v1::TenantStats none;
    none.set_tenant("(none)");
    return none;
  }

  std::string tokens_path_;
  std::unique_ptr<ManagerServer> server_;
  std::unique_ptr<v1::CacheManager::Stub> stub_;
};

TEST_F(QuotaRpcTest, AWorkersReservationIsItsTenants) {
  ASSERT_TRUE(Insert("acme", 1, 1).ok());  // creates the pool
  grpc::Status s = Reserve(kAcmeToken, 2 * kBytesPerPage);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::StatsResponse stats = Stats();
  EXPECT_EQ(Tenant(stats, "acme").reserved_bytes(), 2 * kBytesPerPage);
  EXPECT_EQ(Tenant(stats, "acme").max_bytes(), kQuotaPages * kBytesPerPage);

  // Globex can neither name acme nor give back acme's bytes as its own.
  s = Reserve(kGlobexToken, kBytesPerPage, "acme", /*unreserve=*/true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("tenant acme"));
  s = Reserve(kGlobexToken, kBytesPerPage, "", /*unreserve=*/true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(Tenant(Stats(), "acme").reserved_bytes(), 2 * kBytesPerPage);

  // Acme's worker takes its own back, naming itself or not.
  EXPECT_TRUE(Reserve(kAcmeToken, kBytesPerPage, "acme", /*unreserve=*/true).ok());
  EXPECT_TRUE(Reserve(kAcmeToken, kBytesPerPage, "", /*unreserve=*/true).ok());
  EXPECT_EQ(Tenant(Stats(), "acme").reserved_bytes(), 0u);
}

TEST_F(QuotaRpcTest, ReserveBeyondTheQuotaIsRefusedForTheTenantAndNotTheOperator) {
  ASSERT_TRUE(Insert("globex", 1, 1).ok());
  grpc::Status s = Reserve(kGlobexToken, 100 * kBytesPerPage);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("tenant_max_bytes: tenant globex"));
  // An admin acting for globex meets the same quota; as the operator, none.
  s = Reserve(kAdminToken, 100 * kBytesPerPage, "globex");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  s = Reserve(kAdminToken, 100 * kBytesPerPage);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Tenant(Stats(), "").reserved_bytes(), 100 * kBytesPerPage);
  // A worker may not give back the operators' headroom.
  EXPECT_EQ(Reserve(kGlobexToken, kBytesPerPage, "", /*unreserve=*/true).error_code(),
            grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(Reserve(kAdminToken, 100 * kBytesPerPage, "", /*unreserve=*/true).ok());
}

TEST_F(QuotaRpcTest, InsertsPastTheQuotaEvictTheTenantsOwnPages) {
  ASSERT_TRUE(Insert("globex", 50, 2).ok());
  for (int i = 1; i <= 6; ++i) ASSERT_TRUE(Insert("acme", i, 1).ok()) << i;
  v1::StatsResponse stats = Stats();
  EXPECT_EQ(Tenant(stats, "acme").stored_bytes(), kQuotaPages * kBytesPerPage);
  EXPECT_EQ(Tenant(stats, "globex").stored_bytes(), 2 * kBytesPerPage);
}

TEST_F(QuotaRpcTest, PinsPastThePinnedBudgetAreRefused) {
  ASSERT_TRUE(Insert("acme", 1, 3).ok());
  grpc::Status s = Pin(kAcmeToken, "acme", 1, 3);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("tenant_max_pinned_bytes"));
  s = Pin(kAcmeToken, "acme", 1, 2);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Tenant(Stats(), "acme").pinned_bytes(), 2 * kBytesPerPage);
  EXPECT_EQ(Tenant(Stats(), "acme").pins(), 1u);
}

TEST_F(QuotaRpcTest, AWorkerSeesOnlyItsOwnTenant) {
  ASSERT_TRUE(Insert("acme", 1, 1).ok());
  ASSERT_TRUE(Reserve(kAdminToken, kBytesPerPage).ok());
  v1::StatsResponse all = Stats();
  EXPECT_EQ(all.tenants_size(), 3);  // "", acme, globex
  v1::StatsResponse mine = Stats(kAcmeToken);
  ASSERT_EQ(mine.tenants_size(), 1);
  EXPECT_EQ(mine.tenants(0).tenant(), "acme");
  EXPECT_EQ(mine.tenants(0).stored_bytes(), kBytesPerPage);
}

}  // namespace
}  // namespace kvcm
