// A kvcm-manager and kvcm-agents as child processes on loopback, for multi-process tests:
// started together, each logging to its own file (printed when the test failed), every one
// SIGKILLed and reaped when the cluster dies, whatever path the test left by. Header-only,
// test code. REQUIRES: the test target defines KVCM_MANAGER_PATH and KVCM_AGENT_PATH.
#ifndef KVCM_TESTS_UTIL_PROCESS_CLUSTER_H_
#define KVCM_TESTS_UTIL_PROCESS_CLUSTER_H_

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/util/child_process.h"

namespace kvcm::testing {

struct ProcessClusterOptions {
  std::vector<std::string> agent_ids;
  // Flags every kvcm-agent gets after its id and addresses: model, capacity, heartbeats.
  std::vector<std::string> agent_flags;
  // Flags kvcm-manager gets after its addresses.
  std::vector<std::string> manager_flags;
};

// Not thread-safe: one test thread drives it.
class ProcessCluster {
 public:
  // Starts the manager and every agent and waits up to 20 s for all of them to register;
  // null, with a test failure, when they do not.
  static std::unique_ptr<ProcessCluster> Start(const ProcessClusterOptions& options) {
    static std::atomic<int> clusters{0};
    auto c = std::unique_ptr<ProcessCluster>(new ProcessCluster());
    const char* tmp = std::getenv("TMPDIR");
    c->log_base_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcm_cluster_", getpid(), "_",
                                clusters.fetch_add(1));
    c->manager_address_ = absl::StrCat("127.0.0.1:", FreePort());
    std::vector<std::string> manager = {KVCM_MANAGER_PATH, "--insecure",
                                        absl::StrCat("--listen_address=", c->manager_address_),
                                        "--metrics_address=", "--shutdown_grace_ms=500"};
    manager.insert(manager.end(), options.manager_flags.begin(), options.manager_flags.end());
    if (!c->Spawn("manager", manager)) return nullptr;
    // Agents start once the manager serves: one that finds it absent waits out gRPC's
    // reconnect backoff (a second) before registering. Each poll uses a new channel, as a
    // channel that found no server may take seconds to try again.
    const bool serving = WaitUntil(
        [&] {
          absl::StatusOr<std::unique_ptr<Client>> probe = Client::Connect(
              {.address = c->manager_address_, .max_attempts = 1, .insecure = true});
          return probe.ok() && (*probe)->Stats({.deadline_ms = 500}).ok();
        },
        absl::Seconds(20));
    if (!serving) {
      ADD_FAILURE() << "kvcm-manager did not serve within 20 s";
      return nullptr;
    }
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect({.address = c->manager_address_, .insecure = true});
    if (!client.ok()) {
      ADD_FAILURE() << client.status();
      return nullptr;
    }
    c->client_ = *std::move(client);
    for (const std::string& id : options.agent_ids) {
      std::vector<std::string> agent = {KVCM_AGENT_PATH,
                                        "--insecure",
                                        absl::StrCat("--agent_id=", id),
                                        absl::StrCat("--manager_address=", c->manager_address_),
                                        "--listen_address=127.0.0.1:0",
                                        "--data_listen_address=127.0.0.1:0"};
      agent.insert(agent.end(), options.agent_flags.begin(), options.agent_flags.end());
      if (!c->Spawn(id, agent)) return nullptr;
    }
    const bool registered = WaitUntil(
        [&] {
          absl::StatusOr<ManagerStats> s = c->client_->Stats();
          return s.ok() && s->agents.size() == options.agent_ids.size();
        },
        absl::Seconds(20));
    if (!registered) {
      ADD_FAILURE() << "the agents did not register within 20 s";
      return nullptr;
    }
    absl::StatusOr<ManagerStats> stats = c->client_->Stats();
    if (!stats.ok()) {
      ADD_FAILURE() << stats.status();
      return nullptr;
    }
    for (const ManagerStats::Agent& a : stats->agents) c->agents_[a.agent_id] = a;
    return c;
  }

  ~ProcessCluster() {
    for (auto& [name, p] : processes_) {
      if (p != nullptr) {
        p->Signal(SIGKILL);
        p->Finish(absl::Seconds(10));
      }
      const std::string path = LogPath(name);
      if (::testing::Test::HasFailure()) {
        std::fprintf(stderr, "--- %s ---\n%s\n", name.c_str(), ReadFile(path).c_str());
      }
      std::remove(path.c_str());
    }
  }

  const std::string& manager_address() const { return manager_address_; }
  // A client of the manager (no namespace registered by it).
  Client& client() { return *client_; }
  // The agent as the manager saw it once every agent had registered. REQUIRES: a started id.
  const ManagerStats::Agent& agent(const std::string& id) const { return agents_.at(id); }

  std::unique_ptr<v1::BlockAgent::Stub> Stub(const std::string& id) const {
    return v1::BlockAgent::NewStub(MakeInsecureChannel(agent(id).block_agent_address));
  }

  // BlockAgent.Stats of agent `id` within 5 s, or the call's error.
  absl::StatusOr<v1::BlockAgentStatsResponse> AgentStats(const std::string& id) const {
    v1::BlockAgentStatsResponse s;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const grpc::Status status = Stub(id)->Stats(&ctx, v1::BlockAgentStatsRequest(), &s);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    return s;
  }
  // Free blocks of agent `id`'s pool; 0 when it does not answer.
  uint64_t FreeBlocks(const std::string& id) const {
    absl::StatusOr<v1::BlockAgentStatsResponse> s = AgentStats(id);
    return s.ok() ? s->free_blocks() : 0;
  }

  // kill -9 of process `name` (an agent id or "manager"), reaped before this returns.
  void Kill(const std::string& name) {
    std::unique_ptr<Subprocess>& p = processes_.at(name);
    if (p == nullptr) return;
    p->Signal(SIGKILL);
    p->Finish(absl::Seconds(10));
    p.reset();
  }

  // The blocks `agent` holds for the matched pages of `tokens` (probing: nothing changes),
  // in page order, over its pool of any tier.
  std::vector<BlockId> MatchedOn(const NamespaceId& ns, std::span<const int32_t> tokens,
                                 const std::string& agent) {
    std::vector<BlockId> out;
    absl::StatusOr<MatchReply> m = client_->Match(ns, tokens, {.probe = true});
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return out;
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& r : seg.replicas) {
        if (r.pool.agent_id == agent) out.insert(out.end(), r.block_ids.begin(), r.block_ids.end());
      }
    }
    return out;
  }

 private:
  ProcessCluster() = default;

  std::string LogPath(const std::string& name) const {
    return absl::StrCat(log_base_, "_", name, ".log");
  }
  bool Spawn(const std::string& name, const std::vector<std::string>& argv) {
    processes_[name] = Subprocess::Start(argv, LogPath(name));
    return processes_[name] != nullptr;
  }

  std::string log_base_;
  std::string manager_address_;
  std::map<std::string, std::unique_ptr<Subprocess>> processes_;  // by agent id, "manager"
  std::unique_ptr<Client> client_;
  std::map<std::string, ManagerStats::Agent> agents_;
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_PROCESS_CLUSTER_H_
