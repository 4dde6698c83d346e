// Issue 22's unauthenticated floods, against real kvcm-manager and kvcm-agent processes with
// mutual TLS and a tokens file: thousands of idle TCP connections (no TLS byte sent) from a
// child process, while a legitimate client keeps calling; a fresh client must connect
// within seconds once the flood ends. And an unauthenticated 2^20-token Match is refused
// UNAUTHENTICATED by the auth metadata processor before any handler parses it.
//
// Scale (CI has 2 cores): each flood is 6,000 connections from 12 loopback source
// addresses, against a server started under `prlimit --nofile=4096` so that the flood is
// larger than the server's fd table (the attack: 20,000 against 20,000 fds).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "tests/util/child_process.h"
#include "tests/util/http_get.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::kvcm::testing::FreePort;
using ::kvcm::testing::HttpGet;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::TestCerts;
using ::kvcm::testing::WaitUntil;
using ::testing::HasSubstr;

constexpr char kAdminToken[] = "ops-token-0123456789abcdef";
constexpr int kFloodConnections = 6'000;
constexpr int kFloodSources = 12;  // 127.0.0.10 .. 127.0.0.21
constexpr char kServerFdLimit[] = "--nofile=4096:4096";
// 5 s rather than the default 20 s, so that a test waits out the deadline quickly; the clients
// here wait for ready (see WithDeadline), so a 5 s deadline does not shut them out.
constexpr char kHandshakeFlag[] = "--grpc_handshake_timeout_ms=5000";

TestCerts& Certs() {
  static TestCerts* const certs = [] {
    absl::StatusOr<std::unique_ptr<TestCerts>> made = TestCerts::Make({"gpu-f"});
    if (!made.ok()) {
      ADD_FAILURE() << made.status();
      std::abort();
    }
    return made->release();
  }();
  return *certs;
}

std::string TokensFile() {
  const std::string path = Certs().Path("flood_tokens");
  std::ofstream(path) << Sha256Hex(kAdminToken) << " ops roles=admin\n";
  return path;
}

// A channel with the client certificate and, unless empty, a bearer token.
std::shared_ptr<grpc::Channel> Channel(const std::string& address, const std::string& token) {
  absl::StatusOr<ChannelFactory> f = ChannelFactory::Create(Certs().Identity("client"), token);
  EXPECT_TRUE(f.ok()) << f.status();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  // A fresh channel every time (no subchannel sharing with an earlier one).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return f->Open(address, args);
}

template <typename Call>
grpc::Status WithDeadline(absl::Duration deadline, Call call) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline)));
  // Wait for the connection within the deadline: a fail-fast sync call does not poll, and
  // an idle sync client's connection attempt then advances only with gRPC's 5 s backup
  // poller.
  ctx.set_wait_for_ready(true);
  return call(&ctx);
}

// How long a brand-new client takes to get an OK from `ok_call` on a new channel, retrying
// every 100 ms; InfiniteDuration when it does not within `give_up`.
template <typename OkCall>
absl::Duration FreshClientConnects(OkCall ok_call, absl::Duration give_up) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < give_up) {
    if (ok_call()) return absl::Now() - start;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::InfiniteDuration();
}

// `n` TCP connections to 127.0.0.1:`port` from `sources` loopback addresses, opened by a
// forked child that sends nothing and holds them until killed: what a scanner or an
// attacker leaves. The child reports how many it opened.
class IdleFlood {
 public:
  IdleFlood(int port, int n, int sources) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {  // only system calls from here: the parent has threads
      close(fds[0]);
      rlimit limit{};
      getrlimit(RLIMIT_NOFILE, &limit);
      limit.rlim_cur = limit.rlim_max;
      setrlimit(RLIMIT_NOFILE, &limit);
      int opened = 0;
      for (int i = 0; i < n; ++i) {
        const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) break;
        timeval tv{.tv_sec = 1, .tv_usec = 0};  // a full backlog must not stall the flood
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        sockaddr_in src{};
        src.sin_family = AF_INET;
        src.sin_addr.s_addr = htonl(0x7f00000a + static_cast<uint32_t>(i % sources));
        sockaddr_in dst{};
        dst.sin_family = AF_INET;
        dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        dst.sin_port = htons(static_cast<uint16_t>(port));
        if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) == 0 &&
            connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) == 0) {
          ++opened;
        } else {
          close(fd);
        }
      }
      (void)!write(fds[1], &opened, sizeof(opened));
      while (true) pause();
    }
    close(fds[1]);
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, 60'000) > 0) (void)!read(fds[0], &opened_, sizeof(opened_));
    close(fds[0]);
  }
  ~IdleFlood() { Stop(); }

  // Ends the flood: the child and its connections go.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  int opened() const { return opened_; }

 private:
  pid_t pid_ = -1;
  int opened_ = 0;
};

// kvcm-manager under a 4,096-fd limit with mutual TLS, the tokens file and default limits.
std::unique_ptr<Subprocess> StartManager(int port, int metrics_port,
                                         const std::vector<std::string>& extra = {}) {
  TestCerts& c = Certs();
  std::vector<std::string> argv = {"/usr/bin/prlimit",
                                   kServerFdLimit,
                                   KVCM_MANAGER_PATH,
                                   absl::StrCat("--listen_address=127.0.0.1:", port),
                                   absl::StrCat("--metrics_address=127.0.0.1:", metrics_port),
                                   "--tls_cert_file=" + c.Path("manager.pem"),
                                   "--tls_key_file=" + c.Path("manager.key"),
                                   "--tls_ca_file=" + c.Path("ca.pem"),
                                   "--tokens_file=" + TokensFile(),
                                   "--shutdown_grace_ms=100",
                                   kHandshakeFlag};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return Subprocess::Start(argv);
}

bool ManagerStatsOk(const std::shared_ptr<grpc::Channel>& channel, absl::Duration deadline) {
  std::unique_ptr<v1::CacheManager::Stub> stub = v1::CacheManager::NewStub(channel);
  v1::StatsRequest req;
  v1::StatsResponse resp;
  const grpc::Status s = WithDeadline(
      deadline, [&](grpc::ClientContext* ctx) { return stub->Stats(ctx, req, &resp); });
  return s.ok();
}

bool AgentStatsOk(const std::shared_ptr<grpc::Channel>& channel, absl::Duration deadline) {
  std::unique_ptr<v1::BlockAgent::Stub> stub = v1::BlockAgent::NewStub(channel);
  v1::BlockAgentStatsRequest req;
  v1::BlockAgentStatsResponse resp;
  return WithDeadline(deadline,
                      [&](grpc::ClientContext* ctx) { return stub->Stats(ctx, req, &resp); })
      .ok();
}

// The flood scenario against the server at `address` (whose Stats `stats_ok` calls): a
// connected client keeps its answers during the flood, a fresh one connects within the
// handshake deadline (kHandshakeFlag) plus slack even while the flood holds its sockets,
// and within 3 s after it ends.
template <typename StatsOk>
void FloodAndRecover(int port, const std::string& address, StatsOk stats_ok) {
  std::shared_ptr<grpc::Channel> connected = Channel(address, kAdminToken);
  ASSERT_TRUE(WaitUntil([&] { return stats_ok(connected, absl::Seconds(2)); }, absl::Seconds(20)))
      << "the server did not come up";

  const absl::Time flood_start = absl::Now();
  IdleFlood flood(port, kFloodConnections, kFloodSources);
  ASSERT_GE(flood.opened(), kFloodConnections / 2) << "the flood could not connect";
  std::printf("flood: %d idle connections opened in %s\n", flood.opened(),
              absl::FormatDuration(absl::Now() - flood_start).c_str());

  // The connected client is served throughout.
  for (int i = 0; i < 5; ++i) {
    const absl::Time t = absl::Now();
    EXPECT_TRUE(stats_ok(connected, absl::Seconds(2))) << "call " << i << " during the flood";
    EXPECT_LT(absl::Now() - t, absl::Seconds(2));
    absl::SleepFor(absl::Milliseconds(100));
  }
  // A fresh client during the flood: over the caps at first, in once the handshake
  // deadline has closed the idle sockets.
  const absl::Duration during = FreshClientConnects(
      [&] { return stats_ok(Channel(address, kAdminToken), absl::Seconds(1)); }, absl::Seconds(12));
  std::printf("fresh client during the flood connected after %s\n",
              absl::FormatDuration(during).c_str());
  EXPECT_LT(during, absl::Seconds(10));

  // The flood comes again and leaves: a fresh client is in within 3 s.
  flood.Stop();
  IdleFlood second(port, kFloodConnections, kFloodSources);
  ASSERT_GE(second.opened(), kFloodConnections / 2);
  second.Stop();
  const absl::Duration after = FreshClientConnects(
      [&] { return stats_ok(Channel(address, kAdminToken), absl::Seconds(1)); }, absl::Seconds(10));
  std::printf("fresh client after the flood connected after %s\n",
              absl::FormatDuration(after).c_str());
  EXPECT_LT(after, absl::Seconds(3));
  EXPECT_TRUE(stats_ok(connected, absl::Seconds(2)));
}

// The value of the /metrics sample whose line starts with `prefix`; -1 when absent.
double Sample(int metrics_port, absl::string_view prefix) {
  const std::string page = HttpGet(metrics_port, "/metrics");
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    double v = -1;
    (void)absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v);
    return v;
  }
  return -1;
}

// gRPC logs a line for every handshake that times out: the server lets through at most 20
// a second (RateLimitGrpcLog), so two floods of thousands write hundreds of lines at most.
void ExpectGrpcLogWasRateLimited(const std::string& err) {
  int grpc_lines = 0;
  for (absl::string_view line : absl::StrSplit(err, '\n')) {
    if (absl::StrContains(line, "] grpc ")) ++grpc_lines;
  }
  std::printf("gRPC log lines: %d\n", grpc_lines);
  EXPECT_GT(grpc_lines, 0);
  EXPECT_LT(grpc_lines, 1'000);
}

TEST(FloodProcessTest, ManagerKeepsServingAndAcceptsAgainAfterAnIdleFlood) {
  const int port = FreePort();
  const int metrics_port = FreePort();
  std::unique_ptr<Subprocess> manager = StartManager(port, metrics_port);
  ASSERT_NE(manager, nullptr);
  FloodAndRecover(port, absl::StrCat("127.0.0.1:", port), ManagerStatsOk);
  // The guard, not luck: connections over the caps were closed as they were accepted.
  const double over_total =
      Sample(metrics_port, "kvcm_grpc_connections_refused_total{reason=\"grpc_max_connections\"}");
  const double over_peer =
      Sample(metrics_port,
             "kvcm_grpc_connections_refused_total{reason=\"grpc_max_connections_per_peer\"}");
  std::printf("refused: %.0f over grpc_max_connections, %.0f over the per-peer cap\n", over_total,
              over_peer);
  EXPECT_GT(over_total + over_peer, 0);
  const double log_suppressed = Sample(metrics_port, "kvcm_grpc_log_lines_suppressed_total");
  std::printf("gRPC log lines suppressed: %.0f\n", log_suppressed);
  EXPECT_GT(log_suppressed, 1'000);
  manager->Signal(SIGTERM);
  testing::ProcessResult r = manager->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("gRPC connection limits: 3072 connections"));
  ExpectGrpcLogWasRateLimited(r.err);
}

TEST(FloodProcessTest, AgentBlockAgentPortKeepsServingAndAcceptsAgainAfterAnIdleFlood) {
  TestCerts& c = Certs();
  const int port = FreePort();
  std::unique_ptr<Subprocess> agent = Subprocess::Start(
      {"/usr/bin/prlimit", kServerFdLimit, KVCM_AGENT_PATH, "--agent_id=gpu-f",
       absl::StrCat("--listen_address=127.0.0.1:", port),
       // No manager: BlockAgent serves regardless; the agent retries registering.
       absl::StrCat("--manager_address=127.0.0.1:", FreePort()), "--use_device=false",
       "--model=deepseek-v3", "--capacity_bytes=50000000", "--heartbeat_interval_ms=1000",
       "--tls_cert_file=" + c.Path("gpu-f.pem"), "--tls_key_file=" + c.Path("gpu-f.key"),
       "--tls_ca_file=" + c.Path("ca.pem"), "--tokens_file=" + TokensFile(), kHandshakeFlag});
  ASSERT_NE(agent, nullptr);
  FloodAndRecover(port, absl::StrCat("127.0.0.1:", port), AgentStatsOk);
  agent->Signal(SIGTERM);
  testing::ProcessResult r = agent->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("BlockAgent connection limits: 3072 connections"));
  ExpectGrpcLogWasRateLimited(r.err);
}

// The Match of 2^20 token ids (about 4 MB) an unauthenticated client sends.
v1::MatchRequest BigMatch() {
  v1::MatchRequest req;
  req.mutable_namespace_()->set_tenant("acme");
  req.mutable_namespace_()->set_model("deepseek-v3");
  v1::TokenList* tokens = req.mutable_prompt()->mutable_tokens();
  for (uint32_t i = 0; i < (1u << 20); ++i)
    tokens->add_ids(static_cast<int32_t>(i * 7919u % 100000u));
  return req;
}

// kvcm_rpc_requests_total{rpc="Match",code="UNAUTHENTICATED"}: the calls the Match handler
// itself refused (the handler's runner counts them; a processor refusal never reaches it).
double HandlerRefusedMatches(int metrics_port) {
  const std::string page = HttpGet(metrics_port, "/metrics");
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (absl::StartsWith(line, "kvcm_rpc_requests_total{") &&
        absl::StrContains(line, "code=\"UNAUTHENTICATED\"") &&
        absl::StrContains(line, "rpc=\"Match\"")) {
      double v = 0;
      (void)absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v);
      return v;
    }
  }
  return 0;
}

// Work before authentication: with TLS, an unauthenticated 2^20-token Match ends
// UNAUTHENTICATED in the auth metadata processor, on its headers: the Match handler never
// runs (its refusal counter stays 0). Without TLS (no processor) the same call is refused by
// the handler, after the body was parsed: the counter this test reads does move then.
TEST(FloodProcessTest, UnauthenticatedBigMatchIsRefusedBeforeAnyHandlerParsesIt) {
  const int port = FreePort();
  const int metrics_port = FreePort();
  std::unique_ptr<Subprocess> manager = StartManager(port, metrics_port);
  ASSERT_NE(manager, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  std::shared_ptr<grpc::Channel> admin = Channel(address, kAdminToken);
  if (!WaitUntil([&] { return ManagerStatsOk(admin, absl::Seconds(2)); }, absl::Seconds(20))) {
    manager->Signal(SIGTERM);
    FAIL() << manager->Finish(absl::Seconds(15)).Describe();
  }

  const v1::MatchRequest big = BigMatch();
  for (const std::string& token : {std::string(), std::string("not-a-known-token-123")}) {
    std::unique_ptr<v1::CacheManager::Stub> stub =
        v1::CacheManager::NewStub(Channel(address, token));
    v1::MatchResponse resp;
    const grpc::Status s = WithDeadline(
        absl::Seconds(10), [&](grpc::ClientContext* ctx) { return stub->Match(ctx, big, &resp); });
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    EXPECT_THAT(s.error_message(),
                ::testing::AnyOf(HasSubstr("no bearer token"), HasSubstr("unknown bearer token")));
  }
  EXPECT_EQ(HandlerRefusedMatches(metrics_port), 0)
      << "a Match handler ran for an unauthenticated call";

  // A known token still works, and health probes need none.
  EXPECT_TRUE(ManagerStatsOk(admin, absl::Seconds(2)));
  {
    // grpc.health.v1.Health/Check with an empty HealthCheckRequest (the whole server).
    grpc::GenericStub health(Channel(address, ""));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::ByteBuffer req(nullptr, 0), resp;
    grpc::Status s;
    absl::Notification done;
    health.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                     [&](grpc::Status status) {
                       s = std::move(status);
                       done.Notify();
                     });
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
  }
  manager->Signal(SIGTERM);
  testing::ProcessResult r = manager->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
}

// The counter above can see a handler refusal: in the insecure mode (no processor) the same
// call is refused by the handler.
TEST(FloodProcessTest, WithoutTlsTheHandlerRefusesAndTheCounterMoves) {
  const int port = FreePort();
  const int metrics_port = FreePort();
  std::unique_ptr<Subprocess> manager =
      Subprocess::Start({KVCM_MANAGER_PATH, absl::StrCat("--listen_address=127.0.0.1:", port),
                         absl::StrCat("--metrics_address=127.0.0.1:", metrics_port), "--insecure",
                         "--tokens_file=" + TokensFile(), "--shutdown_grace_ms=100"});
  ASSERT_NE(manager, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  std::shared_ptr<grpc::Channel> anonymous = MakeInsecureChannel(address);
  std::unique_ptr<v1::CacheManager::Stub> stub = v1::CacheManager::NewStub(anonymous);
  ASSERT_TRUE(WaitUntil(
      [&] {
        v1::StatsResponse resp;
        return WithDeadline(absl::Seconds(1), [&](grpc::ClientContext* ctx) {
                 return stub->Stats(ctx, v1::StatsRequest(), &resp);
               }).error_code() == grpc::StatusCode::UNAUTHENTICATED;
      },
      absl::Seconds(20)));
  v1::MatchResponse resp;
  const grpc::Status s = WithDeadline(absl::Seconds(10), [&](grpc::ClientContext* ctx) {
    return stub->Match(ctx, BigMatch(), &resp);
  });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(HandlerRefusedMatches(metrics_port), 1);
  manager->Signal(SIGTERM);
  testing::ProcessResult r = manager->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
}

}  // namespace
}  // namespace kvcm
