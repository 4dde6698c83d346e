// BlockAgent.Fetch end to end, in process: a manager and two agents (host pools, TCP
// transport). A prompt cached on agent A is fetched by agent B: B's copy holds A's bytes bit
// for bit and the index lists both replicas. A source block evicted since the Match, or an
// unreachable source, fails the fetch with B's pool as it was (nothing leaked), and the
// transfer metrics count bytes and failures by reason. The source is an agent id the manager
// knows: an unknown one is NOT_FOUND with nothing dialled, a data address is refused, and an
// unreachable source answers the same whether its port refuses or stays silent.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gpu/agent/control/agent_proto.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/in_process_cluster.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateIn;
using ::kvcm::testing::BlockAgentStub;
using ::kvcm::testing::Bytes;
using ::kvcm::testing::ConnectAndRegister;
using ::kvcm::testing::FreeBlocksOf;
using ::kvcm::testing::kBlockBytes;
using ::kvcm::testing::ReadAll;
using ::kvcm::testing::StartAgent;
using ::kvcm::testing::StartManager;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kBlocks = 8;

class FetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manager_ = StartManager();
    a_ = StartAgent(manager_->address(), kBlocks, 0, "gpu-a");
    b_ = StartAgent(manager_->address(), kBlocks, 0, "gpu-b");
    ASSERT_TRUE(WaitFor([&] { return a_->registered() && b_->registered(); }));
    spec_ = a_->pool().geometry().spec;
    client_ = ConnectAndRegister(manager_->address(), ns_, spec_);
    ASSERT_NE(client_, nullptr);
    absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(ns_, spec_);
    ASSERT_TRUE(reg.ok());
    fingerprint_ = reg->key_fingerprint;
    ba_ = BlockAgentStub(*a_);
    bb_ = BlockAgentStub(*b_);
  }

  // Caches `pages` pages of prompt `seed` on A with random bytes; returns the bytes.
  std::string CacheOnA(int seed, size_t pages) {
    const std::vector<int32_t> tokens = Tokens(pages, spec_.page_size_tokens, seed);
    const std::vector<BlockId> blocks = AllocateIn(*ba_, pages, a_->epoch(), ns_);
    const std::string bytes = Bytes(pages * a_->pool().geometry().bytes_per_block(), seed);
    EXPECT_TRUE(WriteAll(*ba_, blocks, a_->epoch(), bytes).ok());
    EXPECT_TRUE(client_->Insert(ns_, tokens, PoolRef{"gpu-a", Tier::kGpu}, blocks).ok());
    return bytes;
  }

  // The blocks each agent's pool holds for prompt `seed`, by agent id.
  std::map<std::string, std::vector<BlockId>> Replicas(int seed, size_t pages) {
    absl::StatusOr<MatchReply> m =
        client_->Match(ns_, Tokens(pages, spec_.page_size_tokens, seed), {.probe = true});
    std::map<std::string, std::vector<BlockId>> out;
    if (!m.ok()) return out;
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        auto& blocks = out[r.pool.agent_id];
        blocks.insert(blocks.end(), r.block_ids.begin(), r.block_ids.end());
      }
    }
    return out;
  }

  v1::FetchRequest Request(int seed, size_t pages, const std::vector<BlockId>& source) {
    absl::StatusOr<std::vector<PageHash>> hashes =
        manager_->index().HashTokens(ns_, Tokens(pages, spec_.page_size_tokens, seed));
    EXPECT_TRUE(hashes.ok());
    return testing::FetchRequestFor(ns_, hashes.ok() ? *hashes : std::vector<PageHash>{},
                                    spec_.page_size_tokens, fingerprint_, "gpu-a", source);
  }

  grpc::Status Fetch(const v1::FetchRequest& req, v1::FetchResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return bb_->Fetch(&ctx, req, resp);
  }

  // Registers a stand-in agent `id` whose data port is `data_address` (it never
  // heartbeats: alive for the manager's heartbeat timeout).
  grpc::Status RegisterAgentAt(const std::string& id, const std::string& data_address) {
    auto control = v1::AgentControl::NewStub(
        grpc::CreateChannel(manager_->address(), grpc::InsecureChannelCredentials()));
    v1::RegisterAgentRequest req;
    req.set_agent_id(id);
    req.set_device("host");
    req.set_tier(v1::TIER_GPU);
    PoolGeometryToProto(a_->pool().geometry(), req.mutable_geometry());
    req.set_capacity_bytes(a_->pool().geometry().bytes_per_block());
    req.set_epoch(1);
    req.set_data_address(data_address);
    req.set_transport("tcp");
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RegisterAgentResponse resp;
    return control->Register(&ctx, req, &resp);
  }

  // "127.0.0.1:port" of a port nothing listens on (bound, then closed).
  static std::string ClosedPort() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    ::close(fd);
    return absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  }

  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Agent> a_, b_;
  ModelSpec spec_;
  const NamespaceId ns_{"acme", "deepseek-v3"};
  std::unique_ptr<Client> client_;
  uint64_t fingerprint_ = 0;
  std::unique_ptr<v1::BlockAgent::Stub> ba_, bb_;
};

TEST_F(FetchTest, APrefixCachedOnAIsFetchedByBAndIndexedAsASecondReplica) {
  const std::string bytes = CacheOnA(1, 3);
  const std::vector<BlockId> on_a = Replicas(1, 3)["gpu-a"];
  ASSERT_EQ(on_a.size(), 3u);

  v1::FetchResponse resp;
  grpc::Status s = Fetch(Request(1, 3, on_a), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.fetched_pages(), 3u);
  EXPECT_EQ(resp.bytes(), bytes.size());
  const std::vector<BlockId> on_b(resp.block_ids().begin(), resp.block_ids().end());
  EXPECT_EQ(Replicas(1, 3)["gpu-b"], on_b);
  EXPECT_EQ(Replicas(1, 3)["gpu-a"], on_a);
  // B's copy holds A's bytes, bit for bit, and belongs to the cache (committed).
  absl::StatusOr<std::string> copy = ReadAll(*bb_, on_b, b_->epoch());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(*copy == bytes);
  EXPECT_EQ(b_->pool().Stats().committed_blocks, 3u);
  EXPECT_EQ(FreeBlocksOf(*bb_), kBlocks - 3);
  EXPECT_THAT(b_->metrics().RenderText(),
              HasSubstr(absl::StrCat("kvcm_transfer_bytes_total ", bytes.size())));

  // Fetching again: the pages are there already; B's new blocks are handed back and freed.
  v1::FetchResponse again;
  ASSERT_TRUE(Fetch(Request(1, 3, on_a), &again).ok());
  EXPECT_EQ(std::vector<BlockId>(again.block_ids().begin(), again.block_ids().end()), on_b);
  EXPECT_EQ(FreeBlocksOf(*bb_), kBlocks - 3);
}

TEST_F(FetchTest, AFailedFetchLeavesTheDestinationAsItWas) {
  CacheOnA(2, 2);
  const std::vector<BlockId> on_a = Replicas(2, 2)["gpu-a"];
  ASSERT_EQ(on_a.size(), 2u);
  // A evicts the prompt after the Match: its blocks no longer hold the pages.
  ASSERT_TRUE(client_->EvictFromPool(PoolRef{"gpu-a", Tier::kGpu}, 2 * kBlockBytes).ok());
  ASSERT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba_) == kBlocks; }));

  v1::FetchResponse resp;
  grpc::Status stale = Fetch(Request(2, 2, on_a), &resp);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << stale.error_message();
  EXPECT_THAT(stale.error_message(), HasSubstr("no longer holds page"));
  // The refusal reaches the agents' logs: it names no page hash (issue 22's leak).
  for (const PageHash& page : DecodePageHashes(Request(2, 2, on_a).prompt().page_hashes())) {
    EXPECT_THAT(stale.error_message(), ::testing::Not(HasSubstr(page.ToHex())));
  }

  // The source's data port is gone (A stopped serving pulls): UNAVAILABLE.
  v1::FetchRequest nowhere = Request(2, 2, on_a);
  nowhere.set_source_agent_id("gpu-gone");
  ASSERT_TRUE(RegisterAgentAt("gpu-gone", ClosedPort()).ok());
  grpc::Status gone = Fetch(nowhere, &resp);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::UNAVAILABLE) << gone.error_message();

  v1::FetchRequest bad = Request(2, 2, on_a);
  bad.clear_source_block_ids();
  grpc::Status invalid = Fetch(bad, &resp);
  EXPECT_EQ(invalid.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(invalid.error_message(), HasSubstr("source_block_ids"));

  // Tiers that are no tier at all (257 would wrap to TIER_GPU in a one-byte Tier).
  v1::FetchRequest wrap = Request(2, 2, on_a);
  wrap.set_tier(static_cast<v1::Tier>(257));
  EXPECT_EQ(Fetch(wrap, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  wrap = Request(2, 2, on_a);
  wrap.set_source_tier(static_cast<v1::Tier>(99));
  grpc::Status source_tier = Fetch(wrap, &resp);
  EXPECT_EQ(source_tier.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(source_tier.error_message(), HasSubstr("source_tier 99"));

  // Nothing leaked on B and nothing was indexed there.
  EXPECT_EQ(FreeBlocksOf(*bb_), kBlocks);
  EXPECT_TRUE(Replicas(2, 2).empty());
  const std::string metrics = b_->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_transfer_failures_total{reason=\"FAILED_PRECONDITION\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvcm_transfer_failures_total{reason=\"UNAVAILABLE\"} 1"));
}

TEST_F(FetchTest, TheSourceIsAnAgentTheManagerKnowsNeverAnAddress) {
  CacheOnA(3, 2);
  const std::vector<BlockId> on_a = Replicas(3, 2)["gpu-a"];
  ASSERT_EQ(on_a.size(), 2u);
  // A listener that would notice a dial: nothing may connect to it.
  const int trap = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(trap, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(::listen(trap, 4), 0);
  ASSERT_EQ(::getsockname(trap, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string trap_address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));

  v1::FetchResponse resp;
  v1::FetchRequest unknown = Request(3, 2, on_a);
  unknown.set_source_agent_id("gpu-nobody");
  grpc::Status s = Fetch(unknown, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("source_agent_id \"gpu-nobody\""));

  v1::FetchRequest address = Request(3, 2, on_a);
  address.set_source_data_address(trap_address);
  s = Fetch(address, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("source_data_address is no longer accepted"));
  EXPECT_THAT(s.error_message(), HasSubstr("source_agent_id"));

  v1::FetchRequest none = Request(3, 2, on_a);
  none.clear_source_agent_id();
  s = Fetch(none, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("source_agent_id"));

  // Nothing allocated, indexed or dialled on B; the trap saw no connection.
  EXPECT_EQ(FreeBlocksOf(*bb_), kBlocks);
  EXPECT_EQ(Replicas(3, 2).count("gpu-b"), 0u);
  EXPECT_THAT(b_->metrics().RenderText(), Not(HasSubstr("kvcm_transfer_failures_total{")));
  ::fcntl(trap, F_SETFL, O_NONBLOCK);
  EXPECT_LT(::accept(trap, nullptr, nullptr), 0) << "Fetch dialled the trap";
  ::close(trap);

  // The same request naming A fetches.
  v1::FetchRequest good = Request(3, 2, on_a);
  s = Fetch(good, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.fetched_pages(), 2u);
}

// A port scan through Fetch learns nothing: a source whose port refuses and one whose port
// accepts and stays silent get the same code and the same message.
TEST_F(FetchTest, AnUnreachableSourceAnswersTheSameWhetherItsPortRefusesOrStaysSilent) {
  CacheOnA(4, 1);
  const std::vector<BlockId> on_a = Replicas(4, 1)["gpu-a"];
  ASSERT_EQ(on_a.size(), 1u);
  const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(::listen(silent, 4), 0);  // the kernel accepts; nobody ever reads or writes
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ASSERT_TRUE(RegisterAgentAt("ghost-1", ClosedPort()).ok());
  ASSERT_TRUE(RegisterAgentAt("ghost-2", absl::StrCat("127.0.0.1:", ntohs(addr.sin_port))).ok());

  // An agent that gives up on a silent peer quickly.
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "gpu-c";
  o.manager_address = manager_->address();
  o.use_device = false;
  o.capacity_bytes = kBlocks * kBlockBytes;
  o.heartbeat_interval_ms = 20;
  o.transfer_io_timeout_ms = 300;
  absl::StatusOr<std::unique_ptr<Agent>> c = Agent::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(WaitFor([&] { return (*c)->registered(); }));
  std::unique_ptr<v1::BlockAgent::Stub> bc = BlockAgentStub(**c);

  std::string answers[2];
  for (int i = 0; i < 2; ++i) {
    v1::FetchRequest req = Request(4, 1, on_a);
    req.set_source_agent_id(absl::StrCat("ghost-", i + 1));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::FetchResponse resp;
    const grpc::Status s = bc->Fetch(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    answers[i] = s.error_message();
    absl::StrReplaceAll({{absl::StrCat("ghost-", i + 1), "ghost-N"}}, &answers[i]);
  }
  EXPECT_EQ(answers[0], answers[1]);
  EXPECT_THAT(answers[0], HasSubstr("could not be reached"));
  EXPECT_EQ(FreeBlocksOf(*bc), kBlocks);
  // The agent's operator still sees why, in its metrics (and log).
  const std::string metrics = (*c)->metrics().RenderText();
  EXPECT_THAT(metrics, HasSubstr("kvcm_transfer_failures_total{reason=\"UNAVAILABLE\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("kvcm_transfer_failures_total{reason=\"DEADLINE_EXCEEDED\"} 1"));
  ::close(silent);
}

}  // namespace
}  // namespace kvcm
