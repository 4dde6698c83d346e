// BlockAgentService over loopback: Allocate with and without a namespace; the streams cap per
// principal (StreamLimiter) and the limits Stats reports.
#include "gpu/agent/server/block_agent_service.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/stream_limiter.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/block_agent_calls.h"

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

TEST(StreamLimiterTest, CountsEachPrincipalApartAndReleasesOnceAtTheEnd) {
  StreamLimiter limiter(2);
  absl::StatusOr<StreamLimiter::Slot> a1 = limiter.Acquire("a");
  absl::StatusOr<StreamLimiter::Slot> a2 = limiter.Acquire("a");
  ASSERT_TRUE(a1.ok() && a2.ok());
  absl::StatusOr<StreamLimiter::Slot> a3 = limiter.Acquire("a");
  EXPECT_EQ(a3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(a3.status().message(), HasSubstr("max_streams_per_principal"));
  EXPECT_TRUE(limiter.Acquire("b").ok()) << "another principal has its own count";
  StreamLimiter::Slot moved = *std::move(a1);
  moved.Release();
  moved.Release();  // idempotent
  EXPECT_EQ(limiter.open("a"), 1u);
  { StreamLimiter::Slot gone = *std::move(a2); }
  EXPECT_EQ(limiter.open("a"), 0u);
  EXPECT_TRUE(limiter.Acquire("a").ok());
}

// A WriteBlocks stream that sent its header and stays open (holding a slot).
struct HeldWrite {
  grpc::ClientContext ctx;
  v1::WriteBlocksResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::WriteBlocksRequest>> writer;
};

std::unique_ptr<HeldWrite> OpenWrite(v1::BlockAgent::Stub& stub, BlockId id) {
  auto w = std::make_unique<HeldWrite>();
  w->writer = stub.WriteBlocks(&w->ctx, &w->resp);
  v1::WriteBlocksRequest header;
  header.mutable_header()->add_block_ids(id);
  header.mutable_header()->set_owner_epoch(kOwner);
  w->writer->Write(header);
  return w;
}

TEST(BlockAgentStreamCapTest, TheNextStreamOverTheCapIsRefusedUntilOneEnds) {
  AgentOptions options;
  options.max_streams_per_principal = 2;
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  AgentEpoch epoch;
  AgentMetrics metrics{"agent-1", AgentPools{.main = pool.get()}, &epoch};
  BlockAgentService service{&options, AgentPools{.main = pool.get()}, &epoch, &metrics};
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::BlockAgent::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  const std::vector<BlockId> ids = testing::AllocateIn(*stub, 2, kOwner, kNs);
  ASSERT_EQ(ids.size(), 2u);
  const std::string bytes(pool->geometry().bytes_per_block(), 'k');
  ASSERT_TRUE(testing::WriteAll(*stub, {&ids[0], 1}, kOwner, bytes).ok());

  v1::BlockAgentStatsResponse stats;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Stats(&ctx, v1::BlockAgentStatsRequest(), &stats).ok());
  }
  EXPECT_EQ(stats.stream_limits().max_streams_per_principal(), 2u);
  EXPECT_EQ(stats.stream_limits().max_message_bytes(), options.max_message_bytes);
  EXPECT_EQ(stats.stream_limits().read_chunk_bytes(), options.read_chunk_bytes);

  // Each held stream is counted before the next one opens: a stream still ending (the
  // Allocate and WriteAll above) or a third opened too early could otherwise take the slot
  // `second` was meant to have, and `second` would be the one refused.
  const std::string caller = OpenPrincipal()->name;
  ASSERT_TRUE(testing::WaitFor([&] { return service.open_streams(caller) == 0; }));
  std::unique_ptr<HeldWrite> first = OpenWrite(*stub, ids[1]);
  ASSERT_TRUE(testing::WaitFor([&] { return service.open_streams(caller) == 1; }));
  std::unique_ptr<HeldWrite> second = OpenWrite(*stub, ids[1]);
  ASSERT_TRUE(testing::WaitFor([&] { return service.open_streams(caller) == 2; }));
  // With both open, a third is refused, whether it writes or reads, and changes nothing.
  grpc::Status third;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    third = testing::WriteAll(*stub, {&ids[1], 1}, kOwner, std::string(bytes.size(), 'x'));
  } while (third.ok() && absl::Now() < deadline);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third.error_message();
  EXPECT_THAT(third.error_message(), HasSubstr("max_streams_per_principal"));
  absl::StatusOr<std::string> read = testing::ReadAll(*stub, {&ids[0], 1}, kOwner);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kResourceExhausted);
  // Unary calls are not streams.
  grpc::ClientContext stats_ctx;
  EXPECT_TRUE(stub->Stats(&stats_ctx, v1::BlockAgentStatsRequest(), &stats).ok());

  // A cancelled stream gives its slot back: the next stream is accepted again.
  first->ctx.TryCancel();
  (void)first->writer->Finish();
  absl::StatusOr<std::string> again;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  do {
    again = testing::ReadAll(*stub, {&ids[0], 1}, kOwner);
  } while (!again.ok() && absl::Now() < until);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, bytes) << "the refused write changed nothing";
  // So does one that ends normally (here short of data: INVALID_ARGUMENT).
  second->writer->WritesDone();
  EXPECT_EQ(second->writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Both slots come back once the server has finished the ended streams (its reactors end
  // after the client sees Finish, so the first tries may still be refused).
  bool both_open = false;
  for (const absl::Time until_both = absl::Now() + absl::Seconds(10);
       !both_open && absl::Now() < until_both;) {
    std::unique_ptr<HeldWrite> third_held = OpenWrite(*stub, ids[1]);
    std::unique_ptr<HeldWrite> fourth_held = OpenWrite(*stub, ids[1]);
    third_held->writer->WritesDone();
    fourth_held->writer->WritesDone();
    const grpc::StatusCode a = third_held->writer->Finish().error_code();
    const grpc::StatusCode b = fourth_held->writer->Finish().error_code();
    for (grpc::StatusCode code : {a, b}) {
      EXPECT_TRUE(code == grpc::StatusCode::INVALID_ARGUMENT ||
                  code == grpc::StatusCode::RESOURCE_EXHAUSTED)
          << code;
    }
    both_open = a == grpc::StatusCode::INVALID_ARGUMENT && b == grpc::StatusCode::INVALID_ARGUMENT;
  }
  EXPECT_TRUE(both_open) << "two streams were never accepted side by side again";
  server->Shutdown();
}

}  // namespace
}  // namespace kvcm
