// Agents named by their certificate (issues 26 and 35; docs/SECURITY.md "Agent identity"),
// end to end in process: a ManagerServer serving mutual TLS with a tokens file and
// agent_identity_dns_suffix, in-process agents whose pod certificates name
// <pod>.kvcm-agent.test.svc (no token mounted), and raw AgentControl and BlockAgent calls
// with certificates an attacker could get from the CA: a URI, an email or a common name under
// the suffix, two agents' names in one certificate. Also the Register epoch bound
// (max_agent_epoch_ahead_s). Every refusal checks its code and that nothing changed.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/in_process_cluster.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::kvcm::testing::kBlockBytes;
using ::kvcm::testing::TestCerts;
using ::kvcm::testing::WaitFor;
using ::testing::HasSubstr;

constexpr char kSuffix[] = ".kvcm-agent.test.svc";
constexpr uint64_t kBlocks = 8;

absl::Status ToAbsl(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::unique_ptr<ManagerServer> StartManager(const ServerOptions& o) {
  absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

std::unique_ptr<Agent> StartAgent(const AgentOptions& o) {
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? *std::move(agent) : nullptr;
}

// Certificates: pod-a and pod-b name their pod; the others are what the CA might also
// sign. Each name file is <identity>.pem / .key.
class AgentIdentityTest : public ::testing::Test {
 protected:
  // Certificates that must never be an agent, whatever agent id they claim.
  static constexpr const char* kNotAgents[] = {
      "uri",                        // URI:pod-a.kvcm-agent.test.svc only
      "email",                      // email:pod-a.kvcm-agent.test.svc only
      "pod-a.kvcm-agent.test.svc",  // common name only
      "two",                        // DNS names of pod-a and pod-b
  };

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestCerts>> made = TestCerts::Make(
        {"pod-a@pod-a.kvcm-agent.test.svc", "pod-b@pod-b.kvcm-agent.test.svc",
         "deep@x.pod-b.kvcm-agent.test.svc", "plain", "uri@URI:pod-a.kvcm-agent.test.svc",
         "email@email:pod-a.kvcm-agent.test.svc", "pod-a.kvcm-agent.test.svc",
         "two@pod-a.kvcm-agent.test.svc,pod-b.kvcm-agent.test.svc",
         "twice@pod-a.kvcm-agent.test.svc,other.svc,pod-a.kvcm-agent.test.svc"});
    ASSERT_TRUE(made.ok()) << made.status();
    certs_ = *std::move(made);
    tokens_ = certs_->Path("tokens");
    {
      std::ofstream out(tokens_);
      out << Sha256Hex("ops-token-01234567890") << " ops roles=admin\n"
          << Sha256Hex("acme-token-0123456789") << " acme roles=worker tenant=acme\n";
    }
    ServerOptions o;
    o.listen_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.shutdown_grace_ms = 100;
    o.tls.cert_file = certs_->Path("manager.pem");
    o.tls.key_file = certs_->Path("manager.key");
    o.tls.ca_file = certs_->Path("ca.pem");
    o.tls.reload_interval_s = 1;
    o.tokens_file = tokens_;
    o.agent_identity_dns_suffix = kSuffix;
    manager_ = StartManager(o);
    ASSERT_NE(manager_, nullptr);
    ClientOptions ops;
    ops.address = manager_->address();
    ops.max_attempts = 1;
    ops.default_deadline_ms = 5'000;
    ops.ca_file = certs_->Path("ca.pem");
    ops.cert_file = certs_->Path("client.pem");
    ops.key_file = certs_->Path("client.key");
    ops.token = "ops-token-01234567890";
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(ops);
    ASSERT_TRUE(client.ok()) << client.status();
    ops_ = *std::move(client);
  }

  // An in-process agent `agent_id` with certificate `identity` and no token.
  AgentOptions AgentOf(const std::string& identity, const std::string& agent_id) {
    AgentOptions o;
    o.agent_id = agent_id;
    o.manager_address = manager_->address();
    o.use_device = false;
    o.capacity_bytes = kBlocks * kBlockBytes;
    o.heartbeat_interval_ms = 20;
    o.tls.cert_file = certs_->Path(identity + ".pem");
    o.tls.key_file = certs_->Path(identity + ".key");
    o.tls.ca_file = certs_->Path("ca.pem");
    o.tls.reload_interval_s = 1;
    return o;
  }

  std::shared_ptr<grpc::Channel> Channel(const std::string& identity, const std::string& address,
                                         const std::string& token = "") {
    absl::StatusOr<ChannelFactory> channels =
        ChannelFactory::Create(certs_->Identity(identity), token);
    EXPECT_TRUE(channels.ok()) << channels.status();
    return channels.ok() ? channels->Open(address) : nullptr;
  }

  // A Register the manager would accept from agent `agent_id` (a pool of deepseek-v3 pages)
  // with `epoch`, naming `address` as its BlockAgent and data address.
  static v1::RegisterAgentRequest Registration(const std::string& agent_id, uint64_t epoch,
                                               const std::string& address = "evil.test:1") {
    v1::RegisterAgentRequest req;
    req.set_agent_id(agent_id);
    req.set_device("host");
    req.set_tier(v1::TIER_GPU);
    absl::StatusOr<ModelSpec> spec = FindModel("deepseek-v3");
    EXPECT_TRUE(spec.ok());
    ModelSpecToProto(*spec, req.mutable_geometry()->mutable_spec());
    req.mutable_geometry()->set_bytes_per_block(spec->BytesPerPage());
    req.mutable_geometry()->set_num_blocks(4);
    req.set_capacity_bytes(4 * spec->BytesPerPage());
    req.set_block_agent_address(address);
    req.set_data_address(address);
    req.set_transport("tcp");
    req.set_epoch(epoch);
    return req;
  }

  // Register `req` from certificate `identity` (with bearer `token`, empty: none).
  absl::Status Register(const std::string& identity, const v1::RegisterAgentRequest& req,
                        const std::string& token = "") {
    auto stub = v1::AgentControl::NewStub(Channel(identity, manager_->address(), token));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RegisterAgentResponse resp;
    return ToAbsl(stub->Register(&ctx, req, &resp));
  }

  // Heartbeat as `agent_id` from certificate `identity`, with bearer `token` (empty: none).
  absl::Status Heartbeat(const std::string& identity, const std::string& agent_id,
                         const std::string& token = "") {
    auto stub = v1::AgentControl::NewStub(Channel(identity, manager_->address(), token));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::HeartbeatRequest req;
    req.set_agent_id(agent_id);
    req.set_epoch(1);
    v1::HeartbeatResponse resp;
    return ToAbsl(stub->Heartbeat(&ctx, req, &resp));
  }

  std::vector<ManagerStats::Agent> Agents() {
    absl::StatusOr<ManagerStats> stats = ops_->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? stats->agents : std::vector<ManagerStats::Agent>{};
  }

  std::unique_ptr<TestCerts> certs_;
  std::string tokens_;
  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Client> ops_;
};

TEST_F(AgentIdentityTest, AnAgentWithoutATokenRegistersAsItsCertificatesPerGpuIds) {
  std::unique_ptr<Agent> gpu3 = StartAgent(AgentOf("pod-a", "pod-a-gpu3"));
  std::unique_ptr<Agent> whole = StartAgent(AgentOf("pod-a", "pod-a"));
  // The same DNS name twice (and one outside the suffix) is still one agent.
  std::unique_ptr<Agent> twice = StartAgent(AgentOf("twice", "pod-a-gpu1"));
  ASSERT_TRUE(gpu3 && whole && twice);
  ASSERT_TRUE(
      WaitFor([&] { return gpu3->registered() && whole->registered() && twice->registered(); }));
  EXPECT_EQ(Agents().size(), 3u);
}

TEST_F(AgentIdentityTest, ACertificateActsAsNoOtherAgentAndChangesNothing) {
  for (const char* other : {"pod-b", "pod-a-gpu256", "pod-a-gpu03", "pod-ab", "pod-a-gpu1x"}) {
    absl::Status s = Heartbeat("pod-a", other);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << other << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("certificate pod-a.kvcm-agent.test.svc"));
  }
  // An agent process refused likewise never registers.
  std::unique_ptr<Agent> impostor = StartAgent(AgentOf("pod-a", "pod-b-gpu0"));
  ASSERT_NE(impostor, nullptr);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(impostor->registered());
  EXPECT_TRUE(Agents().empty());
}

TEST_F(AgentIdentityTest, OnlyOneDnsLabelBeforeTheSuffixNamesAnAgent) {
  // x.pod-b.kvcm-agent.test.svc: two labels, no agent; a certificate of no such name either.
  EXPECT_EQ(Heartbeat("deep", "x.pod-b").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Heartbeat("deep", "pod-b").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Heartbeat("plain", "plain").code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(AgentIdentityTest, ABearerTokenDecidesAloneOverTheCertificate) {
  // A worker's token on the agent's certificate: a worker, which may not act as an agent.
  absl::Status s = Heartbeat("pod-a", "pod-a", "acme-token-0123456789");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("acme"));
  EXPECT_EQ(Heartbeat("pod-a", "pod-a", "unknown-token-0123456").code(),
            absl::StatusCode::kUnauthenticated);
}

// The adversary's report (issue 35): a URI, email or common name under the suffix, or a
// certificate naming two agents, registered as the real agent, redirected its peers' pulls
// and locked it out with a huge epoch. None of them is an agent: UNAUTHENTICATED (the
// certificate proves no principal, as one of no agent name), refused before the handler.
TEST_F(AgentIdentityTest, AUriEmailCommonNameOrTwoAgentCertificateIsNoAgent) {
  std::unique_ptr<Agent> real = StartAgent(AgentOf("pod-a", "pod-a"));
  ASSERT_NE(real, nullptr);
  ASSERT_TRUE(WaitFor([&] { return real->registered(); }));
  const uint64_t epoch = real->epoch();
  const std::vector<ManagerStats::Agent> before = Agents();
  ASSERT_EQ(before.size(), 1u);

  for (const char* identity : kNotAgents) {
    for (const char* id : {"pod-a", "pod-a-gpu0", "pod-b"}) {
      absl::Status s = Register(identity, Registration(id, epoch + 1'000'000));
      EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << identity << " as " << id << s;
      s = Heartbeat(identity, id);
      EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << identity << " as " << id << s;
    }
  }
  EXPECT_THAT(std::string(Heartbeat("two", "pod-a").message()),
              HasSubstr("names 2 agents under .kvcm-agent.test.svc (pod-a, pod-b)"));
  EXPECT_THAT(std::string(Heartbeat("uri", "pod-a").message()), HasSubstr("no bearer token"));

  // pod-a is as it was: its epoch and addresses, still heartbeating.
  const std::vector<ManagerStats::Agent> after = Agents();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].agent_id, "pod-a");
  EXPECT_EQ(after[0].epoch, epoch);
  EXPECT_EQ(after[0].block_agent_address, before[0].block_agent_address);
  EXPECT_EQ(after[0].data_address, before[0].data_address);
  EXPECT_EQ(real->epoch(), epoch);
  EXPECT_TRUE(real->registered());

  // An agent process with such a certificate never registers.
  std::unique_ptr<Agent> impostor = StartAgent(AgentOf("uri", "pod-b"));
  ASSERT_NE(impostor, nullptr);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(impostor->registered());
  EXPECT_EQ(Agents().size(), 1u);
}

// On an agent's own BlockAgent port the same rule decides who is a peer agent (which may
// read and free any block): pod-b's certificate is, the others are UNAUTHENTICATED and
// allocate nothing.
TEST_F(AgentIdentityTest, OnABlockAgentPortOnlyADnsNameMakesAPeer) {
  AgentOptions o = AgentOf("pod-a", "pod-a");
  o.tokens_file = tokens_;
  o.agent_identity_dns_suffix = kSuffix;
  std::unique_ptr<Agent> agent = StartAgent(o);
  ASSERT_NE(agent, nullptr);
  ASSERT_TRUE(WaitFor([&] { return agent->registered(); }));

  auto allocate = [&](const std::string& identity) {
    auto stub = v1::BlockAgent::NewStub(Channel(identity, agent->address()));
    v1::AllocateBlocksRequest req;  // no namespace: only agents and admins may
    req.set_count(2);
    req.set_owner_epoch(agent->epoch());
    v1::AllocateBlocksResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ToAbsl(stub->Allocate(&ctx, req, &resp));
  };
  const uint64_t free_before = agent->pool().Stats().free_blocks;
  for (const char* identity : kNotAgents) {
    absl::Status s = allocate(identity);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << identity << ": " << s;
    auto stub = v1::BlockAgent::NewStub(Channel(identity, agent->address()));
    grpc::ClientContext ctx;
    v1::BlockAgentStatsResponse resp;
    EXPECT_EQ(stub->Stats(&ctx, v1::BlockAgentStatsRequest(), &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED)
        << identity;
  }
  EXPECT_EQ(agent->pool().Stats().free_blocks, free_before);
  EXPECT_THAT(std::string(allocate("two").message()), HasSubstr("names 2 agents"));
  // The peer agent pod-b (and pod-a's own GPU agents) may.
  EXPECT_TRUE(allocate("pod-b").ok());
  EXPECT_TRUE(allocate("twice").ok());
  EXPECT_EQ(agent->pool().Stats().free_blocks, free_before - 4);
}

// An epoch is the agent's start time in microseconds: one far ahead of the manager's clock
// would lock the real agent out for good (each retry frees its blocks and still loses).
// Refused OUT_OF_RANGE naming `epoch`, with nothing changed; the real agent registers.
TEST_F(AgentIdentityTest, AnEpochFarAheadOfTheClockIsRefusedAndChangesNothing) {
  const uint64_t now_us = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  const uint64_t far = now_us + 3'600'000'000;  // an hour ahead; the bound is 300 s
  // With pod-a's own certificate (a bug, or its stolen key): before the agent starts ...
  absl::Status s = Register("pod-a", Registration("pod-a", far));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::StartsWith(absl::StrCat("epoch ", far)));
  EXPECT_THAT(std::string(s.message()), HasSubstr("5m ahead of the manager's clock"));
  EXPECT_TRUE(Agents().empty());

  // ... the real agent registers fine; and after, nothing of it changes.
  std::unique_ptr<Agent> real = StartAgent(AgentOf("pod-a", "pod-a"));
  ASSERT_NE(real, nullptr);
  ASSERT_TRUE(WaitFor([&] { return real->registered(); }));
  const uint64_t epoch = real->epoch();
  const std::vector<ManagerStats::Agent> before = Agents();
  ASSERT_EQ(before.size(), 1u);
  for (uint64_t ahead : {far, std::numeric_limits<uint64_t>::max()}) {
    s = Register("pod-a", Registration("pod-a", ahead));
    EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  }
  absl::SleepFor(absl::Milliseconds(200));  // ~10 heartbeats of the real agent
  const std::vector<ManagerStats::Agent> after = Agents();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].epoch, epoch);
  EXPECT_EQ(after[0].block_agent_address, before[0].block_agent_address);
  EXPECT_TRUE(after[0].alive);
  EXPECT_EQ(real->epoch(), epoch);
  EXPECT_TRUE(real->registered());

  // An epoch within the bound (a restart on a host whose clock runs a minute ahead) is taken.
  EXPECT_TRUE(Register("pod-a", Registration("pod-a-gpu0", now_us + 60'000'000)).ok());
}

TEST(AgentIdentityOptionsTest, TheSuffixNeedsTokensAndClientCertificates) {
  ServerOptions o;
  o.tls.cert_file = "manager.pem";
  o.tls.key_file = "manager.key";
  o.tls.ca_file = "ca.pem";
  o.agent_identity_dns_suffix = kSuffix;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("needs tokens_file"));
  o.tokens_file = "tokens";
  o.tls.ca_file.clear();
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("needs tls_ca_file"));
  o.tls.ca_file = "ca.pem";
  o.agent_identity_dns_suffix = "kvcm-agent.test.svc";
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("must start with '.'"));
}

}  // namespace
}  // namespace kvcm
