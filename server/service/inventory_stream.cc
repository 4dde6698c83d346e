#include "server/service/inventory_stream.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "proto/core_types.h"
#include "server/core/inventory_restore.h"
#include "server/service/access_control.h"
#include "server/service/proto_convert.h"

namespace kvcm {
namespace {

constexpr size_t kHashBytes = 16;

absl::Status Invalid(absl::string_view what) { return absl::InvalidArgumentError(what); }

}  // namespace

InventoryReceiver::InventoryReceiver(CacheIndex* index, const AgentRegistry* agents,
                                     std::shared_ptr<const Principal> caller)
    : index_(index), agents_(agents), caller_(std::move(caller)) {}

absl::Status InventoryReceiver::Take(const v1::InventoryChunk& chunk) {
  if (!collector_.has_value()) {
    if (absl::Status s = Begin(chunk); !s.ok()) return s;
  } else if (chunk.agent_id() != agent_id_ || chunk.epoch() != epoch_) {
    return Invalid(absl::StrCat("agent_id and epoch must be the same in every chunk (", agent_id_,
                                " epoch ", epoch_, ")"));
  }
  const int n = chunk.block_ids_size();
  if (n > kMaxInventoryChunkBlocks) {
    return Invalid(absl::StrCat("block_ids has ", n, " entries; at most ", kMaxInventoryChunkBlocks,
                                " per chunk"));
  }
  for (absl::string_view field : {"page_hashes", "parent_hashes"}) {
    const std::string& bytes = field == "page_hashes" ? chunk.page_hashes() : chunk.parent_hashes();
    if (bytes.size() != kHashBytes * n) {
      return Invalid(absl::StrCat(field, " has ", bytes.size(), " bytes, expected 16 per block (",
                                  kHashBytes * n, ")"));
    }
  }
  absl::StatusOr<NamespaceId> ns =
      NamespaceFromProto(chunk.has_namespace_() ? &chunk.namespace_() : nullptr, "namespace");
  if (!ns.ok()) return ns.status();
  absl::StatusOr<ModelSpec> spec = ModelSpecFromProto(chunk.has_spec() ? &chunk.spec() : nullptr);
  if (!spec.ok()) return spec.status();
  // Commit times are optional (an agent that does not record them sends none), but when
  // present there is one per block.
  const int times = chunk.committed_unix_ms_size();
  if (times != 0 && times != n) {
    return Invalid(absl::StrCat("committed_unix_ms has ", times,
                                " entries, expected 0 or one per "
                                "block (",
                                n, ")"));
  }
  const std::vector<PageHash> pages = DecodePageHashes(chunk.page_hashes());
  const std::vector<PageHash> parents = DecodePageHashes(chunk.parent_hashes());
  std::vector<InventoryPage> entries(n);
  for (int i = 0; i < n; ++i) {
    entries[i] = InventoryPage{.block = chunk.block_ids(i),
                               .page = pages[i],
                               .parent = parents[i],
                               .committed_unix_ms = times == 0 ? 0 : chunk.committed_unix_ms(i)};
  }
  return collector_->Add(TierFromProto(chunk.tier()), *ns, *spec, std::move(entries),
                         absl::Seconds(chunk.max_page_age_s()));
}

// The first chunk: the agent must be registered in this epoch; its pools are noted with
// their generations, so that a re-registration during the stream is noticed.
absl::Status InventoryReceiver::Begin(const v1::InventoryChunk& chunk) {
  agent_id_ = chunk.agent_id();
  epoch_ = chunk.epoch();
  if (absl::Status s = AuthorizeAgent(*caller_, agent_id_); !s.ok()) return s;
  if (absl::Status s = ValidateAgentId(agent_id_, "agent_id"); !s.ok()) return s;
  if (absl::Status s = agents_->CheckLive(agent_id_, epoch_); !s.ok()) return s;
  std::vector<InventoryCollector::Pool> pools;
  uint64_t bytes_per_block = 0;
  for (Tier tier : {Tier::kGpu, Tier::kHost, Tier::kDisk}) {
    const PoolKey key{agent_id_, tier};
    std::optional<AgentPool> pool = agents_->FindPool(key);
    if (!pool.has_value() || pool->epoch != epoch_) continue;
    absl::StatusOr<uint64_t> generation = index_->PoolGeneration(key);
    if (!generation.ok()) continue;
    bytes_per_block = pool->bytes_per_block;
    pools.push_back({.tier = tier, .num_blocks = pool->num_blocks, .generation = *generation});
  }
  if (pools.empty()) {
    return absl::AbortedError(
        absl::StrCat("agent ", agent_id_, " epoch ", epoch_, " has no pool; register again"));
  }
  collector_.emplace(agent_id_, bytes_per_block, std::move(pools));
  return absl::OkStatus();
}

absl::Status InventoryReceiver::Restore(v1::InventoryReply* reply) {
  if (!collector_.has_value()) return absl::OkStatus();  // an empty inventory
  // The epoch may have ended while the chunks came; the pool generations catch a
  // re-registration that happens during the restore itself.
  if (absl::Status s = agents_->CheckLive(agent_id_, epoch_); !s.ok()) return s;
  absl::StatusOr<InventoryOutcome> outcome = collector_->Restore(*index_);
  if (!outcome.ok()) return outcome.status();
  reply->set_indexed_pages(outcome->indexed_pages);
  reply->set_orphan_pages(outcome->orphan_pages);
  reply->set_duplicate_pages(outcome->duplicate_pages);
  reply->set_refused_pages(outcome->refused_pages);
  reply->set_expired_pages(outcome->expired_pages);
  for (const auto& [tier, blocks] : outcome->to_free) {
    if (blocks.empty()) continue;
    v1::PoolBlocks* free = reply->add_to_free();
    free->set_tier(TierToProto(tier));
    free->mutable_block_ids()->Add(blocks.begin(), blocks.end());
  }
  LogInfo(absl::StrCat("agent ", agent_id_, " epoch ", epoch_, ": inventory of ",
                       collector_->pages(), " committed blocks; indexed ", outcome->indexed_pages,
                       ", orphans ", outcome->orphan_pages, ", duplicates ",
                       outcome->duplicate_pages, ", refused ", outcome->refused_pages, ", expired ",
                       outcome->expired_pages));
  return absl::OkStatus();
}

namespace {

// gRPC runs at most one reaction of a call at a time, and OnDone last, so the reactor
// needs no lock.
class InventoryReactor final : public grpc::ServerReadReactor<v1::InventoryChunk> {
 public:
  // An authenticated `caller`; the call is refused at once when it is an error.
  InventoryReactor(CacheIndex* index, const AgentRegistry* agents, RpcRunner<Rpc>* rpc,
                   absl::StatusOr<std::shared_ptr<const Principal>> caller,
                   v1::InventoryReply* reply)
      : receiver_(index, agents, caller.ok() ? *caller : nullptr), rpc_(rpc), reply_(reply) {
    if (!caller.ok()) {
      Finish(rpc_->StreamEnd(Rpc::kReportInventory, caller.status()));
      return;
    }
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    const absl::Status status = ok ? receiver_.Take(chunk_) : receiver_.Restore(reply_);
    if (ok && status.ok()) {
      StartRead(&chunk_);
      return;
    }
    // A failed chunk ends the call at once: what was collected is dropped.
    Finish(rpc_->StreamEnd(Rpc::kReportInventory, status));
  }

  void OnDone() override { delete this; }

 private:
  InventoryReceiver receiver_;
  RpcRunner<Rpc>* const rpc_;
  v1::InventoryReply* const reply_;
  v1::InventoryChunk chunk_;
};

}  // namespace

grpc::ServerReadReactor<v1::InventoryChunk>* OpenInventoryStream(
    CacheIndex* index, const AgentRegistry* agents, RpcRunner<Rpc>* rpc,
    absl::StatusOr<std::shared_ptr<const Principal>> caller, v1::InventoryReply* reply) {
  return new InventoryReactor(index, agents, rpc, std::move(caller), reply);
}

}  // namespace kvcm
