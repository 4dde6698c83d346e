// Transport security end to end, in process: a ManagerServer serving mutual TLS, in-process
// agents (host pools, TCP transport) with certificates of the cluster CA, and the real
// client. Which clients the manager and the agents serve and refuse, a certificate rotated
// on disk, options that cannot start; agents that register over mTLS and whose committed
// pages a worker's Match finds; a Fetch whose bytes cross the TLS data port; the agent's
// bearer token on every AgentControl call (a stand-in AgentControl records it), read from
// --token_file in process and from $KVCM_AGENT_TOKEN by a kvcm-agent process.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gpu/agent/transport/data_tls.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_pools.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/block_agent_calls.h"
#include "tests/util/child_process.h"
#include "tests/util/in_process_cluster.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::kvcm::testing::AllocateIn;
using ::kvcm::testing::Bytes;
using ::kvcm::testing::kBlockBytes;
using ::kvcm::testing::ReadAll;
using ::kvcm::testing::TestCerts;
using ::kvcm::testing::Tokens;
using ::kvcm::testing::WaitFor;
using ::kvcm::testing::WriteAll;
using ::testing::HasSubstr;

constexpr uint64_t kBlocks = 8;

// A certificate set shared by the tests of this binary (making one takes ~0.2 s); the
// rotation test makes its own, as it overwrites files.
TestCerts& SharedCerts() {
  static TestCerts* const certs = [] {
    absl::StatusOr<std::unique_ptr<TestCerts>> made = TestCerts::Make({"gpu-a", "gpu-b"});
    if (!made.ok()) {
      ADD_FAILURE() << made.status();
      std::abort();
    }
    return made->release();
  }();
  return *certs;
}

// The manager's options: TLS with its certificate, mutual when `mtls`.
ServerOptions ManagerTls(const TestCerts& certs, bool mtls = true) {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  o.tls.cert_file = certs.Path("manager.pem");
  o.tls.key_file = certs.Path("manager.key");
  if (mtls) o.tls.ca_file = certs.Path("ca.pem");
  o.tls.reload_interval_s = 1;
  return o;
}

std::unique_ptr<ManagerServer> StartManager(const ServerOptions& o) {
  absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

// Client options for `address` as identity `identity` (empty: no certificate) trusting `ca`.
ClientOptions ClientTls(const TestCerts& certs, const std::string& address,
                        const std::string& identity = "client", const std::string& ca = "ca") {
  ClientOptions o;
  o.address = address;
  o.max_attempts = 1;
  o.default_deadline_ms = 5'000;
  o.ca_file = certs.Path(ca + ".pem");
  if (!identity.empty()) {
    o.cert_file = certs.Path(identity + ".pem");
    o.key_file = certs.Path(identity + ".key");
  }
  return o;
}

ClientOptions Plaintext(const std::string& address) {
  return ClientOptions{.address = address, .max_attempts = 1, .insecure = true};
}

// Stats through a client made of `options`: the call's code.
absl::StatusCode StatsCode(const ClientOptions& options) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return absl::StatusCode::kInternal;
  return (*client)->Stats().status().code();
}

// An agent with certificate `identity` (trusting ca.pem) of the manager at `manager`.
AgentOptions AgentTls(const TestCerts& certs, const std::string& identity,
                      const std::string& manager, const std::string& agent_id) {
  AgentOptions o;
  o.agent_id = agent_id;
  o.manager_address = manager;
  o.use_device = false;
  o.capacity_bytes = kBlocks * kBlockBytes;
  o.heartbeat_interval_ms = 20;
  o.tls.cert_file = certs.Path(identity + ".pem");
  o.tls.key_file = certs.Path(identity + ".key");
  o.tls.ca_file = certs.Path("ca.pem");
  o.tls.reload_interval_s = 1;
  return o;
}

std::unique_ptr<Agent> StartAgent(const AgentOptions& o) {
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? *std::move(agent) : nullptr;
}

TEST(TlsManagerTest, MutualTlsServesAClientWithTheCaAndACertificateAndNoOther) {
  TestCerts& certs = SharedCerts();
  std::unique_ptr<ManagerServer> manager = StartManager(ManagerTls(certs));
  ASSERT_NE(manager, nullptr);
  const std::string address = manager->address();
  EXPECT_EQ(StatsCode(ClientTls(certs, address)), absl::StatusCode::kOk);
  EXPECT_EQ(StatsCode(ClientTls(certs, address, "gpu-a")), absl::StatusCode::kOk);
  // Plaintext; a certificate of the untrusted CA; no certificate; not trusting the manager.
  EXPECT_EQ(StatsCode(Plaintext(address)), absl::StatusCode::kUnavailable);
  EXPECT_EQ(StatsCode(ClientTls(certs, address, "untrusted")), absl::StatusCode::kUnavailable);
  EXPECT_EQ(StatsCode(ClientTls(certs, address, "")), absl::StatusCode::kUnavailable);
  EXPECT_EQ(StatsCode(ClientTls(certs, address, "client", "untrusted-ca")),
            absl::StatusCode::kUnavailable);
}

TEST(TlsManagerTest, TlsWithoutACaServesClientsWithoutACertificate) {
  TestCerts& certs = SharedCerts();
  std::unique_ptr<ManagerServer> manager = StartManager(ManagerTls(certs, /*mtls=*/false));
  ASSERT_NE(manager, nullptr);
  EXPECT_EQ(StatsCode(ClientTls(certs, manager->address(), "")), absl::StatusCode::kOk);
  EXPECT_EQ(StatsCode(Plaintext(manager->address())), absl::StatusCode::kUnavailable);
}

TEST(TlsManagerTest, ARotatedCertificateServesNewConnectionsWithoutARestart) {
  absl::StatusOr<std::unique_ptr<TestCerts>> own = TestCerts::Make({});
  ASSERT_TRUE(own.ok()) << own.status();
  TestCerts& certs = **own;
  std::unique_ptr<ManagerServer> manager = StartManager(ManagerTls(certs));
  ASSERT_NE(manager, nullptr);
  const ClientOptions trusts_ca = ClientTls(certs, manager->address());
  // A client that trusts only the untrusted CA, yet holds a certificate the manager trusts.
  ClientOptions trusts_other = trusts_ca;
  trusts_other.ca_file = certs.Path("untrusted-ca.pem");
  ASSERT_EQ(StatsCode(trusts_ca), absl::StatusCode::kOk);
  ASSERT_EQ(StatsCode(trusts_other), absl::StatusCode::kUnavailable);

  ASSERT_TRUE(certs.Replace("manager", "untrusted").ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(15);
  while (StatsCode(trusts_other) != absl::StatusCode::kOk && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(StatsCode(trusts_other), absl::StatusCode::kOk);
  EXPECT_EQ(StatsCode(trusts_ca), absl::StatusCode::kUnavailable);
}

TEST(TlsManagerTest, OptionsThatCannotServeSecurelyDoNotStart) {
  TestCerts& certs = SharedCerts();
  ServerOptions none = ManagerTls(certs);
  none.tls.cert_file = none.tls.key_file = none.tls.ca_file = "";
  absl::Status s = ManagerServer::Start(none).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("--tls_cert_file and --tls_key_file"));
  EXPECT_THAT(s.message(), HasSubstr("--insecure"));

  ServerOptions missing = ManagerTls(certs);
  missing.tls.cert_file = certs.Path("nope.pem");
  s = ManagerServer::Start(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("tls_cert_file \"", certs.Path("nope.pem"),
                                                  "\": cannot open: No such file")));

  ServerOptions mismatched = ManagerTls(certs);
  mismatched.tls.key_file = certs.Path("client.key");
  s = ManagerServer::Start(mismatched).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tls_key_file"));
  EXPECT_THAT(s.message(), HasSubstr("is not the key of cert_file"));
}

// A manager serving mutual TLS, agents gpu-a and gpu-b with their certificates, and a
// worker client with its own.
class TlsClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    manager_ = StartManager(ManagerTls(certs_));
    ASSERT_NE(manager_, nullptr);
    a_ = StartAgent(AgentTls(certs_, "gpu-a", manager_->address(), "gpu-a"));
    b_ = StartAgent(AgentTls(certs_, "gpu-b", manager_->address(), "gpu-b"));
    ASSERT_NE(a_, nullptr);
    ASSERT_NE(b_, nullptr);
    ASSERT_TRUE(WaitFor([&] { return a_->registered() && b_->registered(); }))
        << "the agents did not register over mutual TLS";
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(ClientTls(certs_, manager_->address()));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    spec_ = a_->pool().geometry().spec;
    absl::StatusOr<RegisterModelReply> reg = client_->RegisterModel(ns_, spec_);
    ASSERT_TRUE(reg.ok()) << reg.status();
    fingerprint_ = reg->key_fingerprint;
    // BlockAgent over mutual TLS with the worker's certificate.
    ba_ = v1::BlockAgent::NewStub(client_->channels().Open(a_->address()));
    bb_ = v1::BlockAgent::NewStub(client_->channels().Open(b_->address()));
  }

  // Caches `pages` pages of prompt `seed` on A with known bytes; returns the bytes.
  std::string CacheOnA(int seed, size_t pages) {
    const std::vector<int32_t> tokens = Tokens(pages, spec_.page_size_tokens, seed);
    const std::vector<BlockId> blocks = AllocateIn(*ba_, pages, a_->epoch(), ns_);
    const std::string bytes = Bytes(pages * a_->pool().geometry().bytes_per_block(), seed);
    EXPECT_TRUE(WriteAll(*ba_, blocks, a_->epoch(), bytes).ok());
    absl::StatusOr<InsertReply> inserted =
        client_->Insert(ns_, tokens, PoolRef{"gpu-a", Tier::kGpu}, blocks);
    EXPECT_TRUE(inserted.ok()) << inserted.status();
    return bytes;
  }

  // The blocks each agent holds for prompt `seed`, by agent id (a worker's probing Match).
  std::map<std::string, std::vector<BlockId>> Replicas(int seed, size_t pages) {
    absl::StatusOr<MatchReply> m =
        client_->Match(ns_, Tokens(pages, spec_.page_size_tokens, seed), {.probe = true});
    EXPECT_TRUE(m.ok()) << m.status();
    std::map<std::string, std::vector<BlockId>> out;
    if (!m.ok()) return out;
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        auto& blocks = out[r.pool.agent_id];
        blocks.insert(blocks.end(), r.block_ids.begin(), r.block_ids.end());
      }
    }
    return out;
  }

  TestCerts& certs_ = SharedCerts();
  std::unique_ptr<ManagerServer> manager_;
  std::unique_ptr<Agent> a_, b_;
  std::unique_ptr<Client> client_;
  const NamespaceId ns_{"acme", "deepseek-v3"};
  ModelSpec spec_;
  uint64_t fingerprint_ = 0;
  std::unique_ptr<v1::BlockAgent::Stub> ba_, bb_;
};

TEST_F(TlsClusterTest, AgentsRegisterOverMutualTlsAndAWorkerMatchFindsTheirPages) {
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->agents.size(), 2u);
  CacheOnA(1, 3);  // committed through the agent's Commands stream, over mTLS
  const std::vector<BlockId> on_a = Replicas(1, 3)["gpu-a"];
  EXPECT_EQ(on_a.size(), 3u);
  EXPECT_EQ(a_->pool().Stats().committed_blocks, 3u);
}

TEST_F(TlsClusterTest, AFetchCrossesTheTlsDataPortBitForBit) {
  const std::string bytes = CacheOnA(2, 3);
  const std::vector<BlockId> on_a = Replicas(2, 3)["gpu-a"];
  ASSERT_EQ(on_a.size(), 3u);
  absl::StatusOr<std::vector<PageHash>> hashes =
      client_->HashPrompt(ns_, Tokens(3, spec_.page_size_tokens, 2));
  ASSERT_TRUE(hashes.ok()) << hashes.status();
  v1::FetchRequest req =
      testing::FetchRequestFor(ns_, *hashes, spec_.page_size_tokens, fingerprint_, "gpu-a", on_a);
  v1::FetchResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::Status s = bb_->Fetch(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.fetched_pages(), 3u);
  const std::vector<BlockId> on_b(resp.block_ids().begin(), resp.block_ids().end());
  absl::StatusOr<std::string> copy = ReadAll(*bb_, on_b, b_->epoch());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(*copy == bytes) << "B's copy differs from A's bytes";
  EXPECT_EQ(Replicas(2, 3)["gpu-b"], on_b);
}

TEST_F(TlsClusterTest, ADataPortPeerWithoutACertificateOfTheCaGetsNothing) {
  CacheOnA(3, 2);
  const std::vector<BlockId> on_a = Replicas(3, 2)["gpu-a"];
  ASSERT_EQ(on_a.size(), 2u);
  // A would-be agent holding a certificate of the untrusted CA pulls from A's data port.
  TlsOptions stranger_tls = certs_.Identity("untrusted");
  absl::StatusOr<std::shared_ptr<DataTls>> stranger_data = DataTls::Create(stranger_tls);
  ASSERT_TRUE(stranger_data.ok()) << stranger_data.status();
  std::unique_ptr<BlockPool> pool = MakeHostPool(spec_, 4);
  std::unique_ptr<Transport> stranger = *MakeTcpTransport(
      {.io_timeout_ms = 2'000, .tls = *stranger_data}, AgentPools{.main = pool.get()}, Tier::kGpu);
  absl::StatusOr<std::vector<PageHash>> hashes =
      client_->HashPrompt(ns_, Tokens(2, spec_.page_size_tokens, 3));
  ASSERT_TRUE(hashes.ok());
  PullSpec spec{.peer_address = a_->data_address(),
                .peer_tier = Tier::kGpu,
                .ns = ns_,
                .peer_blocks = on_a,
                .pages = *hashes,
                .dst = pool.get(),
                .dst_blocks = *pool->Allocate(2, 1, &ns_),
                .dst_owner_epoch = 1};
  absl::Notification done;
  absl::StatusOr<TransferStats> result = absl::InternalError("no outcome");
  stranger->Pull(spec, [&](absl::StatusOr<TransferStats> r) {
    result = std::move(r);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
}

TEST_F(TlsClusterTest, BlockAgentRefusesClientsWithoutACertificateOfTheCa) {
  for (const TlsOptions& tls : {certs_.TrustOnly(), certs_.Identity("untrusted")}) {
    absl::StatusOr<ChannelFactory> channels = ChannelFactory::Create(tls);
    ASSERT_TRUE(channels.ok()) << channels.status();
    auto stub = v1::BlockAgent::NewStub(channels->Open(a_->address()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::BlockAgentStatsResponse resp;
    EXPECT_EQ(stub->Stats(&ctx, v1::BlockAgentStatsRequest(), &resp).error_code(),
              grpc::StatusCode::UNAVAILABLE)
        << tls.cert_file;
  }
  auto plain = v1::BlockAgent::NewStub(MakeInsecureChannel(a_->address()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::BlockAgentStatsResponse resp;
  EXPECT_EQ(plain->Stats(&ctx, v1::BlockAgentStatsRequest(), &resp).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsClusterTest, AnAgentWithACertificateOfAnotherCaNeverRegisters) {
  std::unique_ptr<Agent> stranger =
      StartAgent(AgentTls(certs_, "untrusted", manager_->address(), "gpu-x"));
  ASSERT_NE(stranger, nullptr);
  absl::SleepFor(absl::Milliseconds(500));  // ~25 registration attempts
  EXPECT_FALSE(stranger->registered());
  absl::StatusOr<ManagerStats> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->agents.size(), 2u);
}

// AgentControl that answers every call (Commands stays open) and records, per method, the
// authorization metadata it came with.
class RecordingAgentControl final : public v1::AgentControl::Service {
 public:
  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterAgentRequest*,
                        v1::RegisterAgentResponse*) override {
    Record("Register", *ctx);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override {
    Record("Heartbeat", *ctx);
    return grpc::Status::OK;
  }
  grpc::Status Commands(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::AgentCommand, v1::AgentCommandAck>* stream) override {
    Record("Commands", *ctx);
    v1::AgentCommandAck ack;
    while (stream->Read(&ack)) {
    }
    return grpc::Status::OK;
  }

  // "Method authorization" lines seen so far (each distinct one once).
  std::set<std::string> Seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  void Record(absl::string_view method, const grpc::ServerContext& ctx) {
    std::string auth = "(none)";
    auto it = ctx.client_metadata().find(std::string(kAuthorizationKey));
    if (it != ctx.client_metadata().end()) auth.assign(it->second.data(), it->second.size());
    absl::MutexLock lock(&mu_);
    seen_.insert(absl::StrCat(method, " ", auth));
  }

  absl::Mutex mu_;
  std::set<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

class AgentTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", MakeInsecureServerCredentials(), &port_);
    builder.RegisterService(&control_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  }

  // Whether every method of the control loop and the command loop was called with `auth`.
  bool SawEveryCallWith(const std::string& auth) {
    const std::set<std::string> seen = control_.Seen();
    for (const char* method : {"Register", "Heartbeat", "Commands"}) {
      if (seen.count(absl::StrCat(method, " ", auth)) == 0) return false;
    }
    return true;
  }

  RecordingAgentControl control_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(AgentTokenTest, TheTokenFileGoesWithEveryAgentControlCall) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/agent_token_", getpid());
  std::ofstream(path) << "agent-secret-1\n";
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "gpu-t";
  o.manager_address = absl::StrCat("127.0.0.1:", port_);
  o.use_device = false;
  o.capacity_bytes = kBlocks * kBlockBytes;
  o.heartbeat_interval_ms = 20;
  o.token_file = path;
  std::unique_ptr<Agent> agent = StartAgent(o);
  ASSERT_NE(agent, nullptr);
  EXPECT_TRUE(WaitFor([&] { return SawEveryCallWith("Bearer agent-secret-1"); }))
      << ::testing::PrintToString(control_.Seen());
  agent->Shutdown();
  for (const std::string& line : control_.Seen()) {
    EXPECT_THAT(line, HasSubstr("Bearer agent-secret-1")) << "a call without the token";
  }
  std::remove(path.c_str());
}

TEST_F(AgentTokenTest, AKvcmAgentProcessSendsTheTokenOfItsEnvironment) {
  setenv("KVCM_AGENT_TOKEN", "agent-secret-env", 1);
  std::unique_ptr<testing::Subprocess> agent = testing::Subprocess::Start(
      {KVCM_AGENT_PATH, "--insecure", "--agent_id=gpu-e",
       absl::StrCat("--manager_address=127.0.0.1:", port_), "--use_device=false",
       "--model=deepseek-v3", "--capacity_bytes=50000000", "--heartbeat_interval_ms=50"});
  unsetenv("KVCM_AGENT_TOKEN");
  ASSERT_NE(agent, nullptr);
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!SawEveryCallWith("Bearer agent-secret-env") && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(SawEveryCallWith("Bearer agent-secret-env"))
      << ::testing::PrintToString(control_.Seen());
  agent->Signal(SIGTERM);
  testing::ProcessResult r = agent->Finish(absl::Seconds(10));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("agent-secret-env"))) << "the token was logged";
}

}  // namespace
}  // namespace kvcm

namespace kvcm {
namespace {

// Issue 10's attacks again, with TLS on and through the real client: a manager serving mutual
// TLS with a tokens file; "evil" holds a valid certificate and a valid worker token of its own
// tenant, and tries acme's namespace, pins and cache. Every attempt fails with the right code
// and acme's pages, pin and stats stay as they were.
TEST(TlsTenantTest, AValidCertificateAndTokenOfAnotherTenantGetNothingOfAcme) {
  TestCerts& certs = SharedCerts();
  const std::string tokens = certs.Path("tenant_tokens");
  {
    std::ofstream out(tokens);
    out << Sha256Hex("acme-token-0123456789") << " acme-vllm roles=worker tenant=acme\n"
        << Sha256Hex("evil-token-0123456789") << " evil-vllm roles=worker tenant=evil\n"
        << Sha256Hex("ops-token-01234567890") << " ops roles=admin\n";
  }
  ServerOptions o = ManagerTls(certs);
  o.tokens_file = tokens;
  std::unique_ptr<ManagerServer> manager = StartManager(o);
  ASSERT_NE(manager, nullptr);
  auto connect = [&](const std::string& token) {
    ClientOptions c = ClientTls(certs, manager->address());
    c.token = token;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(c);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  };
  std::unique_ptr<Client> acme = connect("acme-token-0123456789");
  std::unique_ptr<Client> evil = connect("evil-token-0123456789");
  std::unique_ptr<Client> ops = connect("ops-token-01234567890");
  std::unique_ptr<Client> nobody = connect("");
  ASSERT_TRUE(acme && evil && ops && nobody);

  const NamespaceId acme_ns{"acme", "deepseek-v3"}, evil_ns{"evil", "deepseek-v3"};
  ModelSpec spec = *FindModel("deepseek-v3");
  const std::vector<int32_t> prompt = Tokens(4, spec.page_size_tokens, 11);
  const std::vector<BlockId> blocks = {1, 2, 3, 4};
  const PoolRef pool{"index-pool", Tier::kGpu};
  ASSERT_TRUE(acme->RegisterModel(acme_ns, spec).ok());
  ASSERT_TRUE(evil->RegisterModel(evil_ns, spec).ok());
  // Workers cannot make up pools; the operator creates an index-only one.
  absl::StatusOr<InsertReply> made_up = acme->Insert(acme_ns, prompt, pool, blocks);
  EXPECT_EQ(made_up.status().code(), absl::StatusCode::kNotFound) << made_up.status();
  ASSERT_TRUE(ops->RegisterModel(acme_ns, spec).ok());
  ASSERT_TRUE(ops->Insert(acme_ns, std::span(prompt).first(spec.page_size_tokens), pool,
                          std::span(blocks).first(1))
                  .ok());
  ASSERT_TRUE(acme->Insert(acme_ns, prompt, pool, blocks).ok());
  absl::StatusOr<MatchReply> pinned = acme->Match(acme_ns, prompt, {.pin = true});
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  ASSERT_EQ(pinned->matched_pages, 4u);
  const absl::StatusOr<ManagerStats> before = ops->Stats();
  ASSERT_TRUE(before.ok());

  // No token: nothing at all.
  EXPECT_EQ(nobody->Stats().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(nobody->Match(acme_ns, prompt, {.probe = true}).status().code(),
            absl::StatusCode::kUnauthenticated);
  // evil: acme's hash key, a probe with the right guess, acme's pin, eviction, acme's stats.
  absl::Status s = evil->RegisterModel(acme_ns, spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("evil-vllm"));
  s = evil->Match(acme_ns, prompt, {.probe = true}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  s = evil->Release(acme_ns, pinned->pin_id);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(evil->Release(evil_ns, pinned->pin_id).code(), absl::StatusCode::kNotFound);
  s = evil->EvictFromNamespace(acme_ns, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  s = evil->EvictFromPool(pool, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  s = evil->DeleteNamespace(acme_ns).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  absl::StatusOr<ManagerStats> evil_view = evil->Stats();
  ASSERT_TRUE(evil_view.ok());
  for (const ManagerStats::Namespace& n : evil_view->namespaces) EXPECT_EQ(n.ns.tenant, "evil");

  // acme's state is as it was.
  absl::StatusOr<ManagerStats> after = ops->Stats();
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->namespaces.size(), before->namespaces.size());
  for (size_t i = 0; i < after->namespaces.size(); ++i) {
    EXPECT_EQ(after->namespaces[i].page_locations, before->namespaces[i].page_locations);
  }
  EXPECT_EQ(after->active_pins, before->active_pins);
  EXPECT_EQ(after->counters.pins_released, before->counters.pins_released);
  EXPECT_TRUE(acme->RenewLease(acme_ns, pinned->pin_id, 0).ok());
  absl::StatusOr<MatchReply> still = acme->Match(acme_ns, prompt, {.probe = true});
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(still->matched_pages, 4u);
  EXPECT_TRUE(acme->Release(acme_ns, pinned->pin_id).ok());
}

}  // namespace
}  // namespace kvcm
