// Writes the seed corpus: make_fuzz_seeds DIR puts DIR/<harness>/<seed> files, each a
// valid session (or file) built from the worlds' constants, so that the fuzzers start past
// the parsers' and validators' first refusals. The checked-in fuzz/corpus/ is its output.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/base/internal/endian.h"
#include "fuzz/agent_world.h"
#include "fuzz/calls.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/manager_world.h"

namespace kvcm::fuzz {
namespace {

namespace fs = std::filesystem;

void Write(const fs::path& dir, const std::string& harness, const std::string& name,
           const std::string& bytes) {
  fs::create_directories(dir / harness);
  std::FILE* f = std::fopen((dir / harness / name).c_str(), "wb");
  Require(f != nullptr, "seed file");
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

std::string Frame(const google::protobuf::MessageLite& m) {
  const std::string body = m.SerializeAsString();
  char len[4];
  absl::little_endian::Store32(len, static_cast<uint32_t>(body.size()));
  return std::string(len, 4) + body;
}

void Tokens(const std::vector<int32_t>& tokens, v1::Prompt* out) {
  out->mutable_tokens()->mutable_ids()->Add(tokens.begin(), tokens.end());
}

void Hashes(const ManagerWorld& w, int prompt, v1::Prompt* out) {
  absl::StatusOr<std::vector<PageHash>> pages =
      w.index->HashTokens(SeedNamespace(), SeedTokens(prompt));
  Require(pages.ok(), "hashes");
  out->set_page_hashes(EncodePageHashes(*pages));
  *out->mutable_scheme() = SeedScheme(w);
}

// An Insert of seed prompt `prompt` (as tokens) into `agent`'s pool of `tier`, its four pages
// in blocks first_block.., of agent epoch `epoch` (0: an index-only pool).
v1::InsertRequest InsertOf(const std::string& agent, v1::Tier tier, int prompt, BlockId first_block,
                           uint64_t epoch) {
  v1::InsertRequest insert;
  NamespaceToProto(SeedNamespace(), insert.mutable_namespace_());
  insert.mutable_pool()->set_agent_id(agent);
  insert.mutable_pool()->set_tier(tier);
  Tokens(SeedTokens(prompt), insert.mutable_prompt());
  for (BlockId b = first_block; b < first_block + 4; ++b) insert.add_block_ids(b);
  insert.set_agent_epoch(epoch);
  return insert;
}

void CacheManagerSeeds(const fs::path& dir) {
  const ManagerWorld w;
  using namespace cache_manager_calls;  // NOLINT: the tags
  std::string s;
  v1::RegisterModelRequest reg;
  reg.mutable_namespace_()->set_tenant("tenant-b");
  reg.mutable_namespace_()->set_model("model-y");
  ModelSpecToProto(SeedSpec(), reg.mutable_spec());
  AppendRecord(&s, kRegisterModel, reg);
  AppendRecord(&s, kStats, "");
  Write(dir, "cache_manager_fuzzer", "register_model", s);

  for (bool hashes : {false, true}) {
    s.clear();
    v1::MatchRequest match;
    NamespaceToProto(SeedNamespace(), match.mutable_namespace_());
    if (hashes) {
      Hashes(w, 0, match.mutable_prompt());
    } else {
      Tokens(SeedTokens(0), match.mutable_prompt());
    }
    match.set_requester_agent_id(kAgents[0]);
    AppendRecord(&s, kMatch, match);
    match.set_pin(true);
    match.set_lease_ttl_ms(5000);
    AppendRecord(&s, kMatch, match);
    v1::RenewLeaseRequest renew;
    NamespaceToProto(SeedNamespace(), renew.mutable_namespace_());
    renew.set_pin_id(1);
    AppendRecord(&s, kRenewLease, renew);
    v1::ReleaseRequest release;
    NamespaceToProto(SeedNamespace(), release.mutable_namespace_());
    release.set_pin_id(1);
    AppendRecord(&s, kRelease, release);
    AppendRecord(&s, kMatch, match);
    AppendRecord(&s, kAdvanceClock, std::string(1, '\x0a'));
    renew.set_pin_id(2);
    AppendRecord(&s, kRenewLease, renew);
    Write(dir, "cache_manager_fuzzer", hashes ? "match_hashes_pin" : "match_tokens_pin", s);
  }

  for (const char* agent : {"store-1", kAgents[0]}) {
    s.clear();
    v1::WatchEventsRequest watch;
    AppendRecord(&s, kWatchEvents, watch);
    const bool live = agent == std::string(kAgents[0]);
    v1::InsertRequest insert =
        InsertOf(agent, live ? v1::TIER_GPU : v1::TIER_HOST, 2, 20, live ? 1 : 0);
    AppendRecord(&s, kInsert, insert);
    v1::EvictRequest evict;
    evict.mutable_pool()->set_agent_id(agent);
    evict.mutable_pool()->set_tier(insert.pool().tier());
    evict.set_bytes(SeedSpec().BytesPerPage());
    AppendRecord(&s, kEvict, evict);
    evict.Clear();
    NamespaceToProto(SeedNamespace(), evict.mutable_namespace_());
    evict.set_bytes(3 * SeedSpec().BytesPerPage());
    AppendRecord(&s, kEvict, evict);
    v1::ReserveRequest reserve;
    *reserve.mutable_pool() = insert.pool();
    reserve.set_bytes(2 * SeedSpec().BytesPerPage());
    AppendRecord(&s, kReserve, reserve);
    insert.set_use_reservation(true);
    AppendRecord(&s, kInsert, insert);
    AppendRecord(&s, kUnreserve, reserve);
    AppendRecord(&s, kStats, "");
    Write(dir, "cache_manager_fuzzer", std::string("insert_evict_reserve_") + agent, s);
  }

  // A namespace deleted under a pin, and agents forgotten: one live without force (refused),
  // one live with force, one gone after the clock passes the registry's stale time.
  s.clear();
  {
    AppendRecord(&s, kInsert, InsertOf(kAgents[0], v1::TIER_GPU, 0, 30, 1));
    v1::MatchRequest match;
    NamespaceToProto(SeedNamespace(), match.mutable_namespace_());
    Tokens(SeedTokens(0), match.mutable_prompt());
    match.set_pin(true);
    AppendRecord(&s, kMatch, match);
    v1::DeleteNamespaceRequest del;
    NamespaceToProto(SeedNamespace(), del.mutable_namespace_());
    AppendRecord(&s, kDeleteNamespace, del);
    AppendRecord(&s, kDeleteNamespace, del);
    v1::ForgetAgentRequest forget;
    forget.set_agent_id(kAgents[0]);
    AppendRecord(&s, kForgetAgent, forget);
    forget.set_force(true);
    AppendRecord(&s, kForgetAgent, forget);
    AppendRecord(&s, kAdvanceClock, std::string(1, '\xff'));
    forget.set_agent_id(kAgents[1]);
    forget.set_force(false);
    AppendRecord(&s, kForgetAgent, forget);
    AppendRecord(&s, kStats, "");
  }
  Write(dir, "cache_manager_fuzzer", "delete_namespace_forget_agent", s);

  for (int policy = 0; policy <= 4; ++policy) {
    s.clear();
    v1::RouteRequest route;
    NamespaceToProto(SeedNamespace(), route.mutable_namespace_());
    Tokens(SeedTokens(1), route.mutable_prompt());
    route.set_policy(static_cast<v1::RoutePolicy>(policy));
    route.set_probe(true);
    AppendRecord(&s, kRoute, route);
    route.set_probe(false);
    route.set_pin(policy % 2 == 0);
    v1::RouteCandidate* c = route.add_candidates();
    c->set_agent_id(kAgents[1]);
    c->set_load(3);
    c->set_queued_prefill_tokens(4096);
    route.add_candidates()->set_agent_id(kAgents[0]);
    route.set_prefill_tokens_per_s(2e4);
    AppendRecord(&s, kRoute, route);
    Write(dir, "cache_manager_fuzzer", "route_policy_" + std::to_string(policy), s);
  }

  // An engine's session: stores, a removal, a clear, a gap, a new session, a close.
  s.clear();
  v1::PublishEngineEventsRequest publish;
  publish.set_engine_id("vllm-0");
  NamespaceToProto(SeedNamespace(), publish.mutable_namespace_());
  *publish.mutable_scheme() = SeedScheme(w);
  publish.set_session(7);
  publish.set_sequence(1);
  for (int prompt = 0; prompt < 2; ++prompt) {
    v1::Prompt p;
    Hashes(w, prompt, &p);
    v1::EngineChange* c = publish.add_changes();
    c->set_kind(v1::EngineChange::KIND_STORED);
    c->set_tier(prompt == 0 ? v1::TIER_GPU : v1::TIER_HOST);
    c->set_page_hashes(p.page_hashes());
  }
  AppendRecord(&s, kPublishEngineEvents, publish);
  v1::RouteRequest route;
  NamespaceToProto(SeedNamespace(), route.mutable_namespace_());
  Tokens(SeedTokens(0), route.mutable_prompt());
  route.set_probe(true);
  route.add_candidates()->set_agent_id("vllm-0");
  route.add_candidates()->set_agent_id(kAgents[0]);
  AppendRecord(&s, kRoute, route);
  publish.set_sequence(2);
  publish.mutable_changes(0)->set_kind(v1::EngineChange::KIND_REMOVED);
  publish.mutable_changes(1)->set_kind(v1::EngineChange::KIND_CLEARED);
  publish.mutable_changes(1)->clear_page_hashes();
  AppendRecord(&s, kPublishEngineEvents, publish);
  publish.set_sequence(4);
  AppendRecord(&s, kPublishEngineEvents, publish);
  AppendRecord(&s, kStats, "");
  publish.set_session(8);
  publish.set_sequence(1);
  publish.set_close(true);
  AppendRecord(&s, kPublishEngineEvents, publish);
  AppendRecord(&s, kAdvanceClock, std::string(1, '\x28'));
  Write(dir, "cache_manager_fuzzer", "engine_session", s);
}

void AgentControlSeeds(const fs::path& dir) {
  const ManagerWorld w;
  using namespace agent_control_calls;  // NOLINT: the tags
  std::string s;
  AppendRecord(&s, kRegister, SeedRegistration("agent-2", 1));
  AppendRecord(&s, kRegister, SeedRegistration(kAgents[0], 2));
  v1::HeartbeatRequest hb;
  hb.set_agent_id(kAgents[0]);
  hb.set_epoch(2);
  hb.set_used_bytes(1024);
  hb.set_free_blocks(10);
  hb.set_pull_gbps(12.5);
  AppendRecord(&s, kHeartbeat, hb);
  AppendRecord(&s, kAdvanceClock, std::string(1, '\x0b'));
  AppendRecord(&s, kHeartbeat, hb);
  Write(dir, "agent_control_fuzzer", "register_heartbeat", s);

  s.clear();
  absl::StatusOr<std::vector<PageHash>> pages = w.index->HashTokens(SeedNamespace(), SeedTokens(3));
  Require(pages.ok(), "hashes");
  for (int half = 0; half < 2; ++half) {
    v1::InventoryChunk chunk;
    chunk.set_agent_id(kAgents[0]);
    chunk.set_epoch(1);
    chunk.set_tier(half == 0 ? v1::TIER_GPU : v1::TIER_HOST);
    NamespaceToProto(SeedNamespace(), chunk.mutable_namespace_());
    ModelSpecToProto(SeedSpec(), chunk.mutable_spec());
    std::vector<PageHash> parents = {PageHash{}};
    parents.insert(parents.end(), pages->begin(), pages->end() - 1);
    chunk.set_page_hashes(EncodePageHashes(*pages));
    chunk.set_parent_hashes(EncodePageHashes(parents));
    for (BlockId b : {30, 31, 32, 33}) chunk.add_block_ids(b);
    AppendRecord(&s, kInventoryChunk, chunk);
  }
  AppendRecord(&s, kInventoryClose, "");
  Write(dir, "agent_control_fuzzer", "inventory", s);

  s.clear();
  v1::AgentCommandAck hello;
  hello.set_agent_id(kAgents[0]);
  hello.set_epoch(1);
  AppendRecord(&s, kCommandsMessage, hello);
  const v1::InsertRequest insert = InsertOf(kAgents[0], v1::TIER_GPU, 2, 20, 1);
  AppendRecord(&s, kInsert, insert);
  v1::AgentCommandAck ack;
  ack.set_sequence(1);
  for (BlockId b : {20, 21, 22, 23}) ack.add_block_ids(b);
  AppendRecord(&s, kCommandsMessage, ack);
  AppendRecord(&s, kInsert, insert);
  ack.Clear();
  ack.set_sequence(2);
  ack.set_code(9);
  ack.set_message("block 20 is committed to another page");
  AppendRecord(&s, kCommandsMessage, ack);
  AppendRecord(&s, kCommandsClose, "");
  Write(dir, "agent_control_fuzzer", "commands_commit_acks", s);

  s.clear();
  v1::RegisterAgentRequest peer = SeedRegistration("agent-2", 1);
  peer.set_transport("nccl");
  AppendRecord(&s, kRegister, peer);
  v1::NcclBootstrapRequest nccl;
  nccl.set_agent_id(kAgents[1]);
  nccl.set_epoch(1);
  nccl.set_peer_agent_id("agent-2");
  nccl.set_link_id(7);
  nccl.set_unique_id(std::string(kNcclUniqueIdBytes, 'u'));
  AppendRecord(&s, kNcclBootstrap, nccl);
  Write(dir, "agent_control_fuzzer", "nccl_bootstrap", s);

  // A peer's data port, then room made in a pool the Insert filled (the eviction a
  // worker's Allocate asks for), and in a tier the agent did not register.
  s.clear();
  v1::LookupAgentRequest lookup;
  lookup.set_agent_id(kAgents[0]);
  lookup.set_peer_agent_id(kAgents[1]);
  AppendRecord(&s, kLookupAgent, lookup);
  lookup.set_peer_agent_id("agent-9");
  AppendRecord(&s, kLookupAgent, lookup);
  AppendRecord(&s, kInsert, insert);
  v1::MakeRoomRequest room;
  room.set_agent_id(kAgents[0]);
  room.set_epoch(1);
  NamespaceToProto(SeedNamespace(), room.mutable_namespace_());
  room.set_tier(v1::TIER_GPU);
  room.set_blocks(2);
  room.set_allocation_blocks(4);
  room.set_tenant_allocated_blocks(4);
  AppendRecord(&s, kMakeRoom, room);
  room.set_tier(v1::TIER_DISK);
  AppendRecord(&s, kMakeRoom, room);
  Write(dir, "agent_control_fuzzer", "lookup_make_room", s);
}

void BlockAgentSeeds(const fs::path& dir) {
  const AgentWorld w;
  using namespace block_agent_calls;  // NOLINT: the tags
  const uint64_t bpb = w.main->geometry().bytes_per_block();
  std::string s;
  v1::AllocateBlocksRequest alloc;
  alloc.set_count(2);
  alloc.set_owner_epoch(w.owner_epoch);
  NamespaceToProto(AgentNamespace(), alloc.mutable_namespace_());
  AppendRecord(&s, kAllocate, alloc);
  v1::FreeBlocksRequest free;
  free.set_owner_epoch(w.owner_epoch);
  free.add_block_ids(w.owned[3]);
  AppendRecord(&s, kFree, free);
  AppendRecord(&s, kStats, "");
  Write(dir, "block_agent_fuzzer", "allocate_free", s);

  s.clear();
  v1::WriteBlocksRequest msg;
  msg.mutable_header()->set_owner_epoch(w.owner_epoch);
  msg.mutable_header()->add_block_ids(w.owned[0]);
  msg.mutable_header()->add_block_ids(w.owned[1]);
  AppendRecord(&s, kWriteMessage, msg);
  for (uint64_t left = 2 * bpb; left > 0;) {
    const uint64_t n = std::min<uint64_t>(left, w.options.max_message_bytes);
    msg.Clear();
    msg.set_data(std::string(n, 'k'));
    AppendRecord(&s, kWriteMessage, msg);
    left -= n;
  }
  AppendRecord(&s, kWriteClose, "");
  v1::ReadBlocksRequest read;
  read.set_owner_epoch(w.owner_epoch);
  read.add_block_ids(w.owned[0]);
  read.add_block_ids(w.owned[1]);
  AppendRecord(&s, kReadBlocks, read);
  read.set_tier(v1::TIER_HOST);
  AppendRecord(&s, kReadBlocks, read);
  Write(dir, "block_agent_fuzzer", "write_read", s);

  s.clear();
  v1::RunAttentionRequest attn;
  v1::BlockList* row = attn.add_block_table();
  row->add_block_ids(w.owned[0]);
  row->add_block_ids(w.owned[1]);
  attn.add_seq_lens(7);
  const ModelSpec spec = AgentSpec();
  attn.set_query(
      std::string(size_t{spec.num_heads} * (spec.kv_lora_rank + spec.rope_dim) * 2, '\x3f'));
  attn.set_softmax_scale(0.125f);
  attn.set_num_heads(spec.num_heads);
  attn.set_layer(1);
  attn.set_owner_epoch(w.owner_epoch);
  AppendRecord(&s, kRunAttention, attn);
  Write(dir, "block_agent_fuzzer", "run_attention", s);

  s.clear();
  v1::FetchRequest fetch;
  NamespaceToProto(AgentNamespace(), fetch.mutable_namespace_());
  std::vector<PageHash> pages;
  for (int i = 0; i < 3; ++i) pages.push_back(CommittedPage(i));
  fetch.mutable_prompt()->set_page_hashes(EncodePageHashes(pages));
  fetch.mutable_prompt()->mutable_scheme()->set_version(kPageHashVersion);
  fetch.mutable_prompt()->mutable_scheme()->set_page_size_tokens(spec.page_size_tokens);
  fetch.add_local_block_ids(w.committed[0]);
  fetch.add_source_block_ids(5);
  fetch.add_source_block_ids(6);
  fetch.set_source_agent_id("gpu-b");
  fetch.set_source_tier(v1::TIER_GPU);
  AppendRecord(&s, kFetch, fetch);
  Write(dir, "block_agent_fuzzer", "fetch", s);
}

void DataPortSeeds(const fs::path& dir) {
  const AgentWorld w;
  const uint64_t bpb = w.main->geometry().bytes_per_block();
  v1::PullBlocksRequest req;
  req.set_tier(v1::TIER_GPU);
  NamespaceToProto(AgentNamespace(), req.mutable_namespace_());
  std::vector<PageHash> pages;
  for (int i = 0; i < kCommittedBlocks; ++i) {
    req.add_block_ids(w.committed[i]);
    pages.push_back(CommittedPage(i));
  }
  req.set_page_hashes(EncodePageHashes(pages));
  Write(dir, "data_port_fuzzer", "serve", std::string(1, '\0') + Frame(req));
  pages[2] = CommittedPage(7);
  req.set_page_hashes(EncodePageHashes(pages));
  Write(dir, "data_port_fuzzer", "serve_wrong_page", std::string(1, '\0') + Frame(req));

  v1::PullBlocksHeader header;
  header.set_bytes_per_block(bpb);
  std::string blocks;
  for (int i = 0; i < 4; ++i) blocks += std::string(1, '\x01') + std::string(bpb, 'b');
  Write(dir, "data_port_fuzzer", "pull", std::string(1, '\x01') + Frame(header) + blocks);
  v1::PullBlocksHeader error;
  error.set_code(9);
  error.set_message("block_ids[1] is not committed to that page");
  Write(dir, "data_port_fuzzer", "pull_error",
        std::string(1, '\x01') + Frame(header) + blocks.substr(0, bpb + 1) + '\x02' + Frame(error));
}

void TraceSeeds(const fs::path& dir) {
  Write(
      dir, "trace_fuzzer", "mooncake",
      "{\"timestamp\": 0, \"input_length\": 1030, \"output_length\": 50, \"hash_ids\": [0, 1, 2]}\n"
      "{\"timestamp\": 12.5, \"input_length\": 512, \"output_length\": 3, \"hash_ids\": [0]}\n"
      "\n"
      "{\"timestamp\": 3, \"input_length\": 0, \"output_length\": 0, \"hash_ids\": [], "
      "\"note\": \"x\\u00e9\", \"nested\": {\"a\": [true, null, 1e3]}}\n");
  Write(dir, "trace_fuzzer", "tokens",
        "{\"timestamp\": 1.5, \"tokens\": [1, 2, 3, 4, 5, 6, 7, 8, -9], \"output_length\": 4}\n"
        "{\"timestamp\": 0, \"tokens\": [2147483647, -2147483648], \"output_length\": 0}\n");
}

void PageHashSeeds(const fs::path& dir) {
  const ManagerWorld w;
  v1::Prompt prompt;
  Tokens(SeedTokens(0), &prompt);
  Write(dir, "page_hash_fuzzer", "tokens", std::string(1, '\0') + prompt.SerializeAsString());
  prompt.Clear();
  Hashes(w, 1, &prompt);
  Write(dir, "page_hash_fuzzer", "page_hashes", std::string(1, '\0') + prompt.SerializeAsString());
}

}  // namespace
}  // namespace kvcm::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  kvcm::fuzz::CacheManagerSeeds(dir);
  kvcm::fuzz::AgentControlSeeds(dir);
  kvcm::fuzz::BlockAgentSeeds(dir);
  kvcm::fuzz::DataPortSeeds(dir);
  kvcm::fuzz::TraceSeeds(dir);
  kvcm::fuzz::PageHashSeeds(dir);
  return 0;
}
