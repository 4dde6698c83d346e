// kvcm_auth_bench: what mutual TLS and bearer-token authentication add to a full-hit Match
// RPC, against plaintext, in the same run (issue 10: the secured Match p50 within 1.3x the
// plaintext one).
//
//   kvcm_auth_bench [--smoke] [--calls=20000] [--warmup=2000] [--block=250] [--connects=30]
//
// Four ManagerServers in one process, one per arm, each on 127.0.0.1:0 and holding its own
// copy of kvcm_rpc_bench's ChatWorkload index (1M+ page-locations, the same hash secret):
//   plain:       insecure, no tokens file (kvcm_rpc_bench's match arm; the baseline);
//   plain+tok:   insecure, a tokens file; the channel sends a worker's bearer token;
//   mtls:        TLS requiring client certificates, no tokens file;
//   mtls+tok:    both: the secured deployment.
// Throw-away certificates come from scripts/make_test_certs.sh, run into a temporary
// directory (with the tokens file) that is removed at the end. The client is a CacheManager
// stub on a channel from ChannelFactory (what kvcm::Client opens: its credentials, and its
// interceptor adding "authorization: Bearer <token>"), one persistent channel per arm. Every
// arm sends call i's MatchRequest (128 pages, a full hit, requester = the conversation's
// agent), in blocks of --block calls in rotated order, so that machine noise lands on all
// arms alike. A latency is the client's wall time of one call; cpu_us is the process's CPU
// time (client, servers, gRPC threads) per call of the arm; srv_us the arm's server's mean
// time in its Match handler (kvcm_rpc_duration_seconds: access check, validation, index).
//
// The ratios are of calls on established connections: the TLS handshake is paid once per
// connection, not per call. The "first call" table measures it separately: --connects fresh
// channels per arm (a local subchannel pool each, so no connection is shared), interleaved,
// each timed from creation to the end of its first Match (TCP connect, TLS handshake with
// both certificates verified, the call). "token-find" is the server's per-call token work
// in process: TokenTable::Find (SHA-256 of the token and a hash-map lookup).
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "bench/manager_metrics.h"
#include "bench/workload.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "common/program_flags.h"
#include "common/token_table.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"
#include "server/service/server_options.h"

ABSL_FLAG(bool, smoke, false, "tiny index and few calls: proves the benchmark runs (ctest)");
ABSL_FLAG(int, calls, 20'000, "measured calls per arm");
ABSL_FLAG(int, warmup, 2'000, "unmeasured calls per arm before measuring");
ABSL_FLAG(int, block, 250, "calls per arm in a row before switching to the next arm");
ABSL_FLAG(int, connects, 30, "fresh connections per arm whose first call is timed");
ABSL_FLAG(std::string, arms, "plain,plain+tok,mtls,mtls+tok",
          "arms to measure, comma-separated (one arm alone is for profiling)");

namespace kvcm::bench {
namespace {

namespace pb = ::kvcm::v1;
using SteadyClock = std::chrono::steady_clock;

const NamespaceId kNamespace{"bench", "deepseek-v3"};
// The worker's bearer token (64 characters, as `openssl rand -hex 32` makes one).
constexpr char kToken[] = "6b76636d2d617574682d62656e63682d746f6b656e2d6f662d612d776f726b65";
constexpr int kArms = 4;

// The temporary directory of the certificates and the tokens file; removed on destruction.
class TempDir {
 public:
  static absl::StatusOr<TempDir> Make() {
    char dir[] = "/tmp/kvcm_auth_bench_XXXXXX";
    if (mkdtemp(dir) == nullptr) return absl::InternalError("mkdtemp failed");
    return TempDir(dir);
  }
  TempDir(TempDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  std::string Path(const std::string& file) const { return path_ + "/" + file; }
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

struct Arm {
  const char* name;
  bool tls = false;
  bool token = false;
  bool enabled = false;  // measured (--arms)
  std::unique_ptr<ManagerServer> server;
  ChannelFactory channels = ChannelFactory::Insecure();
  std::unique_ptr<pb::CacheManager::Stub> stub;
  LatencyHistogram latency;
  LatencyHistogram first_call;
  double cpu_seconds = 0;  // process CPU time spent while this arm's blocks ran
  double handler_us = 0;   // the server's mean Match handler time over the measured calls
};

ServerOptions ArmServerOptions(const Arm& arm, const TempDir& dir) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";  // no exporter; the service still records its metrics
  options.hash_secret_hex = "6b76636d2d62656e63682d7365637265";  // the same keys in every arm
  options.default_pool_capacity_bytes = ~uint64_t{0} / 2;        // nothing evicts
  if (arm.tls) {
    options.tls.cert_file = dir.Path("manager.pem");
    options.tls.key_file = dir.Path("manager.key");
    options.tls.ca_file = dir.Path("ca.pem");  // mutual: client certificates required
  } else {
    options.tls.insecure = true;
  }
  if (arm.token) options.tokens_file = dir.Path("tokens");
  return options;
}

absl::StatusOr<ChannelFactory> ArmChannels(const Arm& arm, const TempDir& dir) {
  TlsOptions tls;
  if (arm.tls) {
    tls.ca_file = dir.Path("ca.pem");
    tls.cert_file = dir.Path("client.pem");
    tls.key_file = dir.Path("client.key");
  } else {
    tls.insecure = true;
  }
  return ChannelFactory::Create(tls, arm.token ? kToken : "");
}

// Builds the ChatWorkload index in `server`; returns the namespace's hash key.
absl::StatusOr<HashKey> FillIndex(ManagerServer& server, const ChatWorkloadOptions& options) {
  absl::StatusOr<RegisterModelResult> reg =
      server.index().RegisterModel(kNamespace, DeepSeekV3Spec());
  if (!reg.ok()) return reg.status();
  const ChatWorkload workload(options, reg->hash_key);
  absl::StatusOr<BuildResult> build = BuildIndex(workload, kNamespace, server.index());
  if (!build.ok()) return build.status();
  return reg->hash_key;
}

// One Match of `req` on `stub`: its wall time, or the error.
absl::StatusOr<SteadyClock::duration> TimedMatch(pb::CacheManager::Stub& stub,
                                                 const pb::MatchRequest& req, uint32_t want_pages) {
  pb::MatchResponse resp;
  const auto start = SteadyClock::now();
  grpc::Status s;
  {
    grpc::ClientContext ctx;
    s = stub.Match(&ctx, req, &resp);
  }
  const auto end = SteadyClock::now();
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }
  if (resp.matched_pages() != want_pages) {
    return absl::InternalError(
        absl::StrCat("matched ", resp.matched_pages(), " of ", want_pages, " pages"));
  }
  return end - start;
}

// The code of one Match on a channel from `channels`, with a short deadline: proves that an
// arm refuses what it should (a call without token, a client without certificate).
grpc::StatusCode RefusedCode(const ChannelFactory& channels, const std::string& address,
                             const pb::MatchRequest& req) {
  auto stub = pb::CacheManager::NewStub(channels.Open(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  pb::MatchResponse resp;
  return stub->Match(&ctx, req, &resp).error_code();
}

// One row of the latency table; cpu_us and srv_us only for RPC arms (cpu_seconds >= 0).
void PrintLatency(const char* name, LatencyHistogram& h, double cpu_seconds, double handler_us) {
  const double n = static_cast<double>(std::max<size_t>(h.size(), 1));
  std::printf("  %-12s %7zu %9.1f %9.1f %9.1f %9.1f %9.1f", name, h.size(), h.Percentile(0.5) / 1e3,
              h.Percentile(0.9) / 1e3, h.Percentile(0.99) / 1e3, h.Percentile(0.999) / 1e3,
              h.mean_ns() / 1e3);
  if (cpu_seconds >= 0) std::printf(" %8.1f %8.1f", cpu_seconds / n * 1e6, handler_us);
  std::printf("\n");
}

int Run() {
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  const int calls = smoke ? 200 : absl::GetFlag(FLAGS_calls);
  const int warmup = smoke ? 20 : absl::GetFlag(FLAGS_warmup);
  const int block = std::max(1, smoke ? 50 : absl::GetFlag(FLAGS_block));
  const int connects = std::max(1, smoke ? 2 : absl::GetFlag(FLAGS_connects));
  const ChatWorkloadOptions workload_options =
      smoke ? ChatWorkloadOptions{.groups = 4, .conversations_per_group = 4}
            : ChatWorkloadOptions{};

  absl::StatusOr<TempDir> dir = TempDir::Make();
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", dir.status().ToString().c_str());
    return 1;
  }
  const std::string make_certs =
      absl::StrCat("'", KVCM_MAKE_TEST_CERTS, "' '", dir->path(), "' >/dev/null");
  if (std::system(make_certs.c_str()) != 0) {
    std::fprintf(stderr, "%s failed\n", make_certs.c_str());
    return 1;
  }
  {
    std::ofstream tokens(dir->Path("tokens"));
    tokens << Sha256Hex(kToken) << " bench-worker roles=worker tenant=" << kNamespace.tenant
           << "\n";
    if (!tokens) {
      std::fprintf(stderr, "cannot write %s\n", dir->Path("tokens").c_str());
      return 1;
    }
  }

  Arm arms[kArms] = {{.name = "plain"},
                     {.name = "plain+tok", .token = true},
                     {.name = "mtls", .tls = true},
                     {.name = "mtls+tok", .tls = true, .token = true}};
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_arms), ',')) {
    for (Arm& arm : arms) arm.enabled |= name == arm.name;
  }
  HashKey hash_key{};
  for (Arm& arm : arms) {
    absl::StatusOr<std::unique_ptr<ManagerServer>> server =
        ManagerServer::Start(ArmServerOptions(arm, *dir));
    if (!server.ok()) {
      std::fprintf(stderr, "%s: ManagerServer::Start: %s\n", arm.name,
                   server.status().ToString().c_str());
      return 1;
    }
    arm.server = *std::move(server);
    absl::StatusOr<HashKey> key = FillIndex(*arm.server, workload_options);
    if (!key.ok()) {
      std::fprintf(stderr, "%s: %s\n", arm.name, key.status().ToString().c_str());
      return 1;
    }
    hash_key = *key;  // the same in every arm: the same hash secret
    absl::StatusOr<ChannelFactory> channels = ArmChannels(arm, *dir);
    if (!channels.ok()) {
      std::fprintf(stderr, "%s: %s\n", arm.name, channels.status().ToString().c_str());
      return 1;
    }
    arm.channels = *std::move(channels);
    arm.stub = pb::CacheManager::NewStub(arm.channels.Open(arm.server->address()));
  }
  const NamespaceStats stats = arms[0].server->index().Stats().namespaces.at(0);
  const ChatWorkload workload(workload_options, hash_key);

  // Distinct prompts, cycled: random full-hit conversations, as a client sends them.
  const uint32_t distinct = std::min<uint32_t>(workload.conversations(), 4'096);
  std::vector<pb::MatchRequest> requests(distinct);
  std::vector<uint32_t> want_pages(distinct);
  uint64_t state = 42;
  for (uint32_t i = 0; i < distinct; ++i) {
    const uint32_t c = static_cast<uint32_t>(SplitMix64(state) % workload.conversations());
    const std::span<const PageHash> prompt = workload.Context(c);
    want_pages[i] = static_cast<uint32_t>(prompt.size());
    pb::MatchRequest& req = requests[i];
    req.mutable_namespace_()->set_tenant(kNamespace.tenant);
    req.mutable_namespace_()->set_model(kNamespace.model);
    req.mutable_prompt()->set_page_hashes(EncodePageHashes(prompt));
    req.mutable_prompt()->mutable_scheme()->set_version(kPageHashVersion);
    req.mutable_prompt()->mutable_scheme()->set_page_size_tokens(
        workload.options().page_size_tokens);
    req.mutable_prompt()->mutable_scheme()->set_key_fingerprint(KeyFingerprint(hash_key));
    req.set_requester_agent_id(workload.PoolOf(c).agent_id);
  }

  // Each arm refuses what it should: the token arms a call without token, the TLS arms a
  // client without certificate.
  for (Arm& arm : arms) {
    if (arm.token) {
      TlsOptions tls = arm.tls ? TlsOptions{.cert_file = dir->Path("client.pem"),
                                            .key_file = dir->Path("client.key"),
                                            .ca_file = dir->Path("ca.pem")}
                               : TlsOptions{.insecure = true};
      absl::StatusOr<ChannelFactory> no_token = ChannelFactory::Create(tls);
      if (!no_token.ok() || RefusedCode(*no_token, arm.server->address(), requests[0]) !=
                                grpc::StatusCode::UNAUTHENTICATED) {
        std::fprintf(stderr, "%s: a call without token was not refused as UNAUTHENTICATED\n",
                     arm.name);
        return 1;
      }
    }
    if (arm.tls) {
      absl::StatusOr<ChannelFactory> no_cert =
          ChannelFactory::Create({.ca_file = dir->Path("ca.pem")}, arm.token ? kToken : "");
      if (!no_cert.ok() ||
          RefusedCode(*no_cert, arm.server->address(), requests[0]) == grpc::StatusCode::OK) {
        std::fprintf(stderr, "%s: a client without certificate was served\n", arm.name);
        return 1;
      }
    }
  }

  // Arm j's call i; exits on any failure (a wrong answer would make the timing meaningless).
  auto call = [&](Arm& arm, uint32_t i, LatencyHistogram* into) {
    absl::StatusOr<SteadyClock::duration> d = TimedMatch(*arm.stub, requests[i], want_pages[i]);
    if (!d.ok()) {
      std::fprintf(stderr, "%s: Match: %s\n", arm.name, d.status().ToString().c_str());
      std::exit(1);
    }
    if (into != nullptr) into->Add(*d);
  };
  for (int i = 0; i < warmup; ++i) {
    for (Arm& arm : arms) {
      if (arm.enabled) call(arm, i % distinct, nullptr);
    }
  }
  std::pair<double, double> handler_before[kArms];
  for (int j = 0; j < kArms; ++j) {
    arms[j].latency.Reserve(calls);
    handler_before[j] = MatchHandlerSeconds(*arms[j].server);
  }
  // Block k runs the arms in rotated order (plain plain+tok mtls mtls+tok, plain+tok mtls
  // mtls+tok plain, ...); every arm sends call i's request.
  for (int first = 0, k = 0; first < calls; first += block, ++k) {
    const int last = std::min(calls, first + block);
    for (int step = 0; step < kArms; ++step) {
      Arm& arm = arms[(k + step) % kArms];
      if (!arm.enabled) continue;
      const double cpu_start = ProcessCpuSeconds();
      for (int i = first; i < last; ++i) call(arm, i % distinct, &arm.latency);
      arm.cpu_seconds += ProcessCpuSeconds() - cpu_start;
    }
  }

  for (int j = 0; j < kArms; ++j) {
    const std::pair<double, double> after = MatchHandlerSeconds(*arms[j].server);
    arms[j].handler_us = (after.first - handler_before[j].first) /
                         std::max(1.0, after.second - handler_before[j].second) * 1e6;
  }

  // First calls on fresh connections, interleaved the same way.
  grpc::ChannelArguments fresh_args;
  fresh_args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (int r = 0; r < connects; ++r) {
    for (int step = 0; step < kArms; ++step) {
      Arm& arm = arms[(r + step) % kArms];
      if (!arm.enabled) continue;
      const uint32_t q = r % distinct;
      const auto start = SteadyClock::now();
      auto stub = pb::CacheManager::NewStub(arm.channels.Open(arm.server->address(), fresh_args));
      absl::StatusOr<SteadyClock::duration> d = TimedMatch(*stub, requests[q], want_pages[q]);
      const auto end = SteadyClock::now();
      if (!d.ok()) {
        std::fprintf(stderr, "%s: first Match: %s\n", arm.name, d.status().ToString().c_str());
        return 1;
      }
      arm.first_call.Add(end - start);
    }
  }

  // The server's per-call token work, in process.
  absl::StatusOr<TokenTable> table = TokenTable::Load(dir->Path("tokens"));
  if (!table.ok()) {
    std::fprintf(stderr, "%s\n", table.status().ToString().c_str());
    return 1;
  }
  LatencyHistogram token_find;
  token_find.Reserve(calls);
  for (int i = 0; i < calls; ++i) {
    const auto start = SteadyClock::now();
    const bool found = table->Find(kToken) != nullptr;
    token_find.Add(SteadyClock::now() - start);
    if (!found) {
      std::fprintf(stderr, "token-find: the bench's token is not in its table\n");
      return 1;
    }
  }

  std::printf("kvcm_auth_bench%s: %s\n", smoke ? " --smoke" : "", MachineSummary().c_str());
  std::printf(
      "index per arm: %llu pages, %llu page-locations; full-hit 128-page Match, %d calls per "
      "arm after %d warm-up, blocks of %d, one client thread, loopback TCP, persistent "
      "connections\n",
      static_cast<unsigned long long>(stats.pages),
      static_cast<unsigned long long>(stats.page_locations), calls, warmup, block);
  std::printf("  %-12s %7s %9s %9s %9s %9s %9s %8s %8s\n", "arm", "calls", "p50_us", "p90_us",
              "p99_us", "p999_us", "mean_us", "cpu_us", "srv_us");
  for (Arm& arm : arms) {
    if (arm.enabled) PrintLatency(arm.name, arm.latency, arm.cpu_seconds, arm.handler_us);
  }
  PrintLatency("token-find", token_find, -1, 0);
  LatencyHistogram& base = arms[0].latency;
  for (int j = 1; j < kArms; ++j) {
    LatencyHistogram& h = arms[j].latency;
    if (base.size() == 0 || h.size() == 0) continue;
    std::printf("ratio %s/plain: p50 %.3f, p99 %.3f, cpu %.3f\n", arms[j].name,
                h.Percentile(0.5) / base.Percentile(0.5),
                h.Percentile(0.99) / base.Percentile(0.99),
                arms[j].cpu_seconds / std::max(arms[0].cpu_seconds, 1e-12));
  }
  if (base.size() > 0 && arms[3].latency.size() > 0) {
    const double secured = arms[3].latency.Percentile(0.5) / base.Percentile(0.5);
    std::printf("secured (mtls+tok) / plain, p50: %.3f (target <= 1.3: %s)\n", secured,
                secured <= 1.3 ? "met" : "missed");
  }
  std::printf(
      "first call on a fresh connection (channel creation, TCP connect, TLS handshake, "
      "Match), %d per arm:\n",
      connects);
  std::printf("  %-12s %7s %9s %9s %9s\n", "arm", "conns", "p50_us", "p90_us", "max_us");
  for (Arm& arm : arms) {
    if (!arm.enabled) continue;
    LatencyHistogram& h = arm.first_call;
    std::printf("  %-12s %7zu %9.1f %9.1f %9.1f\n", arm.name, h.size(), h.Percentile(0.5) / 1e3,
                h.Percentile(0.9) / 1e3, h.Percentile(1.0) / 1e3);
  }

  for (Arm& arm : arms) {
    arm.stub.reset();
    arm.server->Shutdown();
  }
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) {
  kvcm::ParseProgramFlags(argc, argv,
                          {.name = "kvcm_auth_bench",
                           .usage = "kvcm_auth_bench [--option=value ...]: the cost of "
                                    "authentication on the manager's RPCs",
                           .flag_files = {"bench/auth_bench.cc"}});
  // As kvcm-manager does (Debian's Abseil keeps Mutex deadlock detection on otherwise).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return kvcm::bench::Run();
}
