// Who may make a call: the rules the proto states, their enforcement from the descriptors
// alone, failing closed; whose reservation a Reserve or Unreserve is, and who may make it.
#include "server/service/access_control.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"

namespace kvcm {

// A custom rule for a type no method takes (so no other translation unit instantiates
// Authorize for it): the proto cannot ask for it, so Authorize must refuse.
absl::Status AuthorizeCustom(const Principal& /*p*/, const v1::PoolRef& /*req*/) {
  return absl::OkStatus();
}

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

const google::protobuf::ServiceDescriptor* Service(const char* name) {
  return google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
}

TEST(AccessRuleTest, EveryMethodStatesARuleItsRequestCanCarry) {
  for (const char* name :
       {v1::CacheManager::service_full_name(), v1::AgentControl::service_full_name()}) {
    const google::protobuf::ServiceDescriptor* service = Service(name);
    ASSERT_NE(service, nullptr) << name;
    for (int i = 0; i < service->method_count(); ++i) {
      const google::protobuf::MethodDescriptor* m = service->method(i);
      const v1::Access stated = m->options().GetExtension(v1::access);
      SCOPED_TRACE(m->full_name());
      EXPECT_NE(stated, v1::ACCESS_UNSPECIFIED) << "state (kvcm.v1.access) in the proto";
      // Methods sharing a request type share its rule (Reserve, Unreserve).
      EXPECT_EQ(AccessRuleOf(m->input_type()), stated);
      const google::protobuf::Descriptor* in = m->input_type();
      if (stated == v1::ACCESS_AGENT) {
        const google::protobuf::FieldDescriptor* f = in->FindFieldByName("agent_id");
        ASSERT_NE(f, nullptr) << "rule AGENT needs the request's agent_id";
        EXPECT_EQ(f->type(), google::protobuf::FieldDescriptor::TYPE_STRING);
      }
      if (stated == v1::ACCESS_TENANT_WORKER) {
        const google::protobuf::FieldDescriptor* f = in->FindFieldByName("namespace");
        ASSERT_NE(f, nullptr) << "rule TENANT_WORKER needs the request's namespace";
        EXPECT_EQ(f->message_type(), v1::Namespace::descriptor());
      }
    }
  }
}

TEST(AccessRuleTest, StatedRulesAreEnforced) {
  // TENANT_WORKER: Release.
  v1::ReleaseRequest release;
  release.mutable_namespace_()->set_tenant("acme");
  EXPECT_TRUE(Authorize(Worker("acme"), release).ok());
  EXPECT_TRUE(Authorize(Admin(), release).ok());
  absl::Status other = Authorize(Worker("globex"), release);
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other.message(), HasSubstr("call Release in tenant \"acme\""));
  EXPECT_EQ(Authorize(Agent("gpu-0"), release).code(), absl::StatusCode::kPermissionDenied);
  // ADMIN: Evict, DeleteNamespace, ForgetAgent.
  EXPECT_TRUE(Authorize(Admin(), v1::EvictRequest()).ok());
  absl::Status evict = Authorize(Worker("acme"), v1::EvictRequest());
  EXPECT_EQ(evict.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(evict.message(), HasSubstr("call Evict (role admin only)"));
  EXPECT_EQ(Authorize(Worker("acme"), v1::ForgetAgentRequest()).code(),
            absl::StatusCode::kPermissionDenied);
  // AGENT: as the agent the request names.
  v1::HeartbeatRequest beat;
  beat.set_agent_id("gpu-0");
  EXPECT_TRUE(Authorize(Agent("gpu-0"), beat).ok());
  EXPECT_THAT(Authorize(Agent("gpu-1"), beat).message(), HasSubstr("act as agent \"gpu-0\""));
  EXPECT_EQ(Authorize(Admin(), beat).code(), absl::StatusCode::kPermissionDenied);
  // ANY: Stats (the handler cuts the answer to the caller's tenants).
  EXPECT_TRUE(Authorize(Agent("gpu-1"), v1::StatsRequest()).ok());
}

TEST(AccessRuleTest, WhatNoStatedRuleCoversIsRefusedToEveryone) {
  const Principal& open = *OpenPrincipal();
  // A CUSTOM method's type through the descriptors alone: its rule is code, not stated.
  EXPECT_EQ(AuthorizeByRule(open, v1::MatchRequest()).code(), absl::StatusCode::kPermissionDenied);
  // A type no method takes.
  EXPECT_EQ(AuthorizeByRule(open, v1::Namespace()).code(), absl::StatusCode::kPermissionDenied);
  // A custom rule the proto does not ask for (AuthorizeCustom(PoolRef) above, which allows
  // everything) is not run.
  absl::Status s = Authorize(open, v1::PoolRef());
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("a custom rule is written for it"));
}

}  // namespace
}  // namespace kvcm
