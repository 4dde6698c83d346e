// AgentControl.ReportInventory over a real loopback channel, spoken by hand as an agent (or an
// impostor) would: a registered agent's inventory rebuilds the index and namespace, orphans
// come back in to_free; malformed or foreign streams are refused with the field named and
// index nothing.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kEpoch = 5;

class InventoryRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.tls.insecure = true;
    o.listen_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.shutdown_grace_ms = 100;
    absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = *std::move(m);
    auto channel = MakeInsecureChannel(manager_->address());
    ac_ = v1::AgentControl::NewStub(channel);
    spec_ = *FindModel("deepseek-v3");

    v1::RegisterAgentRequest req;
    req.set_agent_id("a1");
    req.set_tier(v1::TIER_GPU);
    ModelSpecToProto(spec_, req.mutable_geometry()->mutable_spec());
    req.mutable_geometry()->set_bytes_per_block(spec_.BytesPerPage());
    req.mutable_geometry()->set_num_blocks(8);
    req.set_capacity_bytes(8 * spec_.BytesPerPage());
    req.set_epoch(kEpoch);
    grpc::ClientContext ctx;
    v1::RegisterAgentResponse resp;
    ASSERT_TRUE(ac_->Register(&ctx, req, &resp).ok());
  }

  // A chunk of agent a1 with pages [first, first + n) of one prompt, chained, in `blocks`;
  // page p's hash is {p, p}, its parent {p - 1, p - 1} (none for page 0).
  v1::InventoryChunk Chunk(uint64_t first, std::vector<uint32_t> blocks) {
    v1::InventoryChunk c;
    c.set_agent_id("a1");
    c.set_epoch(kEpoch);
    c.set_tier(v1::TIER_GPU);
    c.mutable_namespace_()->set_tenant("acme");
    c.mutable_namespace_()->set_model("dsv3");
    ModelSpecToProto(spec_, c.mutable_spec());
    std::vector<PageHash> pages, parents;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const uint64_t p = first + i;
      c.add_block_ids(blocks[i]);
      pages.push_back({p + 1, p + 1});
      parents.push_back(p == 0 ? PageHash{} : PageHash{p, p});
    }
    c.set_page_hashes(EncodePageHashes(pages));
    c.set_parent_hashes(EncodePageHashes(parents));
    return c;
  }

  grpc::Status Report(const std::vector<v1::InventoryChunk>& chunks, v1::InventoryReply* reply) {
    grpc::ClientContext ctx;
    auto writer = ac_->ReportInventory(&ctx, reply);
    for (const v1::InventoryChunk& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  uint64_t IndexedPages() {
    uint64_t n = 0;
    for (const PoolStats& p : manager_->index().Stats().pools) n += p.pages;
    return n;
  }

  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<v1::AgentControl::Stub> ac_;
  ModelSpec spec_;
};

TEST_F(InventoryRpcTest, AnInventoryRebuildsPagesAndNamespaceAndReturnsOrphans) {
  // Pages 0..2 of a prompt over two chunks (the child first), and an orphan: page 5 whose
  // parent (page 4) no inventory holds.
  v1::InventoryReply reply;
  grpc::Status s = Report({Chunk(2, {6}), Chunk(0, {3, 4}), Chunk(5, {1})}, &reply);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(reply.indexed_pages(), 3u);
  EXPECT_EQ(reply.orphan_pages(), 1u);
  ASSERT_EQ(reply.to_free_size(), 1);
  EXPECT_EQ(reply.to_free(0).tier(), v1::TIER_GPU);
  EXPECT_THAT(reply.to_free(0).block_ids(), ElementsAre(1));
  EXPECT_EQ(IndexedPages(), 3u);
  absl::StatusOr<RegisterModelResult> ns = manager_->index().GetNamespace({"acme", "dsv3"});
  ASSERT_TRUE(ns.ok());
  EXPECT_EQ(ns->spec, spec_);
  absl::StatusOr<MatchResult> m = manager_->index().Match(
      {"acme", "dsv3"}, std::vector<PageHash>{{1, 1}, {2, 2}, {3, 3}}, {.probe = true});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->matched_pages, 3u);
}

TEST_F(InventoryRpcTest, MalformedOrForeignInventoriesIndexNothing) {
  struct Case {
    const char* name;
    std::vector<v1::InventoryChunk> chunks;
    grpc::StatusCode code;
    const char* message;
  };
  v1::InventoryChunk short_hashes = Chunk(0, {1, 2});
  short_hashes.mutable_page_hashes()->resize(20);
  v1::InventoryChunk other_agent = Chunk(1, {2});
  other_agent.set_agent_id("a2");
  v1::InventoryChunk stranger = Chunk(0, {1});
  stranger.set_agent_id("nobody");
  v1::InventoryChunk stale = Chunk(0, {1});
  stale.set_epoch(kEpoch - 1);
  v1::InventoryChunk host = Chunk(0, {1});
  host.set_tier(v1::TIER_HOST);
  v1::InventoryChunk bad_ns = Chunk(0, {1});
  bad_ns.mutable_namespace_()->set_tenant("a b");
  v1::InventoryChunk no_spec = Chunk(0, {1});
  no_spec.clear_spec();
  v1::InventoryChunk other_spec = Chunk(1, {2});
  other_spec.mutable_spec()->set_page_size_tokens(32);
  const Case cases[] = {
      {"hash bytes", {short_hashes}, grpc::StatusCode::INVALID_ARGUMENT, "page_hashes has 20"},
      {"agent changes",
       {Chunk(0, {1}), other_agent},
       grpc::StatusCode::INVALID_ARGUMENT,
       "agent_id and epoch must be the same"},
      {"unknown agent", {stranger}, grpc::StatusCode::NOT_FOUND, "not registered"},
      {"stale epoch", {stale}, grpc::StatusCode::ABORTED, "stale"},
      {"no host pool", {host}, grpc::StatusCode::INVALID_ARGUMENT, "tier host"},
      {"bad namespace", {bad_ns}, grpc::StatusCode::INVALID_ARGUMENT, "namespace.tenant"},
      {"no spec", {no_spec}, grpc::StatusCode::INVALID_ARGUMENT, "spec"},
      {"two specs",
       {Chunk(0, {1}), other_spec},
       grpc::StatusCode::INVALID_ARGUMENT,
       "spec: namespace acme/dsv3"},
      {"past the pool",
       {Chunk(0, {1, 8})},
       grpc::StatusCode::INVALID_ARGUMENT,
       "block_ids[1]: block 8 of pool gpu is past the pool"},
      {"block twice",
       {Chunk(0, {1}), Chunk(1, {1})},
       grpc::StatusCode::INVALID_ARGUMENT,
       "listed twice"},
      {"pending", {Chunk(0, {0xFFFFFFFF})}, grpc::StatusCode::INVALID_ARGUMENT, "reserved"},
  };
  for (const Case& c : cases) {
    v1::InventoryReply reply;
    grpc::Status s = Report(c.chunks, &reply);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.name;
    EXPECT_EQ(reply.to_free_size(), 0) << c.name;
  }
  EXPECT_EQ(IndexedPages(), 0u);
  EXPECT_TRUE(manager_->index().Stats().namespaces.empty());
}

}  // namespace
}  // namespace kvcm
