// AgentControl and BlockAgent over real loopback channels: an in-process ManagerServer and an
// in-process Agent (host backend) that registers, heartbeats and shows in Stats; bad and
// stale registrations through the AgentControl stub; WriteBlocks / ReadBlocks round trips and
// refusals that change nothing; RunAttention against MlaDecodeCpu on the same latents.
#include "tests/util/agent_rpc.h"

#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"
#include "tests/util/http_get.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateBlocks;
using ::kvcm::testing::HttpGet;
using ::kvcm::testing::StatsOf;
using ::testing::HasSubstr;

std::unique_ptr<ManagerServer> StartManager(uint32_t timeout_ms) {
  ServerOptions o;
  o.tls.insecure = true;
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
  auto cm = v1::CacheManager::NewStub(MakeInsecureChannel(manager->address()));

  AgentOptions o;
  o.tls.insecure = true;
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
  auto ba = v1::BlockAgent::NewStub(MakeInsecureChannel((*agent)->address()));
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

  // Stopped on purpose, the agent says so in a last heartbeat: the manager forgets it and
  // its pool at once, instead of keeping a "gone" record that every rollout would add to.
  (*agent)->Shutdown();
  s = WaitForStats(*cm, [](const v1::StatsResponse& r) { return r.agents_size() == 0; });
  EXPECT_EQ(s.agents_size(), 0);
  EXPECT_EQ(s.pools_size(), 0);
  const std::string metrics = manager->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_agents{state=\"gone\"} 0"));
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

grpc::Status Leave(v1::AgentControl::Stub& stub, const std::string& id, uint64_t epoch) {
  grpc::ClientContext ctx;
  v1::HeartbeatRequest req;
  req.set_agent_id(id);
  req.set_epoch(epoch);
  req.set_leaving(true);
  v1::HeartbeatResponse resp;
  return stub.Heartbeat(&ctx, req, &resp);
}

// An agent that falls silent is reported gone after the heartbeat timeout (a crash: the
// KvcmAgentGone alert's case); one that leaves is forgotten, and a leave with a stale epoch or
// for an unknown agent changes nothing.
TEST(AgentRpcTest, ASilentAgentIsGoneAndALeavingOneIsForgotten) {
  std::unique_ptr<ManagerServer> manager = StartManager(500);
  auto channel = MakeInsecureChannel(manager->address());
  auto ac = v1::AgentControl::NewStub(channel);
  auto cm = v1::CacheManager::NewStub(channel);
  const uint64_t epoch = absl::ToUnixMicros(absl::Now());
  ASSERT_TRUE(Register(*ac, GoodRegistration(epoch)).ok());

  v1::StatsResponse s = WaitForStats(
      *cm, [](const v1::StatsResponse& r) { return r.agents_size() == 1 && !r.agents(0).alive(); });
  ASSERT_EQ(s.agents_size(), 1);
  EXPECT_FALSE(s.agents(0).alive());
  EXPECT_THAT(manager->metrics().RenderText(), HasSubstr("kvcm_agents{state=\"gone\"} 1"));

  EXPECT_EQ(Leave(*ac, "a1", epoch - 1).error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(Leave(*ac, "nobody", epoch).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Stats(*cm).agents_size(), 1) << "a refused leave forgets nothing";

  ASSERT_TRUE(Leave(*ac, "a1", epoch).ok());
  s = Stats(*cm);
  EXPECT_EQ(s.agents_size(), 0);
  EXPECT_EQ(s.pools_size(), 0) << "its pool left too";
  EXPECT_THAT(manager->metrics().RenderText(), HasSubstr("kvcm_agents{state=\"gone\"} 0"));
  EXPECT_EQ(Heartbeat(*ac, "a1", epoch).error_code(), grpc::StatusCode::NOT_FOUND);
  // It may come back: a new registration is a new agent.
  ASSERT_TRUE(Register(*ac, GoodRegistration(epoch + 1)).ok());
  EXPECT_EQ(Stats(*cm).agents_size(), 1);
}

TEST(AgentRpcTest, BadStaleAndUnknownAreRefusedWithNothingChanged) {
  std::unique_ptr<ManagerServer> manager = StartManager(10'000);
  auto channel = MakeInsecureChannel(manager->address());
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
      {"transport",
       [](v1::RegisterAgentRequest* r) {
         r->set_data_address("127.0.0.1:9");
         r->set_transport("udp");
       }},
      {"transport", [](v1::RegisterAgentRequest* r) { r->set_transport("nccl"); }},
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

  // A bandwidth no link has is refused, and the last good one stays.
  for (double gbps : {std::nan(""), -1.0, 1e7, std::numeric_limits<double>::infinity()}) {
    grpc::ClientContext ctx;
    v1::HeartbeatRequest req;
    req.set_agent_id("a1");
    req.set_epoch(5);
    req.set_pull_gbps(gbps);
    v1::HeartbeatResponse resp;
    const grpc::Status st = ac->Heartbeat(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::INVALID_ARGUMENT) << gbps;
    EXPECT_THAT(st.error_message(), HasSubstr("pull_gbps"));
  }
  s = Stats(*cm);
  EXPECT_EQ(s.agents(0).heartbeats(), 1u);
  EXPECT_EQ(s.agents(0).pull_gbps(), 0);
}

// An agent over a small MLA bf16 pool: 2 layers, 16-token pages, 16 blocks (36,864 B each).
// The manager address is unreachable; BlockAgent does not need it. /metrics on
// `metrics_address` unless empty.
std::unique_ptr<Agent> StartMlaAgent(uint64_t read_chunk_bytes,
                                     const std::string& metrics_address = "") {
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "mla-test";
  o.manager_address = "127.0.0.1:1";
  o.use_device = false;
  o.model = "";
  o.spec.attention = AttentionKind::kMla;
  o.spec.num_layers = 2;
  o.spec.num_heads = 16;
  o.spec.kv_lora_rank = 512;
  o.spec.rope_dim = 64;
  o.spec.dtype = KvDtype::kBf16;
  o.spec.page_size_tokens = 16;
  o.page_size_tokens = 16;
  o.capacity_bytes = 16 * 1152ull * 2 * 16;
  o.heartbeat_interval_ms = 60'000;
  o.max_blocks_per_call = 8;
  o.read_chunk_bytes = read_chunk_bytes;
  o.metrics_address = metrics_address;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return *std::move(agent);
}

// Streams a header (unless !send_header) and `bytes` in chunks of `chunk` bytes.
grpc::Status WriteBlocks(v1::BlockAgent::Stub& stub, const std::vector<BlockId>& ids,
                         uint64_t epoch, const std::string& bytes, size_t chunk,
                         bool send_header = true, uint64_t* written = nullptr) {
  grpc::ClientContext ctx;
  v1::WriteBlocksResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::WriteBlocksRequest>> w = stub.WriteBlocks(&ctx, &resp);
  v1::WriteBlocksRequest msg;
  bool open = true;
  if (send_header) {
    msg.mutable_header()->mutable_block_ids()->Add(ids.begin(), ids.end());
    msg.mutable_header()->set_owner_epoch(epoch);
    open = w->Write(msg);
  }
  for (size_t i = 0; open && i < bytes.size(); i += chunk) {
    msg.set_data(bytes.substr(i, chunk));
    open = w->Write(msg);
  }
  w->WritesDone();
  grpc::Status st = w->Finish();
  if (written != nullptr) *written = resp.bytes_written();
  return st;
}

// The blocks' bytes; `max_chunk` gets the largest message seen.
grpc::Status ReadBlocks(v1::BlockAgent::Stub& stub, const std::vector<BlockId>& ids, uint64_t epoch,
                        std::string* out, size_t* max_chunk = nullptr) {
  grpc::ClientContext ctx;
  v1::ReadBlocksRequest req;
  req.mutable_block_ids()->Add(ids.begin(), ids.end());
  req.set_owner_epoch(epoch);
  std::unique_ptr<grpc::ClientReader<v1::ReadBlocksResponse>> r = stub.ReadBlocks(&ctx, req);
  v1::ReadBlocksResponse msg;
  out->clear();
  size_t biggest = 0;
  while (r->Read(&msg)) {
    out->append(msg.data());
    biggest = std::max(biggest, msg.data().size());
  }
  if (max_chunk != nullptr) *max_chunk = biggest;
  return r->Finish();
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFF);
  return s;
}

constexpr uint64_t kMlaBlockBytes = 1152ull * 2 * 16;

TEST(BlockAgentDataTest, WriteThenReadScatteredBlocksRoundTrips) {
  std::unique_ptr<Agent> agent = StartMlaAgent(10'000);
  auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()));
  const std::vector<BlockId> got = AllocateBlocks(*stub, 8, 5);
  ASSERT_EQ(got.size(), 8u);
  const std::vector<BlockId> ids = {got[6], got[1], got[4]};  // scattered, out of order
  const std::string bytes = RandomBytes(ids.size() * kMlaBlockBytes, 1);
  uint64_t written = 0;
  ASSERT_TRUE(WriteBlocks(*stub, ids, 5, bytes, 7'777, true, &written).ok());
  EXPECT_EQ(written, bytes.size());

  std::string back;
  size_t max_chunk = 0;
  ASSERT_TRUE(ReadBlocks(*stub, ids, 5, &back, &max_chunk).ok());
  EXPECT_TRUE(back == bytes);
  EXPECT_EQ(max_chunk, 10'000u) << "chunks are bounded by read_chunk_bytes";
  // One block on its own is the matching slice.
  ASSERT_TRUE(ReadBlocks(*stub, {got[1]}, 5, &back).ok());
  EXPECT_TRUE(back == bytes.substr(kMlaBlockBytes, kMlaBlockBytes));
}

TEST(BlockAgentDataTest, RefusedWritesAndReadsNameTheFieldAndChangeNothing) {
  std::unique_ptr<Agent> agent = StartMlaAgent(1 << 20);
  auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()));
  const std::vector<BlockId> ids = AllocateBlocks(*stub, 2, 5);
  ASSERT_EQ(ids.size(), 2u);
  const std::string original = RandomBytes(2 * kMlaBlockBytes, 2);
  ASSERT_TRUE(WriteBlocks(*stub, ids, 5, original, 1 << 20).ok());
  const BlockId unallocated = 15;  // the pool hands out 0, 1, 2, ... first
  ASSERT_NE(ids[0], unallocated);
  ASSERT_NE(ids[1], unallocated);
  const std::string other = RandomBytes(2 * kMlaBlockBytes, 3);

  struct Case {
    const char* what;
    std::vector<BlockId> ids;
    uint64_t epoch;
    std::string bytes;
    bool send_header;
    grpc::StatusCode code;
    const char* field;
  };
  const Case cases[] = {
      {"unallocated block",
       {ids[0], unallocated},
       5,
       other,
       true,
       grpc::FAILED_PRECONDITION,
       "header.block_ids"},
      {"wrong epoch", ids, 6, other, true, grpc::FAILED_PRECONDITION, "header.block_ids"},
      {"one byte short", ids, 5, other.substr(1), true, grpc::INVALID_ARGUMENT, "bytes"},
      {"one byte long", ids, 5, other + "x", true, grpc::INVALID_ARGUMENT, "data"},
      {"no header", ids, 5, other, false, grpc::INVALID_ARGUMENT, "header"},
      {"past the pool", {ids[0], 16}, 5, other, true, grpc::INVALID_ARGUMENT, "header.block_ids"},
      {"repeated id", {ids[0], ids[0]}, 5, other, true, grpc::INVALID_ARGUMENT, "header.block_ids"},
      {"too many blocks", std::vector<BlockId>(9, ids[0]), 5, other, true, grpc::INVALID_ARGUMENT,
       "header.block_ids"},
  };
  for (const Case& c : cases) {
    grpc::Status st = WriteBlocks(*stub, c.ids, c.epoch, c.bytes, 5'000, c.send_header);
    EXPECT_EQ(st.error_code(), c.code) << c.what << ": " << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(c.field)) << c.what;
    std::string back;
    ASSERT_TRUE(ReadBlocks(*stub, ids, 5, &back).ok());
    if (c.code == grpc::INVALID_ARGUMENT && c.ids == ids && c.epoch == 5 && c.send_header) {
      // A valid header, then a bad byte count: the chunks before the error were written
      // into the caller's own blocks as they came (a stream buffers one message).
      ASSERT_TRUE(WriteBlocks(*stub, ids, 5, original, 1 << 20).ok());
      continue;
    }
    EXPECT_TRUE(back == original) << c.what << " must leave the blocks unchanged";
  }

  std::string back;
  grpc::Status st = ReadBlocks(*stub, {ids[0], unallocated}, 5, &back);
  EXPECT_EQ(st.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("block_ids"));
  EXPECT_TRUE(back.empty()) << "nothing is streamed before the checks pass";
  EXPECT_EQ(ReadBlocks(*stub, ids, 6, &back).error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_EQ(ReadBlocks(*stub, {16}, 5, &back).error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(ReadBlocks(*stub, {}, 5, &back).error_code(), grpc::INVALID_ARGUMENT);
}

TEST(BlockAgentMetricsTest, MetricsEndpointServesRpcCountsAndLatencies) {
  std::unique_ptr<Agent> agent = StartMlaAgent(1 << 20, "127.0.0.1:0");
  const std::string& address = agent->metrics_address();
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) << address;
  auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()));
  const std::vector<BlockId> ids = AllocateBlocks(*stub, 2, 5);
  ASSERT_EQ(ids.size(), 2u);
  ASSERT_TRUE(WriteBlocks(*stub, ids, 5, RandomBytes(2 * kMlaBlockBytes, 4), 1 << 20).ok());
  std::string back;
  ASSERT_TRUE(ReadBlocks(*stub, ids, 5, &back).ok());
  EXPECT_EQ(ReadBlocks(*stub, ids, 6, &back).error_code(), grpc::FAILED_PRECONDITION);
  StatsOf(*stub);

  const std::string response = HttpGet(port, "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response, HasSubstr("kvcm_agent_rpc_requests_total{code=\"OK\",rpc=\"Allocate\"} 1"));
  EXPECT_THAT(response,
              HasSubstr("kvcm_agent_rpc_requests_total{code=\"OK\",rpc=\"WriteBlocks\"} 1"));
  EXPECT_THAT(response,
              HasSubstr("kvcm_agent_rpc_requests_total{code=\"OK\",rpc=\"ReadBlocks\"} 1"));
  EXPECT_THAT(response, HasSubstr("kvcm_agent_rpc_requests_total{code=\"FAILED_PRECONDITION\","
                                  "rpc=\"ReadBlocks\"} 1"));
  EXPECT_THAT(response, HasSubstr("kvcm_agent_rpc_requests_total{code=\"OK\",rpc=\"Stats\"} 1"));
  EXPECT_THAT(response, HasSubstr("kvcm_agent_rpc_requests_total{code=\"OK\",rpc=\"Free\"} 0"))
      << "every rpc starts from a zero sample";
  EXPECT_THAT(response, HasSubstr("kvcm_agent_rpc_duration_seconds_count{rpc=\"Allocate\"} 1"));
  EXPECT_THAT(response, HasSubstr("kvcm_agent_rpc_duration_seconds_count{rpc=\"Stats\"} 1"));
  EXPECT_THAT(response,
              HasSubstr(absl::StrCat("kvcm_agent_pool_used_bytes{agent=\"mla-test\"", ",backend=\"",
                                     agent->pool().backend().name(), "\"} ", 2 * kMlaBlockBytes)));
}

// bf16 bits of uniform values in [-1, 1).
std::vector<uint16_t> RandomBf16(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = gpu::FloatToBf16(u(rng));
  return v;
}

TEST(BlockAgentAttentionTest, RunAttentionOnTheHostEqualsMlaDecodeCpuOnTheSameLatents) {
  std::unique_ptr<Agent> agent = StartMlaAgent(1 << 20);
  auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(agent->address()));
  const std::vector<BlockId> got = AllocateBlocks(*stub, 6, 5);
  ASSERT_EQ(got.size(), 6u);
  // Sequence 0: 37 tokens over 3 blocks; sequence 1: 20 tokens over 2 (both end mid-block).
  const std::vector<std::vector<BlockId>> table = {{got[4], got[0], got[2]}, {got[5], got[1]}};
  const std::vector<int32_t> seq_lens = {37, 20};
  constexpr int kHeads = 4;
  constexpr int kLayer = 1;
  std::mt19937 rng(7);
  // The whole pool as the agent holds it: written blocks get random latents in both layers.
  const uint64_t pool_blocks = 16;
  std::vector<uint16_t> arena(pool_blocks * kMlaBlockBytes / 2, 0);
  std::vector<BlockId> written;
  std::string bytes;
  for (const std::vector<BlockId>& row : table) {
    for (BlockId id : row) {
      const std::vector<uint16_t> block = RandomBf16(kMlaBlockBytes / 2, rng);
      std::memcpy(arena.data() + id * kMlaBlockBytes / 2, block.data(), kMlaBlockBytes);
      bytes.append(reinterpret_cast<const char*>(block.data()), kMlaBlockBytes);
      written.push_back(id);
    }
  }
  ASSERT_TRUE(WriteBlocks(*stub, written, 5, bytes, 1 << 20).ok());
  const std::vector<uint16_t> q = RandomBf16(2 * kHeads * 576, rng);
  const float scale = 1.0f / std::sqrt(192.0f);

  v1::RunAttentionRequest req;
  for (const std::vector<BlockId>& row : table) {
    req.add_block_table()->mutable_block_ids()->Add(row.begin(), row.end());
  }
  req.mutable_seq_lens()->Add(seq_lens.begin(), seq_lens.end());
  req.set_query(reinterpret_cast<const char*>(q.data()), q.size() * 2);
  req.set_softmax_scale(scale);
  req.set_num_heads(kHeads);
  req.set_layer(kLayer);
  req.set_owner_epoch(5);
  v1::RunAttentionResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status st = stub->RunAttention(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  EXPECT_EQ(resp.backend(), "host") << "without a GPU the CPU kernel over host memory runs";
  ASSERT_EQ(resp.output().size(), 2u * kHeads * 512 * sizeof(float));
  ASSERT_EQ(resp.lse_size(), 2 * kHeads);

  // The reference: MlaDecodeCpu over our copy of the pool, layer 1, block stride one block.
  std::vector<int32_t> flat = {
      static_cast<int32_t>(table[0][0]), static_cast<int32_t>(table[0][1]),
      static_cast<int32_t>(table[0][2]), static_cast<int32_t>(table[1][0]),
      static_cast<int32_t>(table[1][1]), static_cast<int32_t>(table[1][1])};
  std::vector<uint16_t> out(2 * kHeads * 512);
  std::vector<float> lse(2 * kHeads);
  gpu::MlaDecodeParams p;
  p.kv_cache = reinterpret_cast<const std::byte*>(arena.data()) + kLayer * 1152 * 16;
  p.kv_block_stride_bytes = kMlaBlockBytes;
  p.block_table = flat.data();
  p.block_table_stride = 3;
  p.seq_lens = seq_lens.data();
  p.q = q.data();
  p.q_head_stride = 576;
  p.q_batch_stride = kHeads * 576;
  p.out = out.data();
  p.out_head_stride = 512;
  p.out_batch_stride = kHeads * 512;
  p.lse = lse.data();
  p.batch = 2;
  p.num_heads = kHeads;
  p.num_blocks = pool_blocks;
  p.page_size = 16;
  p.max_blocks_per_seq = 3;
  p.softmax_scale = scale;
  ASSERT_TRUE(gpu::MlaDecodeCpu(p).ok());
  std::vector<float> got_out(out.size());
  std::memcpy(got_out.data(), resp.output().data(), resp.output().size());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(got_out[i], gpu::Bf16ToFloat(out[i])) << "output element " << i;
  }
  for (int i = 0; i < 2 * kHeads; ++i) EXPECT_EQ(resp.lse(i), lse[i]) << "lse " << i;

  // Layer 0 holds other latents, so it must give another answer.
  req.set_layer(0);
  v1::RunAttentionResponse layer0;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->RunAttention(&ctx, req, &layer0).ok());
  }
  EXPECT_NE(layer0.output(), resp.output());

  // Bad requests name the field; foreign blocks are refused.
  struct Case {
    const char* field;
    grpc::StatusCode code;
    void (*mutate)(v1::RunAttentionRequest*);
  };
  const Case cases[] = {
      {"num_heads", grpc::INVALID_ARGUMENT,
       [](v1::RunAttentionRequest* r) { r->set_num_heads(0); }},
      {"query", grpc::INVALID_ARGUMENT,
       [](v1::RunAttentionRequest* r) { r->mutable_query()->pop_back(); }},
      {"seq_lens[0]", grpc::INVALID_ARGUMENT,
       [](v1::RunAttentionRequest* r) { r->set_seq_lens(0, 49); }},
      {"seq_lens", grpc::INVALID_ARGUMENT,
       [](v1::RunAttentionRequest* r) { r->mutable_seq_lens()->RemoveLast(); }},
      {"layer", grpc::INVALID_ARGUMENT, [](v1::RunAttentionRequest* r) { r->set_layer(2); }},
      {"softmax_scale", grpc::INVALID_ARGUMENT,
       [](v1::RunAttentionRequest* r) { r->set_softmax_scale(0.0f); }},
      {"block_table", grpc::INVALID_ARGUMENT,
       [](v1::RunAttentionRequest* r) { r->clear_block_table(); }},
      {"block_table", grpc::FAILED_PRECONDITION,
       [](v1::RunAttentionRequest* r) { r->mutable_block_table(1)->set_block_ids(0, 15); }},
      {"block_table", grpc::FAILED_PRECONDITION,
       [](v1::RunAttentionRequest* r) { r->set_owner_epoch(6); }},
  };
  for (const Case& c : cases) {
    v1::RunAttentionRequest bad = req;
    c.mutate(&bad);
    grpc::ClientContext ctx;
    v1::RunAttentionResponse ignored;
    grpc::Status st = stub->RunAttention(&ctx, bad, &ignored);
    EXPECT_EQ(st.error_code(), c.code) << c.field << ": " << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(c.field));
  }
}

}  // namespace
}  // namespace kvcm
