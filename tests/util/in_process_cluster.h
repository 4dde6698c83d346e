// Helpers of the tests that run a ManagerServer and in-process Agents (host backend) and talk
// to them through the real client and stubs: agent_commands_test and agent_insert_test.
#ifndef KVCM_TESTS_UTIL_IN_PROCESS_CLUSTER_H_
#define KVCM_TESTS_UTIL_IN_PROCESS_CLUSTER_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gpu/agent/server/agent.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm::testing {

inline std::unique_ptr<ManagerServer> StartManager(ServerOptions o = {}) {
  o.tls.insecure = true;  // plaintext in-process; tests/tls_test.cc covers TLS
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

inline constexpr uint64_t kBlockBytes = 1152ull * 61 * 64;  // a DeepSeek-V3 bf16 page

inline std::unique_ptr<Agent> StartAgent(const std::string& manager_address, uint64_t blocks,
                                         uint64_t host_blocks = 0,
                                         const std::string& agent_id = "gpu-3") {
  AgentOptions o;
  o.tls.insecure = true;  // plaintext in-process; tests/tls_test.cc covers TLS
  o.agent_id = agent_id;
  o.manager_address = manager_address;
  o.use_device = false;
  o.capacity_bytes = blocks * kBlockBytes;
  o.host_capacity_bytes = host_blocks * kBlockBytes;
  o.heartbeat_interval_ms = 20;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return *std::move(agent);
}

inline uint64_t FreeBlocksOf(v1::BlockAgent::Stub& agent) { return StatsOf(agent).free_blocks(); }

// A client of the manager at `address` that has registered `spec` as `ns`; null (with a
// test failure) if either step fails.
inline std::unique_ptr<Client> ConnectAndRegister(const std::string& address, const NamespaceId& ns,
                                                  const ModelSpec& spec) {
  ClientOptions co;
  co.insecure = true;
  co.address = address;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(co);
  if (!client.ok()) {
    ADD_FAILURE() << client.status();
    return nullptr;
  }
  if (absl::StatusOr<RegisterModelReply> r = (*client)->RegisterModel(ns, spec); !r.ok()) {
    ADD_FAILURE() << r.status();
    return nullptr;
  }
  return *std::move(client);
}

inline std::unique_ptr<v1::BlockAgent::Stub> BlockAgentStub(const Agent& agent) {
  return v1::BlockAgent::NewStub(MakeInsecureChannel(agent.address()));
}

// What a refused insert must leave as it was: the pages of every pool, the page locations
// of every namespace, and the agent's free blocks.
using Counts = std::tuple<uint64_t, uint64_t, uint64_t>;
inline Counts CountsOf(Client& client, v1::BlockAgent::Stub& agent) {
  absl::StatusOr<ManagerStats> stats = client.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  uint64_t pool_pages = 0;
  uint64_t ns_pages = 0;
  if (stats.ok()) {
    for (const ManagerStats::Pool& p : stats->pools) pool_pages += p.pages;
    for (const ManagerStats::Namespace& n : stats->namespaces) ns_pages += n.page_locations;
  }
  return {pool_pages, ns_pages, FreeBlocksOf(agent)};
}

// The blocks of every matched page of `tokens` in `ns`, in page order (probing: nothing
// changes); empty when nothing matches.
inline std::vector<BlockId> MatchedBlocks(Client& client, const NamespaceId& ns,
                                          std::span<const int32_t> tokens) {
  absl::StatusOr<MatchReply> m = client.Match(ns, tokens, {.probe = true});
  EXPECT_TRUE(m.ok()) << m.status();
  std::vector<BlockId> blocks;
  if (!m.ok()) return blocks;
  for (const MatchReply::Segment& seg : m->segments) {
    EXPECT_EQ(seg.replicas.size(), 1u);
    if (seg.replicas.empty()) continue;
    blocks.insert(blocks.end(), seg.replicas[0].block_ids.begin(), seg.replicas[0].block_ids.end());
  }
  EXPECT_EQ(blocks.size(), m->matched_pages);
  return blocks;
}

inline bool MetricsHave(ManagerServer& manager, absl::string_view line) {
  return absl::StrContains(manager.metrics().RenderText(), line);
}

// kvcm_agent_commands_total{result="failed"}: commands the agent acked with an error.
inline uint64_t FailedCommands(ManagerServer& manager) {
  const std::string text = manager.metrics().RenderText();
  const std::string kLine = "kvcm_agent_commands_total{result=\"failed\"} ";
  const size_t at = text.find(kLine);
  EXPECT_NE(at, std::string::npos);
  return at == std::string::npos ? 0 : std::strtoull(text.c_str() + at + kLine.size(), nullptr, 10);
}

inline std::vector<int32_t> Tokens(size_t pages, uint32_t page_size, int32_t seed) {
  std::vector<int32_t> tokens(pages * page_size);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7 + seed);
  return tokens;
}

inline std::string Bytes(size_t n, int seed) {
  std::string b(n, '\0');
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<char>((i * 13 + seed) & 0xff);
  return b;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_IN_PROCESS_CLUSTER_H_
