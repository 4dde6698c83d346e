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
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "common/page_hash.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/process_util.h"

namespace kvcm {
namespace {

using ::kvcm::testing::FreePort;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::WaitUntil;

constexpr uint64_t kPageBytes = 1152ull * 61 * 64;  // DeepSeek-V3 bf16, 64 tokens
constexpr uint32_t kPages = 64;
constexpr uint64_t kAgentBlocks = 70;
const NamespaceId kNs{"acme", "deepseek-v3"};

class FetchProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = FreePort();
    manager_ =
        Subprocess::Start({KVCM_MANAGER_PATH, absl::StrCat("--listen_address=127.0.0.1:", port_),
                           "--metrics_address=", "--shutdown_grace_ms=500"},
                          "/dev/null");
    ASSERT_NE(manager_, nullptr);
    for (const char* id : {"gpu-a", "gpu-b"}) {
      agents_.push_back(Subprocess::Start(
          {KVCM_AGENT_PATH, absl::StrCat("--agent_id=", id),
           absl::StrCat("--manager_address=127.0.0.1:", port_), "--listen_address=127.0.0.1:0",
           "--model=deepseek-v3", absl::StrCat("--capacity_bytes=", kAgentBlocks * kPageBytes),
           "--heartbeat_interval_ms=100"},
          "/dev/null"));
      ASSERT_NE(agents_.back(), nullptr);
    }
    client_ = *Client::Connect({.address = absl::StrCat("127.0.0.1:", port_)});
    ASSERT_TRUE(WaitUntil(
        [&] {
          absl::StatusOr<ManagerStats> s = client_->Stats();
          return s.ok() && s->agents.size() == 2;
        },
        absl::Seconds(20)));
    absl::StatusOr<ManagerStats> stats = client_->Stats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    for (const ManagerStats::Agent& a : stats->agents) agents_info_[a.agent_id] = a;
    absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(kNs, *FindModel("deepseek-v3"));
    ASSERT_TRUE(reg.ok()) << reg.status();
    fingerprint_ = reg->key_fingerprint;
    page_size_ = reg->spec.page_size_tokens;

    // The prompt, cached on A in blocks A allocated for it.
    tokens_.resize(kPages * page_size_);
    for (size_t i = 0; i < tokens_.size(); ++i) tokens_[i] = static_cast<int32_t>(i * 31 + 7);
    a_stub_ = Stub("gpu-a");
    v1::AllocateBlocksRequest alloc;
    alloc.set_count(kPages);
    alloc.set_owner_epoch(agents_info_["gpu-a"].epoch);
    alloc.mutable_namespace_()->set_tenant(kNs.tenant);
    alloc.mutable_namespace_()->set_model(kNs.model);
    v1::AllocateBlocksResponse blocks;
    grpc::ClientContext ctx;
    ASSERT_TRUE(a_stub_->Allocate(&ctx, alloc, &blocks).ok());
    a_blocks_.assign(blocks.block_ids().begin(), blocks.block_ids().end());
    ASSERT_TRUE(client_->Insert(kNs, tokens_, PoolRef{"gpu-a", Tier::kGpu}, a_blocks_).ok());
  }

  void TearDown() override {
    for (auto& p : agents_) {
      if (p != nullptr) {
        p->Signal(SIGKILL);
        p->Finish(absl::Seconds(10));
      }
    }
    manager_->Signal(SIGKILL);
    manager_->Finish(absl::Seconds(10));
  }

  std::unique_ptr<v1::BlockAgent::Stub> Stub(const std::string& id) {
    return v1::BlockAgent::NewStub(MakeChannel(agents_info_[id].block_agent_address));
  }

  uint64_t FreeBlocks(v1::BlockAgent::Stub& stub) {
    v1::BlockAgentStatsResponse s;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return stub.Stats(&ctx, v1::BlockAgentStatsRequest(), &s).ok() ? s.free_blocks() : 0;
  }

  v1::FetchRequest Request() {
    v1::FetchRequest req;
    req.mutable_namespace_()->set_tenant(kNs.tenant);
    req.mutable_namespace_()->set_model(kNs.model);
    absl::StatusOr<std::vector<PageHash>> pages = client_->HashPrompt(kNs, tokens_);
    EXPECT_TRUE(pages.ok()) << pages.status();
    req.mutable_prompt()->set_page_hashes(EncodePageHashes(*pages));
    req.mutable_prompt()->mutable_scheme()->set_version(kPageHashVersion);
    req.mutable_prompt()->mutable_scheme()->set_page_size_tokens(page_size_);
    req.mutable_prompt()->mutable_scheme()->set_key_fingerprint(fingerprint_);
    req.set_source_data_address(agents_info_["gpu-a"].data_address);
    req.mutable_source_block_ids()->Add(a_blocks_.begin(), a_blocks_.end());
    return req;
  }

  // The blocks `agent` holds for the prompt, per a probe Match.
  std::vector<BlockId> Matched(const std::string& agent) {
    std::vector<BlockId> out;
    absl::StatusOr<MatchReply> m = client_->Match(kNs, tokens_, {.probe = true});
    if (!m.ok()) return out;
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        if (r.pool.agent_id == agent) out.insert(out.end(), r.block_ids.begin(), r.block_ids.end());
      }
    }
    return out;
  }

  int port_ = 0;
  std::unique_ptr<Subprocess> manager_;
  std::vector<std::unique_ptr<Subprocess>> agents_;  // gpu-a, gpu-b
  std::map<std::string, ManagerStats::Agent> agents_info_;
  std::unique_ptr<Client> client_;
  uint64_t fingerprint_ = 0;
  uint32_t page_size_ = 0;
  std::vector<int32_t> tokens_;
  std::unique_ptr<v1::BlockAgent::Stub> a_stub_;
  std::vector<BlockId> a_blocks_;
};

TEST_F(FetchProcessTest, KillingTheSourceMidFetchLeaksNothingOnTheDestination) {
  std::unique_ptr<v1::BlockAgent::Stub> b = Stub("gpu-b");
  ASSERT_EQ(FreeBlocks(*b), kAgentBlocks);
  auto fetch = std::async(std::launch::async, [&] {
    v1::FetchResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return b->Fetch(&ctx, Request(), &resp);
  });
  absl::SleepFor(absl::Milliseconds(20));  // 288 MiB: the pull is under way, or about to be
  agents_[0]->Signal(SIGKILL);
  agents_[0]->Finish(absl::Seconds(10));
  agents_[0].reset();
  const grpc::Status s = fetch.get();
  if (s.ok()) {
    // The pull won the race: B holds a replica, indexed, and nothing else.
    EXPECT_EQ(Matched("gpu-b").size(), kPages);
    EXPECT_EQ(FreeBlocks(*b), kAgentBlocks - kPages);
  } else {
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << s.error_code() << " " << s.error_message();
    EXPECT_TRUE(WaitUntil([&] { return FreeBlocks(*b) == kAgentBlocks; }, absl::Seconds(10)))
        << "B leaked blocks: " << FreeBlocks(*b) << " free";
    EXPECT_TRUE(Matched("gpu-b").empty());
  }
  std::printf("source killed: the fetch %s\n", s.ok() ? "had finished" : "failed");
}

TEST_F(FetchProcessTest, KillingTheDestinationMidFetchLeavesTheSourceServing) {
  std::unique_ptr<v1::BlockAgent::Stub> b = Stub("gpu-b");
  auto fetch = std::async(std::launch::async, [&] {
    v1::FetchResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return b->Fetch(&ctx, Request(), &resp);
  });
  absl::SleepFor(absl::Milliseconds(20));
  agents_[1]->Signal(SIGKILL);
  agents_[1]->Finish(absl::Seconds(10));
  agents_[1].reset();
  (void)fetch.get();
  // A is unaffected: same blocks, all still allocated, and it serves BlockAgent.
  EXPECT_EQ(Matched("gpu-a"), a_blocks_);
  EXPECT_EQ(FreeBlocks(*a_stub_), kAgentBlocks - kPages);
}

}  // namespace
}  // namespace kvcm
