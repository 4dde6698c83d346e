#include "tests/util/worker_sim.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/agent_blocks.h"
#include "client/fetch_plan.h"
#include "common/credentials.h"
#include "common/grpc_status.h"
#include "tests/util/block_agent_calls.h"

namespace kvcm::testing {

absl::StatusOr<std::unique_ptr<WorkerSim>> WorkerSim::Create(Client* client, NamespaceId ns,
                                                             const ModelSpec& spec,
                                                             std::vector<AgentInfo> agents) {
  auto sim = std::unique_ptr<WorkerSim>(new WorkerSim(client, std::move(ns)));
  absl::StatusOr<RegisterModelReply> reg = client->RegisterModel(sim->ns_, spec);
  if (!reg.ok()) return reg.status();
  sim->page_size_tokens_ = reg->spec.page_size_tokens;
  sim->key_fingerprint_ = reg->key_fingerprint;
  sim->bytes_per_block_ = reg->bytes_per_page;
  for (AgentInfo& info : agents) {
    Agent a;
    a.stub = v1::BlockAgent::NewStub(MakeInsecureChannel(info.block_agent_address));
    v1::BlockAgentStatsResponse stats;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (grpc::Status s = a.stub->Stats(&ctx, v1::BlockAgentStatsRequest(), &stats); !s.ok()) {
      return FromGrpcStatus(s);
    }
    if (stats.geometry().bytes_per_block() != sim->bytes_per_block_) {
      return absl::FailedPreconditionError(
          absl::StrCat("agent ", info.id, " has blocks of ", stats.geometry().bytes_per_block(),
                       " bytes, the namespace pages of ", sim->bytes_per_block_));
    }
    a.epoch = stats.epoch();
    sim->order_.push_back(info.id);
    a.info = std::move(info);
    sim->agents_.emplace(a.info.id, std::move(a));
  }
  return sim;
}

absl::StatusOr<WorkerSim::Served> WorkerSim::Serve(std::span<const int32_t> tokens) {
  std::vector<RouteParams::Candidate> candidates;
  for (const std::string& id : order_) {
    Agent& a = agents_.at(id);
    candidates.push_back(
        {.agent_id = id, .load = a.queued_tokens, .queued_prefill_tokens = a.queued_tokens});
    a.queued_tokens -= a.queued_tokens / 4;
  }
  absl::StatusOr<Served> served = Serve(tokens, std::move(candidates));
  if (served.ok()) {
    agents_.at(served->agent).queued_tokens +=
        tokens.size() - uint64_t{served->cached_pages} * page_size_tokens_;
  }
  return served;
}

absl::StatusOr<WorkerSim::Served> WorkerSim::Serve(std::span<const int32_t> tokens,
                                                   std::vector<RouteParams::Candidate> candidates) {
  absl::StatusOr<std::vector<PageHash>> pages = client_->HashPrompt(ns_, tokens);
  if (!pages.ok()) return pages.status();
  absl::StatusOr<RouteReply> route =
      client_->Route(ns_, tokens, {.candidates = std::move(candidates), .pin = true});
  if (!route.ok()) return route.status();
  absl::Cleanup release_route = [&] {
    if (route->match.pin_id != 0) (void)client_->Release(ns_, route->match.pin_id);
  };
  const RouteReply::Ranked& best = route->ranked.at(0);
  auto agent = agents_.find(best.agent_id);
  if (agent == agents_.end()) {
    return absl::NotFoundError(absl::StrCat("Route chose unknown agent ", best.agent_id));
  }
  Served out{.agent = best.agent_id};
  const PoolRef pool{best.agent_id, Tier::kGpu};

  // Pages this agent holds, then the ones worth fetching from the replicas Route matched.
  std::vector<BlockId> held = LeadingBlocksIn(route->match, pool);
  out.cached_pages = static_cast<uint32_t>(held.size());
  if (best.fetch_pages > 0) {
    absl::StatusOr<FetchPlan> plan = PlanFetch(route->match, pool, std::nullopt, best.fetch_pages);
    if (!plan.ok()) return plan.status();
    absl::StatusOr<FetchedPages> fetched = FetchPlanned(
        *agent->second.stub, ns_, HashedPrompt{*pages, page_size_tokens_, key_fingerprint_}, *plan);
    if (!fetched.ok()) return fetched.status();
    out.fetched_pages = fetched->fetched_pages;
    held = std::move(fetched->block_ids);
  }

  absl::StatusOr<std::vector<BlockId>> blocks = Prefill(agent->second, *pages, std::move(held));
  if (!blocks.ok()) return blocks.status();
  out.computed_pages = static_cast<uint32_t>(pages->size()) - out.cached_pages - out.fetched_pages;
  out.block_ids = *std::move(blocks);

  // The "decode": the whole prompt pinned where it runs.
  absl::StatusOr<MatchReply> decode =
      client_->MatchHashes(ns_, *pages, {.requester_agent_id = out.agent, .pin = true});
  if (!decode.ok()) return decode.status();
  absl::Cleanup release_decode = [&] {
    if (decode->pin_id != 0) (void)client_->Release(ns_, decode->pin_id);
  };
  if (decode->local_pages != pages->size()) {
    return absl::InternalError(absl::StrCat(out.agent, " holds ", decode->local_pages, " of the ",
                                            pages->size(), " pages it was just given"));
  }
  return out;
}

absl::StatusOr<std::vector<BlockId>> WorkerSim::Prefill(Agent& agent,
                                                        std::span<const PageHash> pages,
                                                        std::vector<BlockId> held) {
  const size_t first = held.size();
  if (first == pages.size()) return held;
  const uint32_t count = static_cast<uint32_t>(pages.size() - first);
  std::vector<BlockId> ours;
  std::vector<uint64_t> generations;  // of ours: every later call on them names them
  if (grpc::Status s = AllocateTo(*agent.stub, count, agent.epoch, ns_, &ours, &generations);
      !s.ok()) {
    return FromGrpcStatus(s);
  }
  absl::Cleanup free_ours = [&] {
    (void)FreeAsWorker(*agent.stub, ours, agent.epoch, generations);
  };
  for (size_t i = 0; i < count; i += max_blocks_per_call_) {
    const size_t n = std::min<size_t>(max_blocks_per_call_, count - i);
    std::string bytes;
    bytes.reserve(n * bytes_per_block_);
    for (size_t j = i; j < i + n; ++j) bytes += PageBytes(pages[first + j]);
    if (grpc::Status s = WriteAll(*agent.stub, std::span(ours).subspan(i, n), agent.epoch, bytes,
                                  std::span(generations).subspan(i, n));
        !s.ok()) {
      return FromGrpcStatus(s);
    }
  }
  std::vector<BlockId> all = std::move(held);
  all.insert(all.end(), ours.begin(), ours.end());
  absl::StatusOr<InsertReply> r = client_->InsertHashes(
      ns_, pages, PoolRef{agent.info.id, Tier::kGpu}, all, {.agent_epoch = agent.epoch});
  if (!r.ok()) return r.status();
  // Committed: the cache owns them now, except the duplicates of pages the pool already held,
  // which are ours again to free.
  std::move(free_ours).Cancel();
  std::vector<BlockId> spare;
  std::vector<uint64_t> spare_generations;
  for (size_t i = first; i < r->existing_block_ids.size(); ++i) {
    if (r->existing_block_ids[i] != all[i]) {
      spare.push_back(all[i]);
      spare_generations.push_back(generations[i - first]);
      all[i] = r->existing_block_ids[i];
    }
  }
  if (!spare.empty()) {
    if (grpc::Status s = FreeAsWorker(*agent.stub, spare, agent.epoch, spare_generations);
        !s.ok()) {
      return FromGrpcStatus(s);
    }
  }
  return all;
}

std::string WorkerSim::ExpectedBytes(std::span<const PageHash> pages, size_t first,
                                     size_t n) const {
  std::string bytes;
  for (size_t i = first; i < first + n; ++i) bytes += PageBytes(pages[i]);
  return bytes;
}

absl::StatusOr<std::string> WorkerSim::ReadBlocks(const std::string& agent,
                                                  std::span<const BlockId> blocks) {
  Agent& a = agents_.at(agent);
  std::string bytes;
  for (size_t i = 0; i < blocks.size(); i += max_blocks_per_call_) {
    absl::StatusOr<std::string> part = ReadAll(
        *a.stub, blocks.subspan(i, std::min<size_t>(max_blocks_per_call_, blocks.size() - i)),
        a.epoch);
    if (!part.ok()) return part.status();
    bytes += *part;
  }
  return bytes;
}

std::string WorkerSim::PageBytes(const PageHash& page) const {
  std::string bytes(bytes_per_block_, '\0');
  uint64_t state = page.lo ^ (page.hi * 0x9E3779B97F4A7C15ull);
  for (size_t i = 0; i + 1 < bytes.size(); i += 8) {
    // SplitMix64; 16 bits of each draw per bf16 value: sign, exponent 120..126, mantissa.
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (size_t j = i; j < std::min(i + 8, bytes.size() - 1); j += 2, z >>= 16) {
      const uint16_t r = static_cast<uint16_t>(z);
      const uint16_t exponent = 120 + std::min<uint16_t>((r >> 7) & 7, 6);
      const uint16_t bits = (r & 0x8000) | (exponent << 7) | (r & 0x7f);
      bytes[j] = static_cast<char>(bits & 0xff);
      bytes[j + 1] = static_cast<char>(bits >> 8);
    }
  }
  return bytes;
}

}  // namespace kvcm::testing
