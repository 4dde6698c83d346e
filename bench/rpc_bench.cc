// kvcm_rpc_bench: Match over gRPC on loopback next to a bare gRPC echo of the same sizes,
// in the same run (ARCHITECTURE.md section 10: Match p50 within 1.2x the echo's).
//
//   kvcm_rpc_bench [--smoke] [--calls=20000] [--warmup=2000] [--block=250]
//
// One process runs a kvcm ManagerServer (the real service, metrics recorded, exporter off)
// holding the ChatWorkload index of kvcm_core_bench (1M+ page-locations), and a baseline
// server built with the same gRPC callback API and the same ServerBuilder settings. One
// client thread makes synchronous unary calls; three arms, each a channel's call i:
//   match:  a 128-page MatchRequest of precomputed page hashes (2 KiB of hashes), a full
//           hit of a random conversation, requester = that conversation's agent, no pin,
//           to the ManagerServer.
//   canned: the same MatchRequest to the baseline server, which answers with a copy of the
//           MatchResponse the ManagerServer gave: Match's gRPC and protobuf cost without
//           validation, index or metrics.
//   echo:   an EchoMessage of exactly the serialized size of call i's MatchRequest, answered
//           with one of exactly the size of its MatchResponse, to the baseline server.
//   route:  a probe Route of the same prompt over every agent of the workload (8, registered
//           live in the manager's registry), policy prefill-saved, to the ManagerServer: a
//           router's call.
// Arms run in blocks of --block calls, in rotated order (match canned echo route, canned
// echo route match, ...), so that machine noise lands on all of them alike. A latency is the
// client's wall time of one call, ClientContext construction included; cpu_us is the process's CPU
// time (client, servers, gRPC threads) per call of the arm. Two in-process arms then run
// the same prompts to split a Match RPC's cost: "core" is CacheIndex::Match alone,
// "handler" the service's handler body (MatchFromProto, CacheIndex::Match,
// MatchResultToProto) without gRPC; "route-core" is Route's core work, a probe
// CacheIndex::Match and RankAgents over the 8 agents.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/manager_metrics.h"
#include "bench/workload.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "common/program_flags.h"
#include "echo.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/core/router.h"
#include "server/service/manager_server.h"
#include "server/service/proto_convert.h"
#include "server/service/server_options.h"

ABSL_FLAG(bool, smoke, false, "tiny index and few calls: proves the benchmark runs (ctest)");
ABSL_FLAG(int, calls, 20'000, "measured calls per arm");
ABSL_FLAG(int, warmup, 2'000, "unmeasured calls per arm before measuring");
ABSL_FLAG(int, block, 250, "calls per arm in a row before switching to the other arm");
ABSL_FLAG(std::string, arms, "match,canned,echo,route",
          "RPC arms to measure, comma-separated (one arm alone is for profiling)");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "keep Abseil's Mutex deadlock detection on (Debian's Abseil is built without "
          "NDEBUG, so it is on unless turned off); false, the default, turns it off as "
          "kvcm-manager does");

namespace kvcm::bench {
namespace {

namespace pb = ::kvcm::v1;
namespace echo_pb = ::kvcm::bench::v1;
using SteadyClock = std::chrono::steady_clock;

const NamespaceId kNamespace{"bench", "deepseek-v3"};

// The bench's Echo service: copies the request's payload into a reply of reply_bytes bytes
// and finishes on the default reactor, like the CacheManager's unary handlers.
class EchoService final : public echo_pb::Echo::CallbackService {
 public:
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const echo_pb::EchoMessage* req,
                                 echo_pb::EchoMessage* resp) override {
    std::string* payload = resp->mutable_payload();
    payload->assign(req->payload(), 0, std::min<size_t>(req->reply_bytes(), req->payload().size()));
    payload->resize(req->reply_bytes(), 'e');
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

// Answers Match with the response the real service gave to the same prompt, found by the
// prompt's page hashes: a Match call's gRPC and protobuf work without validation, index or
// metrics. Add() every prompt before serving.
class CannedMatchService final : public pb::CacheManager::CallbackService {
 public:
  void Add(const pb::MatchRequest& req, const pb::MatchResponse& resp) {
    canned_[req.prompt().page_hashes()] = resp;
  }

  grpc::ServerUnaryReactor* Match(grpc::CallbackServerContext* ctx, const pb::MatchRequest* req,
                                  pb::MatchResponse* resp) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    auto it = canned_.find(req->prompt().page_hashes());
    if (it == canned_.end()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "prompt not canned"));
    } else {
      *resp = it->second;
      reactor->Finish(grpc::Status::OK);
    }
    return reactor;
  }

 private:
  absl::flat_hash_map<std::string, pb::MatchResponse> canned_;
};

// Serves the baseline services with the ServerBuilder settings of ManagerServer::Start (its
// health checking and reflection are process-wide switches, already on once the manager
// runs).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartBaselineServer(const ServerOptions& options,
                                                                  EchoService* echo,
                                                                  CannedMatchService* canned,
                                                                  int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, MakeInsecureServerCredentials(), port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(echo);
  builder.RegisterService(canned);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError("baseline server did not start");
  }
  return server;
}

// Bytes of `v` as a protobuf varint.
size_t VarintBytes(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Length of a bytes field 1 whose field (tag + length + data) takes `field_bytes` bytes.
absl::StatusOr<size_t> PayloadFor(size_t field_bytes) {
  for (size_t len_bytes = 1; len_bytes <= 5 && len_bytes + 1 < field_bytes; ++len_bytes) {
    const size_t n = field_bytes - 1 - len_bytes;
    if (VarintBytes(n) == len_bytes) return n;
  }
  return absl::InternalError(absl::StrCat("no bytes field takes exactly ", field_bytes, " bytes"));
}

// An EchoMessage whose serialized size is exactly `wire_bytes`, asking for a reply whose
// serialized size is exactly `reply_wire_bytes`.
absl::StatusOr<echo_pb::EchoMessage> SizedEcho(size_t wire_bytes, size_t reply_wire_bytes) {
  absl::StatusOr<size_t> reply_payload = PayloadFor(reply_wire_bytes);
  if (!reply_payload.ok()) return reply_payload.status();
  echo_pb::EchoMessage msg;
  msg.set_reply_bytes(static_cast<uint32_t>(*reply_payload));
  const size_t reply_field = 1 + VarintBytes(*reply_payload);  // tag + value
  if (wire_bytes <= reply_field) return absl::InternalError("echo request too small");
  absl::StatusOr<size_t> payload = PayloadFor(wire_bytes - reply_field);
  if (!payload.ok()) return payload.status();
  msg.mutable_payload()->assign(*payload, 'p');
  if (msg.ByteSizeLong() != wire_bytes) {
    return absl::InternalError(
        absl::StrCat("echo request of ", msg.ByteSizeLong(), " bytes, wanted ", wire_bytes));
  }
  return msg;
}

struct Arm {
  explicit Arm(const char* name_in) : name(name_in) {}
  const char* name;
  LatencyHistogram latency;
  double cpu_seconds = 0;  // process CPU time spent while this arm's blocks ran
  uint64_t request_bytes = 0, response_bytes = 0;
};

void PrintArm(Arm& arm) {
  const double n = static_cast<double>(std::max<size_t>(arm.latency.size(), 1));
  std::printf("  %-10s %7zu %9.1f %9.1f %9.1f %9.1f %9.1f %8.1f %7.0f %7.0f\n", arm.name,
              arm.latency.size(), arm.latency.Percentile(0.5) / 1e3,
              arm.latency.Percentile(0.9) / 1e3, arm.latency.Percentile(0.99) / 1e3,
              arm.latency.Percentile(0.999) / 1e3, arm.latency.mean_ns() / 1e3,
              arm.cpu_seconds / n * 1e6, arm.request_bytes / n, arm.response_bytes / n);
}

int Run() {
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  const int calls = smoke ? 300 : absl::GetFlag(FLAGS_calls);
  const int warmup = smoke ? 50 : absl::GetFlag(FLAGS_warmup);
  const int block = std::max(1, smoke ? 50 : absl::GetFlag(FLAGS_block));
  const ChatWorkloadOptions workload_options =
      smoke ? ChatWorkloadOptions{.groups = 6, .conversations_per_group = 6}
            : ChatWorkloadOptions{};

  ServerOptions options;
  options.tls.insecure = true;  // the gRPC cost alone, as the baseline server's
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";  // no exporter; the service still records its metrics
  options.hash_secret_hex = "6b76636d2d62656e63682d7365637265";
  options.default_pool_capacity_bytes = ~uint64_t{0} / 2;  // nothing evicts
  options.agent_heartbeat_timeout_ms = 24 * 3'600'000;     // the route arm's agents stay live
  absl::StatusOr<std::unique_ptr<ManagerServer>> manager = ManagerServer::Start(options);
  if (!manager.ok()) {
    std::fprintf(stderr, "ManagerServer::Start: %s\n", manager.status().ToString().c_str());
    return 1;
  }
  CacheIndex& index = (*manager)->index();
  absl::StatusOr<RegisterModelResult> reg = index.RegisterModel(kNamespace, DeepSeekV3Spec());
  if (!reg.ok()) {
    std::fprintf(stderr, "RegisterModel: %s\n", reg.status().ToString().c_str());
    return 1;
  }
  const ChatWorkload workload(workload_options, reg->hash_key);
  absl::StatusOr<BuildResult> build = BuildIndex(workload, kNamespace, index);
  if (!build.ok()) {
    std::fprintf(stderr, "BuildIndex: %s\n", build.status().ToString().c_str());
    return 1;
  }
  const NamespaceStats stats = index.Stats().namespaces.at(0);
  // The workload's agents, live in the registry (their pools stay the index-only ones the
  // build filled): what Route chooses among.
  std::vector<RouteCandidate> route_candidates;
  for (uint32_t a = 0; a < workload.options().agents; ++a) {
    const PoolKey& pool = workload.PoolOf(a);
    const AgentRegistration agent{.agent_id = pool.agent_id,
                                  .device = "bench",
                                  .epoch = 1,
                                  .capacity_bytes = DeepSeekV3Spec().BytesPerPage(),
                                  .data_address = "127.0.0.1:1",
                                  .transport = "tcp",
                                  .bytes_per_block = DeepSeekV3Spec().BytesPerPage(),
                                  .num_blocks = 1};
    if (absl::StatusOr<RegisterOutcome> r = (*manager)->agents().Register(agent); !r.ok()) {
      std::fprintf(stderr, "Register %s: %s\n", pool.agent_id.c_str(),
                   r.status().ToString().c_str());
      return 1;
    }
    route_candidates.push_back(
        {.agent_id = pool.agent_id, .link_gbps = static_cast<double>(options.route_tcp_link_gbps)});
  }
  const RouteCost route_cost{
      .bytes_per_page = DeepSeekV3Spec().BytesPerPage(),
      .page_size_tokens = workload.options().page_size_tokens,
      .prefill_tokens_per_s = static_cast<double>(options.route_prefill_tokens_per_s)};

  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  auto match_stub =
      pb::CacheManager::NewStub(MakeInsecureChannel((*manager)->address(), channel_args));

  EchoService echo_service;
  CannedMatchService canned_service;
  // Distinct prompts, cycled: random full-hit conversations, as a client sends them.
  const uint32_t distinct = std::min<uint32_t>(workload.conversations(), 4'096);
  std::vector<pb::MatchRequest> match_requests(distinct);
  std::vector<pb::RouteRequest> route_requests(distinct);
  std::vector<echo_pb::EchoMessage> echo_requests(distinct);
  std::vector<std::span<const PageHash>> prompts(distinct);
  std::vector<MatchOptions> in_process_options(distinct);
  uint64_t state = 42;
  for (uint32_t i = 0; i < distinct; ++i) {
    const uint32_t c = static_cast<uint32_t>(SplitMix64(state) % workload.conversations());
    prompts[i] = workload.Context(c);
    pb::MatchRequest& req = match_requests[i];
    req.mutable_namespace_()->set_tenant(kNamespace.tenant);
    req.mutable_namespace_()->set_model(kNamespace.model);
    req.mutable_prompt()->set_page_hashes(EncodePageHashes(prompts[i]));
    req.mutable_prompt()->mutable_scheme()->set_version(kPageHashVersion);
    req.mutable_prompt()->mutable_scheme()->set_page_size_tokens(
        workload.options().page_size_tokens);
    req.mutable_prompt()->mutable_scheme()->set_key_fingerprint(KeyFingerprint(reg->hash_key));
    pb::RouteRequest& route = route_requests[i];
    *route.mutable_namespace_() = req.namespace_();
    *route.mutable_prompt() = req.prompt();
    route.set_probe(true);
    req.set_requester_agent_id(workload.PoolOf(c).agent_id);
    in_process_options[i].requester_agent_id = workload.PoolOf(c).agent_id;
    // The response this request gets sets the size of the echo's reply.
    grpc::ClientContext ctx;
    pb::MatchResponse resp;
    grpc::Status s = match_stub->Match(&ctx, req, &resp);
    if (!s.ok() || resp.matched_pages() != prompts[i].size()) {
      std::fprintf(stderr, "Match RPC: %s (matched %u of %zu pages)\n", s.error_message().c_str(),
                   resp.matched_pages(), prompts[i].size());
      return 1;
    }
    absl::StatusOr<echo_pb::EchoMessage> echo = SizedEcho(req.ByteSizeLong(), resp.ByteSizeLong());
    if (!echo.ok()) {
      std::fprintf(stderr, "%s\n", echo.status().ToString().c_str());
      return 1;
    }
    echo_requests[i] = std::move(*echo);
    canned_service.Add(req, resp);
  }

  int baseline_port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> baseline_server =
      StartBaselineServer(options, &echo_service, &canned_service, &baseline_port);
  if (!baseline_server.ok()) {
    std::fprintf(stderr, "%s\n", baseline_server.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<grpc::Channel> baseline_channel =
      MakeInsecureChannel(absl::StrCat("127.0.0.1:", baseline_port), channel_args);
  auto echo_stub = echo_pb::Echo::NewStub(baseline_channel);
  auto canned_stub = pb::CacheManager::NewStub(baseline_channel);

  Arm match("match"), canned("canned"), echo("echo"), route("route"), in_process("core"),
      handler("handler"), route_core("route-core");
  auto call_match = [&](pb::CacheManager::Stub* stub, uint32_t i, Arm* arm) {
    pb::MatchResponse resp;
    const auto start = SteadyClock::now();
    grpc::Status s;
    {
      grpc::ClientContext ctx;
      s = stub->Match(&ctx, match_requests[i], &resp);
    }
    const auto end = SteadyClock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "Match RPC: %s\n", s.error_message().c_str());
      std::exit(1);
    }
    arm->latency.Add(end - start);
    arm->request_bytes += match_requests[i].ByteSizeLong();
    arm->response_bytes += resp.ByteSizeLong();
  };
  auto call_echo = [&](uint32_t i, Arm* arm) {
    echo_pb::EchoMessage resp;
    const auto start = SteadyClock::now();
    grpc::Status s;
    {
      grpc::ClientContext ctx;
      s = echo_stub->Echo(&ctx, echo_requests[i], &resp);
    }
    const auto end = SteadyClock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "Echo RPC: %s\n", s.error_message().c_str());
      std::exit(1);
    }
    arm->latency.Add(end - start);
    arm->request_bytes += echo_requests[i].ByteSizeLong();
    arm->response_bytes += resp.ByteSizeLong();
  };
  auto call_route = [&](uint32_t i, Arm* arm) {
    pb::RouteResponse resp;
    const auto start = SteadyClock::now();
    grpc::Status s;
    {
      grpc::ClientContext ctx;
      s = match_stub->Route(&ctx, route_requests[i], &resp);
    }
    const auto end = SteadyClock::now();
    if (!s.ok() || resp.ranked_size() != static_cast<int>(route_candidates.size()) ||
        resp.ranked(0).cached_pages() != prompts[i].size()) {
      std::fprintf(stderr, "Route RPC: %s\n", s.error_message().c_str());
      std::exit(1);
    }
    arm->latency.Add(end - start);
    arm->request_bytes += route_requests[i].ByteSizeLong();
    arm->response_bytes += resp.ByteSizeLong();
  };
  // Arm j's call i.
  auto call = [&](int j, uint32_t i, Arm* arm) {
    if (j == 0) {
      call_match(match_stub.get(), i, arm);
    } else if (j == 1) {
      call_match(canned_stub.get(), i, arm);
    } else if (j == 2) {
      call_echo(i, arm);
    } else {
      call_route(i, arm);
    }
  };
  Arm* const arms[] = {&match, &canned, &echo, &route};
  constexpr int kArms = 4;

  Arm discard("warm-up");
  for (int i = 0; i < warmup; ++i) {
    for (int j = 0; j < kArms; ++j) call(j, i % distinct, &discard);
  }
  for (Arm* arm : arms) arm->latency.Reserve(calls);
  const std::pair<double, double> handler_before = MatchHandlerSeconds(**manager);
  // Every arm sends call i's sizes, in the same order. Block k runs the arms in rotated order
  // (match canned echo, canned echo match, ...) so drift and noise land on all of them.
  bool enabled[kArms] = {};
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_arms), ',')) {
    for (int j = 0; j < kArms; ++j) enabled[j] |= name == arms[j]->name;
  }
  for (int first = 0, k = 0; first < calls; first += block, ++k) {
    const int last = std::min(calls, first + block);
    for (int step = 0; step < kArms; ++step) {
      const int j = (k + step) % kArms;
      if (!enabled[j]) continue;
      const double cpu_start = ProcessCpuSeconds();
      for (int i = first; i < last; ++i) call(j, i % distinct, arms[j]);
      arms[j]->cpu_seconds += ProcessCpuSeconds() - cpu_start;
    }
  }
  const std::pair<double, double> handler_after = MatchHandlerSeconds(**manager);
  const double handler_mean_us = (handler_after.first - handler_before.first) /
                                 std::max(1.0, handler_after.second - handler_before.second) * 1e6;
  // Without transport: the core call alone, then the handler's body (request proto ->
  // core call -> response proto), back to back on a warm cache.
  in_process.latency.Reserve(calls);
  handler.latency.Reserve(calls);
  const RequestLimits limits;
  for (int i = 0; i < calls; ++i) {
    const uint32_t q = i % distinct;
    const auto start = SteadyClock::now();
    {
      absl::StatusOr<MatchResult> r = index.Match(kNamespace, prompts[q], in_process_options[q]);
      if (!r.ok()) {
        std::fprintf(stderr, "Match: %s\n", r.status().ToString().c_str());
        return 1;
      }
    }
    in_process.latency.Add(SteadyClock::now() - start);
  }
  for (int i = 0; i < calls; ++i) {
    const uint32_t q = i % distinct;
    pb::MatchResponse resp;
    const auto start = SteadyClock::now();
    {
      absl::StatusOr<MatchCall> call = MatchFromProto(index, match_requests[q], limits);
      absl::StatusOr<MatchResult> r = call.ok()
                                          ? index.Match(call->ns, call->prompt.pages, call->options)
                                          : absl::StatusOr<MatchResult>(call.status());
      if (!r.ok()) {
        std::fprintf(stderr, "Match: %s\n", r.status().ToString().c_str());
        return 1;
      }
      MatchResultToProto(*r, call->prompt.page_size_tokens, &resp);
    }
    handler.latency.Add(SteadyClock::now() - start);
  }

  route_core.latency.Reserve(calls);
  for (int i = 0; i < calls; ++i) {
    const uint32_t q = i % distinct;
    const auto start = SteadyClock::now();
    {
      absl::StatusOr<MatchResult> m = index.Match(kNamespace, prompts[q], {.probe = true});
      if (!m.ok()) {
        std::fprintf(stderr, "Match: %s\n", m.status().ToString().c_str());
        return 1;
      }
      const std::vector<RouteEstimate> ranked = RankAgents(
          RoutePolicy::kPrefillSaved, *m, route_candidates, route_cost, 0, &prompts[q][0]);
      if (ranked.front().cached_pages != prompts[q].size()) {
        std::fprintf(stderr, "route-core: the holder was not ranked first\n");
        return 1;
      }
    }
    route_core.latency.Add(SteadyClock::now() - start);
  }

  std::printf("kvcm_rpc_bench%s: %s, absl mutex deadlock detection %s\n", smoke ? " --smoke" : "",
              MachineSummary().c_str(),
              absl::GetFlag(FLAGS_mutex_deadlock_detection) ? "as built" : "off");
  std::printf(
      "index: %llu pages, %llu page-locations, %llu radix nodes; %d calls per arm after %d "
      "warm-up, blocks of %d, one client thread, loopback TCP\n",
      static_cast<unsigned long long>(stats.pages),
      static_cast<unsigned long long>(stats.page_locations),
      static_cast<unsigned long long>(stats.radix_nodes), calls, warmup, block);
  std::printf("  %-10s %7s %9s %9s %9s %9s %9s %8s %7s %7s\n", "arm", "calls", "p50_us", "p90_us",
              "p99_us", "p999_us", "mean_us", "cpu_us", "req_B", "resp_B");
  PrintArm(match);
  PrintArm(canned);
  PrintArm(echo);
  PrintArm(route);
  PrintArm(in_process);
  PrintArm(handler);
  PrintArm(route_core);
  const double p50_ratio = match.latency.Percentile(0.5) / echo.latency.Percentile(0.5);
  const double p99_ratio = match.latency.Percentile(0.99) / echo.latency.Percentile(0.99);
  std::printf("ratio match/echo: p50 %.3f (target <= 1.2: %s), p99 %.3f\n", p50_ratio,
              p50_ratio <= 1.2 ? "met" : "missed", p99_ratio);
  if (route.latency.size() > 0 && match.latency.size() > 0) {
    std::printf("ratio route/match: p50 %.3f, p99 %.3f (route ranks %zu agents)\n",
                route.latency.Percentile(0.5) / match.latency.Percentile(0.5),
                route.latency.Percentile(0.99) / match.latency.Percentile(0.99),
                route_candidates.size());
  }
  std::printf(
      "match p50 - echo p50 = %.1f us; server's Match handler time during the match arm "
      "(kvcm_rpc_duration_seconds): mean %.1f us\n",
      (match.latency.Percentile(0.5) - echo.latency.Percentile(0.5)) / 1e3, handler_mean_us);

  (*baseline_server)->Shutdown();
  (*manager)->Shutdown();
  return 0;
}

}  // namespace
}  // namespace kvcm::bench

int main(int argc, char** argv) {
  kvcm::ParseProgramFlags(argc, argv,
                          {.name = "kvcm_rpc_bench",
                           .usage = "kvcm_rpc_bench [--option=value ...]: the manager's RPC "
                                    "latency and throughput",
                           .flag_files = {"bench/rpc_bench.cc"}});
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  return kvcm::bench::Run();
}
