// BlockAgentService with a tokens file, over loopback: who may call which handler, and that a
// refused call changes nothing (block_agent_access.h).
#include "gpu/agent/server/block_agent_access.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/authenticator.h"
#include "common/credentials.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent_metrics.h"
#include "gpu/agent/server/block_agent_service.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateTo;
using ::kvcm::testing::FreeAsWorker;
using ::kvcm::testing::ReadAll;
using ::kvcm::testing::WriteAll;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kOwner = 7;
constexpr uint64_t kBlocks = 8;
const NamespaceId kAcmeNs{"acme", "meta/small-gqa"};
const NamespaceId kEvilNs{"evil", "meta/small-gqa"};

constexpr char kAcme[] = "acme-worker-token-5d1c0f";
constexpr char kEvil[] = "evil-worker-token-88a2e1";
constexpr char kRouter[] = "acme-router-token-a9e0c3";
constexpr char kPeer[] = "agent-gpu-1-token-61f7d2";
constexpr char kAdmin[] = "ops-admin-token-0b7d44e2";
constexpr char kLater[] = "added-later-token-3c8e19";
constexpr char kUnknown[] = "nobody-knows-this-token-1";

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

std::string TokensFile() {
  return absl::StrCat(Sha256Hex(kAcme), " acme-vllm roles=worker tenant=acme\n",  //
                      Sha256Hex(kEvil), " evil-vllm roles=worker tenant=evil\n",  //
                      Sha256Hex(kRouter), " edge roles=router tenants=acme\n",    //
                      Sha256Hex(kPeer), " gpu-1 roles=agent agent=gpu-1\n",       //
                      Sha256Hex(kAdmin), " ops roles=admin\n");
}

class BlockAgentAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_path_ = absl::StrCat(::testing::TempDir(), "/kvcm_agent_tokens_", getpid());
    WriteFile(tokens_path_, TokensFile());
    absl::StatusOr<std::unique_ptr<Authenticator>> a = Authenticator::FromFile(tokens_path_);
    ASSERT_TRUE(a.ok()) << a.status();
    authenticator_ = *std::move(a);
    service_ =
        std::make_unique<BlockAgentService>(&options_, AgentPools{.main = pool_.get()}, &epoch_,
                                            &metrics_, /*fetcher=*/nullptr, authenticator_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    server_->Shutdown();
    std::remove(tokens_path_.c_str());
  }

  // A stub whose calls carry `token`; none when empty.
  std::unique_ptr<v1::BlockAgent::Stub> As(const std::string& token) {
    absl::StatusOr<ChannelFactory> f = ChannelFactory::Create(TlsOptions{.insecure = true}, token);
    EXPECT_TRUE(f.ok()) << f.status();
    return v1::BlockAgent::NewStub(f->Open(address_));
  }

  // Blocks of acme holding `bytes_` (written as acme).
  std::vector<BlockId> AcmeBlocks(uint32_t count) {
    auto acme = As(kAcme);
    std::vector<BlockId> ids;
    gens_.clear();
    const grpc::Status s = AllocateTo(*acme, count, kOwner, kAcmeNs, &ids, &gens_);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(gens_.size(), ids.size());
    bytes_.assign(ids.size() * pool_->geometry().bytes_per_block(), '\0');
    for (size_t i = 0; i < bytes_.size(); ++i) bytes_[i] = static_cast<char>(i * 31 + 7);
    const grpc::Status w = WriteAll(*acme, ids, kOwner, bytes_, gens_);
    EXPECT_TRUE(w.ok()) << w.error_message();
    return ids;
  }

  // Acme still reads back exactly bytes_ from `ids`.
  void ExpectAcmeBytesUnchanged(const std::vector<BlockId>& ids) {
    auto acme = As(kAcme);
    absl::StatusOr<std::string> got = ReadAll(*acme, ids, kOwner);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, bytes_);
  }

  std::string tokens_path_;
  std::unique_ptr<Authenticator> authenticator_;
  AgentOptions options_;
  std::unique_ptr<BlockPool> pool_ = MakeHostPool(SmallGqa(), kBlocks);
  AgentEpoch epoch_;
  AgentMetrics metrics_{"agent-1", AgentPools{.main = pool_.get()}, &epoch_};
  std::unique_ptr<BlockAgentService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::string bytes_;
  std::vector<uint64_t> gens_;  // of AcmeBlocks' ids
};

grpc::Status Stats(v1::BlockAgent::Stub& stub) {
  v1::BlockAgentStatsResponse resp;
  grpc::ClientContext ctx;
  return stub.Stats(&ctx, v1::BlockAgentStatsRequest(), &resp);
}

grpc::Status RunAttention(v1::BlockAgent::Stub& stub, const std::vector<BlockId>& ids) {
  v1::RunAttentionRequest req;
  req.add_block_table()->mutable_block_ids()->Add(ids.begin(), ids.end());
  req.add_seq_lens(1);
  req.set_owner_epoch(kOwner);
  req.set_num_heads(1);
  v1::RunAttentionResponse resp;
  grpc::ClientContext ctx;
  return stub.RunAttention(&ctx, req, &resp);
}

grpc::Status Fetch(v1::BlockAgent::Stub& stub, const NamespaceId& ns,
                   const std::vector<BlockId>& local,
                   const std::vector<uint64_t>& generations = {}) {
  v1::FetchRequest req;
  NamespaceToProto(ns, req.mutable_namespace_());
  req.mutable_local_block_ids()->Add(local.begin(), local.end());
  req.mutable_local_block_generations()->Add(generations.begin(), generations.end());
  v1::FetchResponse resp;
  grpc::ClientContext ctx;
  return stub.Fetch(&ctx, req, &resp);
}

TEST_F(BlockAgentAccessTest, NoOrUnknownTokenIsUnauthenticatedAndChangesNothing) {
  const std::vector<BlockId> ids = AcmeBlocks(2);
  const uint32_t free_before = pool_->Stats().free_blocks;
  for (const std::string& token : {std::string(), std::string(kUnknown)}) {
    SCOPED_TRACE(token.empty() ? "no token" : "unknown token");
    auto stub = As(token);
    std::vector<BlockId> got;
    EXPECT_EQ(AllocateTo(*stub, 1, kOwner, kAcmeNs, &got).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(FreeAsWorker(*stub, ids, kOwner).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(ReadAll(*stub, ids, kOwner).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(WriteAll(*stub, ids, kOwner, std::string(bytes_.size(), 'x')).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(RunAttention(*stub, ids).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(Fetch(*stub, kAcmeNs, ids).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(Stats(*stub).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(pool_->Stats().free_blocks, free_before);
  ExpectAcmeBytesUnchanged(ids);
}

TEST_F(BlockAgentAccessTest, AnotherTenantsWorkerCannotTouchItsBlocks) {
  const std::vector<BlockId> ids = AcmeBlocks(2);
  const uint32_t free_before = pool_->Stats().free_blocks;
  auto evil = As(kEvil);

  // Even with acme's generations (they are guessable): refused by tenant.
  absl::StatusOr<std::string> read = ReadAll(*evil, ids, kOwner);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(read.status().message(), HasSubstr("evil-vllm"));
  const grpc::Status free = FreeAsWorker(*evil, ids, kOwner, gens_);
  EXPECT_EQ(free.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(free.error_message(), HasSubstr("evil-vllm"));
  EXPECT_EQ(WriteAll(*evil, ids, kOwner, std::string(bytes_.size(), 'x'), gens_).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(RunAttention(*evil, ids).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Fetching into acme's namespace, or into its own over acme's blocks.
  EXPECT_EQ(Fetch(*evil, kAcmeNs, {}).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Fetch(*evil, kEvilNs, ids).error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // One of acme's blocks among its own: the whole call is refused, its own block kept.
  std::vector<BlockId> mixed;
  std::vector<uint64_t> mixed_gens;
  ASSERT_TRUE(AllocateTo(*evil, 1, kOwner, kEvilNs, &mixed, &mixed_gens).ok());
  mixed.push_back(ids[0]);
  mixed_gens.push_back(gens_[0]);
  EXPECT_EQ(FreeAsWorker(*evil, mixed, kOwner, mixed_gens).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(pool_->Stats().free_blocks, free_before - 1);
  EXPECT_EQ(ReadAll(*evil, std::vector<BlockId>{mixed[0]}, kOwner).status().code(),
            absl::StatusCode::kOk);

  ExpectAcmeBytesUnchanged(ids);
  // Acme itself passes the checks (Fetch then fails only for want of a transport).
  auto acme = As(kAcme);
  EXPECT_EQ(Fetch(*acme, kAcmeNs, ids).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_TRUE(FreeAsWorker(*acme, ids, kOwner, gens_).ok());
}

TEST_F(BlockAgentAccessTest, RefusalsNeverSayWhoHoldsABlock) {
  const std::vector<BlockId> ids = AcmeBlocks(1);
  auto evil = As(kEvil);
  const BlockId free_block = kBlocks - 1;  // never allocated
  absl::StatusOr<std::string> taken = ReadAll(*evil, ids, kOwner);
  absl::StatusOr<std::string> free = ReadAll(*evil, std::vector<BlockId>{free_block}, kOwner);
  ASSERT_EQ(taken.status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_EQ(free.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(taken.status().message(), Not(HasSubstr("acme")));
  EXPECT_THAT(taken.status().message(), HasSubstr("not allocated to a namespace of its tenant"));
  // The same words for acme's block and a free one: nothing to tell them apart.
  EXPECT_EQ(taken.status().message(),
            absl::StrReplaceAll(free.status().message(), {{absl::StrCat("block ", free_block),
                                                           absl::StrCat("block ", ids[0])}}));
}

TEST_F(BlockAgentAccessTest, WorkersMustSendGenerationsToFreeOrWrite) {
  const std::vector<BlockId> ids = AcmeBlocks(2);
  auto acme = As(kAcme);
  const uint32_t free_before = pool_->Stats().free_blocks;
  const grpc::Status bare = FreeAsWorker(*acme, ids, kOwner);
  EXPECT_EQ(bare.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bare.error_message(), HasSubstr("block_generations is required"));
  const grpc::Status short_list = FreeAsWorker(*acme, ids, kOwner, std::span(gens_).first(1));
  EXPECT_EQ(short_list.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(short_list.error_message(), HasSubstr("block_generations"));
  const std::vector<uint64_t> zeros(ids.size(), 0);
  EXPECT_EQ(FreeAsWorker(*acme, ids, kOwner, zeros).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const grpc::Status write = WriteAll(*acme, ids, kOwner, std::string(bytes_.size(), 'x'));
  EXPECT_EQ(write.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(write.error_message(), HasSubstr("header.block_generations"));
  EXPECT_EQ(pool_->Stats().free_blocks, free_before);
  ExpectAcmeBytesUnchanged(ids);
}

TEST_F(BlockAgentAccessTest, AFreedAndReallocatedBlockRefusesItsOldGenerationEverywhere) {
  // Acme holds every block; it frees the last, which evil then gets (the only free one).
  const std::vector<BlockId> ids = AcmeBlocks(kBlocks);
  const std::vector<uint64_t> acme_gens = gens_;
  auto acme = As(kAcme);
  const BlockId last = ids.back();
  ASSERT_TRUE(FreeAsWorker(*acme, {&last, 1}, kOwner, {&acme_gens.back(), 1}).ok());
  auto evil = As(kEvil);
  std::vector<BlockId> got;
  std::vector<uint64_t> evil_gens;
  ASSERT_TRUE(AllocateTo(*evil, 1, kOwner, kEvilNs, &got, &evil_gens).ok());
  ASSERT_EQ(got, std::vector<BlockId>{last});
  ASSERT_NE(evil_gens[0], acme_gens.back());
  const std::string evil_bytes(pool_->geometry().bytes_per_block(), 'E');
  ASSERT_TRUE(WriteAll(*evil, got, kOwner, evil_bytes, evil_gens).ok());

  // Acme's stale id with its old generation: ABORTED, naming no tenant, nothing touched.
  const grpc::Status free = FreeAsWorker(*acme, {&last, 1}, kOwner, {&acme_gens.back(), 1});
  EXPECT_EQ(free.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(free.error_message(), HasSubstr("was freed and reallocated since generation"));
  EXPECT_THAT(free.error_message(), Not(HasSubstr("evil")));
  const grpc::Status write = WriteAll(*acme, {&last, 1}, kOwner,
                                      std::string(evil_bytes.size(), 'A'), {&acme_gens.back(), 1});
  EXPECT_EQ(write.error_code(), grpc::StatusCode::ABORTED);
  absl::StatusOr<std::string> read =
      ReadAll(*acme, {&last, 1}, kOwner, v1::TIER_UNSPECIFIED, {&acme_gens.back(), 1});
  EXPECT_EQ(read.status().code(), absl::StatusCode::kAborted);
  absl::StatusOr<std::string> still = ReadAll(*evil, got, kOwner, v1::TIER_UNSPECIFIED, evil_gens);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(*still, evil_bytes);
  EXPECT_EQ(pool_->Stats().free_blocks, 0u);
}

TEST_F(BlockAgentAccessTest, AFetchsGenerationsBindAdminsAndPeersToo) {
  // Acme frees its last block and evil gets it; an admin's Fetch into it, naming acme's old
  // generation, is refused like a worker's: the allocation it names has ended.
  const std::vector<BlockId> ids = AcmeBlocks(kBlocks);
  const BlockId last = ids.back();
  const uint64_t acme_gen = gens_.back();
  ASSERT_TRUE(FreeAsWorker(*As(kAcme), {&last, 1}, kOwner, {&acme_gen, 1}).ok());
  auto evil = As(kEvil);
  std::vector<BlockId> got;
  std::vector<uint64_t> evil_gens;
  ASSERT_TRUE(AllocateTo(*evil, 1, kOwner, kEvilNs, &got, &evil_gens).ok());
  ASSERT_EQ(got, std::vector<BlockId>{last});
  const std::string evil_bytes(pool_->geometry().bytes_per_block(), 'E');
  ASSERT_TRUE(WriteAll(*evil, got, kOwner, evil_bytes, evil_gens).ok());

  for (const char* token : {kAdmin, kPeer}) {
    const grpc::Status stale = Fetch(*As(token), kAcmeNs, {last}, {acme_gen});
    EXPECT_EQ(stale.error_code(), grpc::StatusCode::ABORTED) << token;
    EXPECT_THAT(stale.error_message(), HasSubstr("was freed and reallocated since generation"));
    // The block's own generation passes the checks (then no transport: UNIMPLEMENTED).
    EXPECT_EQ(Fetch(*As(token), kEvilNs, {last}, evil_gens).error_code(),
              grpc::StatusCode::UNIMPLEMENTED)
        << token;
  }
  absl::StatusOr<std::string> still = ReadAll(*evil, got, kOwner, v1::TIER_UNSPECIFIED, evil_gens);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(*still, evil_bytes);
}

TEST_F(BlockAgentAccessTest, AllocatingOutsideItsTenantIsDenied) {
  auto evil = As(kEvil);
  std::vector<BlockId> got;
  const grpc::Status s = AllocateTo(*evil, 2, kOwner, kAcmeNs, &got);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("evil-vllm"));
  EXPECT_THAT(s.error_message(), HasSubstr("\"acme\""));
  // Without a namespace the blocks would belong to no tenant.
  v1::AllocateBlocksRequest req;
  req.set_count(1);
  req.set_owner_epoch(kOwner);
  v1::AllocateBlocksResponse resp;
  grpc::ClientContext ctx;
  EXPECT_EQ(evil->Allocate(&ctx, req, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(pool_->Stats().free_blocks, kBlocks);
}

TEST_F(BlockAgentAccessTest, RoutersMayOnlyCallStats) {
  const std::vector<BlockId> ids = AcmeBlocks(1);
  auto router = As(kRouter);
  EXPECT_TRUE(Stats(*router).ok());
  std::vector<BlockId> got;
  EXPECT_EQ(AllocateTo(*router, 1, kOwner, kAcmeNs, &got).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ReadAll(*router, ids, kOwner).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(FreeAsWorker(*router, ids, kOwner).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(FreeAsWorker(*router, ids, kOwner, gens_).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ExpectAcmeBytesUnchanged(ids);
}

TEST_F(BlockAgentAccessTest, PeersAndAdminsMayDoEverything) {
  const std::vector<BlockId> ids = AcmeBlocks(2);
  // A peer agent pulls any tenant's blocks.
  auto peer = As(kPeer);
  absl::StatusOr<std::string> got = ReadAll(*peer, ids, kOwner);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, bytes_);
  std::vector<BlockId> own;
  EXPECT_TRUE(AllocateTo(*peer, 1, kOwner, kEvilNs, &own).ok());
  auto admin = As(kAdmin);
  EXPECT_TRUE(Stats(*admin).ok());
  EXPECT_TRUE(FreeAsWorker(*admin, ids, kOwner).ok());
  EXPECT_TRUE(FreeAsWorker(*admin, own, kOwner).ok());
  EXPECT_EQ(pool_->Stats().free_blocks, kBlocks);
}

TEST_F(BlockAgentAccessTest, ReloadingTheTokensFileAddsAndRemovesCallers) {
  auto later = As(kLater);
  EXPECT_EQ(Stats(*later).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  WriteFile(tokens_path_,
            absl::StrCat(TokensFile(), Sha256Hex(kLater), " later roles=worker tenant=later\n"));
  ASSERT_TRUE(authenticator_->ReloadIfChanged().ok());
  EXPECT_TRUE(Stats(*later).ok());
  // Removed again (the file's size differs, so the change is seen at once).
  WriteFile(tokens_path_, TokensFile());
  ASSERT_TRUE(authenticator_->ReloadIfChanged().ok());
  EXPECT_EQ(Stats(*later).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Stats(*As(kAcme)).ok());
}

// A service without an authenticator is open, as an agent without tokens_file.
TEST(BlockAgentAccessOpenTest, WithoutAuthenticatorEveryCallerMayDoEverything) {
  AgentOptions options;
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 2);
  AgentEpoch epoch;
  AgentMetrics metrics{"agent-1", AgentPools{.main = pool.get()}, &epoch};
  BlockAgentService service{&options, AgentPools{.main = pool.get()}, &epoch, &metrics};
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(absl::StrCat("127.0.0.1:", port)));
  std::vector<BlockId> ids;
  ASSERT_TRUE(AllocateTo(*stub, 2, kOwner, kAcmeNs, &ids).ok());
  EXPECT_TRUE(ReadAll(*stub, ids, kOwner).ok());
  EXPECT_TRUE(FreeAsWorker(*stub, ids, kOwner).ok());
  server->Shutdown();
}

}  // namespace
}  // namespace kvcm
