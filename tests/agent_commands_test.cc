// AgentControl.Commands end to end, with an in-process ManagerServer and either an
// in-process Agent (host backend) or a hand-driven fake agent on raw stubs:
//   - an Insert into an agent's pool commits its blocks on the agent first (CommitBlocks);
//     agent_insert_test tries it as an adversary;
//   - evicted blocks come back to the agent's free list (FreeBlocks, acked and counted);
//   - with the cost policy, evicted GPU pages are demoted: the agent copies them into its
//     host pool and the index learns the host blocks, which hold the same bytes;
//   - commands wait for a stream, are resent on a new stream until acked, and an
//     out-of-order ack ends the stream; an insert answers only once its commit is acked;
//   - a new epoch, or an agent declared gone, drops the agent's pages and queue (an insert
//     waiting for a commit fails); a gone agent may register the same epoch again;
//   - a stale epoch is ABORTED, an unknown agent NOT_FOUND.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/in_process_cluster.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateIn;
using ::kvcm::testing::BlockAgentStub;
using ::kvcm::testing::Bytes;
using ::kvcm::testing::ConnectAndRegister;
using ::kvcm::testing::FreeAsWorker;
using ::kvcm::testing::FreeBlocksOf;
using ::kvcm::testing::kBlockBytes;
using ::kvcm::testing::MetricsHave;
using ::kvcm::testing::ReadAll;
using ::kvcm::testing::StartAgent;
using ::kvcm::testing::StartManager;
using ::kvcm::testing::StatsOf;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

TEST(AgentCommandsTest, EvictedBlocksAreFreedOnTheAgentAndAcked) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 8);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));

  const NamespaceId ns{"tenant", "deepseek-v3"};
  const ModelSpec& spec = agent->pool().geometry().spec;
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), ns, spec);
  ASSERT_NE(client, nullptr);

  auto ba = BlockAgentStub(*agent);
  const std::vector<BlockId> ids = AllocateIn(*ba, 3, agent->epoch(), ns);
  ASSERT_EQ(ids.size(), 3u);
  ASSERT_EQ(FreeBlocksOf(*ba), 5u);

  // The inserts' commits and the evictions' frees go over the Commands stream.
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
  // Two commits acked. The committed blocks belong to the cache now: still not free, and
  // their worker can no longer free them.
  EXPECT_TRUE(WaitFor([&] { return MetricsHave(*manager, "commands_total{result=\"acked\"} 2"); }));
  EXPECT_EQ(FreeBlocksOf(*ba), 5u);
  EXPECT_EQ(FreeAsWorker(*ba, ids, agent->epoch()).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // The leaf goes first: exactly its block comes back.
  absl::StatusOr<EvictReply> ev = client->EvictFromPool(pool, 1);
  ASSERT_TRUE(ev.ok()) << ev.status();
  ASSERT_EQ(ev->evicted_pages, 1u);
  EXPECT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba) == 6; })) << FreeBlocksOf(*ba);
  absl::SleepFor(absl::Milliseconds(100));  // and nothing more
  EXPECT_EQ(FreeBlocksOf(*ba), 6u);
  EXPECT_TRUE(WaitFor([&] { return MetricsHave(*manager, "commands_total{result=\"acked\"} 3"); }));

  // Then the rest.
  ev = client->EvictFromPool(pool, 2 * spec.BytesPerPage());
  ASSERT_TRUE(ev.ok()) << ev.status();
  ASSERT_EQ(ev->evicted_pages, 2u);
  EXPECT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba) == 8; })) << FreeBlocksOf(*ba);
  EXPECT_TRUE(WaitFor([&] { return MetricsHave(*manager, "commands_total{result=\"acked\"} 4"); }));
  const std::string metrics = manager->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_commands_total{result=\"failed\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_commands_total{result=\"dropped\"} 0"));

  agent->Shutdown();
  EXPECT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 0; }));
}

// The blocks of an insert whose pages the pool already holds (in other blocks) are
// committed, then released back to their worker before the insert answers: the worker may
// free them as soon as it has the answer.
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
  const std::vector<BlockId> gpu_blocks = AllocateIn(*ba, 2, agent->epoch(), ns);
  ASSERT_EQ(gpu_blocks.size(), 2u);
  const std::string written = Bytes(2 * kBlockBytes, 5);
  const grpc::Status wrote = WriteAll(*ba, gpu_blocks, agent->epoch(), written);
  ASSERT_TRUE(wrote.ok()) << wrote.error_message();
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
  absl::StatusOr<std::string> got = ReadAll(*ba, host_blocks, agent->epoch(), v1::TIER_HOST);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == written) << "host blocks differ from the demoted GPU blocks";
  const std::string metrics = manager->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_agent_commands_total{result=\"failed\"} 0"));
}

// A fake agent on raw stubs, so the test decides when streams open, break and ack.
class FakeAgent {
 public:
  FakeAgent(const std::string& manager_address, std::string id)
      : id_(std::move(id)),
        control_(v1::AgentControl::NewStub(MakeInsecureChannel(manager_address))) {}

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

// Heartbeats `epoch` of a fake agent every 50 ms until destroyed, so that the short
// heartbeat timeout of FakeAgentTest does not declare it gone in the middle of a step.
class Heartbeats {
 public:
  Heartbeats(FakeAgent* agent, uint64_t epoch)
      : thread_([this, agent, epoch] {
          while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
            (void)agent->Heartbeat(epoch);
          }
        }) {}
  ~Heartbeats() {
    stop_.Notify();
    thread_.join();
  }

 private:
  absl::Notification stop_;
  std::thread thread_;
};

// Inserts on another thread while this one plays the agent on `s`: the insert's
// CommitBlocks must name `blocks` in `ns`'s pool `pool`, and is acked with `newly` (the
// blocks the agent had not committed before; all of `blocks` when nullopt). Returns the
// insert's answer; *sequence (when given) gets the commit's sequence.
absl::StatusOr<InsertReply> InsertCommitting(
    Client& client, FakeAgent::Stream& s, const NamespaceId& ns, std::span<const int32_t> tokens,
    const PoolRef& pool, const std::vector<BlockId>& blocks,
    const std::optional<std::vector<BlockId>>& newly = std::nullopt, uint64_t* sequence = nullptr) {
  std::future<absl::StatusOr<InsertReply>> insert =
      std::async(std::launch::async, [&] { return client.Insert(ns, tokens, pool, blocks); });
  v1::AgentCommand command;
  if (!s.rw->Read(&command)) {
    ADD_FAILURE() << "the stream ended before the insert's CommitBlocks";
    return insert.get();
  }
  EXPECT_TRUE(command.has_commit()) << command.DebugString();
  EXPECT_EQ(command.commit().tier(), static_cast<v1::Tier>(pool.tier));
  EXPECT_EQ(command.commit().namespace_().tenant(), ns.tenant);
  EXPECT_EQ(command.commit().namespace_().model(), ns.model);
  EXPECT_THAT(command.commit().block_ids(), ElementsAreArray(blocks));
  EXPECT_EQ(command.commit().page_hashes().size(), 16 * blocks.size());
  if (sequence != nullptr) *sequence = command.sequence();
  v1::AgentCommandAck ack = Ack(command.sequence());
  for (BlockId b : newly.value_or(blocks)) ack.add_block_ids(b);
  EXPECT_TRUE(s.rw->Write(ack));
  return insert.get();
}

class FakeAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manager_ = StartManager({.lease_sweep_interval_ms = 20, .agent_heartbeat_timeout_ms = 300});
    client_ = ConnectAndRegister(manager_->address(), ns_, *FakeAgent::FindDeepSeekV3());
    ASSERT_NE(client_, nullptr);
  }

  // Inserts `pages` pages into the fake agent's pool in blocks first_block.., answering the
  // commit on `s` (acked with `newly`, or every block), and evicts the last `evict` of them
  // (their FreeBlocks goes to `s`, unread).
  std::vector<int32_t> InsertAndEvict(FakeAgent::Stream& s, size_t pages, BlockId first_block,
                                      size_t evict,
                                      const std::optional<std::vector<BlockId>>& newly = {}) {
    std::vector<int32_t> tokens = Tokens(pages, kDefaultPageSizeTokens, first_block);
    std::vector<BlockId> blocks(pages);
    for (size_t i = 0; i < pages; ++i) blocks[i] = first_block + i;
    absl::StatusOr<InsertReply> ins =
        InsertCommitting(*client_, s, ns_, tokens, pool_, blocks, newly);
    EXPECT_TRUE(ins.ok()) << ins.status();
    if (evict > 0) {
      EXPECT_TRUE(client_->EvictFromPool(pool_, evict * page_bytes_).ok());
    }
    return tokens;
  }

  size_t Unacked() { return manager_->commands().unacked_commands("fake-1"); }

  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Client> client_;
  const NamespaceId ns_{"tenant", "deepseek-v3"};
  const PoolRef pool_{"fake-1", Tier::kGpu};
  const uint64_t page_bytes_ = FakeAgent::FindDeepSeekV3()->BytesPerPage();
};

TEST_F(FakeAgentTest, CommandsWaitForAStreamAndAreResentUntilAcked) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(1).ok());
  Heartbeats alive(&agent, 1);

  // No stream yet: the insert's CommitBlocks waits for one, and the insert for its ack.
  const std::vector<int32_t> first = Tokens(1, kDefaultPageSizeTokens, 9);
  std::future<absl::StatusOr<InsertReply>> insert = std::async(std::launch::async, [&] {
    return client_->Insert(ns_, first, pool_, std::vector<BlockId>{9});
  });
  ASSERT_TRUE(WaitFor([&] { return Unacked() == 1; }));
  v1::AgentCommand command;
  {
    std::unique_ptr<FakeAgent::Stream> s = agent.Open(1);
    ASSERT_TRUE(s->rw->Read(&command));
    EXPECT_EQ(command.sequence(), 1u);
    ASSERT_TRUE(command.has_commit()) << command.DebugString();
    EXPECT_THAT(command.commit().block_ids(), ElementsAre(9));
    s->ctx.TryCancel();  // the stream breaks before the ack
    s->rw->Finish();
  }
  EXPECT_EQ(Unacked(), 1u);
  EXPECT_EQ(insert.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "the insert answered before its commit was acked";
  EXPECT_EQ(client_->Match(ns_, first, {.probe = true})->matched_pages, 0u);

  std::unique_ptr<FakeAgent::Stream> s = agent.Open(1);
  ASSERT_TRUE(s->rw->Read(&command));
  EXPECT_EQ(command.sequence(), 1u);  // resent
  EXPECT_EQ(command.acked_through(), 0u);
  ASSERT_TRUE(command.has_commit()) << command.DebugString();
  v1::AgentCommandAck ack = Ack(1);
  ack.add_block_ids(9);
  ASSERT_TRUE(s->rw->Write(ack));
  absl::StatusOr<InsertReply> inserted = insert.get();
  ASSERT_TRUE(inserted.ok()) << inserted.status();
  EXPECT_EQ(inserted->new_pages, 1u);
  EXPECT_EQ(client_->Match(ns_, first, {.probe = true})->matched_pages, 1u);
  EXPECT_TRUE(WaitFor([&] { return Unacked() == 0; }));
  ASSERT_TRUE(s->rw->Write(Ack(1)));  // a repeated ack is ignored
  s->ctx.TryCancel();
  s->rw->Finish();

  // An eviction while no stream is open: its FreeBlocks waits for the next one.
  ASSERT_TRUE(client_->EvictFromPool(pool_, page_bytes_).ok());
  EXPECT_EQ(Unacked(), 1u);
  s = agent.Open(1);
  ASSERT_TRUE(s->rw->Read(&command));
  EXPECT_EQ(command.sequence(), 2u);  // numbered per epoch, across streams
  EXPECT_EQ(command.acked_through(), 1u);
  ASSERT_TRUE(command.has_free()) << command.DebugString();
  EXPECT_THAT(command.free().block_ids(), ElementsAre(9));
  ASSERT_TRUE(s->rw->Write(Ack(2)));
  EXPECT_TRUE(WaitFor([&] { return Unacked() == 0; }));

  uint64_t sequence = 0;
  const std::vector<int32_t> second = Tokens(1, kDefaultPageSizeTokens, 12);
  ASSERT_TRUE(
      InsertCommitting(*client_, *s, ns_, second, pool_, {12}, std::nullopt, &sequence).ok());
  EXPECT_EQ(sequence, 3u);
  ASSERT_TRUE(client_->EvictFromPool(pool_, page_bytes_).ok());
  ASSERT_TRUE(s->rw->Read(&command));
  EXPECT_EQ(command.sequence(), 4u);
  EXPECT_EQ(command.acked_through(), 3u);
  EXPECT_THAT(command.free().block_ids(), ElementsAre(12));
  // An ack of a sequence that was not sent next breaks the protocol.
  ASSERT_TRUE(s->rw->Write(Ack(7)));
  EXPECT_FALSE(s->rw->Read(&command));
  grpc::Status end = s->rw->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();
  EXPECT_THAT(end.error_message(), HasSubstr("expected 4"));
  EXPECT_EQ(Unacked(), 1u);  // still owed, and sent again on the next stream
  s = agent.Open(1);
  ASSERT_TRUE(s->rw->Read(&command));
  EXPECT_EQ(command.sequence(), 4u);
  EXPECT_THAT(command.free().block_ids(), ElementsAre(12));
  ASSERT_TRUE(s->rw->Write(Ack(4)));
  EXPECT_TRUE(WaitFor([&] { return Unacked() == 0; }));
}

TEST_F(FakeAgentTest, ANewEpochDropsThePagesAndTheQueueOfTheOldOne) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(1).ok());
  std::unique_ptr<FakeAgent::Stream> s = agent.Open(1);
  std::vector<int32_t> kept;
  {
    Heartbeats alive(&agent, 1);
    InsertAndEvict(*s, 2, 0, 0);
    // Pages 0-1 were committed by the first insert: only block 2 is new. The third page
    // leaves again, and its FreeBlocks stays unacked.
    kept = InsertAndEvict(*s, 3, 0, 1, std::vector<BlockId>{2});
    ASSERT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 2u);
    EXPECT_EQ(Unacked(), 1u);

    ASSERT_TRUE(agent.Register(1).ok());  // a refresh of the same epoch keeps everything
    EXPECT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 2u);
    EXPECT_EQ(Unacked(), 1u);
  }

  ASSERT_TRUE(agent.Register(2).ok());  // restarted
  EXPECT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 0u);
  EXPECT_EQ(manager_->commands().unacked_commands("fake-1"), 0u);
  EXPECT_THAT(manager_->metrics().RenderText(),
              HasSubstr("kvcm_agent_commands_total{result=\"dropped\"} 1"));
  // The old epoch's stream ends (after the FreeBlocks it was sent), and the old epoch is
  // stale everywhere.
  v1::AgentCommand command;
  while (s->rw->Read(&command)) {
    EXPECT_TRUE(command.has_free()) << command.DebugString();
  }
  EXPECT_EQ(s->rw->Finish().error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(agent.Register(1).error_code(), grpc::StatusCode::ABORTED);
  std::unique_ptr<FakeAgent::Stream> old = agent.Open(1);
  EXPECT_FALSE(old->rw->Read(&command));
  EXPECT_EQ(old->rw->Finish().error_code(), grpc::StatusCode::ABORTED);

  // The new epoch numbers its commands from 1 and resends nothing of the old one.
  Heartbeats alive(&agent, 2);
  s = agent.Open(2);
  uint64_t sequence = 0;
  const std::vector<BlockId> blocks = {0, 1, 2};
  ASSERT_TRUE(
      InsertCommitting(*client_, *s, ns_, kept, pool_, blocks, std::nullopt, &sequence).ok());
  EXPECT_EQ(sequence, 1u);
  EXPECT_EQ(client_->Match(ns_, kept, {.probe = true})->matched_pages, 3u);
}

TEST_F(FakeAgentTest, AGoneAgentsPagesAreDroppedAndItsEpochEnds) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(4).ok());
  std::unique_ptr<FakeAgent::Stream> s = agent.Open(4);
  const std::vector<int32_t> tokens = InsertAndEvict(*s, 2, 0, 0);
  absl::StatusOr<MatchReply> pinned = client_->Match(ns_, tokens, {.pin = true});
  ASSERT_TRUE(pinned.ok());
  ASSERT_EQ(pinned->matched_pages, 2u);
  // An insert whose commit the agent reads and never acks.
  const std::vector<int32_t> late = Tokens(1, kDefaultPageSizeTokens, 500);
  std::future<absl::StatusOr<InsertReply>> stuck = std::async(std::launch::async, [&] {
    return client_->Insert(ns_, late, pool_, std::vector<BlockId>{5});
  });
  v1::AgentCommand command;
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_commit()) << command.DebugString();

  // No heartbeat for the 300 ms timeout: the sweeper drops the pages, pinned or not, and
  // the waiting insert fails with nothing indexed.
  EXPECT_TRUE(
      WaitFor([&] { return client_->Match(ns_, tokens, {.probe = true})->matched_pages == 0; }));
  const absl::StatusOr<InsertReply> late_insert = stuck.get();
  EXPECT_EQ(late_insert.status().code(), absl::StatusCode::kAborted) << late_insert.status();
  EXPECT_EQ(client_->Match(ns_, late, {.probe = true})->matched_pages, 0u);
  grpc::Status beat = agent.Heartbeat(4);
  EXPECT_EQ(beat.error_code(), grpc::StatusCode::NOT_FOUND) << beat.error_message();
  EXPECT_FALSE(s->rw->Read(&command));
  EXPECT_EQ(s->rw->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  std::unique_ptr<FakeAgent::Stream> refused = agent.Open(4);  // until it registers again
  EXPECT_FALSE(refused->rw->Read(&command));
  EXPECT_EQ(refused->rw->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(client_->Release(ns_, pinned->pin_id).ok());  // the pin outlives its pages

  // The agent kept its epoch (and its blocks) and registers it again, as a fresh
  // registration: none of the dropped pages come back (a real agent reports its
  // inventory for that), and its commands start over from 1.
  ASSERT_TRUE(agent.Register(4).ok());
  {
    Heartbeats alive(&agent, 4);
    EXPECT_TRUE(agent.Heartbeat(4).ok());
    EXPECT_EQ(client_->Match(ns_, tokens, {.probe = true})->matched_pages, 0u);
    s = agent.Open(4);
    uint64_t sequence = 0;
    const std::vector<BlockId> blocks = {0, 1};
    ASSERT_TRUE(
        InsertCommitting(*client_, *s, ns_, tokens, pool_, blocks, std::nullopt, &sequence).ok());
    EXPECT_EQ(sequence, 1u);
    EXPECT_EQ(client_->Match(ns_, tokens, {.probe = true})->matched_pages, 2u);
  }
  // An older epoch stays stale; a newer one is a new incarnation, without the old pages.
  EXPECT_EQ(agent.Register(3).error_code(), grpc::StatusCode::ABORTED);
  ASSERT_TRUE(agent.Register(5).ok());
  EXPECT_TRUE(agent.Heartbeat(5).ok());
  EXPECT_EQ(client_->Match(ns_, tokens, {.probe = true})->matched_pages, 0u);
}

// An operator forgets an agent now (ForgetAgent) instead of waiting out gone_agent_memory_s:
// an unknown id is NOT_FOUND and a live agent FAILED_PRECONDITION unless forced, each with
// nothing changed; a gone one leaves Stats at once; a forced one's pages leave the index, and
// it registers again.
TEST_F(FakeAgentTest, AnOperatorForgetsAGoneAgentAndAForcedLiveOne) {
  FakeAgent agent(manager_->address(), "fake-1");
  ASSERT_TRUE(agent.Register(4).ok());
  auto agents = [&] { return client_->Stats()->agents; };
  EXPECT_EQ(client_->ForgetAgent("fake-9").status().code(), absl::StatusCode::kNotFound);
  {
    Heartbeats alive(&agent, 4);
    std::unique_ptr<FakeAgent::Stream> s = agent.Open(4);
    const std::vector<int32_t> tokens = InsertAndEvict(*s, 2, 0, 0);
    const absl::StatusOr<ForgetAgentReply> live = client_->ForgetAgent("fake-1");
    EXPECT_EQ(live.status().code(), absl::StatusCode::kFailedPrecondition) << live.status();
    EXPECT_THAT(live.status().message(), HasSubstr("force"));
    ASSERT_EQ(agents().size(), 1u);
    EXPECT_TRUE(agents()[0].alive);
    EXPECT_EQ(client_->Match(ns_, tokens, {.probe = true})->matched_pages, 2u);
    EXPECT_TRUE(agent.Heartbeat(4).ok());
  }

  // No heartbeat for the 300 ms timeout: gone, and forgotten on request, not in an hour.
  EXPECT_TRUE(WaitFor([&] { return !agents().empty() && !agents()[0].alive; }));
  absl::StatusOr<ForgetAgentReply> gone = client_->ForgetAgent("fake-1");
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->epoch, 4u);
  EXPECT_FALSE(gone->was_alive);
  EXPECT_TRUE(agents().empty());
  EXPECT_EQ(client_->ForgetAgent("fake-1").status().code(), absl::StatusCode::kNotFound);

  // Forced: a live agent's pages leave with it; its next heartbeat is NOT_FOUND.
  ASSERT_TRUE(agent.Register(5).ok());
  Heartbeats alive(&agent, 5);
  std::unique_ptr<FakeAgent::Stream> s = agent.Open(5);
  const std::vector<int32_t> tokens = InsertAndEvict(*s, 2, 0, 0);
  absl::StatusOr<ForgetAgentReply> forced = client_->ForgetAgent("fake-1", {.force = true});
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE(forced->was_alive);
  EXPECT_EQ(forced->dropped_pages, 2u);
  EXPECT_EQ(client_->Match(ns_, tokens, {.probe = true})->matched_pages, 0u);
  EXPECT_EQ(agent.Heartbeat(5).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(agent.Register(5).ok());
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
  ASSERT_TRUE(InsertCommitting(*client, *s, ns, kept, gpu, {3, 4}).ok());
  ASSERT_TRUE(InsertCommitting(*client, *s, ns, lost, gpu, {5}).ok());
  const uint64_t page = spec.BytesPerPage();

  // First demotion: the agent copies blocks 3, 4 into host blocks 7, 8.
  ASSERT_TRUE(client->Match(ns, lost, {}).ok());  // `kept` is now the older: it goes first
  ASSERT_TRUE(client->EvictFromPool(gpu, 2 * page).ok());
  v1::AgentCommand command;
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_demote()) << command.DebugString();
  EXPECT_THAT(command.demote().source_block_ids(), ElementsAre(3, 4));
  v1::AgentCommandAck ack = Ack(command.sequence());
  ack.add_block_ids(7);
  ack.add_block_ids(8);
  ASSERT_TRUE(s->rw->Write(ack));
  ASSERT_TRUE(s->rw->Read(&command));  // then the GPU blocks are freed
  ASSERT_TRUE(command.has_free());
  EXPECT_EQ(command.free().tier(), v1::TIER_GPU);
  EXPECT_THAT(command.free().block_ids(), ElementsAre(3, 4));
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
  EXPECT_THAT(host_blocks, ElementsAre(7, 8));

  // Second demotion: the copy fails, so the index forgets the pending host page.
  ASSERT_TRUE(client->EvictFromPool(gpu, page).ok());
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_demote());
  EXPECT_THAT(command.demote().source_block_ids(), ElementsAre(5));
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
  EXPECT_THAT(command.free().block_ids(), ElementsAre(5));
  ASSERT_TRUE(s->rw->Write(Ack(command.sequence())));

  // Third: an answer with the wrong number of blocks is undone like a failure, and the
  // blocks it named are freed.
  const std::vector<int32_t> odd = Tokens(1, spec.page_size_tokens, 2000);
  ASSERT_TRUE(InsertCommitting(*client, *s, ns, odd, gpu, {6}).ok());
  ASSERT_TRUE(client->EvictFromPool(gpu, page).ok());
  ASSERT_TRUE(s->rw->Read(&command));
  ASSERT_TRUE(command.has_demote());
  EXPECT_THAT(command.demote().source_block_ids(), ElementsAre(6));
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
  EXPECT_THAT(command.free().block_ids(), ElementsAre(10, 11));
  ASSERT_TRUE(s->rw->Write(Ack(command.sequence())));
  EXPECT_EQ(client->Match(ns, odd, {.probe = true})->matched_pages, 0u);
}

TEST(AgentCommandsTest, StaleEpochIsAbortedAndUnknownAgentNotFound) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 2);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  auto control = v1::AgentControl::NewStub(MakeInsecureChannel(manager->address()));

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
