// CacheManager.Insert into a real agent's pool, end to end (an in-process ManagerServer and
// Agent, the real client and BlockAgent stubs), as an adversary would try it:
//   - one tenant naming another tenant's cached blocks for its own pages is refused, and the
//     first tenant's pages keep their blocks and bytes whatever the second does next (the
//     aliasing sequence of issue 8);
//   - a refused insert (repeated, out-of-pool or pending block ids, a namespace whose pages
//     are not the pool's block size, blocks the agent would not commit) changes nothing on
//     the manager or the agent;
//   - the blocks of a duplicate insert go back to their worker (ReleaseBlocks) before the
//     insert answers.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "client/client.h"
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

using ::kvcm::testing::AllocateBlocks;
using ::kvcm::testing::AllocateIn;
using ::kvcm::testing::AllocateTo;
using ::kvcm::testing::BlockAgentStub;
using ::kvcm::testing::Bytes;
using ::kvcm::testing::ConnectAndRegister;
using ::kvcm::testing::Counts;
using ::kvcm::testing::CountsOf;
using ::kvcm::testing::FailedCommands;
using ::kvcm::testing::FreeAsWorker;
using ::kvcm::testing::FreeBlocksOf;
using ::kvcm::testing::kBlockBytes;
using ::kvcm::testing::MatchedBlocks;
using ::kvcm::testing::MetricsHave;
using ::kvcm::testing::ReadAll;
using ::kvcm::testing::StartAgent;
using ::kvcm::testing::StartManager;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

TEST(AgentInsertTest, ADuplicateInsertGivesItsBlocksBackToTheWorker) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 8);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  const NamespaceId ns{"tenant", "deepseek-v3"};
  const ModelSpec& spec = agent->pool().geometry().spec;
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), ns, spec);
  ASSERT_NE(client, nullptr);
  auto ba = BlockAgentStub(*agent);
  const PoolRef pool{"gpu-3", Tier::kGpu};
  const std::vector<int32_t> prompt = Tokens(2, spec.page_size_tokens, 1);

  const std::vector<BlockId> first = AllocateIn(*ba, 2, agent->epoch(), ns);
  ASSERT_EQ(first.size(), 2u);
  ASSERT_TRUE(client->Insert(ns, prompt, pool, first).ok());
  const std::vector<BlockId> second = AllocateIn(*ba, 2, agent->epoch(), ns);
  ASSERT_EQ(second.size(), 2u);
  ASSERT_EQ(FreeBlocksOf(*ba), 4u);

  absl::StatusOr<InsertReply> ins = client->Insert(ns, prompt, pool, second);
  ASSERT_TRUE(ins.ok()) << ins.status();
  EXPECT_EQ(ins->already_present_pages, 2u);
  EXPECT_EQ(ins->new_pages, 0u);
  EXPECT_THAT(ins->existing_block_ids, ElementsAreArray(first));
  // Commit, commit, release: all acked before the answer.
  EXPECT_TRUE(MetricsHave(*manager, "commands_total{result=\"acked\"} 3"));
  const grpc::Status freed = FreeAsWorker(*ba, second, agent->epoch());
  EXPECT_TRUE(freed.ok()) << freed.error_message();
  EXPECT_EQ(FreeBlocksOf(*ba), 6u);
  EXPECT_THAT(MatchedBlocks(*client, ns, prompt), ElementsAreArray(first));
  EXPECT_EQ(FreeAsWorker(*ba, first, agent->epoch()).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);  // the indexed ones stay the cache's
}

// The aliasing that commits exist to prevent: tenant B names tenant A's cached blocks for
// its own prompt. The agent's ledger has them committed to A's pages, so B's insert is
// refused, and nothing B can do afterwards (evict its namespace, take and write every block
// left) changes what A's prompt matches: A's blocks holding A's bytes, or nothing.
TEST(AgentInsertTest, ATenantCannotIndexAnotherTenantsBlocks) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 8);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  ASSERT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 1; }));
  const ModelSpec& spec = agent->pool().geometry().spec;
  const NamespaceId ns_a{"tenant-a", "deepseek-v3"};
  const NamespaceId ns_b{"tenant-b", "deepseek-v3"};
  std::unique_ptr<Client> tenant_a = ConnectAndRegister(manager->address(), ns_a, spec);
  ASSERT_NE(tenant_a, nullptr);
  std::unique_ptr<Client> tenant_b = ConnectAndRegister(manager->address(), ns_b, spec);
  ASSERT_NE(tenant_b, nullptr);
  auto ba = BlockAgentStub(*agent);
  const uint64_t epoch = agent->epoch();
  const PoolRef pool{"gpu-3", Tier::kGpu};

  // A allocates two blocks in its namespace, writes its KV and indexes prompt PA.
  const std::vector<BlockId> a_blocks = AllocateIn(*ba, 2, epoch, ns_a);
  ASSERT_EQ(a_blocks.size(), 2u);
  const std::string a_bytes = Bytes(2 * kBlockBytes, 11);
  const grpc::Status wrote = WriteAll(*ba, a_blocks, epoch, a_bytes);
  ASSERT_TRUE(wrote.ok()) << wrote.error_message();
  const std::vector<int32_t> pa = Tokens(2, spec.page_size_tokens, 1);
  absl::StatusOr<InsertReply> ins = tenant_a->Insert(ns_a, pa, pool, a_blocks);
  ASSERT_TRUE(ins.ok()) << ins.status();
  ASSERT_EQ(ins->new_pages, 2u);
  const Counts indexed = CountsOf(*tenant_a, *ba);

  // B names A's blocks for its own prompt PB.
  const std::vector<int32_t> pb = Tokens(2, spec.page_size_tokens, 500);
  ins = tenant_b->Insert(ns_b, pb, pool, a_blocks);
  EXPECT_EQ(ins.status().code(), absl::StatusCode::kFailedPrecondition) << ins.status();
  EXPECT_THAT(ins.status().message(), HasSubstr("block_ids[0]"));
  EXPECT_EQ(CountsOf(*tenant_a, *ba), indexed);
  EXPECT_TRUE(MatchedBlocks(*tenant_b, ns_b, pb).empty());
  EXPECT_THAT(MatchedBlocks(*tenant_a, ns_a, pa), ElementsAreArray(a_blocks));

  // B evicts its namespace. It holds nothing, so that may be OUT_OF_RANGE; A keeps its
  // pages either way.
  absl::StatusOr<EvictReply> ev = tenant_b->EvictFromNamespace(ns_b, 2 * spec.BytesPerPage());
  EXPECT_TRUE(ev.ok() || ev.status().code() == absl::StatusCode::kOutOfRange) << ev.status();
  if (ev.ok()) {
    EXPECT_EQ(ev->evicted_pages, 0u);
  }
  EXPECT_EQ(CountsOf(*tenant_a, *ba), indexed);
  EXPECT_THAT(MatchedBlocks(*tenant_a, ns_a, pa), ElementsAreArray(a_blocks));

  // A's blocks belong to the cache: no worker can write or free them.
  EXPECT_EQ(WriteAll(*ba, a_blocks, epoch, Bytes(2 * kBlockBytes, 99)).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(FreeAsWorker(*ba, a_blocks, epoch).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  // B's worker allocates until the agent runs out of blocks, and fills them with its bytes.
  std::vector<BlockId> b_blocks;
  grpc::Status allocated;
  while ((allocated = AllocateTo(*ba, 1, epoch, ns_b, &b_blocks)).ok()) {
    ASSERT_LE(b_blocks.size(), 8u);
  }
  EXPECT_EQ(allocated.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << allocated.error_message();
  EXPECT_EQ(b_blocks.size(), 6u);
  for (BlockId b : b_blocks) EXPECT_THAT(a_blocks, ::testing::Not(::testing::Contains(b)));
  const grpc::Status wrote_b =
      WriteAll(*ba, b_blocks, epoch, Bytes(b_blocks.size() * kBlockBytes, 99));
  EXPECT_TRUE(wrote_b.ok()) << wrote_b.error_message();

  // A's prompt matches its blocks holding its bytes, or nothing; never other bytes.
  const std::vector<BlockId> matched = MatchedBlocks(*tenant_a, ns_a, pa);
  if (!matched.empty()) {
    EXPECT_THAT(matched, ElementsAreArray(a_blocks));
    absl::StatusOr<std::string> got = ReadAll(*ba, matched, epoch);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == a_bytes) << "A's matched blocks hold other bytes than A wrote";
  }

  // B indexes PB in its own blocks: that is allowed, and A is untouched.
  ins = tenant_b->Insert(ns_b, pb, pool, std::span<const BlockId>(b_blocks).first(2));
  ASSERT_TRUE(ins.ok()) << ins.status();
  EXPECT_EQ(ins->new_pages, 2u);
  EXPECT_THAT(MatchedBlocks(*tenant_a, ns_a, pa), ElementsAreArray(a_blocks));
  absl::StatusOr<std::string> again = ReadAll(*ba, a_blocks, epoch);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(*again == a_bytes);
}

// Inserts the manager or the agent refuses change nothing: no page indexed, no block taken
// or committed on the agent.
TEST(AgentInsertTest, RefusedInsertsChangeNothing) {
  std::unique_ptr<ManagerServer> manager = StartManager();
  std::unique_ptr<Agent> agent = StartAgent(manager->address(), 8);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));
  ASSERT_TRUE(WaitFor([&] { return manager->commands().open_streams() == 1; }));
  const ModelSpec& spec = agent->pool().geometry().spec;
  const NamespaceId ns{"tenant", "deepseek-v3"};
  const NamespaceId other{"other", "deepseek-v3"};
  const NamespaceId llama{"tenant", "llama-3-70b"};
  std::unique_ptr<Client> client = ConnectAndRegister(manager->address(), ns, spec);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->RegisterModel(other, spec).ok());
  absl::StatusOr<ModelSpec> llama_spec = FindModel("llama-3-70b");
  ASSERT_TRUE(llama_spec.ok()) << llama_spec.status();
  ASSERT_EQ(llama_spec->page_size_tokens, spec.page_size_tokens);
  ASSERT_NE(llama_spec->BytesPerPage(), spec.BytesPerPage());
  ASSERT_TRUE(client->RegisterModel(llama, *llama_spec).ok());
  auto ba = BlockAgentStub(*agent);
  const uint64_t epoch = agent->epoch();
  const PoolRef pool{"gpu-3", Tier::kGpu};

  // Something indexed, so that "nothing changed" is not about an empty pool.
  const std::vector<BlockId> indexed = AllocateIn(*ba, 2, epoch, ns);
  ASSERT_EQ(indexed.size(), 2u);
  ASSERT_TRUE(client->Insert(ns, Tokens(2, spec.page_size_tokens, 1), pool, indexed).ok());
  // Blocks the bad inserts name: allocated to `ns` in the agent's epoch (committable), to
  // no namespace, and to `ns` by another owner epoch (a worker's own).
  const std::vector<BlockId> spare = AllocateIn(*ba, 2, epoch, ns);
  ASSERT_EQ(spare.size(), 2u);
  const std::vector<BlockId> unnamed = AllocateBlocks(*ba, 1, epoch);
  ASSERT_EQ(unnamed.size(), 1u);
  const std::vector<BlockId> private_blocks = AllocateIn(*ba, 1, epoch + 100, ns);
  ASSERT_EQ(private_blocks.size(), 1u);
  std::optional<BlockId> never_allocated;
  for (BlockId b = 0; b < 8 && !never_allocated.has_value(); ++b) {
    const auto is = [b](const std::vector<BlockId>& v) {
      return std::find(v.begin(), v.end(), b) != v.end();
    };
    if (!is(indexed) && !is(spare) && !is(unnamed) && !is(private_blocks)) never_allocated = b;
  }
  ASSERT_TRUE(never_allocated.has_value());
  const Counts before = CountsOf(*client, *ba);
  ASSERT_EQ(std::get<2>(before), 2u);

  // INVALID_ARGUMENT: refused by the manager, before any command; FAILED_PRECONDITION:
  // the agent refused the commit (the client, taking that code for a stale hash key,
  // re-registers the namespace and tries once more; the agent refuses again).
  struct Case {
    std::string what;
    NamespaceId ns;
    size_t pages;
    std::vector<BlockId> blocks;
    absl::StatusCode code;
    std::string message;
  };
  using enum absl::StatusCode;
  const std::vector<Case> cases = {
      {"the same block twice",
       ns,
       2,
       {spare[0], spare[0]},
       kInvalidArgument,
       "block_ids[1] repeats"},
      {"a block past the pool", ns, 1, {8}, kInvalidArgument, "is past pool"},
      {"the pending block id",
       ns,
       1,
       {kPendingBlock},
       kInvalidArgument,
       "block_ids[0] is 0xFFFFFFFF"},
      {"a namespace of another page size",
       llama,
       1,
       {spare[0]},
       kInvalidArgument,
       "namespace tenant/llama-3-70b"},
      {"a block never allocated", ns, 1, {*never_allocated}, kFailedPrecondition, "block_ids[0]"},
      {"a block allocated to no namespace",
       ns,
       1,
       {unnamed[0]},
       kFailedPrecondition,
       "block_ids[0]"},
      {"a block of another owner epoch",
       ns,
       1,
       {private_blocks[0]},
       kFailedPrecondition,
       "block_ids[0]"},
      {"blocks allocated to another namespace",
       other,
       2,
       {spare[1], spare[0]},
       kFailedPrecondition,
       "block_ids[0]"},
  };
  int32_t seed = 1000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const uint64_t failed_before = FailedCommands(*manager);
    const std::vector<int32_t> tokens = Tokens(c.pages, spec.page_size_tokens, seed += 100);
    absl::StatusOr<InsertReply> ins = client->Insert(c.ns, tokens, pool, c.blocks);
    EXPECT_EQ(ins.status().code(), c.code) << ins.status();
    EXPECT_THAT(ins.status().message(), HasSubstr(c.message));
    EXPECT_EQ(CountsOf(*client, *ba), before);
    EXPECT_TRUE(MatchedBlocks(*client, c.ns, tokens).empty());
    EXPECT_EQ(manager->commands().unacked_commands("gpu-3"), 0u);
    if (c.code == kInvalidArgument) {
      EXPECT_EQ(FailedCommands(*manager), failed_before) << "sent to the agent";
    } else {
      EXPECT_TRUE(WaitFor([&] { return FailedCommands(*manager) > failed_before; }))
          << "not refused by the agent";
    }
  }

  // Nothing was committed: every block the bad inserts named is still its worker's to write
  // and free.
  const std::vector<std::pair<std::vector<BlockId>, uint64_t>> owned = {
      {spare, epoch}, {unnamed, epoch}, {private_blocks, epoch + 100}};
  for (const auto& [blocks, owner] : owned) {
    const grpc::Status wrote = WriteAll(*ba, blocks, owner, Bytes(blocks.size() * kBlockBytes, 3));
    EXPECT_TRUE(wrote.ok()) << wrote.error_message();
    const grpc::Status freed = FreeAsWorker(*ba, blocks, owner);
    EXPECT_TRUE(freed.ok()) << freed.error_message();
  }
  EXPECT_EQ(FreeBlocksOf(*ba), 6u);
  // And the agent still commits a good insert.
  const std::vector<BlockId> fresh = AllocateIn(*ba, 1, epoch, ns);
  ASSERT_EQ(fresh.size(), 1u);
  absl::StatusOr<InsertReply> ins =
      client->Insert(ns, Tokens(1, spec.page_size_tokens, 7), pool, fresh);
  ASSERT_TRUE(ins.ok()) << ins.status();
  EXPECT_EQ(ins->new_pages, 1u);
}

}  // namespace
}  // namespace kvcm
