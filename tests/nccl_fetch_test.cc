// BlockAgent.Fetch over the NCCL transport, end to end in process: a manager and two agents
// started with --transport=nccl, each on its own GPU. The first fetch bootstraps a link
// through the manager (B's NcclBootstrap, relayed on A's Commands stream), the bytes cross
// on NCCL, B's replica is bit for bit A's and indexed, a second fetch reuses the link, and an
// evicted source fails the fetch leaving B as it was; the transfer metrics count them.
//
// Label `gpu`: skips, saying why, on a machine with fewer than two CUDA devices (NCCL puts
// each rank of a link on its own GPU). Never run on the development machines (no GPU).
#include <cuda_runtime.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
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
using ::kvcm::testing::StartManager;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::HasSubstr;

constexpr uint64_t kBlocks = 8;

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Agent> StartNcclAgent(const std::string& manager, const std::string& id,
                                      int device) {
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = id;
  o.manager_address = manager;
  o.device_index = device;
  o.capacity_bytes = kBlocks * kBlockBytes;
  o.heartbeat_interval_ms = 20;
  o.transport = "nccl";
  o.nccl_staging_bytes = 2 * kBlockBytes;  // a 3-page fetch crosses in two chunks
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? *std::move(agent) : nullptr;
}

class NcclFetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const int have = DeviceCount(); have < 2) {
      GTEST_SKIP() << "needs 2 CUDA devices (one NCCL rank per GPU); this machine has " << have;
    }
    manager_ = StartManager();
    a_ = StartNcclAgent(manager_->address(), "gpu-a", 0);
    b_ = StartNcclAgent(manager_->address(), "gpu-b", 1);
    ASSERT_TRUE(a_ && b_);
    ASSERT_TRUE(WaitFor([&] { return a_->registered() && b_->registered(); }));
    ASSERT_TRUE(WaitFor([&] { return manager_->commands().open_streams() == 2; }));
    spec_ = a_->pool().geometry().spec;
    client_ = ConnectAndRegister(manager_->address(), ns_, spec_);
    ASSERT_NE(client_, nullptr);
    fingerprint_ = client_->RegisterModel(ns_, spec_)->key_fingerprint;
    ba_ = BlockAgentStub(*a_);
    bb_ = BlockAgentStub(*b_);
  }

  std::string CacheOnA(int seed, size_t pages) {
    const std::vector<int32_t> tokens = Tokens(pages, spec_.page_size_tokens, seed);
    const std::vector<BlockId> blocks = AllocateIn(*ba_, pages, a_->epoch(), ns_);
    const std::string bytes = Bytes(pages * a_->pool().geometry().bytes_per_block(), seed);
    EXPECT_TRUE(WriteAll(*ba_, blocks, a_->epoch(), bytes).ok());
    EXPECT_TRUE(client_->Insert(ns_, tokens, PoolRef{"gpu-a", Tier::kGpu}, blocks).ok());
    return bytes;
  }

  std::vector<BlockId> BlocksOn(const std::string& agent, int seed, size_t pages) {
    absl::StatusOr<MatchReply> m =
        client_->Match(ns_, Tokens(pages, spec_.page_size_tokens, seed), {.probe = true});
    std::vector<BlockId> out;
    if (!m.ok()) return out;
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        if (r.pool.agent_id == agent) out.insert(out.end(), r.block_ids.begin(), r.block_ids.end());
      }
    }
    return out;
  }

  grpc::Status Fetch(int seed, size_t pages, const std::vector<BlockId>& source,
                     v1::FetchResponse* resp) {
    absl::StatusOr<std::vector<PageHash>> hashes =
        manager_->index().HashTokens(ns_, Tokens(pages, spec_.page_size_tokens, seed));
    EXPECT_TRUE(hashes.ok());
    const v1::FetchRequest req =
        testing::FetchRequestFor(ns_, hashes.ok() ? *hashes : std::vector<PageHash>{},
                                 spec_.page_size_tokens, fingerprint_, "gpu-a", source);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    return bb_->Fetch(&ctx, req, resp);
  }

  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Agent> a_, b_;
  ModelSpec spec_;
  const NamespaceId ns_{"acme", "deepseek-v3"};
  std::unique_ptr<Client> client_;
  uint64_t fingerprint_ = 0;
  std::unique_ptr<v1::BlockAgent::Stub> ba_, bb_;
};

TEST_F(NcclFetchTest, APrefixCrossesOnNcclBitForBitAndTheLinkIsReused) {
  EXPECT_EQ(a_->pool().backend().name(), "cuda:0");
  EXPECT_EQ(b_->pool().backend().name(), "cuda:1");
  const std::string bytes = CacheOnA(1, 3);
  const std::vector<BlockId> on_a = BlocksOn("gpu-a", 1, 3);
  ASSERT_EQ(on_a.size(), 3u);
  v1::FetchResponse resp;
  grpc::Status s = Fetch(1, 3, on_a, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.bytes(), bytes.size());
  const std::vector<BlockId> on_b(resp.block_ids().begin(), resp.block_ids().end());
  EXPECT_EQ(BlocksOn("gpu-b", 1, 3), on_b);
  absl::StatusOr<std::string> copy = ReadAll(*bb_, on_b, b_->epoch());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(*copy == bytes);
  EXPECT_THAT(b_->metrics().RenderText(),
              HasSubstr(absl::StrCat("kvcm_transfer_bytes_total ", bytes.size())));

  // A second prompt over the same link.
  const std::string second = CacheOnA(2, 2);
  const std::vector<BlockId> on_a2 = BlocksOn("gpu-a", 2, 2);
  v1::FetchResponse resp2;
  ASSERT_TRUE(Fetch(2, 2, on_a2, &resp2).ok());
  const std::vector<BlockId> on_b2(resp2.block_ids().begin(), resp2.block_ids().end());
  absl::StatusOr<std::string> copy2 = ReadAll(*bb_, on_b2, b_->epoch());
  ASSERT_TRUE(copy2.ok());
  EXPECT_TRUE(*copy2 == second);
  EXPECT_THAT(b_->metrics().RenderText(),
              HasSubstr(absl::StrCat("kvcm_transfer_bytes_total ", bytes.size() + second.size())));
}

TEST_F(NcclFetchTest, AnEvictedSourceFailsTheFetchAndLeaksNothing) {
  CacheOnA(3, 2);
  const std::vector<BlockId> on_a = BlocksOn("gpu-a", 3, 2);
  ASSERT_EQ(on_a.size(), 2u);
  ASSERT_TRUE(client_->EvictFromPool(PoolRef{"gpu-a", Tier::kGpu}, 2 * kBlockBytes).ok());
  ASSERT_TRUE(WaitFor([&] { return FreeBlocksOf(*ba_) == kBlocks; }));
  v1::FetchResponse resp;
  grpc::Status stale = Fetch(3, 2, on_a, &resp);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << stale.error_message();
  EXPECT_EQ(FreeBlocksOf(*bb_), kBlocks);
  EXPECT_THAT(b_->metrics().RenderText(),
              HasSubstr("kvcm_transfer_failures_total{reason=\"FAILED_PRECONDITION\"} 1"));
}

}  // namespace
}  // namespace kvcm
