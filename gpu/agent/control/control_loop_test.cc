// ControlLoop against a fake AgentControl over loopback: the inventory after every Register,
// NOT_FOUND (same epoch, blocks kept) and ABORTED (blocks freed, new epoch).
#include "gpu/agent/control/control_loop.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;

const NamespaceId kNs{"acme", "small-gqa"};

// A manager that knows one agent epoch (after Register), answers Heartbeat and
// ReportInventory as agent.proto says, and records what it got.
class FakeManager final : public v1::AgentControl::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterAgentRequest* req,
                        v1::RegisterAgentResponse*) override {
    absl::MutexLock lock(&mu_);
    register_epochs_.push_back(req->epoch());
    if (req->epoch() < known_epoch_) return grpc::Status(grpc::StatusCode::ABORTED, "stale");
    known_epoch_ = req->epoch();
    known_ = true;
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu_);
    last_pull_gbps_ = req->pull_gbps();
    return Check(req->epoch());
  }

  grpc::Status ReportInventory(grpc::ServerContext*, grpc::ServerReader<v1::InventoryChunk>* reader,
                               v1::InventoryReply* reply) override {
    std::vector<v1::InventoryChunk> chunks;
    v1::InventoryChunk chunk;
    while (reader->Read(&chunk)) chunks.push_back(chunk);
    absl::MutexLock lock(&mu_);
    inventories_.push_back(chunks);
    if (!chunks.empty()) {
      if (grpc::Status s = Check(chunks[0].epoch()); !s.ok()) return s;
    }
    if (inventory_failures_.size() > 0) {
      const grpc::StatusCode code = inventory_failures_.front();
      inventory_failures_.erase(inventory_failures_.begin());
      return grpc::Status(code, "inventory refused by the test");
    }
    *reply = reply_;
    return grpc::Status::OK;
  }

  // The manager restarts: it knows no agent.
  void Forget() {
    absl::MutexLock lock(&mu_);
    known_ = false;
    known_epoch_ = 0;
  }
  // Another process took the agent id with a larger epoch.
  void Supersede() {
    absl::MutexLock lock(&mu_);
    known_epoch_ += 1'000'000;
  }
  void FailNextInventories(std::vector<grpc::StatusCode> codes) {
    absl::MutexLock lock(&mu_);
    inventory_failures_ = std::move(codes);
  }
  void SetReply(v1::InventoryReply reply) {
    absl::MutexLock lock(&mu_);
    reply_ = std::move(reply);
  }
  std::vector<uint64_t> register_epochs() const {
    absl::MutexLock lock(&mu_);
    return register_epochs_;
  }
  double last_pull_gbps() const {
    absl::MutexLock lock(&mu_);
    return last_pull_gbps_;
  }
  std::vector<std::vector<v1::InventoryChunk>> inventories() const {
    absl::MutexLock lock(&mu_);
    return inventories_;
  }

 private:
  grpc::Status Check(uint64_t epoch) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!known_) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown agent");
    if (epoch != known_epoch_) return grpc::Status(grpc::StatusCode::ABORTED, "other epoch");
    return grpc::Status::OK;
  }

  mutable absl::Mutex mu_;
  bool known_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t known_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> register_epochs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<v1::InventoryChunk>> inventories_ ABSL_GUARDED_BY(mu_);
  std::vector<grpc::StatusCode> inventory_failures_ ABSL_GUARDED_BY(mu_);
  v1::InventoryReply reply_ ABSL_GUARDED_BY(mu_);
  double last_pull_gbps_ ABSL_GUARDED_BY(mu_) = -1;
};

// Polls `done` for up to 10 s.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

std::vector<BlockId> ChunkIds(const v1::InventoryChunk& c) {
  return std::vector<BlockId>(c.block_ids().begin(), c.block_ids().end());
}

class ControlLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&manager_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AgentControl::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    options_.agent_id = "agent-1";
    options_.heartbeat_interval_ms = 10;
  }
  void TearDown() override {
    if (loop_ != nullptr) loop_->Stop();
    server_->Shutdown();
  }

  // Commits `n` blocks of kNs (pages 0..n-1 of one prompt) for the current epoch.
  std::vector<BlockId> CommitBlocks(uint32_t n) {
    const uint64_t epoch = epoch_.current();
    std::vector<BlockId> ids = *gpu_->Allocate(n, epoch, &kNs);
    std::vector<CommitEntry> entries;
    for (uint32_t i = 0; i < n; ++i) {
      entries.push_back({ids[i], PageHash{i + 1, 0}, i == 0 ? PageHash{} : PageHash{i, 0}});
    }
    EXPECT_TRUE(gpu_->Commit(kNs, epoch, entries, "block_ids").ok());
    specs_.Set(kNs, SmallGqa());
    return ids;
  }

  void StartLoop() {
    const AgentPools pools{.main = gpu_.get(), .host = host_.get()};
    metrics_ = std::make_unique<AgentMetrics>(options_.agent_id, pools, &epoch_);
    loop_ = std::make_unique<ControlLoop>(&options_, pools, &epoch_, stub_.get(), "127.0.0.1:1",
                                          "127.0.0.1:2", &specs_, metrics_.get(),
                                          [this] { ++new_epochs_; });
    loop_->Start();
  }

  FakeManager manager_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AgentControl::Stub> stub_;
  AgentOptions options_;
  std::unique_ptr<BlockPool> gpu_ = MakeHostPool(SmallGqa(), 8);
  std::unique_ptr<BlockPool> host_ = MakeHostPool(SmallGqa(), 4);
  NamespaceSpecs specs_;
  AgentEpoch epoch_;
  std::unique_ptr<AgentMetrics> metrics_;
  std::atomic<int> new_epochs_{0};
  std::unique_ptr<ControlLoop> loop_;
};

TEST_F(ControlLoopTest, RegistersThenReportsTheInventoryAndFreesWhatTheReplyLists) {
  const std::vector<BlockId> ids = CommitBlocks(3);
  v1::InventoryReply reply;
  reply.set_indexed_pages(2);
  reply.set_orphan_pages(1);
  v1::PoolBlocks* to_free = reply.add_to_free();
  to_free->set_tier(v1::TIER_GPU);
  to_free->add_block_ids(ids[2]);
  manager_.SetReply(reply);
  const uint64_t epoch = epoch_.current();
  StartLoop();

  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));
  EXPECT_THAT(manager_.register_epochs(), ElementsAre(epoch));
  const auto inventories = manager_.inventories();
  ASSERT_EQ(inventories.size(), 1u);
  ASSERT_EQ(inventories[0].size(), 1u);
  const v1::InventoryChunk& c = inventories[0][0];
  EXPECT_EQ(c.agent_id(), "agent-1");
  EXPECT_EQ(c.epoch(), epoch);
  EXPECT_EQ(c.tier(), v1::TIER_GPU);
  EXPECT_EQ(c.namespace_().model(), kNs.model);
  EXPECT_EQ(c.spec().num_layers(), SmallGqa().num_layers);
  EXPECT_THAT(ChunkIds(c), ElementsAre(ids[0], ids[1], ids[2]));
  EXPECT_EQ(c.page_hashes().size(), 48u);
  EXPECT_EQ(gpu_->Stats().committed_blocks, 2u);  // ids[2] freed as the reply asked
  EXPECT_EQ(gpu_->Stats().free_blocks, 6u);
}

TEST_F(ControlLoopTest, NotFoundKeepsTheEpochAndReportsTheBlocksAgain) {
  const std::vector<BlockId> ids = CommitBlocks(2);
  const uint64_t epoch = epoch_.current();
  StartLoop();
  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));

  manager_.Forget();  // restarted
  ASSERT_TRUE(Eventually([&] { return manager_.inventories().size() == 2; }));
  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));
  EXPECT_THAT(manager_.register_epochs(), ElementsAre(epoch, epoch));
  EXPECT_EQ(epoch_.current(), epoch);
  EXPECT_EQ(new_epochs_.load(), 0);
  EXPECT_EQ(gpu_->Stats().committed_blocks, 2u);
  EXPECT_THAT(ChunkIds(manager_.inventories()[1][0]), ElementsAre(ids[0], ids[1]));
}

TEST_F(ControlLoopTest, AbortedFreesTheEpochsBlocksAndRegistersANewEpoch) {
  CommitBlocks(2);
  const BlockId private_block = (*gpu_->Allocate(1, 42))[0];  // a worker's own
  const uint64_t epoch = epoch_.current();
  StartLoop();
  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));

  manager_.Supersede();
  ASSERT_TRUE(Eventually([&] { return new_epochs_.load() == 1; }));
  EXPECT_GT(epoch_.current(), epoch);
  EXPECT_EQ(gpu_->Stats().committed_blocks, 0u);
  EXPECT_TRUE(gpu_->CheckOwned({&private_block, 1}, 42, "ids").ok());
}

TEST_F(ControlLoopTest, AFailedInventoryRegistersAgainWithTheSameEpoch) {
  CommitBlocks(1);
  manager_.FailNextInventories({grpc::StatusCode::UNAVAILABLE});
  const uint64_t epoch = epoch_.current();
  StartLoop();
  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));
  EXPECT_THAT(manager_.register_epochs(), ElementsAre(epoch, epoch));
  EXPECT_EQ(manager_.inventories().size(), 2u);
  EXPECT_EQ(gpu_->Stats().committed_blocks, 1u);
}

TEST_F(ControlLoopTest, AnInventoryRefusedAsInvalidStartsANewEpoch) {
  CommitBlocks(1);
  manager_.FailNextInventories({grpc::StatusCode::INVALID_ARGUMENT});
  const uint64_t epoch = epoch_.current();
  StartLoop();
  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));
  EXPECT_EQ(new_epochs_.load(), 1);
  EXPECT_GT(epoch_.current(), epoch);
  EXPECT_EQ(gpu_->Stats().committed_blocks, 0u);
  // Nothing left to report under the new epoch: no second stream.
  EXPECT_EQ(manager_.inventories().size(), 1u);
}

TEST_F(ControlLoopTest, HeartbeatsReportTheMeasuredPullBandwidth) {
  StartLoop();
  ASSERT_TRUE(Eventually([&] { return manager_.last_pull_gbps() == 0; }));  // no pull yet
  // 1 GB in 1 s, then 2 GB in 1 s: 8 Gbit/s, then 8 + (16 - 8) / 8 = 9 Gbit/s.
  metrics_->RecordTransfer(absl::OkStatus(), 1'000'000'000, absl::Seconds(1));
  ASSERT_TRUE(Eventually([&] { return manager_.last_pull_gbps() == 8; }));
  metrics_->RecordTransfer(absl::OkStatus(), 2'000'000'000, absl::Seconds(1));
  metrics_->RecordTransfer(absl::UnavailableError("peer gone"), 0, absl::Seconds(1));
  EXPECT_TRUE(Eventually([&] { return manager_.last_pull_gbps() == 9; }));
}

TEST_F(ControlLoopTest, NoCommittedBlocksSendsNoInventory) {
  (void)gpu_->Allocate(2, epoch_.current(), &kNs);  // allocated, not committed
  StartLoop();
  ASSERT_TRUE(Eventually([&] { return epoch_.registered(); }));
  EXPECT_TRUE(manager_.inventories().empty());
  EXPECT_EQ(gpu_->Stats().free_blocks, 6u);
}

}  // namespace
}  // namespace kvcm
