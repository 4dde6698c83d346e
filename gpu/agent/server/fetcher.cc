#include "gpu/agent/server/fetcher.h"

#include <chrono>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

constexpr size_t kHashBytes = 16;
// The manager's Insert answers once the agent (this one) has committed the blocks.
constexpr auto kInsertTimeout = std::chrono::seconds(30);

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

}  // namespace

struct Fetcher::Job {
  v1::FetchRequest req;
  NamespaceId ns;
  BlockPool* pool = nullptr;
  Tier tier = Tier::kGpu;
  uint64_t epoch = 0;
  std::vector<BlockId> fetched;       // this pool's new blocks, one per source block
  std::vector<uint64_t> generations;  // of their allocations, parallel to fetched
};

Fetcher::Fetcher(std::string agent_id, Tier main_tier, AgentPools pools, const AgentEpoch* epoch,
                 Transport* transport, PeerLookup lookup, v1::CacheManager::Stub* manager,
                 AgentMetrics* metrics, RoomMaker* room_maker)
    : agent_id_(std::move(agent_id)),
      main_tier_(main_tier),
      pools_(pools),
      epoch_(epoch),
      transport_(transport),
      lookup_(std::move(lookup)),
      manager_(manager),
      metrics_(metrics),
      room_maker_(room_maker) {}

void Fetcher::Fetch(const v1::FetchRequest& req, FetchDone done) {
  auto job = std::make_shared<Job>();
  job->req = req;
  absl::StatusOr<NamespaceId> ns =
      NamespaceFromProto(req.has_namespace_() ? &req.namespace_() : nullptr, "namespace");
  if (!ns.ok()) return done(ns.status());
  job->ns = *ns;
  const std::string& hashes = req.prompt().page_hashes();
  if (hashes.empty() || hashes.size() % kHashBytes != 0 || !req.prompt().has_scheme()) {
    return done(Invalid("prompt must hold page_hashes (16 bytes each) and their scheme"));
  }
  const size_t pages = hashes.size() / kHashBytes;
  const size_t local = req.local_block_ids_size();
  if (req.source_block_ids_size() == 0 || local + req.source_block_ids_size() != pages) {
    return done(Invalid(absl::StrCat("local_block_ids (", local, ") and source_block_ids (",
                                     req.source_block_ids_size(), ") must cover the prompt's ",
                                     pages, " pages, with at least one page to fetch")));
  }
  if (!req.source_data_address().empty()) {
    return done(Invalid(
        "source_data_address is no longer accepted: name the source agent in source_agent_id "
        "(this agent looks its data address up at the manager)"));
  }
  // As the manager's agent ids (ValidateAgentId).
  if (absl::Status s = ValidateName(req.source_agent_id(), "source_agent_id", "._:-"); !s.ok()) {
    return done(s);
  }
  job->pool =
      req.tier() == v1::TIER_UNSPECIFIED ? pools_.main : pools_.ForWireTier(main_tier_, req.tier());
  if (job->pool == nullptr) return done(Invalid("tier is not a pool of this agent"));
  job->tier = req.tier() == v1::TIER_UNSPECIFIED ? main_tier_ : TierFromProto(req.tier());
  if (req.source_tier() < v1::TIER_UNSPECIFIED || req.source_tier() > v1::TIER_DISK) {
    return done(Invalid(
        absl::StrCat("source_tier ", static_cast<int>(req.source_tier()), " is not a tier")));
  }

  // Nothing is allocated or dialled before the manager vouches for the source.
  lookup_(req.source_agent_id(),
          [this, job, done = std::move(done)](absl::StatusOr<std::string> address) mutable {
            OnResolved(std::move(job), std::move(address), std::move(done));
          });
}

void Fetcher::OnResolved(std::shared_ptr<Job> job, absl::StatusOr<std::string> address,
                         FetchDone done) {
  if (!address.ok()) return done(address.status());
  const v1::FetchRequest& req = job->req;
  job->epoch = epoch_->current();
  const auto count = static_cast<uint32_t>(req.source_block_ids_size());
  if (job->pool == pools_.main && room_maker_ != nullptr) {
    // A full pool makes room for the replica as for a worker's store.
    room_maker_->Allocate({.count = count, .owner_epoch = job->epoch, .ns = job->ns},
                          [this, job, address = *std::move(address), done = std::move(done)](
                              absl::StatusOr<RoomMaker::Allocation> allocated) mutable {
                            if (!allocated.ok()) return done(allocated.status());
                            job->fetched = std::move(allocated->block_ids);
                            job->generations = std::move(allocated->generations);
                            OnAllocated(std::move(job), std::move(address), std::move(done));
                          });
    return;
  }
  absl::StatusOr<std::vector<BlockId>> blocks =
      job->pool->Allocate(count, job->epoch, &job->ns, &job->generations);
  if (!blocks.ok()) return done(blocks.status());
  job->fetched = *std::move(blocks);
  OnAllocated(std::move(job), *std::move(address), std::move(done));
}

void Fetcher::OnAllocated(std::shared_ptr<Job> job, std::string address, FetchDone done) {
  const v1::FetchRequest& req = job->req;

  const size_t local = req.local_block_ids_size();
  const std::vector<PageHash> all = DecodePageHashes(req.prompt().page_hashes());
  PullSpec spec{.peer_address = std::move(address),
                .peer_tier = req.source_tier() == v1::TIER_UNSPECIFIED
                                 ? Tier::kGpu
                                 : TierFromProto(req.source_tier()),
                .ns = job->ns,
                .peer_blocks = {req.source_block_ids().begin(), req.source_block_ids().end()},
                .pages = {all.begin() + local, all.end()},
                .dst = job->pool,
                .dst_blocks = job->fetched,
                .dst_owner_epoch = job->epoch,
                .dst_generations = job->generations};
  transport_->Pull(std::move(spec), [this, job, done = std::move(done)](
                                        absl::StatusOr<TransferStats> pulled) mutable {
    OnPulled(*job, std::move(pulled), std::move(done));
  });
}

void Fetcher::OnPulled(const Job& job, absl::StatusOr<TransferStats> pulled, FetchDone done) {
  metrics_->RecordTransfer(pulled.status(), pulled.ok() ? pulled->bytes : 0,
                           pulled.ok() ? pulled->elapsed : absl::ZeroDuration());
  if (!pulled.ok()) {
    FreeQuietly(job.pool, job.fetched, job.epoch, job.generations);
    const absl::StatusCode code = pulled.status().code();
    if (code != absl::StatusCode::kUnavailable && code != absl::StatusCode::kDeadlineExceeded) {
      return done(pulled.status());
    }
    // Refused, silent or gone: one answer, so a Fetch probes nothing about the source's
    // host. The operator finds the cause here.
    LogWarning(absl::StrCat("fetch from agent ", job.req.source_agent_id(), ": ",
                            pulled.status().ToString()));
    return done(
        absl::UnavailableError(absl::StrCat("source_agent_id \"", job.req.source_agent_id(),
                                            "\" could not be reached or broke off the transfer")));
  }
  // Index the replica: the manager commits the blocks here, then inserts them.
  v1::InsertRequest insert;
  *insert.mutable_namespace_() = job.req.namespace_();
  *insert.mutable_prompt() = job.req.prompt();
  insert.mutable_pool()->set_agent_id(agent_id_);
  insert.mutable_pool()->set_tier(TierToProto(job.tier));
  insert.mutable_block_ids()->Add(job.req.local_block_ids().begin(),
                                  job.req.local_block_ids().end());
  insert.mutable_block_ids()->Add(job.fetched.begin(), job.fetched.end());
  insert.set_agent_epoch(job.epoch);
  v1::InsertResponse answer;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kInsertTimeout);
  if (absl::Status s = FromGrpcStatus(manager_->Insert(&ctx, insert, &answer)); !s.ok()) {
    // Refused or released by the manager before it answered: the blocks are ours again. A
    // timeout may leave them committed and indexed; then the Free fails and the cache owns
    // them, as it should.
    FreeQuietly(job.pool, job.fetched, job.epoch, job.generations);
    return done(absl::Status(s.code(), absl::StrCat("indexing the fetched pages: ", s.message())));
  }
  // Pages the pool held already (another fetch won): their index blocks stay, ours go.
  FetchResult result{.fetched_pages = static_cast<uint32_t>(job.fetched.size()),
                     .bytes = pulled->bytes};
  const size_t local = job.req.local_block_ids_size();
  std::vector<BlockId> spare;
  std::vector<uint64_t> spare_generations;
  for (int i = 0; i < insert.block_ids_size(); ++i) {
    const BlockId ours = insert.block_ids(i);
    const BlockId held = i < answer.existing_block_ids_size() ? answer.existing_block_ids(i) : ours;
    result.block_ids.push_back(held);
    if (held != ours && static_cast<size_t>(i) >= local) {
      spare.push_back(ours);
      spare_generations.push_back(job.generations[i - local]);
    }
  }
  FreeQuietly(job.pool, spare, job.epoch, spare_generations);
  done(std::move(result));
}

void Fetcher::FreeQuietly(BlockPool* pool, const std::vector<BlockId>& ids, uint64_t epoch,
                          const std::vector<uint64_t>& generations) {
  if (ids.empty()) return;
  if (absl::Status s = pool->Free(ids, epoch, generations); !s.ok()) {
    LogWarning(absl::StrCat("fetch: freeing ", ids.size(), " blocks: ", s.ToString()));
  }
}

}  // namespace kvcm
