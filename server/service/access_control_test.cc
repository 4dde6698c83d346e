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

}  // namespace
}  // namespace kvcm
