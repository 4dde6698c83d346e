// The manager side the CacheManager, AgentControl and prompt harnesses run against: a
// CacheIndex on a fake clock with one namespace and a few cached prompts, an AgentRegistry
// with two live agents registered through the real Register path, the command book, the
// inserter and the NCCL relay, wired as ManagerServer wires them (minus gRPC). Fresh per
// input; the seed generator builds its valid requests from the same constants.
#ifndef KVCM_FUZZ_MANAGER_WORLD_H_
#define KVCM_FUZZ_MANAGER_WORLD_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "fuzz/fuzz_input.h"
#include "kvcm/v1/agent.pb.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "proto/core_types.h"
#include "server/core/agent_command_book.h"
#include "server/core/agent_inserter.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/core/clock.h"
#include "server/core/engine_sessions.h"
#include "server/service/agent_control_service.h"
#include "server/service/nccl_bootstrap_relay.h"
#include "server/service/proto_convert.h"

namespace kvcm::fuzz {

inline constexpr HashKey kSecret{0x6b76636d2d66757a, 0x7a2d736565642d31};
inline const NamespaceId& SeedNamespace() {
  static const NamespaceId* ns = new NamespaceId{"tenant-a", "model-x"};
  return *ns;
}
// A small GQA model with 4-token pages (64 bytes a token, 256 a page).
inline ModelSpec SeedSpec() {
  ModelSpec s;
  s.attention = AttentionKind::kGqa;
  s.num_layers = 2;
  s.num_heads = 4;
  s.num_kv_heads = 2;
  s.head_dim = 4;
  s.dtype = KvDtype::kBf16;
  s.page_size_tokens = 4;
  return s;
}
inline constexpr const char* kAgents[] = {"agent-0", "agent-1"};
inline constexpr uint64_t kAgentBlocks = 64;

// Prompt i of the seeded cache: 16 tokens (4 pages); prompts 0 and 1 share their first 2.
inline std::vector<int32_t> SeedTokens(int i) {
  std::vector<int32_t> t;
  for (int k = 0; k < 16; ++k) t.push_back(k < 8 ? k : 100 * i + k);
  return t;
}

// A valid registration of agent `id` in `epoch`, as kvcm-agent sends it.
inline v1::RegisterAgentRequest SeedRegistration(const std::string& id, uint64_t epoch) {
  v1::RegisterAgentRequest req;
  req.set_agent_id(id);
  req.set_device("host");
  req.set_tier(v1::TIER_GPU);
  req.set_epoch(epoch);
  req.set_block_agent_address("127.0.0.1:7001");
  req.set_data_address("127.0.0.1:7002");
  req.set_transport(id == kAgents[1] ? "nccl" : "tcp");
  ModelSpecToProto(SeedSpec(), req.mutable_geometry()->mutable_spec());
  req.mutable_geometry()->set_bytes_per_block(SeedSpec().BytesPerPage());
  req.mutable_geometry()->set_num_blocks(kAgentBlocks);
  req.set_capacity_bytes(kAgentBlocks * SeedSpec().BytesPerPage());
  req.mutable_host_pool()->set_num_blocks(kAgentBlocks);
  req.mutable_host_pool()->set_capacity_bytes(kAgentBlocks * SeedSpec().BytesPerPage());
  return req;
}

struct ManagerWorld {
  FakeClock clock;
  std::unique_ptr<CacheIndex> index;
  AgentRegistry agents{&clock, absl::Seconds(10)};
  AgentCommandBook commands;
  AgentInserter inserter;
  std::unique_ptr<EngineSessions> engines;
  NcclBootstrapRelay relay;
  RequestLimits limits{.max_tokens_per_request = 4096,
                       .max_pages_per_request = 512,
                       .max_lease_ttl_ms = 600'000,
                       .default_lease_ttl_ms = 30'000};
  RegisterModelResult ns;  // the seeded namespace

  ManagerWorld()
      : index(std::make_unique<CacheIndex>(CacheIndexOptions{
            .hash_secret = kSecret, .default_pool_capacity_bytes = 1 << 20, .clock = &clock})),
        inserter(index.get(), &commands, &agents),
        engines(std::make_unique<EngineSessions>(index.get(), &clock, absl::Seconds(30))) {
    absl::StatusOr<RegisterModelResult> r = index->RegisterModel(SeedNamespace(), SeedSpec());
    Require(r.ok(), "seed namespace");
    ns = *r;
    for (const char* id : kAgents) {
      Require(RegisterAgent(SeedRegistration(id, 1)).ok(), "seed agent");
    }
    // Prompt 0 on agent-0 and in an index-only pool, prompt 1 on agent-1.
    const PoolKey pools[] = {
        {kAgents[0], Tier::kGpu}, {kAgents[1], Tier::kGpu}, {"store-0", Tier::kHost}};
    const int prompt_of_pool[] = {0, 1, 0};
    for (int p = 0; p < 3; ++p) {
      absl::StatusOr<std::vector<PageHash>> pages =
          index->HashTokens(SeedNamespace(), SeedTokens(prompt_of_pool[p]));
      Require(pages.ok(), "seed hashes");
      const std::vector<BlockId> blocks = {10, 11, 12, 13};
      Require(index->Insert(SeedNamespace(), *pages, pools[p], blocks).ok(), "seed insert");
    }
  }

  // As ManagerServer::Shutdown: the book completes what is queued before the rest goes.
  ~ManagerWorld() {
    index->SetEventListener(nullptr);
    commands.Close();
  }

  // AgentControlService::Register's body.
  absl::Status RegisterAgent(const v1::RegisterAgentRequest& req) {
    absl::StatusOr<RegisterAgentCall> call = RegisterAgentFromProto(req);
    if (!call.ok()) return call.status();
    const AgentRegistration& r = call->registration;
    absl::StatusOr<RegisterOutcome> check = agents.CheckRegister(r);
    if (!check.ok()) return check.status();
    if (check->new_epoch) {
      commands.OnRegistered(r.agent_id, r.epoch);
      DropAgentPools(*index, r);
    }
    if (absl::Status s = index->SetPoolCapacity({r.agent_id, r.tier}, r.capacity_bytes); !s.ok()) {
      return s;
    }
    if (r.host_capacity_bytes > 0) {
      if (absl::Status s = index->SetPoolCapacity({r.agent_id, Tier::kHost}, r.host_capacity_bytes);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = agents.Register(r).status(); !s.ok()) return s;
    relay.OnRegistered(r.agent_id, r.epoch, req.transport());
    return absl::OkStatus();
  }
};

// The seeded namespace's hash scheme, as RegisterModel answers it.
inline v1::HashScheme SeedScheme(const ManagerWorld& world) {
  v1::HashScheme scheme;
  scheme.set_version(kPageHashVersion);
  scheme.set_page_size_tokens(SeedSpec().page_size_tokens);
  scheme.set_key_fingerprint(KeyFingerprint(world.ns.hash_key));
  return scheme;
}

}  // namespace kvcm::fuzz

#endif  // KVCM_FUZZ_MANAGER_WORLD_H_
