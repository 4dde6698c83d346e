// Issue 22's two block-reuse attacks, replayed against real kvcm-manager and kvcm-agent
// processes with mutual TLS and a tokens file on both: tenant B ("evil") keeps a stream open
// on one of its blocks, frees the block, tenant A ("acme") allocates it, writes it and
// inserts it, and B resumes its stream. With block generations B's stream ends ABORTED, and
// A's Match and ReadBlocks return A's bytes: B neither wrote A's page nor read it.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/model_catalog.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/util/block_agent_calls.h"
#include "tests/util/child_process.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAcmeToken[] = "acme-token-0123456789";
constexpr char kEvilToken[] = "evil-token-0123456789";
constexpr char kAgentToken[] = "gpu-a-token-012345678";
constexpr uint32_t kBlocks = 24;  // DeepSeek-V3 bf16 blocks of 4.3 MiB

class BlockReuseAttackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<testing::TestCerts>> certs = testing::TestCerts::Make({"gpu-a"});
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *std::move(certs);
    tokens_ = certs_->Path("tokens");
    {
      std::ofstream out(tokens_);
      out << Sha256Hex(kAcmeToken) << " acme-vllm roles=worker tenant=acme\n"
          << Sha256Hex(kEvilToken) << " evil-vllm roles=worker tenant=evil\n"
          << Sha256Hex(kAgentToken) << " gpu-a roles=agent agent=gpu-a\n";
    }
    spec_ = *FindModel("deepseek-v3");
    bpb_ = spec_.BytesPerPage();
    const std::string log = absl::StrCat(certs_->dir(), "/");
    manager_address_ = absl::StrCat("127.0.0.1:", testing::FreePort());
    manager_ = testing::Subprocess::Start(
        {KVCM_MANAGER_PATH, absl::StrCat("--listen_address=", manager_address_),
         "--metrics_address=", "--shutdown_grace_ms=200",
         absl::StrCat("--tls_cert_file=", certs_->Path("manager.pem")),
         absl::StrCat("--tls_key_file=", certs_->Path("manager.key")),
         absl::StrCat("--tls_ca_file=", certs_->Path("ca.pem")),
         absl::StrCat("--tokens_file=", tokens_)},
        log + "manager.log");
    ASSERT_NE(manager_, nullptr);
    // The agent starts once the manager serves (else it waits out gRPC's reconnect backoff).
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
          std::unique_ptr<Client> probe = Connect(kAcmeToken);
          return probe != nullptr && probe->Stats({.deadline_ms = 500}).ok();
        },
        absl::Seconds(20)));
    agent_address_ = absl::StrCat("127.0.0.1:", testing::FreePort());
    setenv("KVCM_AGENT_TOKEN", kAgentToken, 1);
    agent_ = testing::Subprocess::Start(
        {KVCM_AGENT_PATH, "--agent_id=gpu-a", absl::StrCat("--manager_address=", manager_address_),
         absl::StrCat("--listen_address=", agent_address_), "--use_device=false",
         "--model=deepseek-v3", absl::StrCat("--capacity_bytes=", kBlocks * bpb_),
         "--heartbeat_interval_ms=100", absl::StrCat("--tls_cert_file=", certs_->Path("gpu-a.pem")),
         absl::StrCat("--tls_key_file=", certs_->Path("gpu-a.key")),
         absl::StrCat("--tls_ca_file=", certs_->Path("ca.pem")),
         absl::StrCat("--tokens_file=", tokens_)},
        log + "agent.log");
    unsetenv("KVCM_AGENT_TOKEN");
    ASSERT_NE(agent_, nullptr);
    acme_ = Connect(kAcmeToken);
    evil_ = Connect(kEvilToken);
    ASSERT_TRUE(acme_ && evil_);
    acme_agent_ = v1::BlockAgent::NewStub(acme_->channels().Open(agent_address_));
    evil_agent_ = v1::BlockAgent::NewStub(evil_->channels().Open(agent_address_));
    // Registered: the agent's Stats says so once the manager took it.
    ASSERT_TRUE(testing::WaitUntil(
        [&] {
          v1::BlockAgentStatsResponse s;
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
          if (!acme_agent_->Stats(&ctx, v1::BlockAgentStatsRequest(), &s).ok()) return false;
          epoch_ = s.epoch();
          return s.registered();
        },
        absl::Seconds(20)))
        << testing::ReadFile(log + "agent.log");
    ASSERT_TRUE(acme_->RegisterModel(acme_ns_, spec_).ok());
  }

  void TearDown() override {
    if (::testing::Test::HasFailure() && certs_ != nullptr) {
      std::cerr << "agent log:\n" << testing::ReadFile(certs_->Path("agent.log"));
    }
    if (agent_) agent_->Signal(SIGKILL);
    if (manager_) manager_->Signal(SIGKILL);
    if (agent_) (void)agent_->Finish(absl::Seconds(5));
    if (manager_) (void)manager_->Finish(absl::Seconds(5));
  }

  std::unique_ptr<Client> Connect(const std::string& token) {
    ClientOptions o;
    o.address = manager_address_;
    o.ca_file = certs_->Path("ca.pem");
    o.cert_file = certs_->Path("client.pem");
    o.key_file = certs_->Path("client.key");
    o.token = token;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Evil holds every free block; returns them with their generations.
  void EvilTakesEverything(std::vector<BlockId>* ids, std::vector<uint64_t>* gens) {
    v1::BlockAgentStatsResponse s;
    grpc::ClientContext ctx;
    ASSERT_TRUE(evil_agent_->Stats(&ctx, v1::BlockAgentStatsRequest(), &s).ok());
    ASSERT_GE(s.free_blocks(), 20u);
    ASSERT_TRUE(
        testing::AllocateTo(*evil_agent_, s.free_blocks(), epoch_, evil_ns_, ids, gens).ok());
  }

  // Acme allocates one block (the only free one), fills it with `fill` and inserts it as
  // the one page of its prompt `seed`. Returns the block.
  BlockId AcmeInsertsOnePage(char fill, int seed, std::vector<int32_t>* prompt) {
    std::vector<BlockId> ids;
    std::vector<uint64_t> gens;
    const grpc::Status a = testing::AllocateTo(*acme_agent_, 1, epoch_, acme_ns_, &ids, &gens);
    EXPECT_TRUE(a.ok()) << a.error_message();
    if (!a.ok()) return 0;
    EXPECT_TRUE(testing::WriteAll(*acme_agent_, ids, epoch_, std::string(bpb_, fill), gens).ok());
    prompt->assign(spec_.page_size_tokens, 0);
    for (size_t i = 0; i < prompt->size(); ++i) (*prompt)[i] = seed * 1000 + i;
    absl::StatusOr<InsertReply> r = acme_->Insert(acme_ns_, *prompt, PoolRef{"gpu-a", Tier::kGpu},
                                                  ids, {.agent_epoch = epoch_});
    EXPECT_TRUE(r.ok()) << r.status();
    return ids[0];
  }

  // Acme's Match finds `block` for `prompt`, and reading it returns `fill` only.
  void ExpectAcmeHolds(const std::vector<int32_t>& prompt, BlockId block, char fill) {
    absl::StatusOr<MatchReply> m = acme_->Match(acme_ns_, prompt, {.probe = true});
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->matched_pages, 1u);
    ASSERT_FALSE(m->segments.empty());
    ASSERT_FALSE(m->segments[0].replicas.empty());
    EXPECT_EQ(m->segments[0].replicas[0].block_ids[0], block);
    absl::StatusOr<std::string> got = testing::ReadAll(*acme_agent_, {&block, 1}, epoch_);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == std::string(bpb_, fill)) << "acme's page does not hold acme's bytes";
  }

  std::unique_ptr<testing::TestCerts> certs_;
  std::string tokens_;
  ModelSpec spec_;
  uint64_t bpb_ = 0;
  std::string manager_address_, agent_address_;
  std::unique_ptr<testing::Subprocess> manager_, agent_;
  std::unique_ptr<Client> acme_, evil_;
  std::unique_ptr<v1::BlockAgent::Stub> acme_agent_, evil_agent_;
  uint64_t epoch_ = 0;
  const NamespaceId acme_ns_{"acme", "deepseek-v3"};
  const NamespaceId evil_ns_{"evil", "deepseek-v3"};
};

// (a) B opens a WriteBlocks stream for its block, frees it, A allocates, writes and inserts
// it, B finishes its stream: ABORTED, and A's page holds A's bytes.
TEST_F(BlockReuseAttackTest, AStreamOpenedBeforeAFreeCannotWriteTheNextOwnersBlock) {
  std::vector<BlockId> evil_ids;
  std::vector<uint64_t> evil_gens;
  ASSERT_NO_FATAL_FAILURE(EvilTakesEverything(&evil_ids, &evil_gens));
  const BlockId target = evil_ids[0];
  grpc::ClientContext ctx;
  v1::WriteBlocksResponse resp;
  auto w = evil_agent_->WriteBlocks(&ctx, &resp);
  v1::WriteBlocksRequest msg;
  msg.mutable_header()->add_block_ids(target);
  msg.mutable_header()->add_block_generations(evil_gens[0]);
  msg.mutable_header()->set_owner_epoch(epoch_);
  ASSERT_TRUE(w->Write(msg));
  msg.set_data(std::string(1 << 20, 'B'));  // the first MiB: accepted, into evil's block
  ASSERT_TRUE(w->Write(msg));
  ASSERT_TRUE(testing::FreeAsWorker(*evil_agent_, {&target, 1}, epoch_, {&evil_gens[0], 1}).ok());

  std::vector<int32_t> prompt;
  const BlockId acme_block = AcmeInsertsOnePage('A', 1, &prompt);
  ASSERT_EQ(acme_block, target) << "acme got the block evil freed (the only free one)";

  // Evil finishes its stream: the rest of the block's bytes.
  bool open = true;
  for (uint64_t sent = 1 << 20; open && sent < bpb_; sent += 1 << 20) {
    msg.set_data(std::string(std::min<uint64_t>(1 << 20, bpb_ - sent), 'B'));
    open = w->Write(msg);
  }
  w->WritesDone();
  const grpc::Status st = w->Finish();
  // ABORTED at the first chunk the agent took after the Free: "was freed" (and, when it took
  // it after acme's Allocate, "and reallocated") "since generation N", naming nobody.
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("was freed"));
  EXPECT_THAT(st.error_message(), Not(HasSubstr("acme")));
  ExpectAcmeHolds(prompt, acme_block, 'A');
}

// (b) B reads 20 of its blocks, takes one chunk, frees the last; A allocates, writes and
// inserts it; B resumes: its stream ends ABORTED and never carries A's bytes.
TEST_F(BlockReuseAttackTest, AReadStreamNeverReachesTheNextOwnersBytes) {
  std::vector<BlockId> evil_ids;
  std::vector<uint64_t> evil_gens;
  ASSERT_NO_FATAL_FAILURE(EvilTakesEverything(&evil_ids, &evil_gens));
  evil_ids.resize(20);
  evil_gens.resize(20);
  for (size_t i = 0; i < evil_ids.size(); i += 4) {
    const size_t n = std::min<size_t>(4, evil_ids.size() - i);
    ASSERT_TRUE(testing::WriteAll(*evil_agent_, std::span(evil_ids).subspan(i, n), epoch_,
                                  std::string(n * bpb_, 'B'), std::span(evil_gens).subspan(i, n))
                    .ok());
  }
  // Evil still holds every block; the 20th becomes the pool's only free one.
  grpc::ClientContext ctx;
  v1::ReadBlocksRequest req;
  req.mutable_block_ids()->Add(evil_ids.begin(), evil_ids.end());
  req.mutable_block_generations()->Add(evil_gens.begin(), evil_gens.end());
  req.set_owner_epoch(epoch_);
  auto r = evil_agent_->ReadBlocks(&ctx, req);
  v1::ReadBlocksResponse chunk;
  ASSERT_TRUE(r->Read(&chunk));
  uint64_t received = chunk.data().size();
  const BlockId last = evil_ids.back();
  ASSERT_TRUE(testing::FreeAsWorker(*evil_agent_, {&last, 1}, epoch_, {&evil_gens.back(), 1}).ok());

  std::vector<int32_t> prompt;
  const BlockId acme_block = AcmeInsertsOnePage('A', 2, &prompt);
  ASSERT_EQ(acme_block, last) << "acme got the block evil freed (the only free one)";

  bool saw_acme = false;
  while (r->Read(&chunk)) {
    received += chunk.data().size();
    saw_acme |= chunk.data().find('A') != std::string::npos;
  }
  const grpc::Status st = r->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("was freed and reallocated"));
  EXPECT_FALSE(saw_acme) << "evil received acme's bytes";
  EXPECT_LE(received, 19 * bpb_) << "evil received bytes of the freed block";
  ExpectAcmeHolds(prompt, acme_block, 'A');
}

}  // namespace
}  // namespace kvcm
