// Whose reservation a Reserve or Unreserve is, and who may make it.
#include "server/service/access_control.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

Principal Worker(std::string tenant) {
  return Principal{.name = "w", .roles = static_cast<uint8_t>(Role::kWorker), .tenant = tenant};
}

Principal Admin() { return Principal{.name = "ops", .roles = static_cast<uint8_t>(Role::kAdmin)}; }

v1::ReserveRequest Request(std::string tenant) {
  v1::ReserveRequest req;
  req.mutable_pool()->set_agent_id("gpu-0");
  req.mutable_pool()->set_tier(v1::TIER_GPU);
  req.set_bytes(1);
  req.set_tenant(tenant);
  return req;
}

TEST(ReservationAccessTest, AWorkerReservesForItsOwnTenantOnly) {
  const Principal acme = Worker("acme");
  EXPECT_TRUE(Authorize(acme, Request("")).ok());
  EXPECT_EQ(ReservationTenant(acme, Request("")), "acme");
  EXPECT_TRUE(Authorize(acme, Request("acme")).ok());
  EXPECT_EQ(ReservationTenant(acme, Request("acme")), "acme");
  absl::Status other = Authorize(acme, Request("globex"));
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other.message(), HasSubstr("tenant globex"));
}

TEST(ReservationAccessTest, AnAdminReservesForTheTenantNamedOrAsTheOperator) {
  const Principal ops = Admin();
  EXPECT_TRUE(Authorize(ops, Request("globex")).ok());
  EXPECT_EQ(ReservationTenant(ops, Request("globex")), "globex");
  EXPECT_TRUE(Authorize(ops, Request("")).ok());
  EXPECT_EQ(ReservationTenant(ops, Request("")), "");
  // The open dev-mode caller is an admin too.
  EXPECT_EQ(ReservationTenant(*OpenPrincipal(), Request("")), "");
  EXPECT_EQ(ReservationTenant(*OpenPrincipal(), Request("acme")), "acme");
}

TEST(ReservationAccessTest, OtherRolesMayNotReserve) {
  const Principal router{
      .name = "r", .roles = static_cast<uint8_t>(Role::kRouter), .probes_any_tenant = true};
  EXPECT_EQ(Authorize(router, Request("")).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Authorize(router, Request("acme")).code(), absl::StatusCode::kPermissionDenied);
}

Principal Agent(std::string agent_id) {
  return Principal{
      .name = agent_id, .roles = static_cast<uint8_t>(Role::kAgent), .agent_id = agent_id};
}

// What the Fetcher sends after a pull: its own pool, its epoch, page hashes.
v1::InsertRequest FetchedInsert(std::string agent_id) {
  v1::InsertRequest req;
  req.mutable_namespace_()->set_tenant("acme");
  req.mutable_namespace_()->set_model("m");
  req.mutable_prompt()->set_page_hashes(std::string(16, 'x'));
  req.mutable_pool()->set_agent_id(agent_id);
  req.mutable_pool()->set_tier(v1::TIER_GPU);
  req.add_block_ids(3);
  req.set_agent_epoch(7);
  return req;
}

TEST(InsertAccessTest, AnAgentIndexesWhatItFetchedIntoItsOwnPoolOnly) {
  const Principal gpu1 = Agent("gpu1");
  EXPECT_TRUE(Authorize(gpu1, FetchedInsert("gpu1")).ok());

  absl::Status other = Authorize(gpu1, FetchedInsert("gpu2"));
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other.message(), HasSubstr("agent \"gpu2\"'s pool"));

  v1::InsertRequest no_epoch = FetchedInsert("gpu1");
  no_epoch.set_agent_epoch(0);
  EXPECT_THAT(Authorize(gpu1, no_epoch).message(), HasSubstr("agent_epoch"));

  v1::InsertRequest tokens = FetchedInsert("gpu1");
  tokens.mutable_prompt()->mutable_tokens()->add_ids(1);
  EXPECT_THAT(Authorize(gpu1, tokens).message(), HasSubstr("page hashes only"));

  v1::InsertRequest reserved = FetchedInsert("gpu1");
  reserved.set_use_reservation(true);
  absl::Status r = Authorize(gpu1, reserved);
  EXPECT_EQ(r.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(r.message(), HasSubstr("use_reservation"));

  // Other roles are as before: a worker of another tenant, a router, are refused.
  EXPECT_EQ(Authorize(Worker("globex"), FetchedInsert("gpu1")).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Authorize(Worker("acme"), FetchedInsert("gpu2")).ok());
  const Principal router{
      .name = "r", .roles = static_cast<uint8_t>(Role::kRouter), .probes_any_tenant = true};
  EXPECT_EQ(Authorize(router, FetchedInsert("gpu1")).code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace kvcm
