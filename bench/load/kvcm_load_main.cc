// kvcm-load: a load generator for a running kvcm-manager, over real gRPC.
//
// Registers a namespace (RegisterModel with a catalogue model), hashes a prefix-sharing
// prompt set once, registers fake agents when the mix routes, then drives a mix of Match /
// Insert / Release / Route for warmup_s + duration_s, closed or open loop, and prints
// throughput, latency percentiles and errors by gRPC code per RPC kind (--json too).
// Inserts go to index-only pools (pools of no registered agent), which the manager lets an
// admin create; a manager without --tokens_file treats every caller as admin.
//
//   kvcm-load --address=127.0.0.1:50051 --mix=match:70,insert:30 --concurrency=64
//   kvcm-load --loop=open --rate=20000 --duration_s=600 --manager_pid=$PID
//   kvcm-load --smoke --address=...   (about 2 s; exit 1 on any error or no calls)
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "bench/load/load_driver.h"
#include "bench/load/load_stats.h"
#include "bench/load/prompt_set.h"
#include "client/client.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "common/program_flags.h"
#include "grpcpp/grpcpp.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"

ABSL_FLAG(std::string, manager_address, "127.0.0.1:50051", "kvcm-manager address (plaintext)");
ABSL_FLAG(std::string, address, "", "deprecated: use --manager_address");
ABSL_FLAG(std::string, api, "stub",
          "stub: generated async stubs on completion queues; client: kvcm::Client's blocking "
          "calls, one thread per outstanding call (closed loop only)");
ABSL_FLAG(std::string, loop, "closed", "closed (--concurrency outstanding) or open (--rate)");
ABSL_FLAG(double, rate, 1000, "open loop: calls due per second, all threads together");
ABSL_FLAG(std::string, arrivals, "poisson", "open loop: poisson or fixed inter-arrival times");
ABSL_FLAG(uint32_t, concurrency, 32,
          "closed loop: calls outstanding; open loop: the most outstanding at once");
ABSL_FLAG(uint32_t, threads, 1, "stub API: threads driving completion queues");
ABSL_FLAG(uint32_t, channels, 1, "gRPC channels (TCP connections) the calls are spread over");
ABSL_FLAG(double, warmup_s, 1, "seconds of load before measuring");
ABSL_FLAG(double, duration_s, 10, "measured seconds");
ABSL_FLAG(int64_t, deadline_ms, 1000, "deadline of each call");
ABSL_FLAG(std::string, mix, "match:70,insert:30",
          "RPC kinds and weights, e.g. match:60,insert:20,release:10,route:10 (with release, "
          "Matches pin and the pins are released later); probe: a Match with probe set");
ABSL_FLAG(std::string, model, "deepseek-v3", "catalogue model of the namespace");
ABSL_FLAG(std::string, tenant, "kvcm-load", "tenant of the namespaces");
ABSL_FLAG(uint32_t, namespaces, 1,
          "namespaces registered (MODEL, or MODEL-0, MODEL-1, ... when more than one), each "
          "with its own prompts and index-only pools; each call draws one");
ABSL_FLAG(uint32_t, index_pools, 4, "index-only pools per namespace the inserts are spread over");
ABSL_FLAG(uint32_t, route_agents, 4, "fake agents registered (and kept alive) when the mix routes");
ABSL_FLAG(uint32_t, prefixes, 32, "shared prompt prefixes");
ABSL_FLAG(uint32_t, prompts_per_prefix, 32, "prompts behind each prefix");
ABSL_FLAG(uint32_t, prefix_pages, 8, "pages of each shared prefix");
ABSL_FLAG(uint32_t, suffix_pages, 24, "pages each prompt adds to its prefix");
ABSL_FLAG(uint32_t, max_pins_per_thread, 64, "pins a thread holds at most");
ABSL_FLAG(double, report_interval_s, 0, "print a line every this many seconds; 0: none");
ABSL_FLAG(int, manager_pid, 0, "sample this process's VmRSS (/proc/PID/status) in the lines");
ABSL_FLAG(std::string, json, "", "also write the results as JSON to this file");
ABSL_FLAG(bool, smoke, false, "about 2 s of every RPC kind; exit 1 on errors or no calls");

namespace kvcm::load {
namespace {

// VmRSS of `pid` in bytes; 0 when it cannot be read.
uint64_t ReadRssBytes(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
    }
  }
  return 0;
}

// Fake agents for Route (which ranks live agents): registered, then heartbeated every
// second until Stop(). They hold nothing; Route still walks the index for each.
// Not thread-safe: Start and Stop from one thread.
class FakeAgents {
 public:
  absl::Status Start(const std::string& address, const ModelSpec& spec, uint32_t n) {
    stub_ = v1::AgentControl::NewStub(MakeInsecureChannel(address));
    for (uint32_t i = 0; i < n; ++i) {
      v1::RegisterAgentRequest req;
      req.set_agent_id(absl::StrCat("kvcm-load-agent-", i));
      req.set_device("host");
      req.set_tier(v1::TIER_GPU);
      ModelSpecToProto(spec, req.mutable_geometry()->mutable_spec());
      req.mutable_geometry()->set_bytes_per_block(spec.BytesPerPage());
      req.mutable_geometry()->set_num_blocks(1024);
      req.set_capacity_bytes(1024 * spec.BytesPerPage());
      req.set_epoch(static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())));
      grpc::ClientContext ctx;
      v1::RegisterAgentResponse resp;
      grpc::Status s = stub_->Register(&ctx, req, &resp);
      if (!s.ok()) {
        return absl::UnavailableError(
            absl::StrCat("registering ", req.agent_id(), ": ", s.error_message()));
      }
      ids_.emplace_back(req.agent_id(), req.epoch());
    }
    thread_ = std::thread([this] {
      while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
        for (const auto& [id, epoch] : ids_) {
          v1::HeartbeatRequest req;
          req.set_agent_id(id);
          req.set_epoch(epoch);
          grpc::ClientContext ctx;
          v1::HeartbeatResponse resp;
          (void)stub_->Heartbeat(&ctx, req, &resp);
        }
      }
    });
    return absl::OkStatus();
  }
  void Stop() {
    if (!thread_.joinable()) {
      return;
    }
    stop_.Notify();
    thread_.join();
  }
  ~FakeAgents() { Stop(); }

 private:
  std::unique_ptr<v1::AgentControl::Stub> stub_;
  std::vector<std::pair<std::string, uint64_t>> ids_;
  absl::Notification stop_;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<Client>> ConnectClient(const std::string& address, int attempts) {
  ClientOptions o;
  o.address = address;
  o.insecure = true;
  o.max_attempts = attempts;
  return Client::Connect(o);
}

// CPU seconds (user + system) `pid` has used; 0 when it cannot be read.
double ReadCpuSeconds(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) {
    return 0;
  }
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  if (fields.size() < 13) {
    return 0;
  }
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  return (std::strtod(fields[11].c_str(), nullptr) + std::strtod(fields[12].c_str(), nullptr)) /
         ticks;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvcm-load: %s\n", s.ToString().c_str());
  return 2;
}

int Main() {
  const bool smoke = absl::GetFlag(FLAGS_smoke);
  LoadOptions options;
  options.address = absl::GetFlag(FLAGS_manager_address);
  options.open_loop = absl::GetFlag(FLAGS_loop) == "open";
  if (!options.open_loop && absl::GetFlag(FLAGS_loop) != "closed") {
    return Fail(absl::InvalidArgumentError("--loop: closed or open"));
  }
  options.rate_per_s = absl::GetFlag(FLAGS_rate);
  options.poisson = absl::GetFlag(FLAGS_arrivals) != "fixed";
  options.concurrency = absl::GetFlag(FLAGS_concurrency);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.channels = absl::GetFlag(FLAGS_channels);
  options.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  options.duration_s = absl::GetFlag(FLAGS_duration_s);
  options.deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
  options.max_pins_per_thread = absl::GetFlag(FLAGS_max_pins_per_thread);
  std::string mix_spec = absl::GetFlag(FLAGS_mix);
  PromptSetOptions prompt_options;
  prompt_options.num_prefixes = absl::GetFlag(FLAGS_prefixes);
  prompt_options.prompts_per_prefix = absl::GetFlag(FLAGS_prompts_per_prefix);
  prompt_options.prefix_pages = absl::GetFlag(FLAGS_prefix_pages);
  prompt_options.suffix_pages = absl::GetFlag(FLAGS_suffix_pages);
  if (smoke) {
    options.warmup_s = 0.3;
    options.duration_s = 2;
    options.concurrency = 8;
    options.threads = 2;
    options.channels = 2;
    options.deadline_ms = 5000;
    mix_spec = "match:40,insert:30,release:15,route:15";
    prompt_options.num_prefixes = 8;
    prompt_options.prompts_per_prefix = 8;
  }
  if (absl::GetFlag(FLAGS_api) != "client" && absl::GetFlag(FLAGS_api) != "stub") {
    return Fail(absl::InvalidArgumentError("--api: stub or client"));
  }
  options.api =
      absl::GetFlag(FLAGS_api) == "client" ? LoadOptions::Api::kClient : LoadOptions::Api::kStub;
  const bool client_api = options.api == LoadOptions::Api::kClient;
  if (absl::Status s = options.Validate(); !s.ok()) {
    return Fail(s);
  }

  LoadTarget target;
  absl::StatusOr<RpcMix> mix = RpcMix::Parse(mix_spec);
  if (!mix.ok()) {
    return Fail(mix.status());
  }
  target.mix = *mix;
  absl::StatusOr<ModelSpec> spec = FindModel(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) {
    return Fail(spec.status());
  }

  // Set-up client: retries while the manager is still starting.
  absl::StatusOr<std::unique_ptr<Client>> setup = ConnectClient(options.address, 10);
  if (!setup.ok()) {
    return Fail(setup.status());
  }
  const uint32_t num_namespaces = absl::GetFlag(FLAGS_namespaces);
  if (num_namespaces == 0 || absl::GetFlag(FLAGS_index_pools) == 0) {
    return Fail(absl::InvalidArgumentError("--namespaces and --index_pools must be > 0"));
  }
  prompt_options.keep_tokens = client_api && target.mix.weight(RpcKind::kRoute) > 0;
  ModelSpec stored_spec;
  for (uint32_t n = 0; n < num_namespaces; ++n) {
    NamespaceLoad load;
    // One namespace: the model's name; several: its name and a number.
    load.ns = NamespaceId{absl::GetFlag(FLAGS_tenant),
                          num_namespaces == 1 ? absl::GetFlag(FLAGS_model)
                                              : absl::StrCat(absl::GetFlag(FLAGS_model), "-", n)};
    absl::StatusOr<RegisterModelReply> reg = (*setup)->RegisterModel(load.ns, *spec);
    if (!reg.ok()) {
      return Fail(reg.status());
    }
    stored_spec = reg->spec;
    target.page_size_tokens = reg->spec.page_size_tokens;
    load.key_fingerprint = reg->key_fingerprint;
    prompt_options.seed = n + 1;
    absl::StatusOr<PromptSet> prompts = PromptSet::Make(
        prompt_options, target.page_size_tokens,
        [&](std::span<const int32_t> tokens) { return (*setup)->HashPrompt(load.ns, tokens); });
    if (!prompts.ok()) {
      return Fail(prompts.status());
    }
    load.prompts = *std::move(prompts);
    for (uint32_t i = 0; i < absl::GetFlag(FLAGS_index_pools); ++i) {
      // Pools of their own per namespace: a pool's blocks are one model's.
      load.pools.push_back(PoolRef{num_namespaces == 1 ? absl::StrCat("kvcm-load-pool-", i)
                                                       : absl::StrCat("kvcm-load-pool-", n, "-", i),
                                   Tier::kGpu});
    }
    target.namespaces.push_back(std::move(load));
  }

  FakeAgents agents;
  if (target.mix.weight(RpcKind::kRoute) > 0) {
    if (absl::Status s =
            agents.Start(options.address, stored_spec, absl::GetFlag(FLAGS_route_agents));
        !s.ok()) {
      return Fail(s);
    }
  }

  std::vector<std::unique_ptr<Client>> clients;
  if (client_api) {
    for (uint32_t i = 0; i < options.channels; ++i) {
      absl::StatusOr<std::unique_ptr<Client>> c = ConnectClient(options.address, 1);
      if (!c.ok()) {
        return Fail(c.status());
      }
      for (const NamespaceLoad& load : target.namespaces) {
        if (absl::StatusOr<RegisterModelReply> r = (*c)->RegisterModel(load.ns, *spec); !r.ok()) {
          return Fail(r.status());
        }
      }
      target.clients.push_back(c->get());
      clients.push_back(*std::move(c));
    }
  }

  const uint32_t workers = client_api ? options.concurrency : options.threads;
  std::vector<std::unique_ptr<WorkerStats>> stats;
  for (uint32_t i = 0; i < workers; ++i) {
    stats.push_back(std::make_unique<WorkerStats>());
  }
  std::printf(
      "kvcm-load: %s, api %s, %s loop%s, mix %s, concurrency %u, threads %u, channels %u, "
      "warmup %.1f s, duration %.1f s, %zu namespaces, each %zu prompts of %u pages and %zu "
      "index-only pools\n",
      options.address.c_str(), client_api ? "client" : "stub",
      options.open_loop ? "open" : "closed",
      options.open_loop ? absl::StrFormat(" at %.0f/s (%s)", options.rate_per_s,
                                          options.poisson ? "poisson" : "fixed")
                              .c_str()
                        : "",
      target.mix.ToString().c_str(), options.concurrency, options.threads, options.channels,
      options.warmup_s, options.duration_s, target.namespaces.size(),
      target.namespaces[0].prompts.size(),
      prompt_options.prefix_pages + prompt_options.suffix_pages, target.namespaces[0].pools.size());
  std::fflush(stdout);

  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(100);
  // CPU of both processes over the measured window, sampled at its edges.
  double self_cpu_s = 0;
  double manager_cpu_s = 0;
  const int pid = absl::GetFlag(FLAGS_manager_pid);
  const double interval_s = absl::GetFlag(FLAGS_report_interval_s);
  std::thread cpu_sampler([&] {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(options.warmup_s)));
    self_cpu_s = -ReadCpuSeconds(getpid());
    manager_cpu_s = pid > 0 ? -ReadCpuSeconds(pid) : 0;
    std::this_thread::sleep_for(std::chrono::duration<double>(options.duration_s));
    self_cpu_s += ReadCpuSeconds(getpid());
    manager_cpu_s += pid > 0 ? ReadCpuSeconds(pid) : 0;
  });
  absl::Notification done;
  std::thread reporter;
  std::vector<std::string> interval_json;  // written by the reporter, read after joining it
  if (interval_s > 0) {
    reporter = std::thread([&] {
      Clock::time_point last = start;
      while (!done.WaitForNotificationWithTimeout(absl::Seconds(interval_s))) {
        const Clock::time_point now = Clock::now();
        RunStats interval;
        for (auto& s : stats) {
          s->TakeInterval(&interval);
        }
        const double t = std::chrono::duration<double>(now - start).count();
        const double seconds = std::chrono::duration<double>(now - last).count();
        const uint64_t rss_bytes = pid > 0 ? ReadRssBytes(pid) : 0;
        std::string rss;
        if (pid > 0) {
          rss = absl::StrFormat(" | manager rss %.1f MiB", rss_bytes / 1048576.0);
        }
        std::printf("[%7.1f s%s] %s%s\n", t, t < options.warmup_s ? " warmup" : "",
                    FormatIntervalLine(interval, seconds).c_str(), rss.c_str());
        interval_json.push_back(
            absl::StrFormat("{\"t_s\":%.1f,\"manager_rss_bytes\":%d,\"stats\":%s}", t, rss_bytes,
                            StatsToJson(interval, seconds)));
        std::fflush(stdout);
        last = now;
      }
    });
  }
  if (client_api) {
    RunClientLoad(options, target, start, stats);
  } else {
    RunStubLoad(options, target, start, stats);
  }
  done.Notify();
  if (reporter.joinable()) {
    reporter.join();
  }
  cpu_sampler.join();
  agents.Stop();

  RunStats total;
  for (auto& s : stats) {
    s->AddTotal(&total);
  }
  std::printf("%s", FormatStatsTable(total, options.duration_s).c_str());
  const double us_per_call = total.calls() > 0 ? 1e6 / total.calls() : 0;
  std::printf("cpu over the measured window: kvcm-load %.2f cores (%.1f us/call)",
              self_cpu_s / options.duration_s, self_cpu_s * us_per_call);
  if (pid > 0) {
    std::printf(", manager %.2f cores (%.1f us/call); manager rss %.1f MiB",
                manager_cpu_s / options.duration_s, manager_cpu_s * us_per_call,
                ReadRssBytes(pid) / 1048576.0);
  }
  std::printf("\n");
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream out(path);
    out << absl::StrFormat(
        "{\"config\":{\"address\":\"%s\",\"api\":\"%s\",\"loop\":\"%s\",\"rate\":%.1f,"
        "\"arrivals\":\"%s\",\"mix\":\"%s\",\"concurrency\":%d,\"threads\":%d,"
        "\"channels\":%d,\"warmup_s\":%.1f,\"duration_s\":%.1f,\"deadline_ms\":%d,"
        "\"namespaces\":%d,\"prompts\":%d,\"prompt_pages\":%d},"
        "\"cpu\":{\"kvcm_load_cores\":%.3f,\"kvcm_load_us_per_call\":%.2f,"
        "\"manager_cores\":%.3f,\"manager_us_per_call\":%.2f},"
        "\"manager_rss_bytes\":%d,\"results\":%s,\"intervals\":[%s]}\n",
        options.address, client_api ? "client" : "stub", options.open_loop ? "open" : "closed",
        options.rate_per_s, options.poisson ? "poisson" : "fixed", target.mix.ToString(),
        options.concurrency, options.threads, options.channels, options.warmup_s,
        options.duration_s, options.deadline_ms, target.namespaces.size(),
        target.namespaces[0].prompts.size(),
        prompt_options.prefix_pages + prompt_options.suffix_pages, self_cpu_s / options.duration_s,
        self_cpu_s * us_per_call, manager_cpu_s / options.duration_s, manager_cpu_s * us_per_call,
        pid > 0 ? ReadRssBytes(pid) : 0, StatsToJson(total, options.duration_s),
        absl::StrJoin(interval_json, ","));
    if (!out) {
      return Fail(absl::UnavailableError(absl::StrCat("cannot write ", path)));
    }
  }
  if (smoke && (total.calls() == 0 || total.errors() > 0)) {
    std::fprintf(stderr, "kvcm-load: smoke failed: %llu calls, %llu errors\n",
                 static_cast<unsigned long long>(total.calls()),
                 static_cast<unsigned long long>(total.errors()));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvcm::load

int main(int argc, char** argv) {
  kvcm::ParseProgramFlags(
      argc, argv,
      {.name = "kvcm-load",
       .usage = "kvcm-load [--manager_address=HOST:PORT] [--option=value ...]: Match/Insert/"
                "Release/Route load against a running kvcm-manager",
       .flag_files = {"bench/load/kvcm_load_main.cc"}});
  kvcm::ApplyDeprecatedFlag("kvcm-load", FLAGS_address, "address", FLAGS_manager_address,
                            "manager_address");
  // As in kvcm-manager: Debian's Abseil (built without NDEBUG) runs the deadlock detector on
  // every absl::Mutex lock, gRPC's included (GraphCycles: 2.7 % of kvcm-load's CPU profiled).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return kvcm::load::Main();
}
