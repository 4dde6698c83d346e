// Fetch across processes, with kill -9 on either side: one kvcm-manager and two kvcm-agents
// (host pools, TCP transport). A 64-page prompt is cached on agent A; agent B fetches it.
//   - kill -9 of the source as the fetch starts: B's fetch fails and B frees every block it
//     had allocated (whether A died before, during or after the pull);
//   - kill -9 of the destination mid-fetch: A is unaffected, its pages still match in the
//     same blocks and it keeps serving them.

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/model_catalog.h"
#include "common/page_hash.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/util/block_agent_calls.h"
#include "tests/util/process_cluster.h"

namespace kvcm {
namespace {

using ::kvcm::testing::ProcessCluster;
using ::kvcm::testing::WaitUntil;

constexpr uint64_t kPageBytes = 1152ull * 61 * 64;  // DeepSeek-V3 bf16, 64 tokens
constexpr uint32_t kPages = 64;
constexpr uint64_t kAgentBlocks = 70;
const NamespaceId kNs{"acme", "deepseek-v3"};

class FetchProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = ProcessCluster::Start(
        {.agent_ids = {"gpu-a", "gpu-b"},
         .agent_flags = {"--model=deepseek-v3",
                         absl::StrCat("--capacity_bytes=", kAgentBlocks * kPageBytes),
                         "--heartbeat_interval_ms=100"}});
    ASSERT_NE(cluster_, nullptr);
    client_ = &cluster_->client();
    absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(kNs, *FindModel("deepseek-v3"));
    ASSERT_TRUE(reg.ok()) << reg.status();
    fingerprint_ = reg->key_fingerprint;
    page_size_ = reg->spec.page_size_tokens;

    // The prompt, cached on A in blocks A allocated for it.
    tokens_.resize(kPages * page_size_);
    for (size_t i = 0; i < tokens_.size(); ++i) tokens_[i] = static_cast<int32_t>(i * 31 + 7);
    a_stub_ = cluster_->Stub("gpu-a");
    a_blocks_ = testing::AllocateIn(*a_stub_, kPages, cluster_->agent("gpu-a").epoch, kNs);
    ASSERT_EQ(a_blocks_.size(), kPages);
    ASSERT_TRUE(client_->Insert(kNs, tokens_, PoolRef{"gpu-a", Tier::kGpu}, a_blocks_).ok());
  }

  v1::FetchRequest Request() {
    absl::StatusOr<std::vector<PageHash>> pages = client_->HashPrompt(kNs, tokens_);
    EXPECT_TRUE(pages.ok()) << pages.status();
    return testing::FetchRequestFor(kNs, pages.ok() ? *pages : std::vector<PageHash>{}, page_size_,
                                    fingerprint_, "gpu-a", a_blocks_);
  }

  std::vector<BlockId> Matched(const std::string& agent) {
    return cluster_->MatchedOn(kNs, tokens_, agent);
  }

  std::unique_ptr<ProcessCluster> cluster_;
  Client* client_ = nullptr;
  uint64_t fingerprint_ = 0;
  uint32_t page_size_ = 0;
  std::vector<int32_t> tokens_;
  std::unique_ptr<v1::BlockAgent::Stub> a_stub_;
  std::vector<BlockId> a_blocks_;
};

TEST_F(FetchProcessTest, KillingTheSourceMidFetchLeaksNothingOnTheDestination) {
  std::unique_ptr<v1::BlockAgent::Stub> b = cluster_->Stub("gpu-b");
  ASSERT_EQ(cluster_->FreeBlocks("gpu-b"), kAgentBlocks);
  auto fetch = std::async(std::launch::async, [&] {
    v1::FetchResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return b->Fetch(&ctx, Request(), &resp);
  });
  absl::SleepFor(absl::Milliseconds(20));  // 288 MiB: the pull is under way, or about to be
  cluster_->Kill("gpu-a");
  const grpc::Status s = fetch.get();
  if (s.ok()) {
    // The pull won the race: B holds a replica, indexed, and nothing else.
    EXPECT_EQ(Matched("gpu-b").size(), kPages);
    EXPECT_EQ(cluster_->FreeBlocks("gpu-b"), kAgentBlocks - kPages);
  } else {
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << s.error_code() << " " << s.error_message();
    EXPECT_TRUE(
        WaitUntil([&] { return cluster_->FreeBlocks("gpu-b") == kAgentBlocks; }, absl::Seconds(10)))
        << "B leaked blocks: " << cluster_->FreeBlocks("gpu-b") << " free";
    EXPECT_TRUE(Matched("gpu-b").empty());
  }
  std::printf("source killed: the fetch %s\n", s.ok() ? "had finished" : "failed");
}

TEST_F(FetchProcessTest, KillingTheDestinationMidFetchLeavesTheSourceServing) {
  std::unique_ptr<v1::BlockAgent::Stub> b = cluster_->Stub("gpu-b");
  auto fetch = std::async(std::launch::async, [&] {
    v1::FetchResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return b->Fetch(&ctx, Request(), &resp);
  });
  absl::SleepFor(absl::Milliseconds(20));
  cluster_->Kill("gpu-b");
  (void)fetch.get();
  // A is unaffected: same blocks, all still allocated, and it serves BlockAgent.
  EXPECT_EQ(Matched("gpu-a"), a_blocks_);
  EXPECT_EQ(cluster_->FreeBlocks("gpu-a"), kAgentBlocks - kPages);
}

}  // namespace
}  // namespace kvcm
