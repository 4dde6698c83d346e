// AgentControl.Commands end to end, with an in-process ManagerServer and either an
// in-process Agent (host backend) or a hand-driven fake agent on raw stubs:
//   - evicted blocks come back to the agent's free list (FreeBlocks, acked and counted);
//   - with the cost policy, evicted GPU pages are demoted: the agent copies them into its
//     host pool and the index learns the host blocks, which hold the same bytes;
//   - commands wait for a stream, are resent on a new stream until acked, and an
//     out-of-order ack ends the stream;
//   - a new epoch, or an agent declared gone, drops the agent's pages and queue;
//   - a stale epoch is ABORTED, an unknown agent NOT_FOUND.
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
#include "common/credentials.h"
#include "gmock/gmock.h"
#include "gpu/agent/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"
#include "tests/agent_test_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateBlocks;
using ::kvcm::testing::StatsOf;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

std::unique_ptr<ManagerServer> StartManager(ServerOptions o = {}) {
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

constexpr uint64_t kBlockBytes = 1152ull * 61 * 64;  // a DeepSeek-V3 bf16 page

std::unique_ptr<Agent> StartAgent(const std::string& manager_address, uint64_t blocks,
                                  uint64_t host_blocks = 0) {
  AgentOptions o;
  o.agent_id = "gpu-3";
  o.manager_address = manager_address;
  o.use_device = false;
  o.capacity_bytes = blocks * kBlockBytes;
  o.host_capacity_bytes = host_blocks * kBlockBytes;
  o.heartbeat_interval_ms = 20;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return *std::move(agent);
}

uint64_t FreeBlocksOf(v1::BlockAgent::Stub& agent) { return StatsOf(agent).free_blocks(); }

// A client of the manager at `address` that has registered `spec` as `ns`; null (with a
// test failure) if either step fails.
std::unique_ptr<Client> ConnectAndRegister(const std::string& address, const NamespaceId& ns,
                                           const ModelSpec& spec) {
  ClientOptions co;
  co.address = address;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(co);
  if (!client.ok()) {
    ADD_FAILURE() << client.status();
    return nullptr;
  }
  if (absl::StatusOr<RegisterModelReply> r = (*client)->RegisterModel(ns, spec); !r.ok()) {
    ADD_FAILURE() << r.status();
    return nullptr;
  }
  return *std::move(client);
}

std::unique_ptr<v1::BlockAgent::Stub> BlockAgentStub(const Agent& agent) {
  return v1::BlockAgent::NewStub(MakeChannel(agent.address()));
}

TEST(AgentCommandsTest, EvictedBlocksAreFreedOnTheAgentAndAcked) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 8);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));

  const NamespaceId ns{"tenant", "deepseek-v3"};
  const ModelSpec& spec = agent->pool().geometry().spec;
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), ns, spec);
  ASSERT_NE(client, nullptr);

  auto ba = BlockAgentStub(*agent);
  const std::vector<BlockId> ids = AllocateBlocks(*ba, 3, agent->epoch());
  ASSERT_EQ(ids.size(), 3u);
  ASSERT_EQ(FreeBlocksOf(*ba), 5u);

  // The stream is open once the router knows the agent; evicting before that would send
  // nothing.
  ASSERT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 1; }));

  std::vector<int32_t> tokens(3 * spec.page_size_tokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + 1);
  const PoolRef pool{"gpu-3", Tier::kGpu};
  // Two radix nodes: pages 0-1, then page 2 below them.
  const std::span<const int32_t> all(tokens);
  absl::StatusOr<InsertReply> ins = client->Insert(ns, all.first(2 * spec.page_size_tokens), pool,
                                                   std::span<const BlockId>(ids).first(2));
  ASSERT_TRUE(ins.ok()) << ins.status();
  ins = client->Insert(ns, all, pool, ids);
  ASSERT_TRUE(ins.ok()) << ins.status();
  ASSERT_EQ(ins->new_pages, 1u);

  // The leaf goes first: exactly its block comes back.
  absl::StatusOr<EvictReply> ev = client->EvictFromPool(pool, 1);
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
  ev = client->EvictFromPool(pool, 2 * spec.BytesPerPage());
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

std::vector<int32_t> Tokens(size_t pages, uint32_t page_size, int32_t seed) {
  std::vector<int32_t> tokens(pages * page_size);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + seed);
  return tokens;
}

std::string Bytes(size_t n, int seed) {
  std::string b(n, '\0');
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<char>((i * 13 + seed) & 0xff);
  return b;
}

TEST(AgentCommandsTest, EvictedGpuPagesAreDemotedIntoTheHostPool) {
  std::unique_ptr<ManagerServer> manager = StartManager({.policy = "cost"});
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 4, /*host_blocks=*/4);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  ASSERT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 1; }));

  const NamespaceId ns{"tenant", "deepseek-v3"};
  const ModelSpec& spec = agent->pool().geometry().spec;
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), ns, spec);
  ASSERT_NE(client, nullptr);

  // Two pages written into two GPU blocks of the agent's epoch, then indexed.
  auto ba = BlockAgentStub(*agent);
  const std::vector<BlockId> gpu_blocks = AllocateBlocks(*ba, 2, agent->epoch());
  ASSERT_EQ(gpu_blocks.size(), 2u);
  const std::string written = Bytes(2 * kBlockBytes, 5);
  {
    grpc::ClientContext ctx;
    v1::WriteBlocksResponse resp;
    auto writer = ba->WriteBlocks(&ctx, &resp);
    v1::WriteBlocksRequest header;
    header.mutable_header()->mutable_block_ids()->Add(gpu_blocks.begin(), gpu_blocks.end());
    header.mutable_header()->set_owner_epoch(agent->epoch());
    ASSERT_TRUE(writer->Write(header));
    for (size_t off = 0; off < written.size(); off += 1 << 20) {
      v1::WriteBlocksRequest chunk;
      chunk.set_data(written.substr(off, 1 << 20));
      ASSERT_TRUE(writer->Write(chunk));
    }
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  const std::vector<int32_t> tokens = Tokens(2, spec.page_size_tokens, 3);
  const PoolRef gpu{"gpu-3", Tier::kGpu};
  ASSERT_TRUE(client->Insert(ns, tokens, gpu, gpu_blocks).ok());

  // Evicting both GPU pages demotes them: the agent copies, acks with host blocks, frees
  // the GPU blocks; the index then names the host blocks.
  absl::StatusOr<EvictReply> ev = client->EvictFromPool(gpu, 2 * spec.BytesPerPage());
  ASSERT_TRUE(ev.ok()) << ev.status();
  auto host_used = [&] { return StatsOf(*ba).host_pool().used_bytes(); };
  EXPECT_TRUE(WaitFor([&] { return host_used() == 2 * kBlockBytes; })) << host_used();
  EXPECT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba) == 4; })) << FreeBlocksOf(*ba);
  EXPECT_TRUE(WaitFor([&] { return manager->commands().unacked_commands("gpu-3") == 0; }));

  absl::StatusOr<MatchReply> m = client->Match(ns, tokens, {.probe = true});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->matched_pages, 2u);
  std::vector<BlockId> host_blocks;
  for (const MatchReply::Segment& seg : m->segments) {
    ASSERT_EQ(seg.replicas.size(), 1u);
    EXPECT_EQ(seg.replicas[0].pool.tier, Tier::kHost);
    host_blocks.insert(host_blocks.end(), seg.replicas[0].block_ids.begin(),
                       seg.replicas[0].block_ids.end());
  }
  ASSERT_EQ(host_blocks.size(), 2u);
  EXPECT_NE(host_blocks[0], kPendingBlock);
  EXPECT_NE(host_blocks[1], kPendingBlock);

  // The host blocks hold the bytes the GPU blocks held, in page order.
  v1::ReadBlocksRequest read;
  read.mutable_block_ids()->Add(host_blocks.begin(), host_blocks.end());
  read.set_owner_epoch(agent->epoch());
  read.set_tier(v1::TIER_HOST);
  grpc::ClientContext ctx;
  auto reader = ba->ReadBlocks(&ctx, read);
  std::string got;
  v1::ReadBlocksResponse chunk;
  while (reader->Read(&chunk)) got += chunk.data();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(got == written) << "host blocks differ from the demoted GPU blocks";
  const std::string metrics = manager->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_commands_total{result=\"failed\"} 0"));
}

// A fake agent on raw stubs, so the test decides when streams open, break and ack.
class FakeAgent {
 public:
  FakeAgent(const std::string& manager_address, std::string id)
      : id_(std::move(id)), control_(v1::AgentControl::NewStub(MakeChannel(manager_address))) {}

  grpc::Status Register(uint64_t epoch, uint64_t blocks = 16, uint64_t host_blocks = 0) {
    v1::RegisterAgentRequest req;
    req.set_agent_id(id_);
    req.set_device("host");
    req.set_tier(v1::TIER_GPU);
    absl::StatusOr<ModelSpec> spec = FindDeepSeekV3();
    ModelSpecToProto(*spec, req.mutable_geometry()->mutable_spec());
    req.mutable_geometry()->set_bytes_per_block(spec->BytesPerPage());
    req.mutable_geometry()->set_num_blocks(blocks);
    req.set_capacity_bytes(blocks * spec->BytesPerPage());
    if (host_blocks > 0) {
      req.mutable_host_pool()->set_num_blocks(host_blocks);
      req.mutable_host_pool()->set_capacity_bytes(host_blocks * spec->BytesPerPage());
    }
    req.set_epoch(epoch);
    grpc::ClientContext ctx;
    v1::RegisterAgentResponse resp;
    return control_->Register(&ctx, req, &resp);
  }

  grpc::Status Heartbeat(uint64_t epoch) {
    v1::HeartbeatRequest req;
    req.set_agent_id(id_);
    req.set_epoch(epoch);
    grpc::ClientContext ctx;
    v1::HeartbeatResponse resp;
    return control_->Heartbeat(&ctx, req, &resp);
  }

  // An open Commands stream whose hello was sent.
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::AgentCommandAck, v1::AgentCommand>> rw;
  };
  std::unique_ptr<Stream> Open(uint64_t epoch) {
    auto s = std::make_unique<Stream>();
    s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    s->rw = control_->Commands(&s->ctx);
    v1::AgentCommandAck hello;
    hello.set_agent_id(id_);
    hello.set_epoch(epoch);
    EXPECT_TRUE(s->rw->Write(hello));
    return s;
  }

  static absl::StatusOr<ModelSpec> FindDeepSeekV3() {
    ModelSpec s{.attention = AttentionKind::kMla,
                .num_layers = 61,
                .num_heads = 128,
                .kv_lora_rank = 512,
                .rope_dim = 64};
    return s;
  }

 private:
  const std::string id_;
  std::unique_ptr<v1::AgentControl::Stub> control_;
};

v1::AgentCommandAck Ack(uint64_t sequence) {
  v1::AgentCommandAck ack;
  ack.set_sequence(sequence);
  return ack;
}

class FakeAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manager_ = StartManager({.lease_sweep_interval_ms = 20, .agent_heartbeat_timeout_ms = 300});
    client_ = ConnectAndRegister(manager_->address(), ns_, *FakeAgent::FindDeepSeekV3());
    ASSERT_NE(client_, nullptr);
  }

  // Inserts `pages` pages into the fake agent's pool in blocks first_block.. and evicts the
  // last `evict` of them.
  std::vector<int32_t> InsertAndEvict(size_t pages, BlockId first_block, size_t evict) {
    std::vector<int32_t> tokens = Tokens(pages, kDefaultPageSizeTokens, first_block);
    std::vector<BlockId> blocks(pages);
    for (size_t i = 0; i < pages; ++i) blocks[i] = first_block + i;
    EXPECT_TRUE(client_->Insert(ns_, tokens, pool_, blocks).ok());
    if (evict > 0) {
      const uint64_t page_bytes = FakeAgent::FindDeepSeekV3()->BytesPerPage();
      EXPECT_TRUE(client_->EvictFromPool(pool_, evict * page_bytes).ok());
    }
    return tokens;
  }

  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Client> client_;
  const NamespaceId ns_{"tenant", "deepseek-v3"};
  const PoolRef pool_{"fake-1", Tier::kGpu};
};

TEST_F(FakeAgentTest, CommandsWaitForAStreamAndAreResentUntilAcked) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(1).ok());
  InsertAndEvict(1, 9, 1);  // no stream yet: the FreeBlocks waits
  EXPECT_EQ(manager_->commands().unacked_commands("fake-1"), 1u);

  v1::AgentCommand command;
  {
    std::unique_ptr<FakeAgent::Stream> s = agent.Open(1);
    ASSERT_TRUE(s->rw->Read(&command));
    EXPECT_EQ(command.sequence(), 1u);
    ASSERT_TRUE(command.has_free());
    EXPECT_THAT(command.free().block_ids(), ::testing::ElementsAre(9));
    s->ctx.TryCancel();  // the stream breaks before the ack
    s->rw->Finish();
  }
  EXPECT_EQ(manager_->commands().unacked_commands("fake-1"), 1u);

  std::unique_ptr<FakeAgent::Stream> s = agent.Open(1);
  ASSERT_TRUE(s->rw->Read(&command));
  EXPECT_EQ(command.sequence(), 1u);  // resent
  EXPECT_EQ(command.acked_through(), 0u);
  ASSERT_TRUE(s->rw->Write(Ack(1)));
  EXPECT_TRUE(WaitFor([&] { return manager_->commands().unacked_commands("fake-1") == 0; }));
  ASSERT_TRUE(s->rw->Write(Ack(1)));  // a repeated ack is ignored

  InsertAndEvict(1, 20, 1);
  ASSERT_TRUE(s->rw->Read(&command));
  EXPECT_EQ(command.sequence(), 2u);  // numbered per epoch, across streams
  EXPECT_EQ(command.acked_through(), 1u);
  EXPECT_THAT(command.free().block_ids(), ::testing::ElementsAre(20));
  // An ack of a sequence that was not sent next breaks the protocol.
  ASSERT_TRUE(s->rw->Write(Ack(5)));
  EXPECT_FALSE(s->rw->Read(&command));
  grpc::Status end = s->rw->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();
  EXPECT_THAT(end.error_message(), HasSubstr("expected 2"));
  EXPECT_EQ(manager_->commands().unacked_commands("fake-1"), 1u);  // still owed
}

TEST_F(FakeAgentTest, ANewEpochDropsThePagesAndTheQueueOfTheOldOne) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(1).ok());
  InsertAndEvict(2, 0, 0);
  const std::vector<int32_t> kept = InsertAndEvict(3, 0, 1);  // the third page leaves
  ASSERT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 2u);
  EXPECT_EQ(manager_->commands().unacked_commands("fake-1"), 1u);

  ASSERT_TRUE(agent.Register(1).ok());  // a refresh of the same epoch keeps everything
  EXPECT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 2u);

  ASSERT_TRUE(agent.Register(2).ok());  // restarted
  EXPECT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 0u);
  EXPECT_EQ(manager_->commands().unacked_commands("fake-1"), 0u);
  EXPECT_THAT(manager_->metrics().RenderText(),
              HasSubstr("kvcm_agent_commands_total{result=\"dropped\"} 1"));
  // The old epoch is stale everywhere.
  EXPECT_EQ(agent.Register(1).error_code(), grpc::StatusCode::ABORTED);
  std::unique_ptr<FakeAgent::Stream> old = agent.Open(1);
  v1::AgentCommand command;
  EXPECT_FALSE(old->rw->Read(&command));
  EXPECT_EQ(old->rw->Finish().error_code(), grpc::StatusCode::ABORTED);
}

TEST_F(FakeAgentTest, AGoneAgentsPagesAreDroppedAndItsEpochEnds) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(4).ok());
  const std::vector<int32_t> tokens = InsertAndEvict(2, 0, 0);
  absl::StatusOr<MatchReply> pinned = client_->Match(ns_, tokens, {.pin = true});
  ASSERT_TRUE(pinned.ok());
  ASSERT_EQ(pinned->matched_pages, 2u);
  std::unique_ptr<FakeAgent::Stream> s = agent.Open(4);

  // No heartbeat for the 300 ms timeout: the sweeper drops the pages, pinned or not.
  EXPECT_TRUE(
      WaitFor([&] { return client_->Match(ns_, tokens, {.probe = true})->matched_pages == 0; }));
  grpc::Status beat = agent.Heartbeat(4);
  EXPECT_EQ(beat.error_code(), grpc::StatusCode::NOT_FOUND) << beat.error_message();
  EXPECT_EQ(agent.Register(4).error_code(), grpc::StatusCode::ABORTED);
  v1::AgentCommand command;
  EXPECT_FALSE(s->rw->Read(&command));
  EXPECT_EQ(s->rw->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(client_->Release(ns_, pinned->pin_id).ok());  // the pin outlives its pages

  ASSERT_TRUE(agent.Register(5).ok());  // back as a new incarnation
  EXPECT_TRUE(agent.Heartbeat(5).ok());
}

// The manager's side of a demotion, with the agent's answers chosen by the test: blocks the
// agent reports go into the index; a failed copy takes the pending host pages back out.
TEST(AgentCommandsTest, DemoteAcksFillOrUndoTheHostCopies) {
  std::unique_ptr<ManagerServer> manager = StartManager({.policy = "cost"});
  const ModelSpec spec = *FakeAgent::FindDeepSeekV3();
  const NamespaceId ns{"tenant", "deepseek-v3"};
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), ns, spec);
  ASSERT_NE(client, nullptr);
  FakeAgent agent(manager->address(), "fake-2");
  ASSERT_TRUE(agent.Register(1, 16, /*host_blocks=*/16).ok());
  std::unique_ptr<FakeAgent::Stream> s = agent.Open(1);
  ASSERT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 1; }));

  const PoolRef gpu{"fake-2", Tier::kGpu};
  const std::vector<int32_t> kept = Tokens(2, spec.page_size_tokens, 1);
  const std::vector<int32_t> lost = Tokens(1, spec.page_size_tokens, 1000);
  ASSERT_TRUE(client->Insert(ns, kept, gpu, std::vector<BlockId>{3, 4}).ok());
  ASSERT_TRUE(client->Insert(ns, lost, gpu, std::vector<BlockId>{5}).ok());
  const uint64_t page = spec.BytesPerPage();

  // First demotion: the agent copies blocks 3, 4 into host blocks 7, 8.
  ASSERT_TRUE(client->Match(ns, lost, {}).ok());  // `kept` is now the older: it goes first
  ASSERT_TRUE(client->EvictFromPool(gpu, 2 * page).ok());
  v1::AgentCommand command;
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_demote()) << command.DebugString();
  EXPECT_THAT(command.demote().source_block_ids(), ::testing::ElementsAre(3, 4));
  v1::AgentCommandAck ack = Ack(command.sequence());
  ack.add_block_ids(7);
  ack.add_block_ids(8);
  ASSERT_TRUE(s->rw->Write(ack));
  ASSERT_TRUE(s->rw->Read(&command));  // then the GPU blocks are freed
  ASSERT_TRUE(command.has_free());
  EXPECT_EQ(command.free().tier(), v1::TIER_GPU);
  EXPECT_THAT(command.free().block_ids(), ::testing::ElementsAre(3, 4));
  ASSERT_TRUE(s->rw->Write(Ack(command.sequence())));
  ASSERT_TRUE(WaitFor([&] { return manager->commands().unacked_commands("fake-2") == 0; }));
  absl::StatusOr<MatchReply> m = client->Match(ns, kept, {.probe = true});
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->matched_pages, 2u);
  std::vector<BlockId> host_blocks;
  for (const MatchReply::Segment& seg : m->segments) {
    ASSERT_EQ(seg.replicas.size(), 1u);
    EXPECT_EQ(seg.replicas[0].pool.tier, Tier::kHost);
    host_blocks.insert(host_blocks.end(), seg.replicas[0].block_ids.begin(),
                       seg.replicas[0].block_ids.end());
  }
  EXPECT_THAT(host_blocks, ::testing::ElementsAre(7, 8));

  // Second demotion: the copy fails, so the index forgets the pending host page.
  ASSERT_TRUE(client->EvictFromPool(gpu, page).ok());
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_demote());
  EXPECT_THAT(command.demote().source_block_ids(), ::testing::ElementsAre(5));
  EXPECT_EQ(client->Match(ns, lost, {.probe = true})->matched_pages, 1u);  // pending meanwhile
  ack = Ack(command.sequence());
  ack.set_code(static_cast<int32_t>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  ack.set_message("host pool full");
  ASSERT_TRUE(s->rw->Write(ack));
  EXPECT_TRUE(
      WaitFor([&] { return client->Match(ns, lost, {.probe = true})->matched_pages == 0; }));
  EXPECT_EQ(client->Match(ns, kept, {.probe = true})->matched_pages, 2u);
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(manager->metrics().RenderText(),
                             "kvcm_agent_commands_total{result=\"failed\"} 1");
  }));
  ASSERT_TRUE(s->rw->Read(&command));  // the GPU block of the failed copy is freed still
  ASSERT_TRUE(command.has_free());
  EXPECT_THAT(command.free().block_ids(), ::testing::ElementsAre(5));
  ASSERT_TRUE(s->rw->Write(Ack(command.sequence())));

  // Third: an answer with the wrong number of blocks is undone like a failure, and the
  // blocks it named are freed.
  const std::vector<int32_t> odd = Tokens(1, spec.page_size_tokens, 2000);
  ASSERT_TRUE(client->Insert(ns, odd, gpu, std::vector<BlockId>{6}).ok());
  ASSERT_TRUE(client->EvictFromPool(gpu, page).ok());
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_demote());
  EXPECT_THAT(command.demote().source_block_ids(), ::testing::ElementsAre(6));
  ack = Ack(command.sequence());
  ack.add_block_ids(10);
  ack.add_block_ids(11);
  ASSERT_TRUE(s->rw->Write(ack));
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_free());
  EXPECT_EQ(command.free().tier(), v1::TIER_GPU);
  ASSERT_TRUE(s->rw->Write(Ack(command.sequence())));
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_free());
  EXPECT_EQ(command.free().tier(), v1::TIER_HOST);
  EXPECT_THAT(command.free().block_ids(), ::testing::ElementsAre(10, 11));
  ASSERT_TRUE(s->rw->Write(Ack(command.sequence())));
  EXPECT_EQ(client->Match(ns, odd, {.probe = true})->matched_pages, 0u);
}

TEST(AgentCommandsTest, StaleEpochIsAbortedAndUnknownAgentNotFound) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 2);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  auto control = v1::AgentControl::NewStub(MakeChannel(manager->address()));

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
