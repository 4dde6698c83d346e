// AgentControl and BlockAgent over real loopback channels: an in-process ManagerServer and an
// in-process Agent (host backend) that registers, heartbeats and shows in Stats; bad and
// stale registrations through the AgentControl stub.
#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gpu/agent/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "proto/core_types.h"
#include "server/core/model_catalog.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<ManagerServer> StartManager(uint32_t timeout_ms) {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.agent_heartbeat_timeout_ms = timeout_ms;
  o.shutdown_grace_ms = 100;
  absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

v1::StatsResponse Stats(v1::CacheManager::Stub& stub) {
  grpc::ClientContext ctx;
  v1::StatsResponse resp;
  EXPECT_TRUE(stub.Stats(&ctx, v1::StatsRequest(), &resp).ok());
  return resp;
}

// Polls until `pred(Stats())` holds or 10 s pass.
template <typename Pred>
v1::StatsResponse WaitForStats(v1::CacheManager::Stub& stub, Pred pred) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  v1::StatsResponse s = Stats(stub);
  while (!pred(s) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
    s = Stats(stub);
  }
  return s;
}

TEST(AgentRpcTest, AgentRegistersHeartbeatsWithUsageAndShowsInStats) {
  std::unique_ptr<ManagerServer> manager = StartManager(2'000);
  auto cm = v1::CacheManager::NewStub(
      grpc::CreateChannel(manager->address(), grpc::InsecureChannelCredentials()));

  AgentOptions o;
  o.agent_id = "gpu-7";
  o.manager_address = manager->address();
  o.use_device = false;
  o.capacity_bytes = 5 * (1152ull * 61 * 64) + 17;  // five DeepSeek-V3 bf16 pages
  o.heartbeat_interval_ms = 20;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  ASSERT_TRUE(agent.ok()) << agent.status();
  EXPECT_EQ((*agent)->pool().Stats().num_blocks, 5u);

  v1::StatsResponse s =
      WaitForStats(*cm, [](const v1::StatsResponse& r) { return r.agents_size() == 1; });
  ASSERT_EQ(s.agents_size(), 1);
  EXPECT_EQ(s.agents(0).agent_id(), "gpu-7");
  EXPECT_EQ(s.agents(0).device(), "host");
  EXPECT_EQ(s.agents(0).epoch(), (*agent)->epoch());
  EXPECT_TRUE(s.agents(0).alive());
  ASSERT_EQ(s.pools_size(), 1);
  EXPECT_EQ(s.pools(0).pool().agent_id(), "gpu-7");
  EXPECT_EQ(s.pools(0).capacity_bytes(), 5 * 1152ull * 61 * 64) << "exact, whole blocks";

  // Allocate through BlockAgent; the next heartbeats carry the usage.
  auto ba = v1::BlockAgent::NewStub(
      grpc::CreateChannel((*agent)->address(), grpc::InsecureChannelCredentials()));
  v1::AllocateBlocksRequest alloc;
  alloc.set_count(2);
  alloc.set_owner_epoch(9);
  v1::AllocateBlocksResponse got;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(ba->Allocate(&ctx, alloc, &got).ok());
  }
  ASSERT_EQ(got.block_ids_size(), 2);
  s = WaitForStats(*cm, [](const v1::StatsResponse& r) {
    return r.agents_size() == 1 && r.agents(0).free_blocks() == 3;
  });
  EXPECT_EQ(s.agents(0).used_bytes(), 2 * 1152ull * 61 * 64);
  {
    alloc.set_count(4);
    grpc::ClientContext ctx;
    EXPECT_EQ(ba->Allocate(&ctx, alloc, &got).error_code(), grpc::RESOURCE_EXHAUSTED);
  }
  v1::FreeBlocksRequest free_req;
  free_req.add_block_ids(got.block_ids(0));
  free_req.set_owner_epoch(8);
  v1::FreeBlocksResponse free_resp;
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(ba->Free(&ctx, free_req, &free_resp).error_code(), grpc::ABORTED);
  }
  free_req.set_owner_epoch(9);
  {
    grpc::ClientContext ctx;
    EXPECT_TRUE(ba->Free(&ctx, free_req, &free_resp).ok());
  }
  v1::BlockAgentStatsResponse bs;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(ba->Stats(&ctx, v1::BlockAgentStatsRequest(), &bs).ok());
  }
  EXPECT_EQ(bs.free_blocks(), 4u);
  EXPECT_EQ(bs.backend(), "host");
  EXPECT_TRUE(bs.registered());

  // Once the agent stops, it is reported gone after the timeout.
  (*agent)->Shutdown();
  s = WaitForStats(*cm, [](const v1::StatsResponse& r) { return !r.agents(0).alive(); });
  EXPECT_FALSE(s.agents(0).alive());
  EXPECT_GE(s.agents(0).last_heartbeat_age_ms(), 2'000u);
  const std::string metrics = manager->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_agents{state=\"gone\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvcm_agents{state=\"alive\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_heartbeats_total"));
}

v1::RegisterAgentRequest GoodRegistration(uint64_t epoch) {
  v1::RegisterAgentRequest req;
  req.set_agent_id("a1");
  req.set_device("host");
  req.set_tier(v1::TIER_GPU);
  absl::StatusOr<ModelSpec> spec = FindModel("deepseek-v3");
  ModelSpecToProto(*spec, req.mutable_geometry()->mutable_spec());
  req.mutable_geometry()->set_bytes_per_block(spec->BytesPerPage());
  req.mutable_geometry()->set_num_blocks(4);
  req.set_capacity_bytes(4 * spec->BytesPerPage());
  req.set_epoch(epoch);
  return req;
}

grpc::Status Register(v1::AgentControl::Stub& stub, const v1::RegisterAgentRequest& req) {
  grpc::ClientContext ctx;
  v1::RegisterAgentResponse resp;
  return stub.Register(&ctx, req, &resp);
}

grpc::Status Heartbeat(v1::AgentControl::Stub& stub, const std::string& id, uint64_t epoch) {
  grpc::ClientContext ctx;
  v1::HeartbeatRequest req;
  req.set_agent_id(id);
  req.set_epoch(epoch);
  v1::HeartbeatResponse resp;
  return stub.Heartbeat(&ctx, req, &resp);
}

TEST(AgentRpcTest, BadStaleAndUnknownAreRefusedWithNothingChanged) {
  std::unique_ptr<ManagerServer> manager = StartManager(10'000);
  auto channel = grpc::CreateChannel(manager->address(), grpc::InsecureChannelCredentials());
  auto ac = v1::AgentControl::NewStub(channel);
  auto cm = v1::CacheManager::NewStub(channel);

  struct Case {
    const char* field;
    void (*mutate)(v1::RegisterAgentRequest*);
  };
  const Case cases[] = {
      {"agent_id", [](v1::RegisterAgentRequest* r) { r->set_agent_id("bad id!"); }},
      {"tier", [](v1::RegisterAgentRequest* r) { r->set_tier(v1::TIER_UNSPECIFIED); }},
      {"geometry", [](v1::RegisterAgentRequest* r) { r->clear_geometry(); }},
      {"geometry.spec.num_layers",
       [](v1::RegisterAgentRequest* r) {
         r->mutable_geometry()->mutable_spec()->set_num_layers(0);
       }},
      {"geometry.bytes_per_block",
       [](v1::RegisterAgentRequest* r) { r->mutable_geometry()->set_bytes_per_block(1); }},
      {"geometry.num_blocks",
       [](v1::RegisterAgentRequest* r) { r->mutable_geometry()->set_num_blocks(0); }},
      {"capacity_bytes", [](v1::RegisterAgentRequest* r) { r->set_capacity_bytes(1ull << 50); }},
      {"epoch", [](v1::RegisterAgentRequest* r) { r->set_epoch(0); }},
  };
  for (const Case& c : cases) {
    v1::RegisterAgentRequest req = GoodRegistration(5);
    c.mutate(&req);
    grpc::Status st = Register(*ac, req);
    EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(st.error_message(), HasSubstr(c.field));
  }
  v1::StatsResponse s = Stats(*cm);
  EXPECT_EQ(s.agents_size(), 0) << "refused registrations change nothing";
  EXPECT_EQ(s.pools_size(), 0);

  EXPECT_EQ(Heartbeat(*ac, "a1", 5).error_code(), grpc::NOT_FOUND);
  ASSERT_TRUE(Register(*ac, GoodRegistration(5)).ok());
  EXPECT_TRUE(Heartbeat(*ac, "a1", 5).ok());
  v1::RegisterAgentRequest stale = GoodRegistration(4);
  stale.set_capacity_bytes(stale.capacity_bytes() / 2);
  EXPECT_EQ(Register(*ac, stale).error_code(), grpc::ABORTED);
  EXPECT_EQ(Heartbeat(*ac, "a1", 4).error_code(), grpc::ABORTED);
  s = Stats(*cm);
  ASSERT_EQ(s.pools_size(), 1);
  EXPECT_EQ(s.pools(0).capacity_bytes(), GoodRegistration(5).capacity_bytes())
      << "a stale agent must not resize the pool";
  ASSERT_EQ(s.agents_size(), 1);
  EXPECT_EQ(s.agents(0).epoch(), 5u);
  EXPECT_EQ(s.agents(0).heartbeats(), 1u);
}

}  // namespace
}  // namespace kvcm
