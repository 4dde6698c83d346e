// BlockAgentService over loopback: Allocate with and without a namespace.
#include "gpu/agent/block_agent_service.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/agent/agent_metrics.h"
#include "gpu/agent/agent_test_util.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kOwner = 5;
const NamespaceId kNs{"acme", "meta/small-gqa"};

class BlockAgentServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::BlockAgent::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }

  grpc::Status Allocate(uint32_t count, const v1::Namespace* ns, std::vector<BlockId>* ids) {
    v1::AllocateBlocksRequest req;
    req.set_count(count);
    req.set_owner_epoch(kOwner);
    if (ns != nullptr) *req.mutable_namespace_() = *ns;
    v1::AllocateBlocksResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Allocate(&ctx, req, &resp);
    ids->assign(resp.block_ids().begin(), resp.block_ids().end());
    return s;
  }

  // Commits `ids` to pages 1, 2, ... of `ns`.
  absl::Status Commit(const NamespaceId& ns, const std::vector<BlockId>& ids) {
    std::vector<CommitEntry> entries;
    for (size_t i = 0; i < ids.size(); ++i) {
      entries.push_back({ids[i], PageHash{i + 1, 0}, PageHash{i, 0}});
    }
    return pool_->Commit(ns, kOwner, entries, "block_ids").status();
  }

  AgentOptions options_;
  std::unique_ptr<BlockPool> pool_ = MakeHostPool(SmallGqa(), 4);
  AgentEpoch epoch_;
  AgentMetrics metrics_{"agent-1", AgentPools{.main = pool_.get()}, &epoch_};
  BlockAgentService service_{&options_, AgentPools{.main = pool_.get()}, &epoch_, &metrics_};
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::BlockAgent::Stub> stub_;
};

TEST_F(BlockAgentServiceTest, AllocateWithANamespaceMakesCommittableBlocks) {
  v1::Namespace ns;
  ns.set_tenant(kNs.tenant);
  ns.set_model(kNs.model);
  std::vector<BlockId> ids;
  grpc::Status s = Allocate(2, &ns, &ids);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(Commit(NamespaceId{"acme", "other"}, ids).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Commit(kNs, ids).ok());
}

TEST_F(BlockAgentServiceTest, AllocateWithoutANamespaceMakesPrivateBlocks) {
  std::vector<BlockId> ids;
  ASSERT_TRUE(Allocate(1, nullptr, &ids).ok());
  const absl::Status s = Commit(kNs, ids);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pool_->Free(ids, kOwner).ok());
}

TEST_F(BlockAgentServiceTest, AllocateRefusesABadNamespaceAndAllocatesNothing) {
  struct Case {
    std::string tenant, model, field;
  };
  const Case cases[] = {{"", "m", "namespace.tenant"},
                        {"a/b", "m", "namespace.tenant"},
                        {"t", "", "namespace.model"},
                        {"t", "m m", "namespace.model"}};
  for (const Case& c : cases) {
    v1::Namespace ns;
    ns.set_tenant(c.tenant);
    ns.set_model(c.model);
    std::vector<BlockId> ids;
    const grpc::Status s = Allocate(1, &ns, &ids);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(s.error_message(), HasSubstr(c.field));
  }
  EXPECT_EQ(pool_->Stats().free_blocks, 4u);
}

}  // namespace
}  // namespace kvcm
