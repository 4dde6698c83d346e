// AgentControl.Commands end to end: an in-process ManagerServer and an in-process Agent
// (host backend). Blocks allocated through BlockAgent and indexed with Insert come back to
// the agent's free list when the manager evicts them: the manager sends FreeBlocks on the
// agent's Commands stream, the agent frees them and acks, and the manager counts the ack.
// Also: a Commands stream with a stale epoch is ABORTED and one of an unknown agent is
// NOT_FOUND.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gpu/agent/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<ManagerServer> StartManager() {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

std::unique_ptr<Agent> StartAgent(const std::string& manager_address, uint64_t blocks) {
  AgentOptions o;
  o.agent_id = "gpu-3";
  o.manager_address = manager_address;
  o.use_device = false;
  o.capacity_bytes = blocks * (1152ull * 61 * 64);  // DeepSeek-V3 bf16 pages
  o.heartbeat_interval_ms = 20;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return *std::move(agent);
}

uint64_t FreeBlocksOf(v1::BlockAgent::Stub& agent) {
  grpc::ClientContext ctx;
  v1::BlockAgentStatsResponse s;
  EXPECT_TRUE(agent.Stats(&ctx, v1::BlockAgentStatsRequest(), &s).ok());
  return s.free_blocks();
}

// Polls `pred` every 10 ms until it holds or 5 s pass; returns its last value.
template <typename Pred>
bool WaitFor(Pred pred) {
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (!pred()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

TEST(AgentCommandsTest, EvictedBlocksAreFreedOnTheAgentAndAcked) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 8);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));

  ClientOptions co;
  co.address = manager->address();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  const NamespaceId ns{"tenant", "deepseek-v3"};
  const ModelSpec& spec = agent->pool().geometry().spec;
  ASSERT_TRUE((*client)->RegisterModel(ns, spec).ok());

  auto ba = v1::BlockAgent::NewStub(
      grpc::CreateChannel(agent->address(), grpc::InsecureChannelCredentials()));
  v1::AllocateBlocksRequest alloc;
  alloc.set_count(3);
  alloc.set_owner_epoch(agent->epoch());
  v1::AllocateBlocksResponse got;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(ba->Allocate(&ctx, alloc, &got).ok());
  }
  const std::vector<BlockId> ids(got.block_ids().begin(), got.block_ids().end());
  ASSERT_EQ(FreeBlocksOf(*ba), 5u);

  // The stream is open once the router knows the agent; evicting before that would send
  // nothing.
  ASSERT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 1; }));

  std::vector<int32_t> tokens(3 * spec.page_size_tokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + 1);
  const PoolRef pool{"gpu-3", Tier::kGpu};
  // Two radix nodes: pages 0-1, then page 2 below them.
  const std::span<const int32_t> all(tokens);
  absl::StatusOr<InsertReply> ins = (*client)->Insert(ns, all.first(2 * spec.page_size_tokens),
                                                      pool, std::span<const BlockId>(ids).first(2));
  ASSERT_TRUE(ins.ok()) << ins.status();
  ins = (*client)->Insert(ns, all, pool, ids);
  ASSERT_TRUE(ins.ok()) << ins.status();
  ASSERT_EQ(ins->new_pages, 1u);

  // The leaf goes first: exactly its block comes back.
  absl::StatusOr<EvictReply> ev = (*client)->EvictFromPool(pool, 1);
  ASSERT_TRUE(ev.ok()) << ev.status();
  ASSERT_EQ(ev->evicted_pages, 1u);
  EXPECT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba) == 6; })) << FreeBlocksOf(*ba);
  absl::SleepFor(absl::Milliseconds(100));  // and nothing more
  EXPECT_EQ(FreeBlocksOf(*ba), 6u);
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(manager->metrics().RenderText(),
                             "kvcm_agent_commands_total{result=\"acked\"} 1");
  }));

  // Then the rest.
  ev = (*client)->EvictFromPool(pool, 2 * spec.BytesPerPage());
  ASSERT_TRUE(ev.ok()) << ev.status();
  ASSERT_EQ(ev->evicted_pages, 2u);
  EXPECT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba) == 8; })) << FreeBlocksOf(*ba);
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(manager->metrics().RenderText(),
                             "kvcm_agent_commands_total{result=\"acked\"} 2");
  }));
  const std::string metrics = manager->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_commands_total{result=\"failed\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_commands_total{result=\"dropped\"} 0"));

  agent->Shutdown();
  EXPECT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 0; }));
}

TEST(AgentCommandsTest, StaleEpochIsAbortedAndUnknownAgentNotFound) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 2);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  auto control = v1::AgentControl::NewStub(
      grpc::CreateChannel(manager->address(), grpc::InsecureChannelCredentials()));

  auto open = [&](const std::string& agent_id, uint64_t epoch) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto stream = control->Commands(&ctx);
    v1::AgentCommandAck hello;
    hello.set_agent_id(agent_id);
    hello.set_epoch(epoch);
    stream->Write(hello);
    v1::AgentCommand command;
    EXPECT_FALSE(stream->Read(&command));
    return stream->Finish();
  };
  grpc::Status s = open("gpu-3", agent->epoch() - 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  s = open("nobody", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  s = open("gpu-3", 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
}

}  // namespace
}  // namespace kvcm
